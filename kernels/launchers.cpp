/// Validation and device dispatch of the launchers declared in mkv/kernels.h.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/check.h"
#include "core/device.h"
#include "kernel_params.h"
#include "mkv/kernels.h"

namespace mkv::kernels {
namespace {

using detail::RowBufferDesc;

void requireIndexTensor(Tensor const& t, char const* call, char const* name, DeviceType device,
                        int64_t expectedCount) {
  MKV_REQUIRE(t.dataType() == DataType::kInt32, call, "{} must be int32, got {}", name,
              toString(t.dataType()));
  MKV_REQUIRE(t.rank() == 1, call, "{} must be 1-D, got shape {}", name, t.shape().toString());
  MKV_REQUIRE(t.deviceType() == device, call, "{} is on {} but the data is on {}", name,
              toString(t.deviceType()), toString(device));
  if (expectedCount >= 0) {
    MKV_REQUIRE(t.numel() == expectedCount, call, "{} has {} entries, expected {}", name, t.numel(),
                expectedCount);
  }
  MKV_REQUIRE(t.numel() == 0 || t.rawPointer() != nullptr, call, "{} has no data", name);
}

/// Host-readable ids must be -1 or inside [0, limit).
void requireIdsInRange(Tensor const& ids, int64_t limit, char const* call, char const* name) {
  if (ids.deviceType() != DeviceType::kCPU) {
    return;
  }
  int32_t const* values = ids.dataPointer<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    MKV_REQUIRE(values[i] >= -1 && values[i] < limit, call, "{}[{}] = {} is outside [-1, {})", name,
                i, values[i], limit);
  }
}

#if MKV_WITH_CUDA
#define MKV_CUDA_IMPL(function) (&detail::function)
#else
#define MKV_CUDA_IMPL(function) nullptr
#endif

template <typename Launch>
using CudaImpl = cudaError_t (*)(Launch const&, cudaStream_t);

template <typename Launch>
void run(DeviceType device, char const* call, Launch const& launch, void (*host)(Launch const&),
         std::type_identity_t<CudaImpl<Launch>> cuda, cudaStream_t stream) {
  if (device == DeviceType::kCPU) {
    host(launch);
    return;
  }
#if MKV_WITH_CUDA
  mkv::detail::checkCuda(cuda(launch, stream), call);
#else
  (void)cuda;
  (void)stream;
  mkv::detail::throwContract(call, "GPU buffers given, but managedkv was built without CUDA");
#endif
}

void requireRowBuffers(std::span<RowBuffer const> buffers, char const* call, int64_t minRows) {
  MKV_REQUIRE(buffers.size() <= static_cast<std::size_t>(kMaxRowBuffers), call,
              "{} buffers exceed the limit of {}", buffers.size(), kMaxRowBuffers);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    MKV_REQUIRE(buffers[b].rowBytes > 0, call, "buffer {} has rowBytes {}", b, buffers[b].rowBytes);
    MKV_REQUIRE(buffers[b].data != nullptr, call, "buffer {} has no data", b);
    MKV_REQUIRE(buffers[b].numRows >= minRows, call, "buffer {} has {} rows, needs {}", b,
                buffers[b].numRows, minRows);
  }
}

/// Words of the compactBatch workspace for `rows` rows of buffers of these widths: the header
/// and one flag per unit at the narrowest access width (1 byte), which has the most units; a
/// launch's real width depends on the buffers' alignment, so this bounds every launch.
int64_t compactWorkspaceWords(char const* call, int64_t rows, std::span<int64_t const> rowBytes) {
  MKV_REQUIRE(rows >= 0, call, "maxOldBatch {} is negative", rows);
  MKV_REQUIRE(rowBytes.size() <= static_cast<std::size_t>(kMaxRowBuffers), call,
              "{} buffers exceed the limit of {}", rowBytes.size(), kMaxRowBuffers);
  int64_t units = 0;
  for (std::size_t b = 0; b < rowBytes.size(); ++b) {
    MKV_REQUIRE(rowBytes[b] > 0, call, "buffer {} has rowBytes {}", b, rowBytes[b]);
    units += detail::compactUnits(rowBytes[b], 1, rows);  // each <= kMaxCompactUnits + 1
  }
  MKV_REQUIRE(units <= detail::kMaxCompactUnits, call,
              "{} rows of these buffers need {} work units, more than the limit of {}", rows, units,
              detail::kMaxCompactUnits);
  return detail::kCompactHeaderWords + units;
}

}  // namespace

int64_t compactBatchWorkspaceBytes(int64_t maxOldBatch, std::span<int64_t const> rowBytes) {
  return compactWorkspaceWords("compactBatchWorkspaceBytes", maxOldBatch, rowBytes) *
         static_cast<int64_t>(sizeof(uint32_t));
}

void copyPages(PagedBuffers const& src, PagedBuffers const& dst, Tensor const& srcIds,
               Tensor const& dstIds, Tensor const* tokenCounts, cudaStream_t stream) {
  constexpr char const* kCall = "copyPages";
  MKV_REQUIRE(src.deviceType == dst.deviceType, kCall, "src is on {} but dst on {}",
              toString(src.deviceType), toString(dst.deviceType));
  MKV_REQUIRE(src.numLayers() == dst.numLayers(), kCall, "src has {} layers but dst {}",
              src.numLayers(), dst.numLayers());
  MKV_REQUIRE(src.numLayers() <= kMaxLayers, kCall, "{} layers exceed the limit of {}",
              src.numLayers(), kMaxLayers);
  MKV_REQUIRE(src.tokensPerPage > 0 && src.tokensPerPage == dst.tokensPerPage, kCall,
              "tokensPerPage differ or are not positive: src {}, dst {}", src.tokensPerPage,
              dst.tokensPerPage);
  MKV_REQUIRE(src.tokenBytes > 0 && src.tokenBytes == dst.tokenBytes, kCall,
              "tokenBytes differ or are not positive: src {}, dst {}", src.tokenBytes,
              dst.tokenBytes);
  MKV_REQUIRE(src.numPages > 0 && dst.numPages > 0, kCall,
              "numPages must be positive: src {}, dst {}", src.numPages, dst.numPages);
  for (int32_t l = 0; l < src.numLayers(); ++l) {
    MKV_REQUIRE(src.layerBases[static_cast<std::size_t>(l)] != nullptr &&
                    dst.layerBases[static_cast<std::size_t>(l)] != nullptr,
                kCall, "layer {} has a null base pointer", l);
  }
  requireIndexTensor(srcIds, kCall, "srcIds", src.deviceType, -1);
  requireIndexTensor(dstIds, kCall, "dstIds", src.deviceType, srcIds.numel());
  requireIdsInRange(srcIds, src.numPages, kCall, "srcIds");
  requireIdsInRange(dstIds, dst.numPages, kCall, "dstIds");
  if (tokenCounts != nullptr) {
    requireIndexTensor(*tokenCounts, kCall, "tokenCounts", src.deviceType, srcIds.numel());
    if (tokenCounts->deviceType() == DeviceType::kCPU) {
      int32_t const* counts = tokenCounts->dataPointer<int32_t>();
      for (int64_t i = 0; i < tokenCounts->numel(); ++i) {
        MKV_REQUIRE(counts[i] >= 0 && counts[i] <= src.tokensPerPage, kCall,
                    "tokenCounts[{}] = {} is outside [0, {}]", i, counts[i], src.tokensPerPage);
      }
    }
  }
  if (srcIds.numel() == 0) {
    return;
  }
  detail::CopyPagesLaunch launch{};
  std::copy(src.layerBases.begin(), src.layerBases.end(), launch.srcLayers);
  std::copy(dst.layerBases.begin(), dst.layerBases.end(), launch.dstLayers);
  launch.srcIds = srcIds.dataPointer<int32_t>();
  launch.dstIds = dstIds.dataPointer<int32_t>();
  launch.tokenCounts = tokenCounts != nullptr ? tokenCounts->dataPointer<int32_t>() : nullptr;
  launch.tokenBytes = src.tokenBytes;
  launch.numLayers = src.numLayers();
  launch.numItems = static_cast<int32_t>(srcIds.numel());
  launch.srcNumPages = src.numPages;
  launch.dstNumPages = dst.numPages;
  launch.tokensPerPage = src.tokensPerPage;
  run(src.deviceType, kCall, launch, &detail::copyPagesHost, MKV_CUDA_IMPL(copyPagesCuda), stream);
}

void checkCompactBatch(std::span<RowBuffer const> buffers, DeviceType deviceType,
                       Tensor const& oldToNew, int32_t newBatchSize, Tensor const& workspace) {
  constexpr char const* kCall = "compactBatch";
  requireIndexTensor(oldToNew, kCall, "oldToNew", deviceType, -1);
  int64_t const oldBatch = oldToNew.numel();
  MKV_REQUIRE(newBatchSize >= 0 && newBatchSize <= oldBatch, kCall,
              "newBatchSize {} is outside [0, {}]", newBatchSize, oldBatch);
  requireRowBuffers(buffers, kCall, oldBatch);
  if (deviceType == DeviceType::kCPU) {
    int32_t const* mapping = oldToNew.dataPointer<int32_t>();
    int32_t nextSurvivor = 0;
    for (int64_t i = 0; i < oldBatch; ++i) {
      if (mapping[i] < 0 || mapping[i] >= newBatchSize) {
        MKV_REQUIRE(mapping[i] >= -1, kCall, "oldToNew[{}] = {} is below -1", i, mapping[i]);
        continue;
      }
      MKV_REQUIRE(mapping[i] == nextSurvivor, kCall,
                  "mapping is not order-preserving: oldToNew[{}] = {}, expected {}", i, mapping[i],
                  nextSurvivor);
      ++nextSurvivor;
    }
  } else {
    std::array<int64_t, kMaxRowBuffers> rowBytes{};
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      rowBytes[b] = buffers[b].rowBytes;
    }
    int64_t const words =
        compactWorkspaceWords(kCall, oldBatch, std::span(rowBytes.data(), buffers.size()));
    int64_t const bytes = words * static_cast<int64_t>(sizeof(uint32_t));
    MKV_REQUIRE(workspace.dataType() == DataType::kInt32 && workspace.deviceType() == deviceType,
                kCall, "workspace must be int32 on {}, got {} on {}", toString(deviceType),
                toString(workspace.dataType()), toString(workspace.deviceType()));
    MKV_REQUIRE(workspace.sizeBytes() >= bytes, kCall,
                "workspace has {} bytes, needs {} for {} rows of {} buffers "
                "(compactBatchWorkspaceBytes)",
                workspace.sizeBytes(), bytes, oldBatch, buffers.size());
    MKV_REQUIRE(reinterpret_cast<uintptr_t>(workspace.rawPointer()) % sizeof(uint64_t) == 0, kCall,
                "workspace is not 8-byte aligned");
  }
}

void compactBatch(std::span<RowBuffer const> buffers, DeviceType deviceType, Tensor const& oldToNew,
                  int32_t newBatchSize, Tensor& workspace, cudaStream_t stream) {
  constexpr char const* kCall = "compactBatch";
  checkCompactBatch(buffers, deviceType, oldToNew, newBatchSize, workspace);
  int64_t const oldBatch = oldToNew.numel();
  if (buffers.empty() || oldBatch == 0) {
    return;
  }
  detail::CompactBatchLaunch launch{};
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    launch.buffers[b] = RowBufferDesc{static_cast<uint8_t*>(buffers[b].data), buffers[b].rowBytes};
  }
  launch.oldToNew = oldToNew.dataPointer<int32_t>();
  if (deviceType == DeviceType::kGPU) {
    launch.workspace = workspace.dataPointer<uint32_t>();
    launch.workspaceWords = workspace.sizeBytes() / static_cast<int64_t>(sizeof(uint32_t));
  }
  launch.numBuffers = static_cast<int32_t>(buffers.size());
  launch.oldBatch = static_cast<int32_t>(oldBatch);
  launch.newBatch = newBatchSize;
  run(deviceType, kCall, launch, &detail::compactBatchHost, MKV_CUDA_IMPL(compactBatchCuda),
      stream);
}

void copyRows(std::span<RowBufferPair const> buffers, DeviceType deviceType, Tensor const& srcRows,
              Tensor const& dstRows, cudaStream_t stream) {
  constexpr char const* kCall = "copyRows";
  MKV_REQUIRE(buffers.size() <= static_cast<std::size_t>(kMaxRowBuffers), kCall,
              "{} buffer pairs exceed the limit of {}", buffers.size(), kMaxRowBuffers);
  requireIndexTensor(srcRows, kCall, "srcRows", deviceType, -1);
  requireIndexTensor(dstRows, kCall, "dstRows", deviceType, srcRows.numel());
  detail::CopyRowsLaunch launch{};
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    RowBuffer const& src = buffers[b].src;
    RowBuffer const& dst = buffers[b].dst;
    MKV_REQUIRE(src.rowBytes > 0 && src.rowBytes == dst.rowBytes, kCall,
                "pair {}: rowBytes differ or are not positive: {} vs {}", b, src.rowBytes,
                dst.rowBytes);
    MKV_REQUIRE(src.data != nullptr && dst.data != nullptr, kCall, "pair {} has no data", b);
    requireIdsInRange(srcRows, src.numRows, kCall, "srcRows");
    requireIdsInRange(dstRows, dst.numRows, kCall, "dstRows");
    launch.buffers[b] =
        detail::RowCopyDesc{static_cast<uint8_t const*>(src.data), static_cast<uint8_t*>(dst.data),
                            src.rowBytes, src.numRows, dst.numRows};
  }
  if (buffers.empty() || srcRows.numel() == 0) {
    return;
  }
  launch.srcRows = srcRows.dataPointer<int32_t>();
  launch.dstRows = dstRows.dataPointer<int32_t>();
  launch.numBuffers = static_cast<int32_t>(buffers.size());
  launch.numItems = static_cast<int32_t>(srcRows.numel());
  launch.fillSkipped = 0;
  run(deviceType, kCall, launch, &detail::copyRowsHost, MKV_CUDA_IMPL(copyRowsCuda), stream);
}

namespace {

RowBuffer rowsOf(Tensor const& t) {
  return RowBuffer{const_cast<void*>(t.rawPointer()),
                   t.dim(1) * static_cast<int64_t>(dataTypeSize(t.dataType())), t.dim(0)};
}

void copyHiddenRows(char const* call, Tensor const& src, Tensor const& srcRows, Tensor& dst,
                    Tensor const& dstRows, cudaStream_t stream) {
  MKV_REQUIRE(src.rank() == 2 && dst.rank() == 2, call, "expected 2-D tensors, got {} and {}",
              src.shape().toString(), dst.shape().toString());
  MKV_REQUIRE(src.dataType() == dst.dataType(), call, "dtype mismatch: {} vs {}",
              toString(src.dataType()), toString(dst.dataType()));
  MKV_REQUIRE(src.dim(1) == dst.dim(1) && src.dim(1) > 0, call,
              "row width mismatch or empty rows: {} vs {}", src.dim(1), dst.dim(1));
  MKV_REQUIRE(src.deviceType() == dst.deviceType(), call, "src on {} but dst on {}",
              toString(src.deviceType()), toString(dst.deviceType()));
  RowBufferPair const pair{rowsOf(src), rowsOf(dst)};
  try {
    copyRows(std::span<RowBufferPair const>(&pair, 1), src.deviceType(), srcRows, dstRows, stream);
  } catch (Error const& error) {
    mkv::detail::throwContract(call, "{}", error.what());
  }
}

}  // namespace

void captureHiddenRows(Tensor const& hidden, Tensor const& rows, Tensor& slab, Tensor const& slots,
                       cudaStream_t stream) {
  copyHiddenRows("captureHiddenRows", hidden, rows, slab, slots, stream);
}

void restoreHiddenRows(Tensor const& slab, Tensor const& slots, Tensor& hidden, Tensor const& rows,
                       cudaStream_t stream) {
  copyHiddenRows("restoreHiddenRows", slab, slots, hidden, rows, stream);
}

void gatherPageTableRows(Tensor const& table, Tensor const& residentSlots, Tensor& dst,
                         cudaStream_t stream) {
  constexpr char const* kCall = "gatherPageTableRows";
  MKV_REQUIRE(table.rank() == 3 && table.dim(1) == 2, kCall,
              "table must be [maxBatch, 2, maxPagesPerSeq], got {}", table.shape().toString());
  MKV_REQUIRE(table.dataType() == DataType::kInt32 && dst.dataType() == DataType::kInt32, kCall,
              "table and dst must be int32");
  MKV_REQUIRE(table.deviceType() == dst.deviceType(), kCall, "table on {} but dst on {}",
              toString(table.deviceType()), toString(dst.deviceType()));
  requireIndexTensor(residentSlots, kCall, "residentSlots", table.deviceType(), -1);
  requireIdsInRange(residentSlots, table.dim(0), kCall, "residentSlots");
  int64_t const n = residentSlots.numel();
  Coords const shape{n, 2, table.dim(2)};
  MKV_REQUIRE(dst.reshape(shape), kCall, "dst capacity {} bytes cannot hold {}",
              dst.capacityBytes(), shape.toString());
  if (n == 0) {
    return;
  }
  detail::CopyRowsLaunch launch{};
  launch.buffers[0] = detail::RowCopyDesc{
      static_cast<uint8_t const*>(table.rawPointer()), static_cast<uint8_t*>(dst.rawPointer()),
      2 * table.dim(2) * static_cast<int64_t>(sizeof(int32_t)), table.dim(0), n};
  launch.srcRows = residentSlots.dataPointer<int32_t>();
  launch.dstRows = nullptr;
  launch.numBuffers = 1;
  launch.numItems = static_cast<int32_t>(n);
  launch.fillSkipped = 1;
  run(table.deviceType(), kCall, launch, &detail::copyRowsHost, MKV_CUDA_IMPL(copyRowsCuda),
      stream);
}

namespace {

constexpr char const* kViewsCall = "buildAttentionViews";
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

/// A view of buildAttentionViews: given, of `type`, on `device`, with room for `numel` entries.
void requireView(Tensor const* view, char const* name, DataType type, DeviceType device,
                 int64_t numel) {
  MKV_REQUIRE(view != nullptr, kViewsCall, "no {} tensor given", name);
  MKV_REQUIRE(view->dataType() == type, kViewsCall, "{} must be {}, got {}", name, toString(type),
              toString(view->dataType()));
  MKV_REQUIRE(view->deviceType() == device, kViewsCall, "{} is on {} but the table is on {}", name,
              toString(view->deviceType()), toString(device));
  int64_t const bytes = numel * static_cast<int64_t>(dataTypeSize(type));
  MKV_REQUIRE(view->capacityBytes() >= bytes && (bytes == 0 || view->rawPointer() != nullptr),
              kViewsCall, "{} has room for {} bytes, the step needs {}", name,
              view->capacityBytes(), bytes);
}

void reshapeView(Tensor* view, Coords const& shape) {
  bool const fits = view->reshape(shape);
  MKV_ASSERT(fits, "a view of shape {} exceeds the capacity checked before the launch",
             shape.toString());
}

/// buildAttentionViews once the tier is known: validates the rows while it computes their prefix
/// sums into the launch, checks the views' capacities, launches, and only then reshapes.
template <int32_t MaxRows>
void buildAttentionViewsIn(Tensor const& table, AttentionViewStep const& step,
                           AttentionViewTensors const& views, cudaStream_t stream) {
  detail::AttentionViewsLaunch<MaxRows> launch{};
  auto const n = static_cast<int32_t>(step.residentSlots.size());
  int64_t const width = table.dim(2);
  int64_t const pageSize = step.tokensPerPage;
  int64_t const maxTokens = std::min(width * pageSize, kInt32Max);
  int64_t queryStart = 0;
  int64_t kvStart = 0;
  for (int32_t i = 0; i < n; ++i) {
    auto const row = static_cast<std::size_t>(i);
    CacheSlot const slot = step.residentSlots[row];
    int32_t const seqLen = step.seqLens[row];
    int32_t const fresh = step.newTokens[row];
    MKV_REQUIRE(slot >= 0 && slot < table.dim(0), kViewsCall,
                "row {}: resident slot {} outside [0, {})", i, slot, table.dim(0));
    MKV_REQUIRE(seqLen >= 0 && fresh >= 0, kViewsCall,
                "row {}: length {} and {} new tokens, expected both >= 0", i, seqLen, fresh);
    int64_t const after = int64_t{seqLen} + fresh;
    MKV_REQUIRE(after <= maxTokens, kViewsCall,
                "row {}: {} tokens after the step, beyond the {} a row of {} pages of {} holds "
                "(and int32)",
                i, after, maxTokens, width, pageSize);
    launch.rows[i] = detail::AttentionViewRow{slot, seqLen, static_cast<int32_t>(queryStart),
                                              static_cast<int32_t>(kvStart)};
    queryStart += fresh;
    kvStart += (after + pageSize - 1) / pageSize;
    MKV_REQUIRE(queryStart <= kInt32Max && kvStart <= kInt32Max, kViewsCall,
                "rows [0, {}] hold {} new tokens and {} pages: beyond int32", i, queryStart,
                kvStart);
  }
  launch.rows[n] = detail::AttentionViewRow{0, 0, static_cast<int32_t>(queryStart),
                                            static_cast<int32_t>(kvStart)};
  DeviceType const device = table.deviceType();
  requireView(views.blockTable, "blockTable", DataType::kInt32, device, n * width);
  requireView(views.seqLensBefore, "seqLensBefore", DataType::kInt32, device, n);
  requireView(views.seqLensAfter, "seqLensAfter", DataType::kInt32, device, n);
  requireView(views.queryStartLoc, "queryStartLoc", DataType::kInt32, device, n + 1);
  requireView(views.kvIndptr, "kvIndptr", DataType::kInt32, device, n + 1);
  requireView(views.kvIndices, "kvIndices", DataType::kInt32, device, kvStart);
  requireView(views.kvLastPageLen, "kvLastPageLen", DataType::kInt32, device, n);
  requireView(views.slotMapping, "slotMapping", DataType::kInt64, device, queryStart);
  if (views.physicalToLogical != nullptr) {
    requireView(views.physicalToLogical, "physicalToLogical", DataType::kInt32, device,
                int64_t{n} * step.numPages);
  }

  detail::AttentionViewsParams& params = launch.params;
  params.table = table.dataPointer<int32_t>();
  params.blockTable = views.blockTable->dataPointer<int32_t>();
  params.seqLensBefore = views.seqLensBefore->dataPointer<int32_t>();
  params.seqLensAfter = views.seqLensAfter->dataPointer<int32_t>();
  params.queryStartLoc = views.queryStartLoc->dataPointer<int32_t>();
  params.kvIndptr = views.kvIndptr->dataPointer<int32_t>();
  params.kvIndices = views.kvIndices->dataPointer<int32_t>();
  params.kvLastPageLen = views.kvLastPageLen->dataPointer<int32_t>();
  params.slotMapping = views.slotMapping->dataPointer<int64_t>();
  params.physicalToLogical = views.physicalToLogical != nullptr
                                 ? views.physicalToLogical->dataPointer<int32_t>()
                                 : nullptr;
  params.numRows = n;
  params.width = static_cast<int32_t>(width);
  params.tokensPerPage = step.tokensPerPage;
  params.numPages = step.numPages;
  params.nullPage = step.nullPage;
  params.tableRows = static_cast<int32_t>(table.dim(0));
  run(device, kViewsCall, launch, &detail::attentionViewsHost<MaxRows>,
      MKV_CUDA_IMPL(attentionViewsCuda<MaxRows>), stream);
  reshapeView(views.blockTable, {n, width});
  reshapeView(views.seqLensBefore, {n});
  reshapeView(views.seqLensAfter, {n});
  reshapeView(views.queryStartLoc, {n + 1});
  reshapeView(views.kvIndptr, {n + 1});
  reshapeView(views.kvIndices, {kvStart});
  reshapeView(views.kvLastPageLen, {n});
  reshapeView(views.slotMapping, {queryStart});
  if (views.physicalToLogical != nullptr) {
    reshapeView(views.physicalToLogical, {n, step.numPages});
  }
}

}  // namespace

void buildAttentionViews(Tensor const& table, AttentionViewStep const& step,
                         AttentionViewTensors const& views, cudaStream_t stream) {
  MKV_REQUIRE(table.dataType() == DataType::kInt32 && table.rank() == 3 && table.dim(1) == 2,
              kViewsCall, "table must be int32 [maxBatch, 2, maxPagesPerSeq], got {} {}",
              toString(table.dataType()), table.shape().toString());
  MKV_REQUIRE(table.dim(0) <= kInt32Max && table.dim(2) <= kInt32Max && !table.empty(), kViewsCall,
              "table of shape {}: expected int32 extents and data", table.shape().toString());
  std::size_t const n = step.residentSlots.size();
  MKV_REQUIRE(step.seqLens.size() == n && step.newTokens.size() == n, kViewsCall,
              "{} resident slots, {} lengths and {} new-token counts: expected one each", n,
              step.seqLens.size(), step.newTokens.size());
  MKV_REQUIRE(n <= static_cast<std::size_t>(kMaxAttentionViewRows), kViewsCall,
              "{} rows, at most kMaxAttentionViewRows = {}", n, kMaxAttentionViewRows);
  MKV_REQUIRE(step.tokensPerPage >= 1, kViewsCall, "tokensPerPage is {}, expected >= 1",
              step.tokensPerPage);
  MKV_REQUIRE(step.numPages >= 1 && step.nullPage >= 0 && step.nullPage < step.numPages, kViewsCall,
              "nullPage is {}, expected a page in [0, numPages = {})", step.nullPage,
              step.numPages);
  if (n <= static_cast<std::size_t>(detail::kAttentionViewTiers[0])) {
    buildAttentionViewsIn<detail::kAttentionViewTiers[0]>(table, step, views, stream);
  } else if (n <= static_cast<std::size_t>(detail::kAttentionViewTiers[1])) {
    buildAttentionViewsIn<detail::kAttentionViewTiers[1]>(table, step, views, stream);
  } else {
    buildAttentionViewsIn<detail::kAttentionViewTiers[2]>(table, step, views, stream);
  }
}

void zeroRows(std::span<RowBuffer const> buffers, DeviceType deviceType, Tensor const& rows,
              cudaStream_t stream) {
  constexpr char const* kCall = "zeroRows";
  requireIndexTensor(rows, kCall, "rows", deviceType, -1);
  requireRowBuffers(buffers, kCall, 0);
  for (RowBuffer const& buffer : buffers) {
    requireIdsInRange(rows, buffer.numRows, kCall, "rows");
  }
  if (buffers.empty() || rows.numel() == 0) {
    return;
  }
  detail::ZeroRowsLaunch launch{};
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    launch.buffers[b] = RowBufferDesc{static_cast<uint8_t*>(buffers[b].data), buffers[b].rowBytes};
    launch.numRows[b] = buffers[b].numRows;
  }
  launch.rows = rows.dataPointer<int32_t>();
  launch.numBuffers = static_cast<int32_t>(buffers.size());
  launch.numItems = static_cast<int32_t>(rows.numel());
  run(deviceType, kCall, launch, &detail::zeroRowsHost, MKV_CUDA_IMPL(zeroRowsCuda), stream);
}

void applyInt32InlinePatch(Tensor& dst, std::span<int32_t const> patch, int32_t numRanges,
                           cudaStream_t stream) {
  constexpr char const* kCall = "applyInt32InlinePatch";
  MKV_REQUIRE(dst.dataType() == DataType::kInt32, kCall, "dst must be int32, got {}",
              toString(dst.dataType()));
  MKV_REQUIRE(patch.size() <= static_cast<std::size_t>(kMaxInlinePatchValues), kCall,
              "a patch of {} entries exceeds the inline limit of {}", patch.size(),
              kMaxInlinePatchValues);
  auto const patchNumel = static_cast<int64_t>(patch.size());
  MKV_REQUIRE(numRanges >= 0 && 3 * int64_t{numRanges} <= patchNumel, kCall,
              "{} ranges need {} header entries but the patch has {}", numRanges,
              3 * int64_t{numRanges}, patchNumel);
  for (int32_t r = 0; r < numRanges; ++r) {
    auto const header = static_cast<std::size_t>(3 * int64_t{r});
    int64_t const offset = patch[header];
    int64_t const count = patch[header + 1];
    int64_t const start = patch[header + 2];
    MKV_REQUIRE(offset >= 0 && count >= 0 && offset + count <= dst.numel(), kCall,
                "range {} [{}, {}) is outside dst of {} entries", r, offset, offset + count,
                dst.numel());
    MKV_REQUIRE(start >= 3 * int64_t{numRanges} && start + count <= patchNumel, kCall,
                "range {} values [{}, {}) are outside the patch of {} entries", r, start,
                start + count, patchNumel);
  }
  if (numRanges == 0) {
    return;
  }
  detail::Int32InlinePatchLaunch launch{};
  launch.dst[0] = dst.dataPointer<int32_t>();
  launch.dstNumel[0] = dst.numel();
  launch.targetRangeEnd[0] = numRanges;
  launch.numTargets = 1;
  launch.patchNumel = static_cast<int32_t>(patchNumel);
  launch.numRanges = numRanges;
  std::copy(patch.begin(), patch.end(), launch.patch);
  detail::runInt32InlinePatch(dst.deviceType(), kCall, launch, stream);
}

void applyInt32Patch(Tensor& dst, Tensor const& patch, int32_t numRanges, cudaStream_t stream) {
  constexpr char const* kCall = "applyInt32Patch";
  MKV_REQUIRE(dst.dataType() == DataType::kInt32, kCall, "dst must be int32, got {}",
              toString(dst.dataType()));
  requireIndexTensor(patch, kCall, "patch", dst.deviceType(), -1);
  MKV_REQUIRE(numRanges >= 0 && 3 * int64_t{numRanges} <= patch.numel(), kCall,
              "{} ranges need {} header entries but the patch has {}", numRanges,
              3 * int64_t{numRanges}, patch.numel());
  if (patch.deviceType() == DeviceType::kCPU) {
    int32_t const* header = patch.dataPointer<int32_t>();
    for (int32_t r = 0; r < numRanges; ++r) {
      int32_t const* const range = header + 3 * int64_t{r};
      int64_t const offset = range[0];
      int64_t const count = range[1];
      int64_t const start = range[2];
      MKV_REQUIRE(offset >= 0 && count >= 0 && offset + count <= dst.numel(), kCall,
                  "range {} [{}, {}) is outside dst of {} entries", r, offset, offset + count,
                  dst.numel());
      MKV_REQUIRE(start >= 3 * int64_t{numRanges} && start + count <= patch.numel(), kCall,
                  "range {} values [{}, {}) are outside the patch of {} entries", r, start,
                  start + count, patch.numel());
    }
  }
  if (numRanges == 0) {
    return;
  }
  detail::Int32PatchLaunch launch{};
  launch.dst = dst.dataPointer<int32_t>();
  launch.patch = patch.dataPointer<int32_t>();
  launch.dstNumel = dst.numel();
  launch.patchNumel = patch.numel();
  launch.numRanges = numRanges;
  run(dst.deviceType(), kCall, launch, &detail::applyInt32PatchHost,
      MKV_CUDA_IMPL(applyInt32PatchCuda), stream);
}

namespace detail {

void runInt32InlinePatch(DeviceType device, char const* call, Int32InlinePatchLaunch const& launch,
                         cudaStream_t stream) {
  run(device, call, launch, &applyInt32InlinePatchHost, MKV_CUDA_IMPL(applyInt32InlinePatchCuda),
      stream);
}

}  // namespace detail

void loadKernels() {
#if MKV_WITH_CUDA
  cudaError_t status = detail::loadCopyPagesKernels();
  status = status != cudaSuccess ? status : detail::loadCompactBatchKernels();
  status = status != cudaSuccess ? status : detail::loadCopyRowsKernels();
  status = status != cudaSuccess ? status : detail::loadZeroRowsKernels();
  status = status != cudaSuccess ? status : detail::loadInt32PatchKernels();
  status = status != cudaSuccess ? status : detail::loadAttentionViewsKernels();
  mkv::detail::checkCuda(status, "kernels::loadKernels");
#endif
}

}  // namespace mkv::kernels
