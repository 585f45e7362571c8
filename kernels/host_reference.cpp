/// Host reference twins of the CUDA kernels. They define the semantics the GPU kernels must
/// reproduce bit for bit (tests/gpu compares the two on random data).
#include <algorithm>
#include <cstring>

#include "kernel_params.h"

namespace mkv::kernels::detail {

void copyPagesHost(CopyPagesLaunch const& launch) {
  int64_t const pageBytes = launch.tokensPerPage * launch.tokenBytes;
  for (int32_t item = 0; item < launch.numItems; ++item) {
    int32_t const srcId = launch.srcIds[item];
    int32_t const dstId = launch.dstIds[item];
    if (srcId < 0 || srcId >= launch.srcNumPages || dstId < 0 || dstId >= launch.dstNumPages) {
      continue;
    }
    int32_t tokens = launch.tokensPerPage;
    if (launch.tokenCounts != nullptr) {
      tokens = launch.tokenCounts[item];
      if (tokens <= 0) {
        continue;
      }
      if (tokens > launch.tokensPerPage) {
        tokens = launch.tokensPerPage;
      }
    }
    auto const bytes = static_cast<std::size_t>(tokens * launch.tokenBytes);
    for (int32_t layer = 0; layer < launch.numLayers; ++layer) {
      auto const* src = static_cast<uint8_t const*>(launch.srcLayers[layer]);
      auto* dst = static_cast<uint8_t*>(launch.dstLayers[layer]);
      for (int32_t half = 0; half < 2; ++half) {
        int64_t const srcOffset = (int64_t{half} * launch.srcNumPages + srcId) * pageBytes;
        int64_t const dstOffset = (int64_t{half} * launch.dstNumPages + dstId) * pageBytes;
        std::memmove(dst + dstOffset, src + srcOffset, bytes);
      }
    }
  }
}

void compactBatchHost(CompactBatchLaunch const& launch) {
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    RowBufferDesc const& buffer = launch.buffers[b];
    auto const rowBytes = static_cast<std::size_t>(buffer.rowBytes);
    for (int32_t oldRow = 0; oldRow < launch.oldBatch; ++oldRow) {
      int32_t const newRow = launch.oldToNew[oldRow];
      if (newRow < 0 || newRow >= launch.newBatch || newRow == oldRow) {
        continue;
      }
      std::memmove(buffer.data + static_cast<std::size_t>(newRow) * rowBytes,
                   buffer.data + static_cast<std::size_t>(oldRow) * rowBytes, rowBytes);
    }
  }
}

void copyRowsHost(CopyRowsLaunch const& launch) {
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    RowCopyDesc const& buffer = launch.buffers[b];
    auto const rowBytes = static_cast<std::size_t>(buffer.rowBytes);
    for (int32_t item = 0; item < launch.numItems; ++item) {
      int64_t const srcRow = launch.srcRows != nullptr ? launch.srcRows[item] : item;
      int64_t const dstRow = launch.dstRows != nullptr ? launch.dstRows[item] : item;
      if (dstRow < 0 || dstRow >= buffer.dstNumRows) {
        continue;
      }
      uint8_t* dst = buffer.dst + static_cast<std::size_t>(dstRow) * rowBytes;
      if (srcRow < 0 || srcRow >= buffer.srcNumRows) {
        if (launch.fillSkipped != 0) {
          std::memset(dst, 0xFF, rowBytes);
        }
        continue;
      }
      std::memmove(dst, buffer.src + static_cast<std::size_t>(srcRow) * rowBytes, rowBytes);
    }
  }
}

void zeroRowsHost(ZeroRowsLaunch const& launch) {
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    RowBufferDesc const& buffer = launch.buffers[b];
    for (int32_t item = 0; item < launch.numItems; ++item) {
      int32_t const row = launch.rows[item];
      if (row < 0 || row >= launch.numRows[b]) {
        continue;
      }
      std::memset(
          buffer.data + static_cast<std::size_t>(row) * static_cast<std::size_t>(buffer.rowBytes),
          0, static_cast<std::size_t>(buffer.rowBytes));
    }
  }
}

void applyInt32InlinePatchHost(Int32InlinePatchLaunch const& launch) {
  int32_t target = 0;
  for (int32_t r = 0; r < launch.numRanges; ++r) {
    while (target + 1 < launch.numTargets && r >= launch.targetRangeEnd[target]) {
      ++target;
    }
    int64_t const header = 3 * int64_t{r};
    int64_t const offset = launch.patch[header];
    int64_t const count = launch.patch[header + 1];
    int64_t const valueStart = launch.patch[header + 2];
    for (int64_t j = 0; j < count; ++j) {
      int64_t const index = offset + j;
      int64_t const source = valueStart + j;
      if (index >= 0 && index < launch.dstNumel[target] && source >= 0 &&
          source < launch.patchNumel) {
        launch.dst[target][index] = launch.patch[source];
      }
    }
  }
}

void attentionViewsHost(AttentionViewsParams const& params, AttentionViewRow const* rows) {
  int64_t const pageSize = params.tokensPerPage;
  int64_t const width = params.width;
  params.queryStartLoc[0] = 0;
  params.kvIndptr[0] = 0;
  for (int32_t i = 0; i < params.numRows; ++i) {
    AttentionViewRow const& row = rows[i];
    AttentionViewRow const& next = rows[i + 1];
    int32_t const after = row.seqLen + (next.queryStart - row.queryStart);
    int64_t const pages = (after + pageSize - 1) / pageSize;
    // A slot outside the table reads as a row of empty entries.
    int32_t const* const kIds = row.slot >= 0 && row.slot < params.tableRows
                                    ? params.table + 2 * width * row.slot
                                    : nullptr;
    int32_t* const tableRow = params.blockTable + width * i;
    for (int64_t j = 0; j < width; ++j) {
      int32_t id = params.nullPage;
      if (j < pages && kIds != nullptr && kIds[j] >= 0 && kIds[j] < params.numPages) {
        id = kIds[j];
      }
      tableRow[j] = id;
      if (j < pages) {
        params.kvIndices[row.kvStart + j] = id;
      }
    }
    for (int64_t position = row.seqLen; position < after; ++position) {
      params.slotMapping[row.queryStart + position - row.seqLen] =
          int64_t{tableRow[position / pageSize]} * pageSize + position % pageSize;
    }
    params.seqLensBefore[i] = row.seqLen;
    params.seqLensAfter[i] = after;
    params.queryStartLoc[i + 1] = next.queryStart;
    params.kvIndptr[i + 1] = next.kvStart;
    params.kvLastPageLen[i] = pages == 0 ? 0 : static_cast<int32_t>(after - (pages - 1) * pageSize);
    if (params.physicalToLogical != nullptr) {
      int32_t* const map = params.physicalToLogical + int64_t{params.numPages} * i;
      std::fill(map, map + params.numPages, -1);
      for (int64_t j = 0; j < pages && kIds != nullptr; ++j) {
        if (kIds[j] >= 0 && kIds[j] < params.numPages) {
          map[kIds[j]] = static_cast<int32_t>(j);
        }
      }
    }
  }
}

void applyInt32PatchHost(Int32PatchLaunch const& launch) {
  for (int32_t r = 0; r < launch.numRanges; ++r) {
    int64_t const header = 3 * int64_t{r};
    int64_t const offset = launch.patch[header];
    int64_t const count = launch.patch[header + 1];
    int64_t const valueStart = launch.patch[header + 2];
    for (int64_t j = 0; j < count; ++j) {
      int64_t const target = offset + j;
      int64_t const source = valueStart + j;
      if (target >= 0 && target < launch.dstNumel && source >= 0 && source < launch.patchNumel) {
        launch.dst[target] = launch.patch[source];
      }
    }
  }
}

}  // namespace mkv::kernels::detail
