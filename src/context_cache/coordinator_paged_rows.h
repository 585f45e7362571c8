#pragma once
/// \file coordinator_paged_rows.h
/// The paged rows of ContextCacheCoordinator's requests (not installed): the base page table and
/// the KV lengths of the base pool, and, for requests that pair a paged draft, the draft table
/// and draft pool beside them. One row per resident slot; a request's lease pages are its rows.

#include <cstdint>
#include <span>

#include "context_cache/coordinator_request.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "resources/device_write_queue.h"

namespace mkv::detail {

/// A view of the coordinator's tables and pools (borrowed; cheap to copy). Every method that
/// writes a table marks rows dirty; upload() settles them with the KV lengths queued beside them,
/// on the coordinator's stream: now, or at the engine's step (DeviceWriteQueue). Only for
/// deployments with attention (pure-recurrent deployments have no rows).
class PagedRows {
 public:
  /// `writes` holds the table rows and KV lengths until they reach the device (the runtime's
  /// queue, or the coordinator's own; it watches the base and draft tables).
  PagedRows(ContextCachePhysicalResources const& resources, DeviceWriteQueue& writes,
            cudaStream_t stream) noexcept
      : mResources(resources), mWrites(writes), mStream(stream) {}

  /// preparePrefill: binds each sequence's lease pages to its resident row (base, and draft when
  /// `paired`) and resets the batch's KV lengths to the reuse lengths, then settles them: one
  /// launch now, or none until the engine's step (a launch costs the engine thread 1-5 µs:
  /// docs/benchmarks.md). A Hybrid-MTP (`mtp`) draft length stops before the hit's boundary
  /// token (recomputed).
  void bindPrefill(CoordinatorRequest const& req, bool paired, bool mtp) const;
  /// Maps the pages `sequence`'s lease holds beyond `heldBase` base and `heldDraft` draft pages
  /// into its row (draft only when `paired`); no upload.
  void mapGrown(CoordinatorRequest::Sequence const& sequence, std::size_t heldBase,
                std::size_t heldDraft, bool paired) const;
  /// Binds a joiner's pages to row `slot` of the base table and settles it.
  void bindJoiner(CacheSlot slot, std::span<PageId const> pages) const;
  /// Clears row `slot` (base, and draft when `paired`); no upload.
  void clearRow(CacheSlot slot, bool paired) const;
  /// Clears every row of `req` and settles them.
  void release(CoordinatorRequest const& req, bool paired) const;
  /// Settles the dirty rows of the base and draft tables (DeviceWriteQueue::settle: one launch
  /// now, or none until the engine's step).
  void upload() const;
  /// Compacts the KV lengths (base, and draft when `paired`) with the device mapping, after
  /// applying every write that waits (the compaction reads the lengths on the device).
  void compactLengths(Tensor const& deviceMapping, int32_t newBatchSize, bool paired) const;
  /// Throws (naming `call`) unless the KV-length tensors a compaction compacts (base, and draft
  /// when `paired`) hold exactly `rows` rows.
  void requireLengthBatch(char const* call, int32_t rows, bool paired) const;

  int32_t baseRowPages() const noexcept { return mResources.basePageTable->maxPagesPerSeq(); }
  int32_t draftRowPages() const noexcept { return mResources.draftPageTable->maxPagesPerSeq(); }
  int32_t maxBatch() const noexcept { return mResources.basePageTable->maxBatch(); }

 private:
  ContextCachePhysicalResources const& mResources;
  DeviceWriteQueue& mWrites;
  cudaStream_t mStream;
};

}  // namespace mkv::detail
