// The library's enums, configs and value types in Python, under their C++ names. Fields that hold
// C++ callables (synchronizer, faults, retentionClock) and media buffers are not bound, but for
// TensorParallelConfig.agreement: a Python callable (RankOutcome) -> AgreedOutcome, such as
// managedkv.tensor_parallel.torch_agreement().
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "mkv/context_cache/context_cache_config.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/context_cache/context_cache_metrics.h"
#include "mkv/context_cache/context_cache_types.h"
#include "mkv/error.h"
#include "mkv/generation_request.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/tensor_parallel.h"
#include "mkv/types.h"

namespace mkv::python {
namespace {

void bindEnums(py::module_& m) {
  py::enum_<DataType>(m, "DataType")
      .value("kFloat32", DataType::kFloat32)
      .value("kFloat16", DataType::kFloat16)
      .value("kBFloat16", DataType::kBFloat16)
      .value("kFp8E4M3", DataType::kFp8E4M3)
      .value("kInt8", DataType::kInt8)
      .value("kUInt8", DataType::kUInt8)
      .value("kInt32", DataType::kInt32)
      .value("kInt64", DataType::kInt64);
  py::enum_<DeviceType>(m, "DeviceType")
      .value("kCPU", DeviceType::kCPU)
      .value("kGPU", DeviceType::kGPU);
  py::enum_<DeviceWriteTiming>(m, "DeviceWriteTiming")
      .value("kEachCall", DeviceWriteTiming::kEachCall)
      .value("kEngineStep", DeviceWriteTiming::kEngineStep);
  py::enum_<EvictionPolicyKind>(m, "EvictionPolicyKind")
      .value("kLru", EvictionPolicyKind::kLru)
      .value("kS3Fifo", EvictionPolicyKind::kS3Fifo)
      .value("kLoopAware", EvictionPolicyKind::kLoopAware);
  py::enum_<ReusePointAdmission>(m, "ReusePointAdmission")
      .value("kEveryInterval", ReusePointAdmission::kEveryInterval)
      .value("kBranchFirst", ReusePointAdmission::kBranchFirst);
  py::enum_<JoinerPageAllocation>(m, "JoinerPageAllocation")
      .value("kWholePrompt", JoinerPageAllocation::kWholePrompt)
      .value("kPerChunk", JoinerPageAllocation::kPerChunk);
  py::enum_<FinishReason>(m, "FinishReason")
      .value("kNotFinished", FinishReason::kNotFinished)
      .value("kEndOfSequence", FinishReason::kEndOfSequence)
      .value("kStopString", FinishReason::kStopString)
      .value("kLength", FinishReason::kLength)
      .value("kCancelled", FinishReason::kCancelled)
      .value("kError", FinishReason::kError);
  py::enum_<AdmitSequenceStatus>(m, "AdmitSequenceStatus")
      .value("kAdmitted", AdmitSequenceStatus::kAdmitted)
      .value("kNoCapacity", AdmitSequenceStatus::kNoCapacity)
      .value("kFailed", AdmitSequenceStatus::kFailed);
  py::enum_<PreemptionKind>(m, "PreemptionKind")
      .value("kRecompute", PreemptionKind::kRecompute)
      .value("kSwap", PreemptionKind::kSwap);
  py::enum_<RowFailureReason>(m, "RowFailureReason")
      .value("kNone", RowFailureReason::kNone)
      .value("kNoCapacity", RowFailureReason::kNoCapacity)
      .value("kTableFull", RowFailureReason::kTableFull)
      .value("kPoisoned", RowFailureReason::kPoisoned);
  py::enum_<ContextCacheCommitPolicy>(m, "ContextCacheCommitPolicy")
      .value("kIncludingGeneratedTokens", ContextCacheCommitPolicy::kIncludingGeneratedTokens)
      .value("kPrefillStateOnly", ContextCacheCommitPolicy::kPrefillStateOnly);
  py::enum_<ContextCacheLookupPolicy>(m, "ContextCacheLookupPolicy")
      .value("kUseCache", ContextCacheLookupPolicy::kUseCache)
      .value("kBypass", ContextCacheLookupPolicy::kBypass);
  py::enum_<DecodingTokenStateContract>(m, "DecodingTokenStateContract")
      .value("kCommittedPlusLookahead", DecodingTokenStateContract::kCommittedPlusLookahead)
      .value("kFullyCommitted", DecodingTokenStateContract::kFullyCommitted);
  py::enum_<KVCacheBackend>(m, "KVCacheBackend")
      .value("kContextReuse", KVCacheBackend::kContextReuse)
      .value("kBoundedSwa", KVCacheBackend::kBoundedSwa)
      .value("kFullStorage", KVCacheBackend::kFullStorage)
      .value("kSlidingWindowReuse", KVCacheBackend::kSlidingWindowReuse);
  py::enum_<ResidentRowState>(m, "ResidentRowState")
      .value("kFree", ResidentRowState::kFree)
      .value("kActive", ResidentRowState::kActive)
      .value("kQuarantined", ResidentRowState::kQuarantined);
  py::enum_<KvHeadLayout>(m, "KvHeadLayout")
      .value("kSplitHeads", KvHeadLayout::kSplitHeads)
      .value("kReplicated", KvHeadLayout::kReplicated);
  py::enum_<PageTableMode>(m, "PageTableMode")
      .value("kDense", PageTableMode::kDense)
      .value("kSparseWindow", PageTableMode::kSparseWindow);
  py::enum_<MissReason>(m, "MissReason")
      .value("kNoPrefix", MissReason::kNoPrefix)
      .value("kShorterThanOnePage", MissReason::kShorterThanOnePage)
      .value("kEvicted", MissReason::kEvicted)
      .value("kSaltMismatch", MissReason::kSaltMismatch)
      .value("kLoraMismatch", MissReason::kLoraMismatch)
      .value("kMediaMismatch", MissReason::kMediaMismatch)
      .value("kCapacity", MissReason::kCapacity)
      .value("kWindowEvicted", MissReason::kWindowEvicted);
}

void bindConfigs(py::module_& m) {
  py::class_<KVCacheModelConfig>(m, "KVCacheModelConfig")
      .def(py::init<>())
      .def_readwrite("numFullAttentionLayers", &KVCacheModelConfig::numFullAttentionLayers)
      .def_readwrite("numSlidingWindowLayers", &KVCacheModelConfig::numSlidingWindowLayers)
      .def_readwrite("slidingWindowTokens", &KVCacheModelConfig::slidingWindowTokens)
      .def_readwrite("numKVHeads", &KVCacheModelConfig::numKVHeads)
      .def_readwrite("headDim", &KVCacheModelConfig::headDim)
      .def_readwrite("kvDataType", &KVCacheModelConfig::kvDataType)
      .def_readwrite("numRecurrentLayers", &KVCacheModelConfig::numRecurrentLayers)
      .def_readwrite("recurrentStateBytes", &KVCacheModelConfig::recurrentStateBytes)
      .def_readwrite("recurrentConvBytes", &KVCacheModelConfig::recurrentConvBytes);
  py::class_<KVCacheSpeculativeConfig>(m, "KVCacheSpeculativeConfig")
      .def(py::init<>())
      .def_readwrite("pagedDraft", &KVCacheSpeculativeConfig::pagedDraft)
      .def_readwrite("futureDependencyTokens", &KVCacheSpeculativeConfig::futureDependencyTokens)
      .def_readwrite("numDraftLayers", &KVCacheSpeculativeConfig::numDraftLayers)
      .def_readwrite("numDraftKVHeads", &KVCacheSpeculativeConfig::numDraftKVHeads)
      .def_readwrite("draftHeadDim", &KVCacheSpeculativeConfig::draftHeadDim)
      .def_readwrite("draftKvDataType", &KVCacheSpeculativeConfig::draftKvDataType)
      .def_readwrite("numDraftPages", &KVCacheSpeculativeConfig::numDraftPages)
      .def_readwrite("boundaryHiddenWidth", &KVCacheSpeculativeConfig::boundaryHiddenWidth)
      .def_readwrite("boundaryHiddenType", &KVCacheSpeculativeConfig::boundaryHiddenType);
  py::class_<ContextCacheConfig>(m, "ContextCacheConfig")
      .def(py::init<>())
      .def_readwrite("maxRecords", &ContextCacheConfig::maxRecords)
      .def_readwrite("verifyTokens", &ContextCacheConfig::verifyTokens)
      .def_readwrite("eventQueueCapacity", &ContextCacheConfig::eventQueueCapacity)
      .def_readwrite("recurrentSnapshotPoolBytes", &ContextCacheConfig::recurrentSnapshotPoolBytes)
      .def_readwrite("partialKvSnapshotPoolBytes", &ContextCacheConfig::partialKvSnapshotPoolBytes)
      .def_readwrite("checkpointInterval", &ContextCacheConfig::checkpointInterval)
      .def_readwrite("reusePointAdmission", &ContextCacheConfig::reusePointAdmission)
      .def_readwrite("evictionPolicy", &ContextCacheConfig::evictionPolicy)
      .def_readwrite("joinerPages", &ContextCacheConfig::joinerPages);
  py::class_<RankOutcome>(m, "RankOutcome")
      .def(py::init<>())
      .def_readwrite("succeeded", &RankOutcome::succeeded)
      .def_readwrite("decisionDigest", &RankOutcome::decisionDigest);
  py::class_<AgreedOutcome>(m, "AgreedOutcome")
      .def(py::init<>())
      .def(py::init([](bool allSucceeded, bool digestsAgree) {
             return AgreedOutcome{allSucceeded, digestsAgree};
           }),
           py::arg("allSucceeded"), py::arg("digestsAgree"))
      .def_readwrite("allSucceeded", &AgreedOutcome::allSucceeded)
      .def_readwrite("digestsAgree", &AgreedOutcome::digestsAgree);
  py::class_<TensorParallelConfig>(m, "TensorParallelConfig")
      .def(py::init<>())
      .def_readwrite("size", &TensorParallelConfig::size)
      .def_readwrite("rank", &TensorParallelConfig::rank)
      .def_readwrite("kvHeads", &TensorParallelConfig::kvHeads)
      .def_readwrite("agreement", &TensorParallelConfig::agreement,
                     "The group's collective: a callable (RankOutcome) -> AgreedOutcome that every "
                     "rank calls at the same points (managedkv.tensor_parallel.torch_agreement).");
  py::class_<KVCacheRuntimeConfig>(m, "KVCacheRuntimeConfig")
      .def(py::init<>())
      .def_readwrite("model", &KVCacheRuntimeConfig::model)
      .def_readwrite("maxBatchSize", &KVCacheRuntimeConfig::maxBatchSize)
      .def_readwrite("maxSequenceLength", &KVCacheRuntimeConfig::maxSequenceLength)
      .def_readwrite("tokensPerPage", &KVCacheRuntimeConfig::tokensPerPage)
      .def_readwrite("numPages", &KVCacheRuntimeConfig::numPages)
      .def_readwrite("numSwaPages", &KVCacheRuntimeConfig::numSwaPages)
      .def_readwrite("contextReuse", &KVCacheRuntimeConfig::contextReuse)
      .def_readwrite("contextCache", &KVCacheRuntimeConfig::contextCache)
      .def_readwrite("hostPoolTokens", &KVCacheRuntimeConfig::hostPoolTokens)
      .def_readwrite("speculative", &KVCacheRuntimeConfig::speculative)
      .def_readwrite("deviceType", &KVCacheRuntimeConfig::deviceType)
      .def_readwrite("deviceWrites", &KVCacheRuntimeConfig::deviceWrites)
      .def_readwrite("tensorParallel", &KVCacheRuntimeConfig::tensorParallel)
      .def_property(
          "stream",
          [](KVCacheRuntimeConfig const& c) { return reinterpret_cast<uintptr_t>(c.stream); },
          [](KVCacheRuntimeConfig& c, py::object const& stream) { c.stream = streamArg(stream); },
          "The engine's CUDA stream as an int (torch.cuda.Stream.cuda_stream); 0 = legacy.");
}

void bindValues(py::module_& m) {
  py::class_<DecodingKvHeadroom>(m, "DecodingKvHeadroom")
      .def(py::init<>())
      .def(py::init([](int32_t base, int32_t draft) {
             return DecodingKvHeadroom{base, draft};
           }),
           py::arg("baseExtraTokens"), py::arg("draftExtraTokens") = 0)
      .def_readwrite("baseExtraTokens", &DecodingKvHeadroom::baseExtraTokens)
      .def_readwrite("draftExtraTokens", &DecodingKvHeadroom::draftExtraTokens)
      .def("__eq__",
           [](DecodingKvHeadroom const& a, DecodingKvHeadroom const& b) { return a == b; });
  py::class_<ResidentRef>(m, "ResidentRef")
      .def(py::init<>())
      .def(py::init([](CacheSlot slot, uint64_t epoch) {
             return ResidentRef{slot, epoch};
           }),
           py::arg("slot"), py::arg("epoch"))
      .def_readwrite("slot", &ResidentRef::slot)
      .def_readwrite("epoch", &ResidentRef::epoch)
      .def("__eq__", [](ResidentRef const& a, ResidentRef const& b) { return a == b; })
      .def("__repr__", [](ResidentRef const& r) {
        return "ResidentRef(slot=" + std::to_string(r.slot) + ", epoch=" + std::to_string(r.epoch) +
               ")";
      });
  py::class_<RowFailure>(m, "RowFailure")
      .def_readonly("reason", &RowFailure::reason)
      .def_readonly("row", &RowFailure::row);
  py::class_<DecodeStepDemand>(m, "DecodeStepDemand")
      .def_readonly("basePages", &DecodeStepDemand::basePages)
      .def_readonly("draftPages", &DecodeStepDemand::draftPages)
      .def_readonly("slidingPages", &DecodeStepDemand::slidingPages)
      .def_readonly("tableFull", &DecodeStepDemand::tableFull);
  py::class_<RetentionRange>(m, "RetentionRange")
      .def(py::init<>())
      .def_readwrite("tokenStart", &RetentionRange::tokenStart)
      .def_readwrite("tokenEnd", &RetentionRange::tokenEnd)
      .def_readwrite("priority", &RetentionRange::priority)
      .def_readwrite("duration", &RetentionRange::duration);
  py::class_<ReusePointCapture>(m, "ReusePointCapture")
      .def_readonly("position", &ReusePointCapture::position)
      .def_readonly("snapshotSlot", &ReusePointCapture::snapshotSlot);
  py::class_<TensorParallelStats>(m, "TensorParallelStats")
      .def_readonly("agreements", &TensorParallelStats::agreements)
      .def_readonly("failedElsewhere", &TensorParallelStats::failedElsewhere)
      .def_readonly("divergences", &TensorParallelStats::divergences);
  py::class_<PagePoolUsage>(m, "PagePoolUsage")
      .def_readonly("totalPages", &PagePoolUsage::totalPages)
      .def_readonly("freePages", &PagePoolUsage::freePages)
      .def_readonly("reclaimablePages", &PagePoolUsage::reclaimablePages)
      .def_readonly("leasedPages", &PagePoolUsage::leasedPages)
      .def("usage", &PagePoolUsage::usage);
  py::class_<KVCacheCapacity>(m, "KVCacheCapacity")
      .def_readonly("base", &KVCacheCapacity::base)
      .def_readonly("draft", &KVCacheCapacity::draft)
      .def_readonly("sliding", &KVCacheCapacity::sliding)
      .def_readonly("hostTier", &KVCacheCapacity::hostTier)
      .def("usage", &KVCacheCapacity::usage);
  py::class_<ResourceDemand>(m, "ResourceDemand")
      .def_readonly("baseKvPages", &ResourceDemand::baseKvPages)
      .def_readonly("draftKvPages", &ResourceDemand::draftKvPages)
      .def_readonly("recurrentSnapshotSlots", &ResourceDemand::recurrentSnapshotSlots)
      .def_readonly("partialKvSnapshotSlots", &ResourceDemand::partialKvSnapshotSlots);
  py::class_<AdmissionEstimate>(m, "AdmissionEstimate")
      .def_readonly("promptTokens", &AdmissionEstimate::promptTokens)
      .def_readonly("reusableTokens", &AdmissionEstimate::reusableTokens)
      .def_readonly("hostTierTokens", &AdmissionEstimate::hostTierTokens)
      .def_readonly("demand", &AdmissionEstimate::demand)
      .def_readonly("pinnedReclaimable", &AdmissionEstimate::pinnedReclaimable)
      .def_readonly("fitsWithoutEviction", &AdmissionEstimate::fitsWithoutEviction)
      .def_readonly("fitsAfterEviction", &AdmissionEstimate::fitsAfterEviction)
      .def_readonly("missReason", &AdmissionEstimate::missReason)
      .def_readonly("slidingPages", &AdmissionEstimate::slidingPages);
}

void bindMetrics(py::module_& m) {
  py::class_<ContextCacheMetrics>(m, "ContextCacheMetrics")
      .def_readonly("admittedSequences", &ContextCacheMetrics::admittedSequences)
      .def_readonly("lookups", &ContextCacheMetrics::lookups)
      .def_readonly("hits", &ContextCacheMetrics::hits)
      .def_readonly("matchedTokens", &ContextCacheMetrics::matchedTokens)
      .def_readonly("reusedTokens", &ContextCacheMetrics::reusedTokens)
      .def_readonly("queriedTokens", &ContextCacheMetrics::queriedTokens)
      .def_readonly("failedAcquisitions", &ContextCacheMetrics::failedAcquisitions)
      .def_readonly("publishedRecords", &ContextCacheMetrics::publishedRecords)
      .def_readonly("evictedRecords", &ContextCacheMetrics::evictedRecords)
      .def_readonly("verificationRejects", &ContextCacheMetrics::verificationRejects)
      .def_readonly("offloadedPages", &ContextCacheMetrics::offloadedPages)
      .def_readonly("onboardedPages", &ContextCacheMetrics::onboardedPages)
      .def_readonly("hostTierHitTokens", &ContextCacheMetrics::hostTierHitTokens)
      .def_readonly("records", &ContextCacheMetrics::records)
      .def_readonly("liveLeases", &ContextCacheMetrics::liveLeases)
      .def_property_readonly("misses", [](ContextCacheMetrics const& metrics) {
        py::dict misses;
        for (int32_t r = 0; r < kMissReasonCount; ++r) {
          auto const reason = static_cast<MissReason>(r);
          misses[py::str(std::string(toString(reason)))] = metrics.missCount(reason);
        }
        return misses;
      });
  py::class_<ContextCacheCoordinatorCounters>(m, "ContextCacheCoordinatorCounters")
      .def_readonly("requests", &ContextCacheCoordinatorCounters::requests)
      .def_readonly("refusedRequests", &ContextCacheCoordinatorCounters::refusedRequests)
      .def_readonly("liveAdmissions", &ContextCacheCoordinatorCounters::liveAdmissions)
      .def_readonly("retractedAdmissions", &ContextCacheCoordinatorCounters::retractedAdmissions)
      .def_readonly("pageGrowths", &ContextCacheCoordinatorCounters::pageGrowths)
      .def_readonly("growthFailures", &ContextCacheCoordinatorCounters::growthFailures)
      .def_readonly("checkpointRestores", &ContextCacheCoordinatorCounters::checkpointRestores)
      .def_readonly("checkpointCaptures", &ContextCacheCoordinatorCounters::checkpointCaptures)
      .def_readonly("prefillChunks", &ContextCacheCoordinatorCounters::prefillChunks)
      .def_readonly("chunkEndCaptures", &ContextCacheCoordinatorCounters::chunkEndCaptures)
      .def_readonly("chunkPageGrowths", &ContextCacheCoordinatorCounters::chunkPageGrowths)
      .def_readonly("heldPrefills", &ContextCacheCoordinatorCounters::heldPrefills)
      .def_readonly("preemptions", &ContextCacheCoordinatorCounters::preemptions);
}

/// Rows of a DecodingInferenceContext, appended and compacted in place: pybind11 copies a
/// vector field on every access, so `context.generatedTokenIds[0].append(t)` would change a copy.
void appendRow(DecodingInferenceContext& c, std::vector<int32_t> const& prompt,
               ResidentRef resident, int32_t effectivePrefillLength) {
  c.rawBatchedInputIds.push_back(prompt);
  c.effectivePrefillLengths.push_back(effectivePrefillLength);
  c.generatedTokenIds.emplace_back();
  c.residentRefs.push_back(resident);
  c.finishReasons.push_back(FinishReason::kNotFinished);
  c.activeBatchSize = static_cast<int32_t>(c.rawBatchedInputIds.size());
}

void checkRow(DecodingInferenceContext const& c, int32_t row, char const* call) {
  if (row < 0 || static_cast<std::size_t>(row) >= c.generatedTokenIds.size() ||
      static_cast<std::size_t>(row) >= c.finishReasons.size()) {
    throw Error(call, "row " + std::to_string(row) + " outside the context's " +
                          std::to_string(c.generatedTokenIds.size()) + " rows");
  }
}

template <typename T>
void keepRows(std::vector<T>& values, std::vector<int32_t> const& oldToNew, int32_t survivors) {
  if (values.size() != oldToNew.size()) {
    return;  // a field the engine does not keep per row
  }
  std::vector<T> kept(static_cast<std::size_t>(survivors));
  for (std::size_t i = 0; i < oldToNew.size(); ++i) {
    if (oldToNew[i] >= 0) {
      kept[static_cast<std::size_t>(oldToNew[i])] = std::move(values[i]);
    }
  }
  values = std::move(kept);
}

void compactRows(DecodingInferenceContext& c, std::vector<int32_t> const& oldToNew) {
  char const* call = "DecodingInferenceContext.compact";
  if (oldToNew.size() != c.rawBatchedInputIds.size()) {
    throw Error(call, "a mapping of " + std::to_string(oldToNew.size()) + " rows for " +
                          std::to_string(c.rawBatchedInputIds.size()) + " rows");
  }
  int32_t survivors = 0;
  for (int32_t const target : oldToNew) {
    if (target >= 0) {
      if (target != survivors) {
        throw Error(call, "the mapping is not order-preserving: survivor " +
                              std::to_string(survivors) + " maps to " + std::to_string(target));
      }
      ++survivors;
    } else if (target != -1) {
      throw Error(call, "mapping entry " + std::to_string(target) + ", expected -1 or a row");
    }
  }
  keepRows(c.rawBatchedInputIds, oldToNew, survivors);
  keepRows(c.effectivePrefillLengths, oldToNew, survivors);
  keepRows(c.generatedTokenIds, oldToNew, survivors);
  keepRows(c.residentRefs, oldToNew, survivors);
  keepRows(c.finishReasons, oldToNew, survivors);
  c.activeBatchSize = survivors;
}

void bindRequestData(py::module_& m) {
  py::class_<LLMGenerationRequest::Sequence>(m, "LLMGenerationRequestSequence")
      .def(py::init<>())
      .def_readwrite("contextCacheLookupPolicy",
                     &LLMGenerationRequest::Sequence::contextCacheLookupPolicy);
  py::class_<LLMGenerationRequest>(m, "LLMGenerationRequest")
      .def(py::init<>())
      .def(py::init([](int32_t sequences) {
             LLMGenerationRequest request;
             request.requests.resize(static_cast<std::size_t>(std::max(sequences, 0)));
             return request;
           }),
           py::arg("sequences"), "A request of `sequences` text sequences.")
      .def_readwrite("requests", &LLMGenerationRequest::requests)
      .def_readwrite("contextCacheLookupPolicy", &LLMGenerationRequest::contextCacheLookupPolicy)
      .def_readwrite("contextCacheCommitPolicy", &LLMGenerationRequest::contextCacheCommitPolicy)
      .def_readwrite("contextCacheReplayTailLength",
                     &LLMGenerationRequest::contextCacheReplayTailLength)
      .def_readwrite("loraWeightsName", &LLMGenerationRequest::loraWeightsName)
      .def_readwrite("cacheSalt", &LLMGenerationRequest::cacheSalt)
      .def_readwrite("contextCacheRetention", &LLMGenerationRequest::contextCacheRetention);
  py::class_<DecodingInferenceContext>(
      m, "DecodingInferenceContext",
      "The runtime's per-request view. Vector fields are copied on access: assign whole lists, "
      "or use appendRow / appendToken / setFinishReason / compact, which change it in place.")
      .def(py::init<>())
      .def_property(
          "stream",
          [](DecodingInferenceContext const& c) { return reinterpret_cast<uintptr_t>(c.stream); },
          [](DecodingInferenceContext& c, py::object const& s) { c.stream = streamArg(s); })
      .def_readwrite("activeBatchSize", &DecodingInferenceContext::activeBatchSize)
      .def_readwrite("rawBatchedInputIds", &DecodingInferenceContext::rawBatchedInputIds)
      .def_readwrite("effectivePrefillLengths", &DecodingInferenceContext::effectivePrefillLengths)
      .def_readwrite("generatedTokenIds", &DecodingInferenceContext::generatedTokenIds)
      .def_readwrite("residentRefs", &DecodingInferenceContext::residentRefs)
      .def_readwrite("finishReasons", &DecodingInferenceContext::finishReasons)
      .def_readwrite("loraWeightsName", &DecodingInferenceContext::loraWeightsName)
      .def("appendRow", &appendRow, py::arg("prompt"), py::arg("resident"),
           py::arg("effectivePrefillLength") = 0,
           "Appends a row (prompt, no tokens, kNotFinished); activeBatchSize = rows.")
      .def(
          "appendToken",
          [](DecodingInferenceContext& c, int32_t row, int32_t token) {
            checkRow(c, row, "DecodingInferenceContext.appendToken");
            c.generatedTokenIds[static_cast<std::size_t>(row)].push_back(token);
          },
          py::arg("row"), py::arg("token"))
      .def(
          "setFinishReason",
          [](DecodingInferenceContext& c, int32_t row, FinishReason reason) {
            checkRow(c, row, "DecodingInferenceContext.setFinishReason");
            c.finishReasons[static_cast<std::size_t>(row)] = reason;
          },
          py::arg("row"), py::arg("reason"))
      .def(
          "tokens",
          [](DecodingInferenceContext const& c, int32_t row) {
            checkRow(c, row, "DecodingInferenceContext.tokens");
            std::vector<int32_t> all = c.rawBatchedInputIds.at(static_cast<std::size_t>(row));
            auto const& generated = c.generatedTokenIds[static_cast<std::size_t>(row)];
            all.insert(all.end(), generated.begin(), generated.end());
            return all;
          },
          py::arg("row"), "Prompt then generated tokens of one row.")
      .def("compact", &compactRows, py::arg("oldToNew"),
           "Keeps the rows an order-preserving mapping keeps (as a batch compaction does).");
}

}  // namespace

void bindTypes(py::module_& module) {
  bindEnums(module);
  bindConfigs(module);
  bindValues(module);
  bindMetrics(module);
  bindRequestData(module);
}

}  // namespace mkv::python
