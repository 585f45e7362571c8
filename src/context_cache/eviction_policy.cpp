#include "context_cache/eviction_policy.h"

#include "context_cache/loop_aware_eviction_policy.h"
#include "context_cache/lru_eviction_policy.h"
#include "context_cache/s3fifo_eviction_policy.h"
#include "context_cache/slot_list.h"
#include "core/check.h"

namespace mkv {

std::string_view toString(EvictionPolicyKind kind) noexcept {
  switch (kind) {
    case EvictionPolicyKind::kLru:
      return "lru";
    case EvictionPolicyKind::kS3Fifo:
      return "s3fifo";
    case EvictionPolicyKind::kLoopAware:
      return "loopaware";
  }
  return "unknown";
}

std::string_view toString(ReusePointAdmission admission) noexcept {
  switch (admission) {
    case ReusePointAdmission::kEveryInterval:
      return "every-interval";
    case ReusePointAdmission::kBranchFirst:
      return "branch-first";
  }
  return "unknown";
}

std::unique_ptr<EvictionPolicy> makeEvictionPolicy(EvictionPolicyKind kind, int32_t ghostCapacity) {
  constexpr char const* kCall = "makeEvictionPolicy";
  MKV_REQUIRE(ghostCapacity >= 0, kCall, "ghost capacity must be >= 0, got {}", ghostCapacity);
  switch (kind) {
    case EvictionPolicyKind::kLru:
      return std::make_unique<LruEvictionPolicy>();
    case EvictionPolicyKind::kS3Fifo:
      return std::make_unique<S3FifoEvictionPolicy>(ghostCapacity);
    case EvictionPolicyKind::kLoopAware:
      return std::make_unique<LoopAwareEvictionPolicy>(ghostCapacity);
  }
  MKV_REQUIRE(false, kCall, "eviction policy {} out of range", static_cast<int>(kind));
  return nullptr;
}

RetentionChoice retentionOf(std::span<RetentionRange const> ranges, int64_t lastToken) noexcept {
  for (RetentionRange const& range : ranges) {
    if (lastToken >= range.tokenStart && (!range.tokenEnd || lastToken < *range.tokenEnd)) {
      return {range.priority, range.duration};
    }
  }
  return {};
}

void requireValidRetention(char const* call, std::span<RetentionRange const> ranges) {
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    RetentionRange const& range = ranges[i];
    MKV_REQUIRE(range.priority >= kMinRetentionPriority && range.priority <= kMaxRetentionPriority,
                call, "retention range {}: priority {} outside [{}, {}]", i, range.priority,
                kMinRetentionPriority, kMaxRetentionPriority);
    MKV_REQUIRE(range.tokenStart >= 0, call, "retention range {}: negative token start {}", i,
                range.tokenStart);
    MKV_REQUIRE(!range.tokenEnd || *range.tokenEnd > range.tokenStart, call,
                "retention range {}: token end {} not after its start {}", i,
                range.tokenEnd.value_or(0), range.tokenStart);
    MKV_REQUIRE(!range.duration || *range.duration > 0, call,
                "retention range {}: duration {} must be positive", i, range.duration.value_or(0));
    if (i > 0) {
      RetentionRange const& previous = ranges[i - 1];
      MKV_REQUIRE(previous.tokenEnd && range.tokenStart >= *previous.tokenEnd, call,
                  "retention range {} starts at token {}, inside or before range {} (ranges must "
                  "be ascending and disjoint)",
                  i, range.tokenStart, i - 1);
    }
  }
}

void SlotLinks::resize(std::size_t slots) {
  std::vector<RecordSlot> grownOlder = older;
  std::vector<RecordSlot> grownNewer = newer;
  grownOlder.resize(slots, kNoRecordSlot);
  grownNewer.resize(slots, kNoRecordSlot);
  older.swap(grownOlder);
  newer.swap(grownNewer);
}

void SlotList::pushNewest(SlotLinks& links, RecordSlot slot) noexcept {
  auto const s = static_cast<std::size_t>(slot);
  links.older[s] = newest;
  links.newer[s] = kNoRecordSlot;
  if (newest != kNoRecordSlot) {
    links.newer[static_cast<std::size_t>(newest)] = slot;
  } else {
    oldest = slot;
  }
  newest = slot;
  ++count;
}

void SlotList::unlink(SlotLinks& links, RecordSlot slot) noexcept {
  auto const s = static_cast<std::size_t>(slot);
  RecordSlot const before = links.older[s];
  RecordSlot const after = links.newer[s];
  if (before != kNoRecordSlot) {
    links.newer[static_cast<std::size_t>(before)] = after;
  } else {
    oldest = after;
  }
  if (after != kNoRecordSlot) {
    links.older[static_cast<std::size_t>(after)] = before;
  } else {
    newest = before;
  }
  links.older[s] = kNoRecordSlot;
  links.newer[s] = kNoRecordSlot;
  --count;
}

}  // namespace mkv
