#pragma once
/// \file request_stage.h
/// Where a request of either KV backend (ContextCacheCoordinator, BoundedSwaKVPageManager) is
/// in its lifecycle (not installed; beside request_registry.h, which both backends keep too).
/// Each lifecycle call checks the stage it needs before it changes anything. The stages with
/// pending device work (kPrefilling, kDecoding, kCompacting) name the only call that completes
/// it; a request that is finished or abandoned in one of them synchronises first. The stage
/// diagrams: docs/architecture.md, "Bounded SWA" and "Context reuse".

#include <cstdint>

namespace mkv {

enum class RequestStage : uint8_t {
  kAdmitted,    ///< beginRequest admitted it; preparePrefill comes next
  kPrefilling,  ///< preparePrefill bound its rows; the prefill's completion call completes it
                ///< (finalizePrefillPublication; the bounded-SWA manager's completePrefill)
  kSettled,     ///< executing, nothing pending: a decode step, compaction or join may begin
  kDecoding,    ///< prepareDecodeStep grew its pages; completeDecodeStep completes it
  kCompacting,  ///< beginBatchCompaction uploaded the mapping; compactBatch completes it
  kFinishing,   ///< a failed growth or an emptied batch: only finish remains
};

/// Device work is enqueued that no completion call has seen complete.
constexpr bool hasPendingWork(RequestStage stage) noexcept {
  return stage == RequestStage::kPrefilling || stage == RequestStage::kDecoding ||
         stage == RequestStage::kCompacting;
}

/// Past the prefill and not finishing (decode steps, compaction and joins belong here).
constexpr bool isExecuting(RequestStage stage) noexcept {
  return stage == RequestStage::kSettled || stage == RequestStage::kDecoding ||
         stage == RequestStage::kCompacting;
}

}  // namespace mkv
