#pragma once
/// \file kv_page_table.h
/// Host source of truth for page-table rows, with a device mirror at a stable address.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

namespace detail {
class Int32Staging;
}

enum class PageTableMode : uint8_t {
  /// Live entries of a row form a prefix; everything after the first -1 is -1.
  kDense,
  /// Disjoint live ranges are allowed (a sliding window keeps absolute logical pages); a page
  /// id may appear at most once among a row's live entries.
  kSparseWindow,
};

/// Counts of the last upload / uploadDirty call.
struct PageTableUploadStats {
  int64_t entries = 0;  ///< int32 entries copied (K and V entries both count)
  int64_t ranges = 0;   ///< coalesced contiguous runs copied
  /// Uploads beyond the inline limit: each one staged copy and one launch of its own (0 or 1 for
  /// lastUploadStats()).
  int64_t staged = 0;
};

/// Page table `[maxBatch, 2, maxPagesPerSeq]` int32: per resident row the K page ids of its
/// logical pages, then the V ids, where V = K + numPages for live entries and -1 marks an
/// empty entry. The host copy is the source of truth; the device mirror (same shape, on the
/// table's device, stable address for engine bindings and CUDA graphs) is brought up to date
/// by `upload` / `uploadDirty`, each one patch kernel on the stream: a patch of at most
/// kernels::kMaxInlinePatchValues entries travels in the launch's parameters (or joins the
/// caller's kernels::InlinePatchBatch), a larger one is staged first (one copy).
///
/// Rows belong to resident slots and never move between slots. Every mutator validates all of
/// its input before changing anything; on mkv::Error the table is unchanged.
/// Thread-safety: one writer (the engine thread).
class KVPageTable {
 public:
  /// Throws unless maxBatch > 0, maxPagesPerSeq > 0, 0 < numPages <= INT32_MAX / 2.
  KVPageTable(int32_t maxBatch, int32_t maxPagesPerSeq, int32_t numPages, PageTableMode mode,
              DeviceType deviceType);
  ~KVPageTable();
  KVPageTable(KVPageTable const&) = delete;
  KVPageTable& operator=(KVPageTable const&) = delete;

  int32_t maxBatch() const noexcept { return mMaxBatch; }
  int32_t maxPagesPerSeq() const noexcept { return mMaxPagesPerSeq; }
  int32_t numPages() const noexcept { return mNumPages; }
  PageTableMode mode() const noexcept { return mMode; }
  DeviceType deviceType() const noexcept { return mDeviceType; }

  /// One row replacement: `kPages` become logical pages [0, kPages.size()), the rest of the
  /// row is cleared. -1 entries are allowed only in sparse-window mode.
  struct RowUpdate {
    CacheSlot slot = -1;
    std::span<PageId const> kPages;
  };

  void setRow(CacheSlot slot, std::span<PageId const> kPages);
  /// Applies all updates or none: validates slots (in range, not repeated), lengths and page
  /// ids of every update before mutating any row. An empty span clears the row.
  void setRows(std::span<RowUpdate const> updates);
  /// Sets one logical entry to a page id in [0, numPages) (use clearEntry to empty one).
  /// Dense mode: only at the end of the live prefix (appending) or replacing a live entry.
  /// Sparse mode: rejects a page already live elsewhere in the row.
  void setEntry(CacheSlot slot, int32_t logicalPage, PageId kPage);
  /// Clears one entry; clearing an empty entry changes nothing. Dense mode: of the live
  /// entries only the last one may be cleared (anything else would leave a hole).
  void clearEntry(CacheSlot slot, int32_t logicalPage);
  void clearRow(CacheSlot slot);

  /// K page id of one entry (-1 when empty).
  PageId entry(CacheSlot slot, int32_t logicalPage) const;
  /// Host row: 2 * maxPagesPerSeq entries, K ids then V ids.
  std::span<int32_t const> hostRow(CacheSlot slot) const;
  /// Every host row, `[maxBatch, 2, maxPagesPerSeq]` row-major (row `slot` is hostRow(slot)), at
  /// a stable address for the table's lifetime.
  std::span<int32_t const> hostRows() const noexcept { return mHost; }
  /// Number of live entries in a row.
  int32_t liveEntryCount(CacheSlot slot) const;
  /// Whether every entry [first, last) of row `slot` is live (true for an empty range): O(1) when
  /// the row's live entries are contiguous, as a dense row's are, else O(last - first). Throws
  /// mkv::Error naming this call for a slot or a range outside the table.
  bool entriesLive(CacheSlot slot, int32_t first, int32_t last) const;

  /// Checks V derivation, id range and the mode's rule on every row. Returns false and writes
  /// a description of the first violation to *error (when given).
  bool checkInvariants(std::string* error = nullptr) const;

  /// Copies every dirty row (coalesced runs of adjacent rows) to the device mirror: one staged
  /// copy plus one patch launch. Returns false and enqueues nothing when the table is clean.
  /// First checks the invariants of every row it is about to upload (throws mkv::Error on a
  /// broken row, leaving table and dirty state unchanged). Waits for the previous upload's
  /// staging copy before reusing staging memory. The patch buffer on the device is reused by
  /// the next upload, so successive uploads of one table must be ordered (one stream).
  bool upload(cudaStream_t stream);
  /// Copies only the K entries that changed since the last upload and their V twins; runs of
  /// adjacent K entries coalesce into one K range plus the matching V range (a single changed
  /// entry = 2 entries in 2 ranges). Work is O(changed entries), plus the check of each changed
  /// row, which reads only its live range (a sliding window's M pages, a dense row's live
  /// prefix), never the whole row width. Same return, validation and ordering rules as `upload`.
  bool uploadDirty(cudaStream_t stream);
  /// uploadDirty, but an inline-sized patch is queued in `batch` instead of launched, so the
  /// caller's other device writes of the same call share its launch; the caller flushes `batch`
  /// on `stream` before anything reads the table there. A patch beyond the inline limit flushes
  /// `batch` first and is staged and launched at once. The table counts as uploaded on return.
  bool uploadDirty(kernels::InlinePatchBatch& batch, cudaStream_t stream);
  PageTableUploadStats lastUploadStats() const noexcept { return mLastUpload; }
  /// Cumulative counts over every upload of this table.
  PageTableUploadStats totalUploadStats() const noexcept { return mTotalUpload; }
  bool dirty() const noexcept { return !mDirtyEntries.empty(); }
  /// Flat indices (slot x maxPagesPerSeq + logical page) of the entries changed since the last
  /// upload, unsorted; their values are in hostRows().
  std::span<int64_t const> dirtyEntries() const noexcept { return mDirtyEntries; }

  /// Device mirror `[maxBatch, 2, maxPagesPerSeq]`, stable address for the table's lifetime.
  Tensor const& deviceTable() const noexcept { return mDevice; }

  /// dst[i] = device row residentSlots[i] (one launch; -1 slots give rows of -1). Reads the
  /// device mirror, i.e. the state of the last upload, stream-ordered after it.
  /// residentSlots int32 `[n]` on the table's device; dst is reshaped to `[n, 2, maxPages]`.
  void gatherRows(Tensor& dst, Tensor const& residentSlots, cudaStream_t stream) const;

 private:
  friend class KVPageTableTestPeer;  // tests only: breaks the host copy to exercise the checks

  void validateSlot(char const* call, CacheSlot slot) const;
  void validateLogical(char const* call, int32_t logicalPage) const;
  void validateRowPages(char const* call, CacheSlot slot, std::span<PageId const> kPages) const;
  /// Checks row `slot`, reading only logical entries [first, last): the caller knows every entry
  /// outside that range to be empty (K and V -1).
  bool checkRow(CacheSlot slot, std::string* error, int32_t first, int32_t last) const;
  /// One branch-light pass over [first, last) that accepts the rows the mutators produce; false
  /// means "run the full check", which then names the violation.
  bool rowLooksValid(CacheSlot slot, int32_t first, int32_t last) const;
  void writeEntry(CacheSlot slot, int32_t logicalPage, PageId kPage);
  /// upload / uploadDirty: queues into `batch`, or into mOwnWrites and flushes it (nullptr).
  bool uploadRanges(bool rowGranular, kernels::InlinePatchBatch* batch, cudaStream_t stream);

  int32_t mMaxBatch;
  int32_t mMaxPagesPerSeq;
  int32_t mNumPages;
  PageTableMode mMode;
  DeviceType mDeviceType;
  std::vector<int32_t> mHost;       // [maxBatch, 2, maxPagesPerSeq]
  std::vector<int32_t> mLiveCount;  // per slot
  // Per slot [mLiveBegin, mLiveEnd): the first and one past the last live K entry (empty range:
  // begin == end). Every entry outside it is empty, except entries that are dirty. Keeps the row
  // checks of an upload and the sparse duplicate check of setEntry O(live range), not O(width).
  std::vector<int32_t> mLiveBegin;
  std::vector<int32_t> mLiveEnd;
  std::vector<int64_t> mDirtyEntries;     // flat indices of changed K entries, unsorted, unique
  std::vector<uint8_t> mEntryDirtyFlag;   // per K entry, [maxBatch, maxPagesPerSeq]
  mutable std::vector<int32_t> mScratch;  // ids sorted by duplicate checks (preallocated)
  // Sparse tables: page id -> generation of the last rowLooksValid pass that saw it live, so the
  // pass finds a repeated page in O(live entries) without sorting them.
  mutable std::vector<uint32_t> mPageSeen;
  mutable uint32_t mSeenGeneration = 0;
  std::vector<int32_t> mPatch;           // host image of a staged patch (preallocated)
  kernels::InlinePatchBatch mOwnWrites;  // inline patches of upload / uploadDirty(stream)
  Tensor mDevice;
  std::unique_ptr<detail::Int32Staging> mStaging;
  PageTableUploadStats mLastUpload;
  PageTableUploadStats mTotalUpload;
};

}  // namespace mkv
