#pragma once
/// \file kernels.h
/// Data-movement launchers. Every launcher
///   1. validates its arguments first and throws mkv::Error naming the launcher and the bad
///      value (unsupported shape, mismatched geometry, wrong dtype, mixed devices, too many
///      layers/buffers, ids out of range when they are host-readable);
///   2. then makes exactly one CUDA launch covering all layers and all items on `stream` when
///      the buffers are kGPU, or runs the host reference twin synchronously when they are kCPU.
/// GPU and host paths produce bit-identical results. Nothing is allocated on the launch path,
/// nothing synchronises with the host, and every GPU launch is CUDA-graph capturable.
///
/// Id and index tensors live on the same device as the data. GPU kernels cannot report a bad
/// id to the host without a synchronisation, so they skip any id outside its valid range
/// exactly like the -1 sentinel; callers inside the library validate ids on the host before
/// staging them, and CPU launches throw for them.

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv::kernels {

namespace detail {
struct Int32InlinePatchLaunch;
class PatchRing;
}  // namespace detail

/// Most layers one copyPages call addresses (the per-layer pointer table travels in the
/// kernel's parameters, so no descriptor upload is needed).
inline constexpr int32_t kMaxLayers = 256;
/// Most row buffers one compactBatch / zeroRows call addresses.
inline constexpr int32_t kMaxRowBuffers = 256;
/// Most int32 entries (headers and values) of a patch that applyInt32InlinePatch carries in the
/// kernel's parameters (which the classic limit keeps within 4 KiB).
inline constexpr int32_t kMaxInlinePatchValues = 1000;
/// Most tensors one inline patch launch writes (InlinePatchBatch).
inline constexpr int32_t kMaxInlinePatchTargets = 4;

/// Per-layer paged KV buffers of one geometry: a KVCachePool, a reduced SWA pool or a
/// partial-KV snapshot slab. Layer l starts at layerBases[l] and holds two halves (K, then V),
/// each of `numPages` pages of `tokensPerPage` token rows of `tokenBytes` bytes:
/// `[2, numPages, tokensPerPage, heads, headDim]`. The span must outlive the call.
struct PagedBuffers {
  std::span<void* const> layerBases;
  DeviceType deviceType = DeviceType::kCPU;
  int32_t numPages = 0;
  int32_t tokensPerPage = 0;
  int64_t tokenBytes = 0;

  int32_t numLayers() const noexcept { return static_cast<int32_t>(layerBases.size()); }
  int64_t pageBytes() const noexcept { return tokensPerPage * tokenBytes; }
};

/// Rows of one per-slot tensor: `numRows` rows of `rowBytes` bytes, contiguous.
struct RowBuffer {
  void* data = nullptr;
  int64_t rowBytes = 0;
  int64_t numRows = 0;
};

/// Copies item i for every layer and both halves: page srcIds[i] of `src` to page dstIds[i]
/// of `dst` — the whole page, or only its first tokenCounts[i] token rows when `tokenCounts`
/// is given (partial-page snapshots). An item with -1 in either id, or 0 token rows, is
/// skipped. Gather, scatter and in-pool copy are all expressed by the two id lists; `src` and
/// `dst` may be the same buffers. Destination pages of one call must be distinct and must not
/// be source pages of another item of the same call.
/// Requires: same device, layer count, tokensPerPage and tokenBytes on both sides; ids int32
/// `[n]`; tokenCounts int32 `[n]` with values in [0, tokensPerPage].
void copyPages(PagedBuffers const& src, PagedBuffers const& dst, Tensor const& srcIds,
               Tensor const& dstIds, Tensor const* tokenCounts, cudaStream_t stream);

/// Order-preserving in-place batch compaction of several per-slot tensors in one launch:
/// for every old row i with d = oldToNew[i] in [0, newBatchSize), row d becomes old row i.
/// Rows with d == -1 are dropped; destinations outside [0, newBatchSize) are ignored. The
/// mapping must keep survivor order (the k-th survivor goes to k), which makes the in-place
/// move safe although source and destination rows overlap.
///
/// On the GPU the rows are moved by many CTAs that order themselves through `workspace`: int32
/// on the GPU, at least compactBatchWorkspaceBytes(oldBatch, rowBytes of `buffers`) bytes,
/// 8-byte aligned, zero-filled before its first use (an owning Tensor is) and written by
/// nothing but compactBatch afterwards. Each launch leaves it ready for the next, so one
/// workspace serves any number of stream-ordered calls and CUDA-graph replays. Launches that
/// may run concurrently (different streams, or graph nodes without a dependency between them)
/// must use different workspaces. kCPU ignores `workspace` (an empty Tensor will do).
/// Requires: oldToNew int32 `[oldBatch]` on `deviceType`; every buffer has >= oldBatch rows;
/// 0 <= newBatchSize <= oldBatch.
void compactBatch(std::span<RowBuffer const> buffers, DeviceType deviceType, Tensor const& oldToNew,
                  int32_t newBatchSize, Tensor& workspace, cudaStream_t stream);
/// Throws the mkv::Error compactBatch would throw for these arguments, and does nothing else:
/// for a caller that must validate before it changes anything (KVCachePool::compactLengths).
void checkCompactBatch(std::span<RowBuffer const> buffers, DeviceType deviceType,
                       Tensor const& oldToNew, int32_t newBatchSize, Tensor const& workspace);

/// Bytes of the compactBatch workspace for up to `maxOldBatch` rows of buffers whose row widths
/// are `rowBytes` (one entry per buffer), whatever the buffers' alignment. A workspace of this
/// size serves every call with at most that many rows and buffers of those widths (or some of
/// them), so callers size it once at construction: 16 bytes, plus per buffer 1/512 to 1/256 of
/// its rows' bytes and 4 bytes for a partial tile.
/// Throws mkv::Error for a negative maxOldBatch, a width <= 0, more than kMaxRowBuffers widths,
/// or more than 2^31 - 1 work units (several TiB of rows).
int64_t compactBatchWorkspaceBytes(int64_t maxOldBatch, std::span<int64_t const> rowBytes);

/// A source and a destination row buffer with the same rowBytes.
struct RowBufferPair {
  RowBuffer src;
  RowBuffer dst;
};

/// For every pair and every item i: row dstRows[i] of pair.dst = row srcRows[i] of pair.src.
/// One launch for all pairs and items (recurrent snapshot capture / restore of every layer).
/// srcRows and dstRows int32 `[n]` on `deviceType`; -1 in either skips the item. Destination
/// rows must be distinct within a pair and must not be source rows of the same pair.
void copyRows(std::span<RowBufferPair const> buffers, DeviceType deviceType, Tensor const& srcRows,
              Tensor const& dstRows, cudaStream_t stream);

/// slab[slots[i], :] = hidden[rows[i], :] (boundary hidden-state capture).
/// hidden `[tokens, width]` and slab `[slots, width]` have the same dtype and width; rows and
/// slots int32 `[n]`; -1 in either skips the item.
void captureHiddenRows(Tensor const& hidden, Tensor const& rows, Tensor& slab, Tensor const& slots,
                       cudaStream_t stream);

/// hidden[rows[i], :] = slab[slots[i], :] (boundary hidden-state restore). Same rules.
void restoreHiddenRows(Tensor const& slab, Tensor const& slots, Tensor& hidden, Tensor const& rows,
                       cudaStream_t stream);

/// dst[i, :, :] = table[residentSlots[i], :, :] for i < n, building the active-step page table
/// in execution order from resident rows. A slot of -1 yields a row of -1.
/// table int32 `[maxBatch, 2, maxPagesPerSeq]`; residentSlots int32 `[n]`; dst int32 with
/// capacity for `[n, 2, maxPagesPerSeq]` (it is reshaped to exactly that).
void gatherPageTableRows(Tensor const& table, Tensor const& residentSlots, Tensor& dst,
                         cudaStream_t stream);

/// Most rows of one buildAttentionViews call: each row's inputs travel in the launch's parameters
/// (16 bytes a row, within CUDA's 32,764 bytes of kernel parameters), so nothing is uploaded.
inline constexpr int32_t kMaxAttentionViewRows = 2000;

/// The step buildAttentionViews describes: rows in execution order, row i reading table row
/// residentSlots[i], holding seqLens[i] tokens of KV before the step and appending newTokens[i].
struct AttentionViewStep {
  std::span<CacheSlot const> residentSlots;
  std::span<int32_t const> seqLens;
  std::span<int32_t const> newTokens;
  int32_t tokensPerPage = 0;
  /// Pages of the pool: an entry outside [0, numPages) (-1 included) reads as empty.
  int32_t numPages = 0;
  /// What every empty entry and every entry past a row's pages becomes; in [0, numPages).
  PageId nullPage = 0;
};

/// The views buildAttentionViews writes, each on the table's device with the capacity of the
/// largest step; each is reshaped to the step's shape (n rows, P = tokensPerPage, W = the table's
/// width, after_i = seqLens[i] + newTokens[i], pages_i = ceil(after_i / P)).
struct AttentionViewTensors {
  Tensor* blockTable = nullptr;     ///< int32 [n, W]: K id of page j < pages_i, nullPage after
  Tensor* seqLensBefore = nullptr;  ///< int32 [n]: seqLens
  Tensor* seqLensAfter = nullptr;   ///< int32 [n]: after_i
  Tensor* queryStartLoc = nullptr;  ///< int32 [n + 1]: prefix sums of newTokens
  Tensor* kvIndptr = nullptr;       ///< int32 [n + 1]: prefix sums of pages_i
  Tensor* kvIndices = nullptr;      ///< int32 [kvIndptr[n]]: row i's first pages_i blockTable ids
  Tensor* kvLastPageLen = nullptr;  ///< int32 [n]: after_i - (pages_i - 1) * P, 0 for no page
  Tensor* slotMapping = nullptr;    ///< int64 [sum newTokens]: id * P + offset of each new token
  /// Optional (null: not built), int32 [n, numPages]: entry [i, p] is the logical page j <
  /// pages_i whose live table entry is page p, -1 for every other page (FlexAttention's
  /// physical-to-logical map; O(n * numPages) writes).
  Tensor* physicalToLogical = nullptr;
};

/// Builds the kernel-ready views of one step (mkv/attention_views.h) from `table`, int32
/// `[maxBatch, 2, W]` (a KVPageTable's rows: K ids, then V ids), in one launch. The row inputs
/// travel in the launch's parameters; the page ids are read from `table` on the device.
/// Requires: at most kMaxAttentionViewRows rows, one entry per row in each span, slots in
/// [0, maxBatch), lengths >= 0, after_i <= W * P and int32, every view on the table's device with
/// the capacity of its shape. Says nothing about which entries must be live: a caller that needs
/// that (AttentionViews) checks it on the host.
void buildAttentionViews(Tensor const& table, AttentionViewStep const& step,
                         AttentionViewTensors const& views, cudaStream_t stream);

/// Zeroes row rows[i] of every buffer (recurrent / conv state of released residents).
/// rows int32 `[n]`; -1 skips.
void zeroRows(std::span<RowBuffer const> buffers, DeviceType deviceType, Tensor const& rows,
              cudaStream_t stream);

/// Applies a staged patch to an int32 tensor (page-table uploads). `patch` is int32 and starts
/// with `numRanges` (offset, count, valueStart) triples; range r writes
/// dst[offset_r + j] = patch[valueStart_r + j] for j < count_r. Ranges must lie inside `dst`
/// and must not overlap each other.
void applyInt32Patch(Tensor& dst, Tensor const& patch, int32_t numRanges, cudaStream_t stream);

/// applyInt32Patch for a patch held in host memory, of at most kMaxInlinePatchValues entries: the
/// patch travels in the kernel's parameters, so nothing is staged or uploaded (one launch, no
/// copy, no event: the cheapest host path for the small page-table patches of a request's
/// lifecycle). Every range is validated on the host first (throws mkv::Error naming it, dst
/// unchanged). kCPU: the host twin.
void applyInt32InlinePatch(Tensor& dst, std::span<int32_t const> patch, int32_t numRanges,
                           cudaStream_t stream);

/// Int32 writes to up to kMaxInlinePatchTargets tensors of one device, gathered on the host and
/// applied by one applyInt32InlinePatch-style launch: a facade call's page-table rows and KV
/// lengths cost one launch (4-5 µs of the engine thread on an H200, docs/benchmarks.md). The
/// effect is that of applying the writes one by one in order: queued ranges never overlap, so a
/// range inside a queued one replaces its values; add() flushes first on any other overlap, or
/// when it does not fit (values or targets). The owner decides when to flush (at the end of the
/// call, or at the engine's step); writes queued but not flushed are not on the device. A batch
/// made for the GPU launches through a ring of mapped slots and a pre-built graph where it can (see
/// the constructor and kernels/patch_ring.h). Reserves its storage at construction: add() and
/// flush() never allocate. Not thread-safe.
class InlinePatchBatch {
 public:
  /// GPU flushes launch the inline kernel (4-5 µs of host time each on the H200).
  InlinePatchBatch();
  /// For kGPU, also creates a ring of patch slots in mapped pinned memory and a one-kernel graph
  /// that reads them, on the current device: a GPU flush then writes its patch into a free slot
  /// and launches the graph (about half the host cost of a kernel launch), and launches the
  /// inline kernel only when every slot is still to be read or the stream is capturing a graph.
  /// The ring serves the first stream it launches on (a graph's launches are ordered behind each
  /// other whatever their streams); flushes on another stream launch inline. Allocates and
  /// synchronises the device: construct with the owner. kCPU: as above.
  explicit InlinePatchBatch(DeviceType deviceType);
  ~InlinePatchBatch();
  InlinePatchBatch(InlinePatchBatch&& other) noexcept;
  InlinePatchBatch& operator=(InlinePatchBatch&& other) noexcept;
  InlinePatchBatch(InlinePatchBatch const&) = delete;
  InlinePatchBatch& operator=(InlinePatchBatch const&) = delete;

  /// Queues dst[offset + j] = values[j] for every j < values.size(). dst must be int32 and of the
  /// same device as the writes already queued; [offset, offset + values.size()) must lie inside
  /// dst and values.size() + 3 must not exceed kMaxInlinePatchValues: otherwise throws mkv::Error
  /// naming `call` and queues nothing. May flush on `stream` first (see the class comment).
  void add(char const* call, Tensor& dst, int64_t offset, std::span<int32_t const> values,
           cudaStream_t stream);
  /// Applies every queued write in one launch on `stream` (the host twin, synchronously, for
  /// kCPU tensors) and empties the batch. Nothing to do when empty. Throws mkv::Error when the
  /// launch fails, keeping the queue, so the next flush retries the writes (the tables that
  /// queued them count them as uploaded).
  void flush(cudaStream_t stream);
  /// Drops every queued write unapplied.
  void discard() noexcept;
  /// Installs the fault injector every later flush that has writes to apply consults first, at
  /// FaultSite::kDeviceWriteLaunch (kCPU batches too; docs/errors.md, "Device writes that fail").
  void setFaults(FaultInjector faults) { mFaults = std::move(faults); }
  /// Calls `queue()` (which adds writes), then flush(stream): also when `queue` throws half-way
  /// (then rethrows what `queue` threw), so that whatever it queued reaches the device like the
  /// writes before it; a flush that fails there keeps its queue for the next one.
  template <typename Queue>
  void flushAfter(cudaStream_t stream, Queue&& queue) {
    try {
      queue();
    } catch (...) {
      try {
        flush(stream);
      } catch (...) {  // the queue is kept; the error to report is the first one
      }
      throw;
    }
    flush(stream);
  }

  bool empty() const noexcept { return mRanges.empty(); }
  /// Launches (host-twin applications on kCPU) made so far.
  int64_t launches() const noexcept { return mLaunches; }
  /// Of those, the ones made through the ring (graph launches).
  int64_t ringLaunches() const noexcept { return mRingLaunches; }
  /// From now on, keep a digest of every write add() is given (offset, count and values, in
  /// order): equal batches fed the same writes have equal digests, whatever their tensors'
  /// addresses (a tensor-parallel rank's decisions). Off by default: add() then hashes nothing.
  void recordWrittenDigest() noexcept { mRecordsDigest = true; }
  /// The digest recordWrittenDigest() keeps; 0 before it.
  uint64_t writtenDigest() const noexcept { return mWrittenDigest; }

 private:
  struct Range {
    int32_t target;
    int32_t valueStart;  ///< into mValues
    int64_t offset;
    int32_t count;
  };
  /// Whether [offset, offset + count) of `target`'s memory meets a queued range.
  bool overlapsQueued(int32_t const* base, int64_t offset, int64_t count) const;
  /// Index of dst among the queued targets, or -1.
  int32_t findTarget(int32_t const* base) const;
  /// Writes the queued ranges, grouped by target, into `launch` (every field a kernel reads).
  void fillLaunch(detail::Int32InlinePatchLaunch& launch);

  int32_t* mTargets[kMaxInlinePatchTargets] = {};
  int64_t mTargetNumel[kMaxInlinePatchTargets] = {};
  int32_t mNumTargets = 0;
  DeviceType mDeviceType = DeviceType::kCPU;
  std::vector<Range> mRanges;
  std::vector<int32_t> mValues;
  int64_t mLaunches = 0;
  int64_t mRingLaunches = 0;
  uint64_t mWrittenDigest = 0;
  bool mRecordsDigest = false;
  std::unique_ptr<detail::PatchRing> mRing;  // kGPU batches made with a device type
  FaultInjector mFaults;
};

/// Loads every kernel of the library on the current CUDA device now. CUDA's lazy loading would
/// otherwise load each kernel at its first launch, and a load may synchronise the whole context,
/// i.e. wait for the engine's work on other streams. KVCacheRuntime::create calls it for GPU
/// runtimes; call it once per device when using the launchers directly. Idempotent; a no-op in a
/// build without CUDA. Throws mkv::Error on a CUDA failure.
void loadKernels();

}  // namespace mkv::kernels
