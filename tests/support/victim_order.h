#pragma once
/// \file victim_order.h
/// The eviction-policy suites' view of a policy: its victims in the order it offers them.

#include <vector>

#include "context_cache/eviction_policy.h"

namespace mkv::test {

/// Every slot `policy.walkVictims` offers, first victim first (the walk never stops early).
inline std::vector<RecordSlot> victimOrder(EvictionPolicy const& policy) {
  std::vector<RecordSlot> order;
  policy.walkVictims([&order](RecordSlot slot) {
    order.push_back(slot);
    return false;
  });
  return order;
}

}  // namespace mkv::test
