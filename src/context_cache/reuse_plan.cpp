#include "context_cache/reuse_plan.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

std::string_view toString(MissReason reason) noexcept {
  switch (reason) {
    case MissReason::kNoPrefix:
      return "no_prefix";
    case MissReason::kShorterThanOnePage:
      return "shorter_than_one_page";
    case MissReason::kEvicted:
      return "evicted";
    case MissReason::kSaltMismatch:
      return "salt_mismatch";
    case MissReason::kLoraMismatch:
      return "lora_mismatch";
    case MissReason::kMediaMismatch:
      return "media_mismatch";
    case MissReason::kCapacity:
      return "capacity";
    case MissReason::kWindowEvicted:
      return "window_evicted";
  }
  return "unknown";
}

std::string_view toString(ReuseMode mode) noexcept {
  switch (mode) {
    case ReuseMode::kVanilla:
      return "vanilla";
    case ReuseMode::kHybrid:
      return "hybrid";
    case ReuseMode::kHybridMtp:
      return "hybrid_mtp";
    case ReuseMode::kSpec:
      return "spec";
  }
  return "unknown";
}

namespace {

int32_t pagesFor(int64_t tokens, int32_t pageSize) noexcept {
  return static_cast<int32_t>((tokens + pageSize - 1) / pageSize);
}

void checkPolicy(char const* call, ContextCacheLookupPolicy policy) {
  MKV_REQUIRE(
      policy == ContextCacheLookupPolicy::kUseCache || policy == ContextCacheLookupPolicy::kBypass,
      call, "lookup policy {} out of range", static_cast<int>(policy));
}

void checkBlocks(char const* call, BlockIndex const& index, PromptBlocks const& blocks) {
  MKV_REQUIRE(blocks.pageSize == index.pageSize(), call,
              "blocks hashed with page size {}, index uses {}", blocks.pageSize, index.pageSize());
}

template <typename T>
std::vector<T> firstOf(std::vector<T> const& v, int32_t n) {
  return std::vector<T>(v.begin(), v.begin() + n);
}

/// One checkpoint length the hybrid search tries: `full` whole pages, a partial-KV snapshot when
/// `needsPartial`, keyed by the digest of the prompt's first `length` tokens.
struct HybridCandidate {
  int32_t length = 0;
  int32_t full = 0;
  bool needsPartial = false;
  Hash128 digest{};
};

/// Whether `record` (may be null) is a checkpoint of exactly `candidate` for `blocks`: its full
/// blocks are the prompt's, it holds the snapshots and the base (and for MTP the draft) page path
/// the plan kind restores.
bool usableCheckpoint(CacheRecord const* record, PromptBlocks const& blocks,
                      HybridCandidate const& candidate, bool hasAttention, bool mtp) {
  int32_t const full = candidate.full;
  return record != nullptr && record->key.fullBlockCount == full &&
         std::equal(record->logicalBlockDigests.begin(), record->logicalBlockDigests.end(),
                    blocks.keys.begin()) &&
         record->recurrentSnapshotSlot &&
         record->partialKvSnapshotSlot.has_value() == candidate.needsPartial &&
         record->basePagePath.size() == static_cast<std::size_t>(hasAttention ? full : 0) &&
         (!mtp || (record->specState &&
                   record->specState->draftPagePath.size() == static_cast<std::size_t>(full)));
}

/// The usable checkpoint of `candidate`, or null. A Hybrid-MTP plan uses Hybrid-MTP checkpoints
/// only; a plain plan prefers a base-only one and otherwise restores the base side of a
/// Hybrid-MTP checkpoint (unaligned lengths only).
CacheRecord const* findCheckpoint(RecordStore const& records, PromptBlocks const& blocks,
                                  HybridCandidate const& candidate, bool hasAttention, bool mtp) {
  CacheRecord const* record =
      records.findHybrid(HybridKey{candidate.digest, candidate.length, mtp});
  if (!usableCheckpoint(record, blocks, candidate, hasAttention, mtp) && !mtp) {
    record = records.findHybrid(HybridKey{candidate.digest, candidate.length, true});
  }
  return usableCheckpoint(record, blocks, candidate, hasAttention, mtp) ? record : nullptr;
}

/// For an index that verifies tokens: whether the index still holds `record`'s base pages for the
/// prompt's blocks and its verification tokens equal the prompt's tokens past them, up to
/// `length`.
bool checkpointTokensMatch(BlockIndex const& index, PromptBlocks const& blocks,
                           CacheRecord const& record, int32_t length) {
  bool verified = true;
  for (int32_t b = 0; verified && b < static_cast<int32_t>(record.basePagePath.size()); ++b) {
    verified = index.holds(record.basePagePath[static_cast<std::size_t>(b)], blocks, b,
                           /*ancestorsVerified=*/true);
  }
  auto const covered = record.basePagePath.size() * static_cast<std::size_t>(blocks.pageSize);
  auto const tail =
      blocks.prompt.tokens.subspan(covered, static_cast<std::size_t>(length) - covered);
  return verified && std::equal(tail.begin(), tail.end(), record.verificationTokens.begin(),
                                record.verificationTokens.end());
}

/// Turns the cold `plan` into a standard plan restoring `record`, the checkpoint of `candidate`:
/// bindings, snapshots and the demand of the pages past the checkpoint's full ones.
void bindCheckpoint(ReusePlan& plan, PromptBlocks const& blocks, CacheRecord const& record,
                    HybridCandidate const& candidate, bool hasAttention, bool mtp) {
  int32_t const full = candidate.full;
  plan.kind = ReusePlanKind::kStandard;
  plan.matchedTokenLength = candidate.length;
  plan.reuseTokenLength = candidate.length;
  plan.matchedBlockDigests = firstOf(blocks.keys, full);
  plan.basePageBindings = record.basePagePath;
  plan.hybridRecord = record.id;
  plan.hybridCheckpoint = HybridCheckpoint{candidate.digest, candidate.length};
  plan.recurrentSnapshotBinding = record.recurrentSnapshotSlot;
  plan.partialKvSnapshotBinding = record.partialKvSnapshotSlot;
  int32_t const pages = pagesFor(blocks.tokenCount(), blocks.pageSize);
  plan.demand.baseKvPages = hasAttention ? pages - full : 0;
  if (mtp) {
    plan.specRecord = record.id;
    plan.draftPageBindings = record.specState->draftPagePath;
    plan.demand.draftKvPages = pages - full;
  }
}

// Shared search of makeHybridReusePlan / makeHybridMtpReusePlan: the checkpoint lengths the
// store offers, in its order; the first usable (and, where the index verifies, matching) wins.
ReusePlan planHybrid(BlockIndex const& index, RecordStore const& records,
                     PromptBlocks const& blocks, bool hasAttention, bool mtp,
                     ContextCacheLookupPolicy policy) {
  int32_t const n = blocks.tokenCount();
  int32_t const page = blocks.pageSize;
  ReuseMode const mode = mtp ? ReuseMode::kHybridMtp : ReuseMode::kHybrid;
  ReusePlan plan = makeColdReusePlan(mode, n, page, hasAttention, mtp);
  if (policy == ContextCacheLookupPolicy::kBypass || n == 0) {
    return plan;
  }
  BlockIndex::PrefixMatch const indexed = index.longestPrefix(blocks, blocks.fullBlockCount());
  plan.indexedPrefixBlocks = static_cast<int32_t>(indexed.pages.size());
  plan.verificationRejects = indexed.verificationRejected ? 1 : 0;

  for (int32_t const length : records.hybridCheckpointLengths(n)) {
    if (length <= 0) {
      continue;
    }
    HybridCandidate const candidate{length, mtp ? (length - 1) / page : length / page,
                                    mtp || (hasAttention && length % page != 0),
                                    exactPrefixDigest(blocks, length)};
    CacheRecord const* record = findCheckpoint(records, blocks, candidate, hasAttention, mtp);
    if (record == nullptr) {
      continue;
    }
    if (index.verifiesTokens() && !checkpointTokensMatch(index, blocks, *record, length)) {
      ++plan.verificationRejects;
      continue;
    }
    bindCheckpoint(plan, blocks, *record, candidate, hasAttention, mtp);
    return plan;
  }
  return plan;
}

}  // namespace

ReusePlan makeColdReusePlan(ReuseMode mode, int32_t inputTokens, int32_t pageSize,
                            bool hasAttention, bool pairedDraft) {
  MKV_REQUIRE(inputTokens >= 0, "makeColdReusePlan", "negative input length {}", inputTokens);
  MKV_REQUIRE(pageSize > 0, "makeColdReusePlan", "page size must be positive, got {}", pageSize);
  ReusePlan plan;
  plan.mode = mode;
  plan.kind = ReusePlanKind::kNoReusablePrefix;
  plan.inputTokenLength = inputTokens;
  plan.hybridHasAttention = hasAttention;
  int32_t const pages = pagesFor(inputTokens, pageSize);
  plan.demand.baseKvPages = hasAttention ? pages : 0;
  plan.demand.draftKvPages = pairedDraft ? pages : 0;
  return plan;
}

ReusePlan makeVanillaReusePlan(BlockIndex const& index, PromptBlocks const& blocks,
                               ContextCacheLookupPolicy policy, HostBlockTier const* hostTier,
                               int32_t maxBlocks) {
  checkPolicy("makeVanillaReusePlan", policy);
  checkBlocks("makeVanillaReusePlan", index, blocks);
  MKV_REQUIRE(maxBlocks >= 0, "makeVanillaReusePlan", "negative block limit {}", maxBlocks);
  int32_t const n = blocks.tokenCount();
  int32_t const page = blocks.pageSize;
  ReusePlan plan = makeColdReusePlan(ReuseMode::kVanilla, n, page, true, false);
  if (policy == ContextCacheLookupPolicy::kBypass || n == 0) {
    return plan;
  }
  int32_t const full = std::min(blocks.fullBlockCount(), maxBlocks);
  BlockIndex::PrefixMatch match = index.longestPrefix(blocks, full);
  auto const onGpu = static_cast<int32_t>(match.pages.size());
  // A block whose digest is on the GPU with other content ends reuse in both tiers.
  std::vector<PageId> onHost = hostTier != nullptr && !match.verificationRejected
                                   ? hostTier->longestRun(blocks, onGpu, full)
                                   : std::vector<PageId>{};
  int32_t const matched = onGpu + static_cast<int32_t>(onHost.size());
  plan.indexedPrefixBlocks = matched;
  plan.verificationRejects = match.verificationRejected ? 1 : 0;
  if (matched == 0) {
    return plan;
  }
  bool const fullInput = matched * page == n;
  int32_t const reused = fullInput ? matched - 1 : matched;
  int32_t const bound = std::min(onGpu, reused);
  match.pages.resize(static_cast<std::size_t>(bound));
  onHost.resize(static_cast<std::size_t>(reused - bound));
  plan.kind = fullInput ? ReusePlanKind::kFullInputRewind : ReusePlanKind::kStandard;
  plan.matchedTokenLength = matched * page;
  plan.reuseTokenLength = reused * page;
  plan.matchedBlockDigests = firstOf(blocks.keys, bound);
  plan.basePageBindings = std::move(match.pages);
  plan.hostOnboardDigests.assign(blocks.keys.begin() + bound, blocks.keys.begin() + reused);
  plan.hostOnboardPages = std::move(onHost);
  plan.demand.baseKvPages = pagesFor(n, page) - bound;
  return plan;
}

ReusePlan makeWindowedReusePlan(BlockIndex const& index, WindowBlockCache const& window,
                                PromptBlocks const& blocks, ContextCacheLookupPolicy policy) {
  ReusePlan plan = makeVanillaReusePlan(index, blocks, policy);
  auto const bound = static_cast<int32_t>(plan.basePageBindings.size());
  int32_t const reusable = window.longestWindowedPrefix(blocks, bound);
  if (reusable == bound) {
    return plan;
  }
  int32_t const indexed = plan.indexedPrefixBlocks;
  int32_t const rejects = plan.verificationRejects;
  plan = makeVanillaReusePlan(index, blocks, policy, nullptr, reusable);
  // The diagnostics describe the full layers' lookup, not the capped one.
  plan.indexedPrefixBlocks = indexed;
  plan.verificationRejects = rejects;
  plan.windowLimitedTokens = (bound - reusable) * blocks.pageSize;
  return plan;
}

ReusePlan makeHybridReusePlan(BlockIndex const& index, RecordStore const& records,
                              PromptBlocks const& blocks, bool hasAttention,
                              ContextCacheLookupPolicy policy) {
  checkPolicy("makeHybridReusePlan", policy);
  checkBlocks("makeHybridReusePlan", index, blocks);
  return planHybrid(index, records, blocks, hasAttention, false, policy);
}

ReusePlan makeHybridMtpReusePlan(BlockIndex const& index, RecordStore const& records,
                                 PromptBlocks const& blocks, ContextCacheLookupPolicy policy) {
  checkPolicy("makeHybridMtpReusePlan", policy);
  checkBlocks("makeHybridMtpReusePlan", index, blocks);
  return planHybrid(index, records, blocks, true, true, policy);
}

namespace {

/// The longest path a speculative request may reuse within the `baseMatched` indexed blocks: the
/// base prefix itself without paged draft state, else the longest recorded spec path (and the
/// record that produced it).
struct SpecPath {
  int32_t blocks = 0;
  CacheRecord const* producer = nullptr;
};

SpecPath longestSpecPath(RecordStore const& records, PromptBlocks const& blocks,
                         SpecReuseContract const& contract, int32_t baseMatched) {
  if (!contract.pagedSpecState) {
    return SpecPath{baseMatched, nullptr};
  }
  std::optional<RecordStore::SpecPathMatch> const path =
      records.findLongestSpecPath(blocks.keys, baseMatched);
  return path ? SpecPath{path->blockCount, path->record} : SpecPath{};
}

/// Fills `plan` for a non-empty spec path: rewinds the replayed pages (or the last one of a full
/// input), binds the base pages before the rewind and, with a producer, its draft pages.
void planSpecPath(ReusePlan& plan, PromptBlocks const& blocks, SpecReuseContract const& contract,
                  SpecPath const& path, std::vector<PageId> basePages) {
  int32_t const n = blocks.tokenCount();
  int32_t const page = blocks.pageSize;
  int32_t const replayPages = pagesFor(contract.futureDependencyTokens, page);
  bool const fullInput = path.blocks * page == n;
  int32_t const rewind = std::min(path.blocks, std::max(replayPages, fullInput ? 1 : 0));
  int32_t const bound = path.blocks - rewind;
  if (replayPages > 0 && path.blocks > replayPages) {
    plan.specReplayDependency =
        SpecReplayDependency{path.blocks, blocks.keys[static_cast<std::size_t>(path.blocks - 1)]};
  }
  plan.kind = fullInput   ? ReusePlanKind::kFullInputRewind
              : bound > 0 ? ReusePlanKind::kStandard
                          : ReusePlanKind::kNoReusablePrefix;
  plan.matchedTokenLength = path.blocks * page;
  plan.reuseTokenLength = bound * page;
  plan.specReplayMode =
      replayPages > 0 && bound > 0 ? SpecReplayMode::kFullPage : SpecReplayMode::kNone;
  basePages.resize(static_cast<std::size_t>(bound));
  plan.matchedBlockDigests = firstOf(blocks.keys, bound);
  if (path.producer != nullptr && bound > 0) {
    MKV_ASSERT(std::equal(basePages.begin(), basePages.end(), path.producer->basePagePath.begin()),
               "spec record {} base path is not the canonical path", path.producer->id);
    plan.specRecord = path.producer->id;
    plan.draftPageBindings = firstOf(path.producer->specState->draftPagePath, bound);
  }
  plan.basePageBindings = std::move(basePages);
  int32_t const pages = pagesFor(n, page);
  plan.demand.baseKvPages = pages - bound;
  plan.demand.draftKvPages = contract.pagedSpecState ? pages - bound : 0;
}

}  // namespace

ReusePlan makeSpecReusePlan(BlockIndex const& index, RecordStore const& records,
                            PromptBlocks const& blocks, SpecReuseContract const& contract,
                            ContextCacheLookupPolicy policy) {
  checkPolicy("makeSpecReusePlan", policy);
  checkBlocks("makeSpecReusePlan", index, blocks);
  MKV_REQUIRE(contract.futureDependencyTokens >= 0, "makeSpecReusePlan",
              "negative future dependency {}", contract.futureDependencyTokens);
  int32_t const n = blocks.tokenCount();
  ReusePlan plan =
      makeColdReusePlan(ReuseMode::kSpec, n, blocks.pageSize, true, contract.pagedSpecState);
  if (policy == ContextCacheLookupPolicy::kBypass || n == 0) {
    return plan;
  }
  BlockIndex::PrefixMatch match = index.longestPrefix(blocks, blocks.fullBlockCount());
  auto const baseMatched = static_cast<int32_t>(match.pages.size());
  plan.indexedPrefixBlocks = baseMatched;
  plan.verificationRejects = match.verificationRejected ? 1 : 0;
  SpecPath const path = longestSpecPath(records, blocks, contract, baseMatched);
  if (path.blocks > 0) {
    planSpecPath(plan, blocks, contract, path, std::move(match.pages));
  }
  return plan;
}

void requireKvPageCoverage(ReusePlan& plan, int32_t pageSize, int32_t baseTokens,
                           int32_t draftTokens) {
  MKV_REQUIRE(pageSize > 0 && baseTokens >= 0 && draftTokens >= 0, "requireKvPageCoverage",
              "page size {} / base tokens {} / draft tokens {} out of range", pageSize, baseTokens,
              draftTokens);
  auto const raise = [pageSize](int32_t& demand, std::size_t bound, int32_t tokens) {
    int32_t const required = pagesFor(tokens, pageSize) - static_cast<int32_t>(bound);
    demand = std::max(demand, required);
  };
  raise(plan.demand.baseKvPages, plan.basePageBindings.size(), baseTokens);
  raise(plan.demand.draftKvPages, plan.draftPageBindings.size(), draftTokens);
}

namespace {

/// The content key of block `first` (the first one not indexed) under our prompt. Blocks
/// [0, first) matched the index (token by token with verification on), so the indexed entry of
/// block first - 1 holds our content key there: one chain step instead of a walk.
Hash128 contentKeyOfBlock(BlockIndex const& index, PromptBlocks const& blocks, int32_t first) {
  auto const b = static_cast<std::size_t>(first);
  std::optional<PageId> const parentPage =
      first == 0 ? std::nullopt : index.find(blocks.keys[b - 1]);
  return parentPage ? blocks.contentKeyAfter(index.provenanceOf(*parentPage).contentKey, first)
                    : blocks.contentKey(first);
}

/// The nearest cached identity names the culprit: of the provenances `others` that differ from
/// ours, the one matching the most of (salt, adapter, media); its first differing field, in that
/// order, is the reason (ties between provenances go to the reason first in that order). Nullopt
/// when every provenance is ours.
std::optional<MissReason> nearestIdentityMismatch(std::vector<BlockProvenance> const& others,
                                                  BlockKeyExtras const& ours,
                                                  Hash128 const& ourMedia) {
  std::optional<MissReason> nearest;
  int32_t nearestMatches = -1;
  for (BlockProvenance const& p : others) {
    bool const salt = p.salt == ours.salt;
    bool const adapter = p.adapter == ours.adapter;
    bool const media = p.media == ourMedia;
    int32_t const matches =
        static_cast<int32_t>(salt) + static_cast<int32_t>(adapter) + static_cast<int32_t>(media);
    if (matches == 3) {
      continue;  // the same identity: not what kept this block out
    }
    MissReason const reason = !salt      ? MissReason::kSaltMismatch
                              : !adapter ? MissReason::kLoraMismatch
                                         : MissReason::kMediaMismatch;
    if (matches > nearestMatches || (matches == nearestMatches && reason < *nearest)) {
      nearest = reason;
      nearestMatches = matches;
    }
  }
  return nearest;
}

}  // namespace

std::optional<MissReason> classifyMiss(BlockIndex const& index, PromptBlocks const& blocks,
                                       ReusePlan const& plan) {
  checkBlocks("classifyMiss", index, blocks);
  if (plan.windowLimitedTokens > 0) {
    return MissReason::kWindowEvicted;
  }
  int32_t const full = blocks.fullBlockCount();
  if (full == 0) {
    return plan.reuseTokenLength > 0 ? std::nullopt
                                     : std::optional(MissReason::kShorterThanOnePage);
  }
  if (plan.matchedTokenLength >= full * blocks.pageSize) {
    return std::nullopt;
  }
  int32_t const first = plan.indexedPrefixBlocks;
  if (first >= full) {
    return MissReason::kNoPrefix;  // every block indexed, yet no record could use them
  }
  auto const b = static_cast<std::size_t>(first);
  if (index.wasRecentlyEvicted(blocks.keys[b])) {
    return MissReason::kEvicted;
  }
  std::vector<BlockProvenance> const others =
      index.provenanceByContent(contentKeyOfBlock(index, blocks, first));
  return nearestIdentityMismatch(others, blocks.prompt.extras, blocks.mediaDigests[b])
      .value_or(MissReason::kNoPrefix);
}

}  // namespace mkv
