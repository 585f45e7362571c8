// KVCacheRuntime, its pools, page tables and resident slots, the seed facade
// ManagedKVCacheRequest and AttentionViews in Python, under their C++ names. Objects a runtime
// owns are returned by reference and keep the runtime alive; a request keeps its backends alive.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "mkv/attention_views.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/resident_slot_pool.h"

namespace mkv::python {
namespace {

constexpr auto kInternal = py::return_value_policy::reference_internal;

void bindPoolAndTable(py::module_& m) {
  py::class_<KVCachePool>(m, "KVCachePool")
      .def_property_readonly("numLayers", &KVCachePool::numLayers)
      .def_property_readonly("numPages", &KVCachePool::numPages)
      .def_property_readonly("tokensPerPage", &KVCachePool::tokensPerPage)
      .def_property_readonly("maxBatchSize", &KVCachePool::maxBatchSize)
      .def_property_readonly("deviceType", &KVCachePool::deviceType)
      .def_property_readonly("activeBatchSize", &KVCachePool::activeBatchSize)
      .def("tokenBytes", &KVCachePool::tokenBytes)
      .def("pageBytes", &KVCachePool::pageBytes)
      .def("totalBytes", &KVCachePool::totalBytes)
      .def("layer", py::overload_cast<int32_t>(&KVCachePool::layer), py::arg("l"), kInternal,
           "Layer l's buffer [2, numPages, tokensPerPage, heads, headDim]: K half, then V half.")
      .def("kvLengths", py::overload_cast<>(&KVCachePool::kvLengths), kInternal,
           "The KV-length tensor, int32 [activeBatchSize] (export it again when the batch "
           "changes: the memory stays, the shape follows the batch).")
      .def(
          "writeLengths",
          [](KVCachePool& pool, int32_t firstRow, std::vector<int32_t> const& lengths,
             py::object const& stream) { pool.writeLengths(firstRow, lengths, streamArg(stream)); },
          py::arg("firstRow"), py::arg("lengths"), py::arg("stream") = py::none())
      .def("setActiveBatchSize", &KVCachePool::setActiveBatchSize, py::arg("batchSize"));
  py::class_<KVPageTable>(m, "KVPageTable")
      .def_property_readonly("maxBatch", &KVPageTable::maxBatch)
      .def_property_readonly("maxPagesPerSeq", &KVPageTable::maxPagesPerSeq)
      .def_property_readonly("numPages", &KVPageTable::numPages)
      .def_property_readonly("mode", &KVPageTable::mode)
      .def_property_readonly("deviceType", &KVPageTable::deviceType)
      .def("entry", &KVPageTable::entry, py::arg("slot"), py::arg("logicalPage"))
      .def(
          "hostRow",
          [](KVPageTable const& table, CacheSlot slot) {
            std::span<int32_t const> const row = table.hostRow(slot);
            return std::vector<int32_t>(row.begin(), row.end());
          },
          py::arg("slot"), "A copy of the host row: maxPagesPerSeq K ids, then the V ids.")
      .def("liveEntryCount", &KVPageTable::liveEntryCount, py::arg("slot"))
      .def(
          "checkInvariants",
          [](KVPageTable const& table) {
            std::string error;
            bool const ok = table.checkInvariants(&error);
            return py::make_tuple(ok, error);
          },
          "(ok, description of the first violation)")
      .def("deviceTable", &KVPageTable::deviceTable, kInternal,
           "The device mirror [maxBatch, 2, maxPagesPerSeq] int32, indexed by resident slot.")
      .def(
          "gatherRows",
          [](KVPageTable const& table, py::object const& dst, py::object const& residentSlots,
             py::object const& stream) {
            TensorArg destination = tensorArg(dst, "KVPageTable.gatherRows");
            TensorArg const slots = tensorArg(residentSlots, "KVPageTable.gatherRows");
            table.gatherRows(destination.view, slots.view, streamArg(stream));
          },
          py::arg("dst"), py::arg("residentSlots"), py::arg("stream") = py::none(),
          "dst[i] = device row residentSlots[i]; dst and residentSlots are tensors (torch, "
          "NumPy or mkv) on the table's device; dst needs room for [n, 2, maxPagesPerSeq].");
  py::class_<ResidentSlotPool>(m, "ResidentSlotPool")
      .def("acquire", &ResidentSlotPool::acquire)
      .def("release", &ResidentSlotPool::release, py::arg("ref"))
      .def("contains", &ResidentSlotPool::contains, py::arg("ref"))
      .def("epoch", &ResidentSlotPool::epoch, py::arg("slot"))
      .def_property_readonly("capacity", &ResidentSlotPool::capacity)
      .def("available", &ResidentSlotPool::available);
}

void bindBackends(py::module_& m) {
  py::class_<ContextCacheCoordinator>(m, "ContextCacheCoordinator")
      .def("metrics", &ContextCacheCoordinator::metrics)
      .def("counters", &ContextCacheCoordinator::counters, py::return_value_policy::copy)
      .def("poisoned", &ContextCacheCoordinator::poisoned)
      .def("activeRequestCount", &ContextCacheCoordinator::activeRequestCount)
      .def("resetPrefixCache", &ContextCacheCoordinator::resetPrefixCache)
      .def(
          "toPrometheus",
          [](ContextCacheCoordinator const& c, std::string const& prefix) {
            return c.toPrometheus(prefix);
          },
          py::arg("prefix") = "managedkv_");
  py::class_<BoundedSwaKVPageManager>(m, "BoundedSwaKVPageManager")
      .def("poisoned", &BoundedSwaKVPageManager::poisoned);
  py::class_<RecurrentStatePool>(m, "RecurrentStatePool")
      .def_property_readonly("numLayers", &RecurrentStatePool::numLayers)
      .def_property_readonly("numSlots", &RecurrentStatePool::numSlots)
      .def_property_readonly("deviceType", &RecurrentStatePool::deviceType)
      .def("bytesPerSlot", &RecurrentStatePool::bytesPerSlot)
      .def("state", py::overload_cast<int32_t>(&RecurrentStatePool::state), py::arg("layer"),
           kInternal,
           "Recurrent layer `layer`'s state rows, uint8 [numSlots, stateBytesPerSlot]: row `slot` "
           "belongs to the resident with that slot (the engine chooses what the bytes hold).")
      .def("conv", py::overload_cast<int32_t>(&RecurrentStatePool::conv), py::arg("layer"),
           kInternal, "Recurrent layer `layer`'s conv rows, uint8 [numSlots, convBytesPerSlot].");
}

void bindRuntimeClass(py::module_& m) {
  py::class_<KVCacheRuntime>(m, "KVCacheRuntime")
      .def_static("create", &KVCacheRuntime::create, py::arg("config"))
      .def_static("kvBytesFor", &KVCacheRuntime::kvBytesFor, py::arg("config"))
      .def_static("availableMemoryBytes", &KVCacheRuntime::availableMemoryBytes, py::arg("device"))
      .def_property_readonly("backend", &KVCacheRuntime::backend)
      .def("config", &KVCacheRuntime::config, py::return_value_policy::copy)
      .def("contextCache", &KVCacheRuntime::contextCache, kInternal)
      .def("swaPageManager", &KVCacheRuntime::swaPageManager, kInternal)
      .def("supportsSeatedAdmission", &KVCacheRuntime::supportsSeatedAdmission)
      .def("fullPool", &KVCacheRuntime::fullPool, kInternal)
      .def("fullPageTable", &KVCacheRuntime::fullPageTable, kInternal)
      .def("swaPool", &KVCacheRuntime::swaPool, kInternal)
      .def("swaPageTable", &KVCacheRuntime::swaPageTable, kInternal)
      .def("draftPool", &KVCacheRuntime::draftPool, kInternal)
      .def("draftPageTable", &KVCacheRuntime::draftPageTable, kInternal)
      .def("residentSlots", &KVCacheRuntime::residentSlots, kInternal)
      .def("lengthPool", &KVCacheRuntime::lengthPool, kInternal)
      .def(
          "recurrentState", &KVCacheRuntime::recurrentState, kInternal,
          "The recurrent rows of a model with recurrent layers (one per resident slot), else None.")
      .def("maxPagesPerSequence", &KVCacheRuntime::maxPagesPerSequence)
      .def("kvBytes", &KVCacheRuntime::kvBytes)
      .def("capacity", &KVCacheRuntime::capacity)
      .def("estimateAdmission", &KVCacheRuntime::estimateAdmission, py::arg("promptTokens"),
           py::arg("loraWeightsName") = "", py::arg("cacheSalt") = "",
           py::arg("headroom") = DecodingKvHeadroom{1, 0})
      .def("flushDeviceWrites", &KVCacheRuntime::flushDeviceWrites)
      .def("deviceWritesPending", &KVCacheRuntime::deviceWritesPending)
      .def("deviceWriteLaunches", &KVCacheRuntime::deviceWriteLaunches)
      .def("tensorParallelStats", &KVCacheRuntime::tensorParallelStats)
      .def("shutdown", &KVCacheRuntime::shutdown)
      .def("residentRowState", &KVCacheRuntime::residentRowState, py::arg("slot"));
}

void bindRequest(py::module_& m) {
  using Request = ManagedKVCacheRequest;
  py::class_<Request>(m, "ManagedKVCacheRequest", py::dynamic_attr(),
                      "The seed facade (mkv::ManagedKVCacheRequest); begin() answers None on a "
                      "failed admission. It keeps its backends (so the runtime) alive.")
      .def_static(
          "begin",
          [](ContextCacheCoordinator* contextCache, BoundedSwaKVPageManager* swaPageManager,
             LLMGenerationRequest const& request, DecodingInferenceContext const& context,
             bool speculativeRequest, DecodingKvHeadroom const& headroom,
             DecodingTokenStateContract contract, ContextCacheCommitPolicy commitPolicy,
             std::vector<int32_t> const& mediaTokenIds) -> std::optional<Request> {
            return Request::begin(contextCache, swaPageManager, request, context,
                                  speculativeRequest, headroom, contract, commitPolicy,
                                  mediaTokenIds);
          },
          py::arg("contextCache"), py::arg("swaPageManager"), py::arg("request"),
          py::arg("context"), py::arg("speculativeRequest") = false,
          py::arg("headroom") = DecodingKvHeadroom{1, 0},
          py::arg("tokenStateContract") = DecodingTokenStateContract::kCommittedPlusLookahead,
          py::arg("commitPolicy") = ContextCacheCommitPolicy::kIncludingGeneratedTokens,
          py::arg("mediaTokenIds") = std::vector<int32_t>{}, py::keep_alive<0, 1>(),
          py::keep_alive<0, 2>())
      .def("hasContextReuse", &Request::hasContextReuse)
      .def("prefillStarts",
           [](Request const& r) -> std::optional<std::vector<int32_t>> {
             if (auto const* starts = r.prefillStarts()) {
               return *starts;
             }
             return std::nullopt;
           })
      .def("reuseTokenLength", &Request::reuseTokenLength, py::arg("row"))
      .def(
          "publishHybridMtpEndpoint",
          [](Request& r, ExecutionRow row, int32_t residentStateLength,
             py::object const& baseHiddenStates, int32_t boundaryHiddenRow) {
            TensorArg const hidden = tensorArg(baseHiddenStates, "publishHybridMtpEndpoint");
            return r.publishHybridMtpEndpoint(row, residentStateLength, hidden.view,
                                              boundaryHiddenRow);
          },
          py::arg("row"), py::arg("residentStateLength"), py::arg("baseHiddenStates"),
          py::arg("boundaryHiddenRow"))
      .def(
          "restoreHybridMtpBoundaryHidden",
          [](Request& r, ExecutionRow row, py::object const& baseHiddenStates,
             int32_t destinationRow) {
            TensorArg hidden = tensorArg(baseHiddenStates, "restoreHybridMtpBoundaryHidden");
            return r.restoreHybridMtpBoundaryHidden(row, hidden.view, destinationRow);
          },
          py::arg("row"), py::arg("baseHiddenStates"), py::arg("destinationRow"))
      .def("preparePrefill", &Request::preparePrefill)
      .def("prepareSwaPrefill", &Request::prepareSwaPrefill, py::arg("effectiveInputLengths"))
      .def(
          "reusePointCaptures",
          [](Request const& r, ExecutionRow row) {
            std::span<ReusePointCapture const> const captures = r.reusePointCaptures(row);
            return std::vector<ReusePointCapture>(captures.begin(), captures.end());
          },
          py::arg("row"))
      .def("enqueuePrefillCaptures", &Request::enqueuePrefillCaptures)
      .def("completePrefill", &Request::completePrefill, py::arg("context"),
           py::arg("commonStateLengths") = std::vector<int32_t>{})
      .def("prepareDecodeStep", &Request::prepareDecodeStep, py::arg("context"),
           py::arg("headroom") = DecodingKvHeadroom{1, 0})
      .def("completeDecodeStep", &Request::completeDecodeStep, py::arg("context"),
           py::arg("commonStateLengths") = std::vector<int32_t>{})
      .def(
          "beginBatchCompaction",
          [](py::object const& self, std::vector<int32_t> const& oldToNew, int32_t newBatchSize,
             py::object const& deviceBatchMapping) {
            // The library keeps a pointer to the mapping tensor until completeBatchCompaction:
            // the view lives in a Python object the request holds until its next compaction.
            TensorArg mapping = tensorArg(deviceBatchMapping, "beginBatchCompaction");
            py::object view = py::cast(std::move(mapping.view));
            view.attr("_owner") = mapping.owner;
            bool const ok = self.cast<Request&>().beginBatchCompaction(oldToNew, newBatchSize,
                                                                       view.cast<Tensor&>());
            self.attr("_deviceBatchMapping") = view;
            return ok;
          },
          py::arg("oldToNew"), py::arg("newBatchSize"), py::arg("deviceBatchMapping"))
      .def("completeBatchCompaction", &Request::completeBatchCompaction, py::arg("keepMapping"))
      .def("finish", &Request::finish)
      .def(
          "admitSequence",
          [](Request& r, std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
             DecodingKvHeadroom const& headroom, ResidentRef resident, py::object const& stream,
             std::vector<int32_t> const& mediaTokenIds) {
            int32_t prefillStart = 0;
            AdmitSequenceStatus const status =
                r.admitSequence(tokenIds, loraWeightsName, headroom, prefillStart, resident,
                                streamArg(stream), mediaTokenIds);
            return py::make_tuple(status, prefillStart);
          },
          py::arg("tokenIds"), py::arg("loraWeightsName"), py::arg("headroom"), py::arg("resident"),
          py::arg("stream") = py::none(), py::arg("mediaTokenIds") = std::vector<int32_t>{},
          "(status, prefillStart): the C++ out-parameter prefillStart is returned.")
      .def(
          "admitSequence",
          [](Request& r, LLMGenerationRequest const& joiner, std::vector<int32_t> const& tokenIds,
             DecodingKvHeadroom const& headroom, ResidentRef resident, py::object const& stream,
             std::vector<int32_t> const& mediaTokenIds) {
            int32_t prefillStart = 0;
            AdmitSequenceStatus const status =
                r.admitSequence(joiner, tokenIds, headroom, prefillStart, resident,
                                streamArg(stream), mediaTokenIds);
            return py::make_tuple(status, prefillStart);
          },
          py::arg("joiner"), py::arg("tokenIds"), py::arg("headroom"), py::arg("resident"),
          py::arg("stream") = py::none(), py::arg("mediaTokenIds") = std::vector<int32_t>{},
          "A joiner with its own salt, adapter, retention and commit policy: (status, "
          "prefillStart).")
      .def("preemptSequence", py::overload_cast<ExecutionRow>(&Request::preemptSequence),
           py::arg("row"))
      .def("preemptSequence",
           py::overload_cast<ExecutionRow, PreemptionKind>(&Request::preemptSequence),
           py::arg("row"), py::arg("kind"))
      .def("decodeStepDemand", &Request::decodeStepDemand, py::arg("headroom"))
      .def("prefillChunkDemand", &Request::prefillChunkDemand, py::arg("row"), py::arg("chunkEnd"))
      .def("preparePrefillChunk", &Request::preparePrefillChunk, py::arg("row"),
           py::arg("chunkEnd"))
      .def("completePrefillChunk", &Request::completePrefillChunk, py::arg("row"),
           py::arg("prefilledTokens"))
      .def("finalizeSequenceAdmission", &Request::finalizeSequenceAdmission, py::arg("row"),
           py::arg("lookaheadToken"), py::arg("fullInputLength"))
      .def("retractSequenceAdmission", &Request::retractSequenceAdmission)
      .def("lastFailure", &Request::lastFailure);
}

void bindViews(py::module_& m) {
  py::class_<AttentionViews>(m, "AttentionViews",
                             "Kernel-ready views of one step (mkv::AttentionViews): block table, "
                             "lengths, FlashInfer CSR, slot mapping; on the table's device (a GPU "
                             "table's views are built by one launch on `stream`), re-exported "
                             "after each build (their shapes follow the step).")
      .def(py::init([](KVPageTable const& table, int32_t tokensPerPage, int32_t maxRows,
                       int32_t maxNewTokens, py::object const& stream, bool physicalToLogical) {
             return std::make_unique<AttentionViews>(
                 table, tokensPerPage, maxRows, maxNewTokens, streamArg(stream),
                 physicalToLogical ? PhysicalPageMap::kPerRow : PhysicalPageMap::kNone);
           }),
           py::arg("table"), py::arg("tokensPerPage"), py::arg("maxRows"), py::arg("maxNewTokens"),
           py::arg("stream") = py::none(), py::arg("physicalToLogical") = false,
           py::keep_alive<1, 2>(),
           "stream: the CUDA stream of every build's launch (GPU tables; the runtime's, as an int: "
           "torch.cuda.Stream.cuda_stream; None = the legacy default stream). physicalToLogical: "
           "also build FlexAttention's physical-to-logical page map ([n, numPages] a step).")
      .def(
          "build",
          [](AttentionViews& views, std::vector<CacheSlot> const& residentSlots,
             std::vector<int32_t> const& seqLens, std::vector<int32_t> const& newTokens,
             PageId nullPage) { views.build(residentSlots, seqLens, newTokens, nullPage); },
          py::arg("residentSlots"), py::arg("seqLens"), py::arg("newTokens"),
          py::arg("nullPage") = 0)
      .def_property_readonly("rows", &AttentionViews::rows)
      .def_property_readonly("newTokenCount", &AttentionViews::newTokenCount)
      .def_property_readonly("maxPagesPerRow", &AttentionViews::maxPagesPerRow)
      .def_property_readonly("tokensPerPage", &AttentionViews::tokensPerPage)
      .def_property_readonly("deviceType", &AttentionViews::deviceType)
      .def_property_readonly("launches", &AttentionViews::launches)
      .def("blockTable", &AttentionViews::blockTable, kInternal)
      .def("seqLensBefore", &AttentionViews::seqLensBefore, kInternal)
      .def("seqLensAfter", &AttentionViews::seqLensAfter, kInternal)
      .def("queryStartLoc", &AttentionViews::queryStartLoc, kInternal)
      .def("kvIndptr", &AttentionViews::kvIndptr, kInternal)
      .def("kvIndices", &AttentionViews::kvIndices, kInternal)
      .def("kvLastPageLen", &AttentionViews::kvLastPageLen, kInternal)
      .def("slotMapping", &AttentionViews::slotMapping, kInternal)
      .def_property_readonly("hasPhysicalPageMap", &AttentionViews::hasPhysicalPageMap)
      .def("physicalToLogical", &AttentionViews::physicalToLogical, kInternal);
}

}  // namespace

void bindRuntime(py::module_& module) {
  bindPoolAndTable(module);
  bindBackends(module);
  bindRuntimeClass(module);
  bindRequest(module);
  bindViews(module);
}

}  // namespace mkv::python
