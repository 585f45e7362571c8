/// The step kernels of the reference engine on the GPU (design: oracle_step.h). One CTA per
/// work unit (a position of every layer and both halves, a chunk of staged digests, a
/// recurrent item or boundary hidden row), grid-stride over the units; the threads of a CTA split
/// each row word by word exactly like the host twin's single thread, and reduce their findings to
/// the unit's minimum key before one thread publishes it with global atomics.
#include "testing/oracle_step.h"
#include "testing/oracle_step_units.h"

namespace mkv::testing::oracle {
namespace {

constexpr int32_t kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

dim3 gridFor(int64_t units) {
  return dim3(static_cast<unsigned>(units < kMaxBlocks ? units : kMaxBlocks));
}

/// Minimum of every thread's key in the CTA (all threads must call it).
__device__ uint64_t blockMin(uint64_t key, unsigned long long* shared) {
  if (threadIdx.x == 0) {
    *shared = kNoKey;
  }
  __syncthreads();
  if (key != kNoKey) {
    atomicMin(shared, static_cast<unsigned long long>(key));
  }
  __syncthreads();
  uint64_t const result = *shared;
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kThreads)
    oracleWriteKernel(OracleGeometry const* __restrict__ geometryPtr, uint8_t* plan) {
  __shared__ unsigned long long shared;
  OracleGeometry const& geometry = *geometryPtr;
  auto& header = *reinterpret_cast<OracleStepHeader*>(plan);
  int64_t const storeChunks = (header.storePositions + kOracleStoreChunk - 1) / kOracleStoreChunk;
  int64_t const units = header.writePositions + storeChunks + header.numRecurrent;
  auto const tid = static_cast<int32_t>(threadIdx.x);
  auto const threads = static_cast<int32_t>(blockDim.x);
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    if (unit < header.writePositions) {
      uint64_t const fault = writeUnitShare(geometry, plan, header, unit, tid, threads);
      if (fault != kNoKey) {
        atomicMin(&header.result.writeFaultKey, static_cast<unsigned long long>(fault));
      }
    } else if (unit < header.writePositions + storeChunks) {
      storeUnitShare(geometry, plan, header, unit - header.writePositions, tid, threads);
    } else {
      int64_t const item = unit - header.writePositions - storeChunks;
      uint64_t const key =
          blockMin(recurrentUnitShare(geometry, plan, header, item, tid, threads), &shared);
      if (tid == 0 && key != kNoKey && isHiddenItem(plan, header, item)) {
        atomicAdd(&header.result.hiddenMismatches, 1ULL);
        atomicMin(&header.result.hiddenKey, static_cast<unsigned long long>(key));
      } else if (tid == 0 && key != kNoKey) {
        atomicAdd(&header.result.recurrentMismatches, 1ULL);
        atomicMin(&header.result.recurrentKey, static_cast<unsigned long long>(key));
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    oracleVerifyKernel(OracleGeometry const* __restrict__ geometryPtr, uint8_t* plan) {
  __shared__ unsigned long long shared;
  OracleGeometry const& geometry = *geometryPtr;
  auto& header = *reinterpret_cast<OracleStepHeader*>(plan);
  auto const tid = static_cast<int32_t>(threadIdx.x);
  auto const threads = static_cast<int32_t>(blockDim.x);
  for (int64_t flat = blockIdx.x; flat < header.verifyPositions; flat += gridDim.x) {
    uint64_t pageKey = kNoKey;
    uint64_t const share = verifyUnitShare(geometry, plan, header, flat, tid, threads, &pageKey);
    uint64_t const key = blockMin(share, &shared);
    if (tid == 0 && key != kNoKey) {
      atomicAdd(&header.result.kvMismatches, 1ULL);
      if (isDraftPosition(plan, header, flat)) {
        atomicAdd(&header.result.draftMismatches, 1ULL);
      }
      atomicMin(&header.result.kvKey, static_cast<unsigned long long>(key));
      atomicMin(&header.result.kvPageKey, static_cast<unsigned long long>(pageKey));
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    oracleLengthsKernel(OracleGeometry const* __restrict__ geometryPtr, int32_t* snapshot,
                        int32_t rowsFull, int32_t rowsSwa, int32_t rowsDraft) {
  OracleGeometry const& geometry = *geometryPtr;
  for (int32_t i = threadIdx.x; i < rowsFull + rowsSwa + rowsDraft; i += blockDim.x) {
    int32_t const pool = i < rowsFull ? 0 : i < rowsFull + rowsSwa ? 1 : kOracleDraftPool;
    int32_t const row = i < rowsFull             ? i
                        : i < rowsFull + rowsSwa ? i - rowsFull
                                                 : i - rowsFull - rowsSwa;
    snapshot[pool * geometry.storeRows + row] = geometry.pools[pool].kvLengths[row];
  }
}

}  // namespace

cudaError_t oracleWriteCuda(OracleGeometry const* geometry, uint8_t* plan,
                            OracleStepHeader const& header, cudaStream_t stream) {
  int64_t const units = oracleWriteUnits(header);
  if (units == 0) {
    return cudaSuccess;
  }
  oracleWriteKernel<<<gridFor(units), kThreads, 0, stream>>>(geometry, plan);
  return cudaGetLastError();
}

cudaError_t oracleVerifyCuda(OracleGeometry const* geometry, uint8_t* plan,
                             OracleStepHeader const& header, cudaStream_t stream) {
  if (header.verifyPositions == 0) {
    return cudaSuccess;
  }
  oracleVerifyKernel<<<gridFor(header.verifyPositions), kThreads, 0, stream>>>(geometry, plan);
  return cudaGetLastError();
}

cudaError_t oracleLengthsCuda(OracleGeometry const* geometry, uint8_t* plan, int64_t lengthsOffset,
                              int32_t rowsFull, int32_t rowsSwa, int32_t rowsDraft,
                              cudaStream_t stream) {
  if (rowsFull + rowsSwa + rowsDraft == 0) {
    return cudaSuccess;
  }
  oracleLengthsKernel<<<1, kThreads, 0, stream>>>(
      geometry, reinterpret_cast<int32_t*>(plan + lengthsOffset), rowsFull, rowsSwa, rowsDraft);
  return cudaGetLastError();
}

}  // namespace mkv::testing::oracle
