#pragma once
/// \file bounded_swa_kv_page_manager_internal.h
/// What the two source files of BoundedSwaKVPageManager share (not installed): the request
/// record and the window arithmetic. The cached mode's calls are in bounded_swa_cached_mode.cpp.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/tensor.h"
#include "resources/request_stage.h"

namespace mkv {

struct BoundedSwaKVPageManager::Request {
  uint64_t id = 0;
  /// Where it is in its lifecycle (resources/request_stage.h, as the coordinator's requests).
  RequestStage stage = RequestStage::kAdmitted;
  /// DeviceWriteQueue::awaitingFlush() at the end of the prepared prefill or decode step (-1:
  /// nothing waited), checked by the call that completes it.
  int64_t writesMark = -1;
  std::vector<SwaSequenceState> sequences;
  /// The row a decode step could not grow, and why (kNone until one fails).
  RowFailure failure;
  /// Cached mode: each sequence's admitted promptTokens, which preparePrefill must be given
  /// (read before any compaction, so it keeps the admission's row order). Empty otherwise.
  std::vector<int32_t> promptTokens;
  std::vector<int32_t> mapping;  // pending compaction (old -> new), empty when none
  int32_t newBatchSize = -1;
  Tensor* deviceMapping = nullptr;
  /// Device work is enqueued and not known complete: a finish or abandonment synchronises.
  bool needsSynchronization() const noexcept { return hasPendingWork(stage); }
};

namespace swa_detail {

inline int32_t ceilDiv(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

// The pool's page size is a power of two: the per-step page arithmetic shifts instead of
// dividing (three 64-bit divisions per sequence and step otherwise).
inline int32_t pagesCovering(int32_t tokens, int32_t pageShift) {
  return static_cast<int32_t>((int64_t{tokens} + (int64_t{1} << pageShift) - 1) >> pageShift);
}

inline int32_t retainedBeginFor(int32_t endpoint, int32_t window, int32_t pageShift) {
  return static_cast<int32_t>(std::max<int64_t>(0, int64_t{endpoint} - window) >> pageShift);
}

/// Undoes appendBindings (the appended bindings are exactly newBindings) without allocating.
inline void dropAppendedBindings(SwaSequenceState& state) noexcept {
  for (auto it = state.newBindings.rbegin(); it != state.newBindings.rend(); ++it) {
    state.bindings.pop_back();
    state.reservedPages.push_back(it->page);  // back where it came from, within capacity
  }
  state.newBindings.clear();
}

}  // namespace swa_detail
}  // namespace mkv
