/// compactBatch on the GPU: order-preserving in-place compaction of every buffer in one launch,
/// parallel over rows as well as columns.
///
/// Work units. Buffer k is cut into row tiles of R_k consecutive old rows and column chunks of
/// C_k vectors with R_k x C_k = 2048 vectors (compactTileShape in kernel_params.h; 32 KiB at
/// 16-byte width). A unit (k, tile r, chunk c) is one CTA: it loads the chunk of every moving
/// row of its tile into registers (a row moves when its destination d = oldToNew[i] lies in
/// [0, newBatch) and differs from i), then stores them to rows d.
///
/// Why it is safe in place. An order-preserving mapping sends old row i to d <= i, and each
/// destination has one source. The old contents of a row d that the unit overwrites are read
/// (if d moves itself) only by the unit (k, tileOf(d), c), with tileOf(d) <= r. When that is the
/// unit itself, a barrier puts its loads before its stores. Otherwise the unit waits for it:
///   1. load the moving rows (every thread waits for its loads before the barrier: the loaded
///      values feed __syncthreads_or);
///   2. thread 0 publishes "tile loaded" for (k, r, c): a device-scope fence, then a flag store;
///   3. thread 0 waits until the units (k, r', c) for r' in [tileOf(minDest),
///      min(tileOf(maxDest), r - 1)] have published, where minDest and maxDest are the extreme
///      destinations of the unit's movers (every row it writes lies between them; for an
///      order-preserving mapping that is at most two tiles), then a barrier;
///   4. store.
/// Nothing else writes a row d: the unit writing it is the one holding its single source.
///
/// No deadlock. Units are not blockIdx: each CTA takes a ticket from a counter in the workspace
/// and works on unit = ticket, numbered buffer by buffer and tile-major within a buffer. A unit
/// waits only for units of the same (k, c) with a smaller tile, so with a smaller ticket, which a
/// running CTA already holds; and a unit publishes before it waits. By induction over tickets
/// every unit publishes and every wait ends, whatever order and residency the scheduler picks
/// (compute-sanitizer running one CTA at a time included), and for any mapping, ordered or not
/// (an unordered one gives undefined rows, never a hang or a write outside [0, newBatch)).
///
/// Memory ordering (PTX memory model). Publisher: its loads have returned before the barrier,
/// then thread 0's fence.acq_rel.gpu and relaxed flag store form a release pattern. Waiter:
/// thread 0 reads the flags relaxed once while the tile loads are in flight; the same fence,
/// executed after that read, turns a hit into an acquire pattern; a miss is then polled with
/// ld.acquire.gpu and __nanosleep backoff. The barrier after the wait orders every thread's
/// stores after thread 0's acquire. A CTA never waits for itself (r' < r). The overlap of a
/// destination row with a source row still to be read is the in-place hazard of vLLM #50729.
///
/// Workspace and replay (layout: kernel_params.h). One 64-bit atomic add hands out the ticket
/// (low half) and the launch generation (high half). The CTA that takes the last ticket knows
/// every ticket of the launch is taken and stores (generation + 1, ticket 0): the next launch
/// (stream-ordered, or the next replay of a graph) starts clean. A flag means "loaded in this
/// launch" when it equals generation + 1, so flags are never cleared, except once every 2^32 - 1
/// launches: in the launch of kCompactWrapGeneration the units count themselves finished and
/// the last one zeroes every flag before the generation restarts at 0. A launch of one unit
/// needs no ordering and leaves the workspace alone.
#include <cuda/atomic>

#include <algorithm>
#include <climits>

#include "kernel_params.h"
#include "vector_copy.cuh"

namespace mkv::kernels::detail {
namespace {

using WordRef = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>;
using TicketRef = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;

/// Kernel parameters: the launch plus where each buffer's units start.
struct CompactKernelParams {
  CompactBatchLaunch launch;
  uint32_t firstUnit[kMaxRowBuffers + 1];  // buffer b: units [firstUnit[b], firstUnit[b + 1])
  uint32_t numUnits;
};

/// Poll interval bounds of a waiting thread 0. A waited-for tile was dispatched before the
/// waiter and publishes after one load round trip (about a microsecond), so the cap is short.
constexpr unsigned int kFirstSleepNs = 32;
constexpr unsigned int kMaxSleepNs = 512;

/// One word of a loaded vector: using it waits for the whole load instruction.
template <typename V>
__device__ __forceinline__ uint32_t lowWord(V const& value) {
  if constexpr (sizeof(V) >= 8) {
    return value.x;
  } else {
    return value;
  }
}

__device__ __forceinline__ void waitUntilLoaded(uint32_t* flag, uint32_t loaded) {
  unsigned int sleepNs = kFirstSleepNs;
  while (WordRef(*flag).load(cuda::memory_order_acquire) != loaded) {
    __nanosleep(sleepNs);
    sleepNs = min(2 * sleepNs, kMaxSleepNs);
  }
}

/// The buffer whose units contain `unit` (firstUnit is strictly increasing: every buffer of a
/// launch has at least one unit).
__device__ __forceinline__ int32_t bufferOfUnit(CompactKernelParams const& params, uint32_t unit) {
  int32_t low = 0;
  int32_t high = params.launch.numBuffers;  // invariant: firstUnit[low] <= unit < firstUnit[high]
  while (high - low > 1) {
    int32_t const middle = (low + high) / 2;
    if (params.firstUnit[middle] <= unit) {
      low = middle;
    } else {
      high = middle;
    }
  }
  return low;
}

/// Four CTAs per SM (64 registers; -Xptxas -v, sm_90: 60-64 registers, no spills, 8.2 KiB of
/// shared memory): 128 KiB of tiles in flight per SM. Without the minimum, ptxas aimed at 48
/// registers and spilled at 2-, 4- and 16-byte widths.
template <int Width>
__global__ void __launch_bounds__(kCompactThreads, 4)
    compactBatchKernel(__grid_constant__ CompactKernelParams const params) {
  using V = Vec<Width>;
  constexpr int32_t kTileVectors = 1 << kCompactTileVectorsLog2;
  __shared__ int32_t sTargets[kTileVectors];  // per tile row: destination, or -1 (not moving)
  __shared__ unsigned long long sTicket;
  __shared__ int32_t sMinTarget;
  __shared__ int32_t sMaxTarget;
  __shared__ bool sLastFinisher;

  CompactBatchLaunch const& launch = params.launch;
  auto const thread = static_cast<int32_t>(threadIdx.x);
  bool const ordered = params.numUnits > 1;
  uint32_t* const flags = launch.workspace + kCompactHeaderWords;
  if (thread == 0) {
    sTicket = 0;  // a single unit is unit 0 and touches no workspace
    if (ordered) {
      auto* const ticketWord =
          reinterpret_cast<unsigned long long*>(launch.workspace + kCompactTicketWord);
      TicketRef ticket(*ticketWord);
      sTicket = ticket.fetch_add(1, cuda::memory_order_relaxed);
      auto const taken = static_cast<uint32_t>(sTicket);
      if (taken == params.numUnits - 1) {  // every ticket of this launch is taken: reset
        auto const generation = static_cast<uint32_t>(sTicket >> 32);
        uint32_t const next = generation == kCompactWrapGeneration ? 0 : generation + 1;
        ticket.store(static_cast<unsigned long long>(next) << 32, cuda::memory_order_relaxed);
      }
    }
    sMinTarget = INT_MAX;
    sMaxTarget = -1;
  }
  __syncthreads();
  auto const unit = static_cast<uint32_t>(sTicket);
  auto const generation = static_cast<uint32_t>(sTicket >> 32);
  if (unit >= params.numUnits) {
    return;  // only with a workspace written by someone else; the whole CTA leaves
  }

  int32_t const b = bufferOfUnit(params, unit);
  uint8_t* const data = launch.buffers[b].data;
  int64_t const rowBytes = launch.buffers[b].rowBytes;
  CompactTileShape const shape = compactTileShape(rowBytes, Width);
  auto const chunks = static_cast<uint32_t>(shape.chunks);
  uint32_t const local = unit - params.firstUnit[b];
  uint32_t const tile = local / chunks;
  uint32_t const chunk = local - tile * chunks;
  int64_t const firstRow = int64_t{tile} << shape.rowsLog2;
  int32_t const tileRows = 1 << shape.rowsLog2;

  // Destinations of the tile's rows, and their extremes.
  int32_t minTarget = INT_MAX;
  int32_t maxTarget = -1;
#pragma unroll
  for (int32_t k = 0; k < kCompactVectorsPerThread; ++k) {
    int32_t const row = k * kCompactThreads + thread;
    if (row < tileRows) {
      int64_t const oldRow = firstRow + row;
      int32_t target = -1;
      if (oldRow < launch.oldBatch) {
        int32_t const newRow = __ldg(launch.oldToNew + oldRow);
        target = newRow >= 0 && newRow < launch.newBatch && newRow != oldRow ? newRow : -1;
      }
      sTargets[row] = target;
      if (target >= 0) {
        minTarget = min(minTarget, target);
        maxTarget = max(maxTarget, target);
      }
    }
  }
#pragma unroll
  for (int32_t offset = kWarpSize / 2; offset > 0; offset /= 2) {
    minTarget = min(minTarget, __shfl_xor_sync(0xFFFFFFFFu, minTarget, offset));
    maxTarget = max(maxTarget, __shfl_xor_sync(0xFFFFFFFFu, maxTarget, offset));
  }
  if (thread % kWarpSize == 0 && maxTarget >= 0) {
    atomicMin(&sMinTarget, minTarget);
    atomicMax(&sMaxTarget, maxTarget);
  }
  __syncthreads();

  // Earlier tiles of (b, chunk) holding rows this unit writes: [firstWait, lastWait].
  uint32_t const loaded = generation + 1;
  int64_t firstWait = 0;
  int64_t lastWait = -1;
  if (ordered && sMaxTarget >= 0) {
    firstWait = sMinTarget >> shape.rowsLog2;
    lastWait = min(int64_t{sMaxTarget >> shape.rowsLog2}, int64_t{tile} - 1);
  }
  auto flagOf = [&](int64_t waitTile) {
    return flags + params.firstUnit[b] + static_cast<uint32_t>(waitTile) * chunks + chunk;
  };

  // 1. Load the moving rows' chunk: vector e = k * threads + thread of the tile is row
  //    e / C, column e % C, so a warp reads 32 consecutive vectors (512 B at 16 B) of a row, or
  //    several whole narrow rows.
  int32_t const chunkLog2 = shape.chunkVectorsLog2;
  int64_t const rowVectors = rowBytes / Width;
  int64_t const firstColumn = int64_t{chunk} << chunkLog2;
  V values[kCompactVectorsPerThread];
  uint32_t moving = 0;  // bit k: vector k moves
  uint32_t touch = 0;
#pragma unroll
  for (int32_t k = 0; k < kCompactVectorsPerThread; ++k) {
    int32_t const e = k * kCompactThreads + thread;
    int32_t const row = e >> chunkLog2;
    int64_t const column = firstColumn + (e & ((1 << chunkLog2) - 1));
    if (sTargets[row] >= 0 && column < rowVectors) {
      values[k] = reinterpret_cast<V const*>(data + (firstRow + row) * rowBytes)[column];
      moving |= 1u << k;
      touch |= lowWord(values[k]);
    }
  }
  // Thread 0 takes a first, relaxed look at the (at most two, for an ordered mapping) flags it
  // needs while its loads are in flight.
  bool earlierLoaded = true;
  if (thread == 0 && firstWait <= lastWait) {
    uint32_t const first = WordRef(*flagOf(firstWait)).load(cuda::memory_order_relaxed);
    uint32_t const last = WordRef(*flagOf(lastWait)).load(cuda::memory_order_relaxed);
    earlierLoaded = lastWait - firstWait <= 1 && first == loaded && last == loaded;
  }
  // Every thread's loads have returned when the barrier opens (it consumes `touch`).
  (void)__syncthreads_or(static_cast<int>(touch));

  if (ordered && thread == 0) {
    // 2. Publish: release pattern (also the acquire fence for the relaxed look above).
    cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_device);
    WordRef(flags[unit]).store(loaded, cuda::memory_order_relaxed);
    // 3. Wait for the earlier tiles that read rows this unit overwrites.
    if (!earlierLoaded) {
      for (int64_t t = firstWait; t <= lastWait; ++t) {
        waitUntilLoaded(flagOf(t), loaded);
      }
    }
  }
  __syncthreads();

  // 4. Store.
#pragma unroll
  for (int32_t k = 0; k < kCompactVectorsPerThread; ++k) {
    if ((moving >> k) & 1u) {
      int32_t const e = k * kCompactThreads + thread;
      int64_t const column = firstColumn + (e & ((1 << chunkLog2) - 1));
      int64_t const target = sTargets[e >> chunkLog2];
      reinterpret_cast<V*>(data + target * rowBytes)[column] = values[k];
    }
  }

  if (ordered && generation == kCompactWrapGeneration) {
    // Once every 2^32 - 1 launches: the last unit to finish with the flags clears them all.
    if (thread == 0) {
      WordRef finished(launch.workspace[kCompactFinishedWord]);
      sLastFinisher = finished.fetch_add(1, cuda::memory_order_acq_rel) == params.numUnits - 1;
    }
    __syncthreads();
    if (sLastFinisher) {
      int64_t const flagWords = launch.workspaceWords - kCompactHeaderWords;
      for (int64_t w = thread; w < flagWords; w += kCompactThreads) {
        flags[w] = 0;
      }
      if (thread == 0) {
        launch.workspace[kCompactFinishedWord] = 0;
      }
    }
  }
}

}  // namespace

cudaError_t compactBatchCuda(CompactBatchLaunch const& launch, cudaStream_t stream) {
  uint64_t bits = 0;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    bits |= addressBits(launch.buffers[b].data) | static_cast<uint64_t>(launch.buffers[b].rowBytes);
  }
  int32_t const width = accessWidth(bits);
  CompactKernelParams params{};
  params.launch = launch;
  int64_t units = 0;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    params.firstUnit[b] = static_cast<uint32_t>(units);
    units += compactUnits(launch.buffers[b].rowBytes, width, launch.oldBatch);
    if (units > std::min(kMaxCompactUnits, launch.workspaceWords - kCompactHeaderWords)) {
      return cudaErrorInvalidValue;  // the launcher's validation makes this unreachable
    }
  }
  params.firstUnit[launch.numBuffers] = static_cast<uint32_t>(units);
  params.numUnits = static_cast<uint32_t>(units);
  withAccessWidth(width, [&](auto w) {
    compactBatchKernel<decltype(w)::value>
        <<<static_cast<unsigned int>(units), kCompactThreads, 0, stream>>>(params);
  });
  return cudaGetLastError();
}

cudaError_t loadCompactBatchKernels() {
  cudaError_t status = cudaSuccess;
  forEachAccessWidth([&](auto width) {
    status = firstError(status, loadKernel(compactBatchKernel<decltype(width)::value>));
  });
  return status;
}

}  // namespace mkv::kernels::detail
