#pragma once
/// \file block_reuse_mode.h
/// Requests that reuse full KV blocks: plain requests of an attention-only deployment (the
/// vanilla mode, with sliding windows and a host tier where the deployment has them), and, in
/// PairedDraftMode, speculative requests that reuse base and draft blocks as pairs.

#include "context_cache/request_mode.h"

namespace mkv::detail {

/// Publishes full blocks at prefill end and at each completed row's end; grows base pages.
class BlockReuseMode final : public RequestMode {
 public:
  BlockReuseMode(CoordinatorParts const& parts, RowLane base);

  void publishPrefill(CoordinatorRequest& req) const override;
  bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const override;
  bool stageCompleted(CoordinatorRequest& req, std::span<uint8_t const> completed) const override;
};

/// Speculative requests of an attention-only deployment (EAGLE / MTP with a paged draft: two
/// lanes; a shared-KV draft: the base lane only). A prefill, the founders' or a joiner's, is
/// frozen until the draft initialisation completed; blocks publish up to the common base/draft
/// length. A joiner's chunks publish nothing: their draft state is written by the draft
/// initialisation after the last chunk.
class PairedDraftMode final : public RequestMode {
 public:
  PairedDraftMode(CoordinatorParts const& parts, std::vector<RowLane> lanes,
                  CommonLengths commonLengths);

  void publishChunk(CoordinatorRequest& /*req*/, std::size_t /*row*/) const override {}
  void publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const override;
  void publishPrefill(CoordinatorRequest& req) const override;
  void publishFrozenPrefill(CoordinatorRequest& req) const override;
  void updateCommonLengths(CoordinatorRequest& req,
                           std::span<ContextCacheSequenceAdvance const> advances,
                           std::span<int32_t const> lengths) const override;
  bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const override;
  bool stageCompleted(CoordinatorRequest& req, std::span<uint8_t const> completed) const override;
};

/// The common lengths of a speculative request's rows that advanced (shared by the speculative
/// modes): the given lengths, or the committed ones.
void advanceCommonLengths(CoordinatorRequest& req,
                          std::span<ContextCacheSequenceAdvance const> advances,
                          std::span<int32_t const> lengths);

}  // namespace mkv::detail
