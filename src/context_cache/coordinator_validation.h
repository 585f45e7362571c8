#pragma once
/// \file coordinator_validation.h
/// The contract checks of ContextCacheCoordinator's calls as pure functions (not installed):
/// each reads its arguments only and throws mkv::Error naming `call` and the offending value,
/// so a call validates everything before it changes anything. The checks both backends make
/// (residents, compaction mappings) are in resources/backend_requests.h.

#include <cstdint>
#include <span>
#include <vector>

#include "context_cache/coordinator_request.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::detail {

/// Base headroom > 0; draft headroom > 0 exactly when the request binds draft pages (`paired`).
void validateHeadroom(char const* call, DecodingKvHeadroom const& headroom, bool paired);

/// What a batch admission is checked against.
struct AdmissionLimits {
  int32_t maxBatch = 0;
  int32_t pageSize = 0;
  bool hasKv = false;         ///< false: pure recurrent (no rows)
  int32_t baseRowPages = 0;   ///< pages a base row holds (hasKv)
  bool pagedDraft = false;    ///< the deployment's draft owns paged KV
  int32_t draftRowPages = 0;  ///< pages a draft row holds (pagedDraft)
  bool speculativeDeployment = false;
  bool hybridMtpDeployment = false;
  /// When set, every resident must be held with its epoch (ResidentSlotPool::requireHeld).
  ResidentSlotPool const* residentSlots = nullptr;
};

/// beginRequest's checks of a batch, in order: enumerations, a speculative request on a
/// non-speculative deployment, headroom, batch size, the Hybrid-MTP shape, then per sequence
/// the resident (range, epoch, held, repeated), the prompt (empty, int32 positions, row width
/// with headroom for base and paired draft), the media and the lookup policy.
void validateBatchAdmission(char const* call, ContextCacheBatchAdmission const& admission,
                            DecodingKvHeadroom const& headroom, AdmissionLimits const& limits);

/// One sequence's checks of an admission, its resident and retention aside: the prompt (empty,
/// int32 positions, row width with headroom for base and paired draft), the media and the
/// lookup policy; `i` names it in the message.
void validateSequence(char const* call, std::size_t i,
                      ContextCacheSequenceAdmission const& sequence,
                      DecodingKvHeadroom const& headroom, AdmissionLimits const& limits,
                      bool paired);

/// admitSequence's checks of the request a joiner joins: the deployment admits in flight
/// (`liveAdmission`), the request executes with no pending work, has a founding sequence, uses
/// the committed-plus-lookahead contract and its batch of at most `maxBatch` rows is not full.
void validateJoinedRequest(char const* call, CoordinatorRequest const& request, bool liveAdmission,
                           int32_t maxBatch);

/// admitSequence's checks of a joiner against a base table of `maxBatch` rows of `rowPages`
/// pages, after the request's own (its batch is not full).
void validateJoiner(char const* call, ContextCacheSequenceAdmission const& admission,
                    DecodingKvHeadroom const& headroom, int32_t maxBatch, int32_t rowPages,
                    int32_t pageSize, ResidentSlotPool const* residentSlots);

/// A prefill advance of row `row` with `ledger` tokens under `contract`: the whole prompt plus,
/// for kCommittedPlusLookahead, exactly one lookahead token.
void validatePrefillAdvance(char const* call, std::size_t row, int32_t ledger,
                            ContextCacheSequenceAdvance const& advance,
                            DecodingTokenStateContract contract);

/// Common state lengths: none for a vanilla request; for a speculative one, one per sequence,
/// which may be left out (derived from the committed lengths) unless `required`.
void validateCommonLengths(char const* call, bool speculative, std::size_t batch,
                           std::span<int32_t const> common, bool required);

/// completeDecodeStep's checks of the advances, common lengths and completed slots against the
/// request; returns one flag per row, 1 for a completed slot.
std::vector<uint8_t> validateDecodeCompletion(char const* call, CoordinatorRequest const& req,
                                              std::span<ContextCacheSequenceAdvance const> advances,
                                              std::span<ExecutionRow const> completedRows,
                                              std::span<int32_t const> commonStateLengths);

/// A Hybrid-MTP hidden-state tensor ([rows, boundaryHiddenWidth] of boundaryHiddenType on
/// `device`) and a row inside it.
void validateHiddenRow(char const* call, ContextCacheDeploymentProfile const& profile,
                       DeviceType device, Tensor const& hidden, int32_t row);

}  // namespace mkv::detail
