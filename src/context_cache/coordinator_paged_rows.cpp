#include "context_cache/coordinator_paged_rows.h"

#include <vector>

#include "core/check.h"

namespace mkv::detail {

void PagedRows::bindPrefill(CoordinatorRequest const& req, bool paired, bool mtp) const {
  std::vector<KVPageTable::RowUpdate> rows;
  std::vector<KVPageTable::RowUpdate> draftRows;
  std::vector<int32_t> lengths;
  std::vector<int32_t> draftLengths;
  rows.reserve(req.sequences.size());
  lengths.reserve(req.sequences.size());
  for (auto const& sequence : req.sequences) {
    rows.push_back({sequence.resident.slot, sequence.lease.basePages()});
    lengths.push_back(sequence.reuseTokenLength);
    if (paired) {
      draftRows.push_back({sequence.resident.slot, sequence.lease.draftPages()});
      // The draft row of a Hybrid-MTP boundary token depends on its successor: recomputed.
      int32_t const reuse = sequence.reuseTokenLength;
      draftLengths.push_back(mtp && reuse > 0 ? reuse - 1 : reuse);
    }
  }
  mResources.basePageTable->setRows(rows);
  if (paired) {
    mResources.draftPageTable->setRows(draftRows);
  }
  mWrites.settleAfter(mStream, [&] {
    mResources.basePool->resetForNewSequences(lengths, mWrites.lengths(), mStream);
    if (paired) {
      mResources.draftPool->resetForNewSequences(draftLengths, mWrites.lengths(), mStream);
    }
  });
}

void PagedRows::mapGrown(CoordinatorRequest::Sequence const& sequence, std::size_t heldBase,
                         std::size_t heldDraft, bool paired) const {
  std::span<PageId const> const pages = sequence.lease.basePages();
  for (std::size_t logical = heldBase; logical < pages.size(); ++logical) {
    mResources.basePageTable->setEntry(sequence.resident.slot, static_cast<int32_t>(logical),
                                       pages[logical]);
  }
  std::span<PageId const> const draftPages = sequence.lease.draftPages();
  for (std::size_t logical = heldDraft; paired && logical < draftPages.size(); ++logical) {
    mResources.draftPageTable->setEntry(sequence.resident.slot, static_cast<int32_t>(logical),
                                        draftPages[logical]);
  }
}

void PagedRows::bindJoiner(CacheSlot slot, std::span<PageId const> pages) const {
  mResources.basePageTable->setRow(slot, pages);
  mWrites.settle(mStream);
}

void PagedRows::clearRow(CacheSlot slot, bool paired) const {
  mResources.basePageTable->clearRow(slot);
  if (paired) {
    mResources.draftPageTable->clearRow(slot);
  }
}

void PagedRows::release(CoordinatorRequest const& req, bool paired) const {
  for (auto const& sequence : req.sequences) {
    clearRow(sequence.resident.slot, paired);
  }
  upload();
}

void PagedRows::upload() const { mWrites.settle(mStream); }

void PagedRows::compactLengths(Tensor const& deviceMapping, int32_t newBatchSize,
                               bool paired) const {
  mWrites.flush(mStream);
  mResources.basePool->compactLengths(deviceMapping, newBatchSize, mStream);
  if (paired) {
    mResources.draftPool->compactLengths(deviceMapping, newBatchSize, mStream);
  }
}

void PagedRows::requireLengthBatch(char const* call, int32_t rows, bool paired) const {
  for (KVCachePool const* pool : {mResources.basePool, paired ? mResources.draftPool : nullptr}) {
    if (pool == nullptr) {
      continue;
    }
    MKV_REQUIRE(pool->activeBatchSize() == rows, call,
                "the {} KV-length tensor's active batch is {} but the request has {} rows (the "
                "engine grows it with setActiveBatchSize + writeLengths when it seats a joiner)",
                pool == mResources.basePool ? "base" : "draft", pool->activeBatchSize(), rows);
  }
}

}  // namespace mkv::detail
