#include "context_cache/cache_record.h"

#include <algorithm>
#include <bit>

#include "core/check.h"

namespace mkv {

std::optional<HybridKey> CacheRecord::hybridKey() const noexcept {
  if (!exactCheckpointLength) {
    return std::nullopt;
  }
  return HybridKey{key.terminal, *exactCheckpointLength, specState.has_value()};
}

std::vector<ResourceId> CacheRecord::resources() const {
  std::vector<ResourceId> out;
  forEachResource([&out](ResourceId resource) { out.push_back(resource); });
  return out;
}

void CacheRecord::validate() const {
  constexpr char const* kCall = "CacheRecord::validate";
  auto const blocks = static_cast<std::size_t>(key.fullBlockCount);
  MKV_REQUIRE(key.fullBlockCount >= 0, kCall, "negative block count {}", key.fullBlockCount);
  MKV_REQUIRE(logicalBlockDigests.size() == blocks, kCall,
              "{} logical digests for a key of {} blocks", logicalBlockDigests.size(), blocks);
  if (isHybrid()) {
    MKV_REQUIRE(*exactCheckpointLength > 0, kCall, "hybrid checkpoint length {} must be positive",
                *exactCheckpointLength);
    MKV_REQUIRE(recurrentSnapshotSlot.has_value(), kCall,
                "hybrid checkpoint at length {} has no recurrent snapshot", *exactCheckpointLength);
    MKV_REQUIRE(basePagePath.size() == blocks || basePagePath.empty(), kCall,
                "hybrid base path of {} pages for {} blocks", basePagePath.size(), blocks);
  } else {
    MKV_REQUIRE(blocks >= 1, kCall, "a block record needs at least one full block");
    MKV_REQUIRE(key.terminal == logicalBlockDigests.back(), kCall,
                "key digest {} is not the last logical digest {}", toString(key.terminal),
                toString(logicalBlockDigests.back()));
    MKV_REQUIRE(basePagePath.size() == blocks, kCall, "base path of {} pages for {} blocks",
                basePagePath.size(), blocks);
    MKV_REQUIRE(!recurrentSnapshotSlot && !partialKvSnapshotSlot, kCall,
                "snapshot slots on a block record");
  }
  MKV_REQUIRE(!specState || specState->draftPagePath.size() == blocks, kCall,
              "draft path of {} pages for {} blocks",
              specState ? specState->draftPagePath.size() : 0, blocks);
  bool negative = false;
  forEachResource([&negative](ResourceId resource) { negative = negative || resource.index < 0; });
  MKV_REQUIRE(!negative, kCall, "negative resource id in record");
  MKV_REQUIRE(
      retentionPriority >= kMinRetentionPriority && retentionPriority <= kMaxRetentionPriority,
      kCall, "retention priority {} outside [{}, {}]", retentionPriority, kMinRetentionPriority,
      kMaxRetentionPriority);
}

int32_t reusePointRank(int32_t intervals) noexcept {
  return std::countr_zero(static_cast<uint32_t>(intervals));
}

int32_t speculationPriority(int32_t rank, int32_t heldPriority) noexcept {
  int32_t const ceiling = std::max(kMinRetentionPriority, heldPriority - 1);
  return std::clamp(rank, kMinRetentionPriority, std::min(kMaxSpeculationRank, ceiling));
}

}  // namespace mkv
