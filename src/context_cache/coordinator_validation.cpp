#include "context_cache/coordinator_validation.h"

#include <fmt/format.h>

#include <limits>
#include <string_view>

#include "context_cache/eviction_policy.h"
#include "context_cache/request_mode.h"
#include "core/check.h"
#include "resources/backend_requests.h"

namespace mkv::detail {

void validateHeadroom(char const* call, DecodingKvHeadroom const& headroom, bool paired) {
  MKV_REQUIRE(headroom.baseExtraTokens > 0, call, "baseExtraTokens must be > 0, got {}",
              headroom.baseExtraTokens);
  if (paired) {
    MKV_REQUIRE(headroom.draftExtraTokens > 0, call,
                "draftExtraTokens must be > 0 for a request with paged draft state, got {}",
                headroom.draftExtraTokens);
  } else {
    MKV_REQUIRE(headroom.draftExtraTokens == 0, call,
                "draftExtraTokens {} given, but the request has no paged draft state",
                headroom.draftExtraTokens);
  }
}

namespace {

/// The lookup and commit policies `sequence` sets, where it sets them, are enumerators; `what`
/// names the sequence in the message.
void requirePoliciesInRange(char const* call, std::string_view what,
                            ContextCacheSequenceAdmission const& sequence) {
  auto const lookup =
      static_cast<int>(sequence.lookupPolicy.value_or(ContextCacheLookupPolicy::kUseCache));
  auto const commit = static_cast<int>(
      sequence.commitPolicy.value_or(ContextCacheCommitPolicy::kIncludingGeneratedTokens));
  MKV_REQUIRE(lookup <= 1 && commit <= 1, call,
              "{}: lookup policy {} / commit policy {} out of range", what, lookup, commit);
}

/// The request-wide part of validateBatchAdmission (before any sequence is looked at).
void validateBatchShape(char const* call, ContextCacheBatchAdmission const& admission,
                        DecodingKvHeadroom const& headroom, AdmissionLimits const& limits) {
  MKV_REQUIRE(static_cast<uint8_t>(admission.tokenStateContract) <= 1 &&
                  static_cast<uint8_t>(admission.commitPolicy) <= 1 &&
                  static_cast<uint8_t>(admission.lookupPolicy) <= 1,
              call, "contract {} / commit policy {} / lookup policy {} out of range",
              static_cast<int>(admission.tokenStateContract),
              static_cast<int>(admission.commitPolicy), static_cast<int>(admission.lookupPolicy));
  MKV_REQUIRE(!admission.speculativeRequest || limits.speculativeDeployment, call,
              "speculative request on a non-speculative deployment");
  bool const paired = admission.speculativeRequest && limits.pagedDraft;
  validateHeadroom(call, headroom, paired);
  std::size_t const batch = admission.sequences.size();
  MKV_REQUIRE(batch > 0 && batch <= static_cast<std::size_t>(limits.maxBatch), call,
              "batch of {} sequences outside [1, {}]", batch, limits.maxBatch);
  bool const hybridMtp = admission.speculativeRequest && limits.hybridMtpDeployment;
  if (hybridMtp) {
    // The engine publishes each row's prompt endpoint (publishHybridMtpEndpoint); the draft KV
    // lags the base by the accepted span, so a decode-end checkpoint would hold short draft state.
    for (std::size_t i = 0; i < batch; ++i) {
      ContextCacheCommitPolicy const policy =
          admission.sequences[i].commitPolicy.value_or(admission.commitPolicy);
      MKV_REQUIRE(policy == ContextCacheCommitPolicy::kPrefillStateOnly, call,
                  "a Hybrid-MTP request needs commit policy kPrefillStateOnly, got {} (row {})",
                  static_cast<int>(policy), i);
    }
  }
  // The replay tail bounds the Hybrid-MTP endpoint (publishHybridMtpEndpoint); the other
  // publications are of whole pages at fixed points, which a volatile tail does not move.
  MKV_REQUIRE(admission.replayTailLength >= 0, call,
              "replay tail length {} is negative (deriving it from the chat template is the "
              "runtime's job: pass the token count)",
              admission.replayTailLength);
  MKV_REQUIRE(admission.replayTailLength == 0 || hybridMtp, call,
              "a replay tail ({} tokens) applies to Hybrid-MTP requests only",
              admission.replayTailLength);
  for (std::size_t i = 0; i < batch && admission.replayTailLength > 0; ++i) {
    MKV_REQUIRE(static_cast<std::size_t>(admission.replayTailLength) <
                    admission.sequences[i].tokenIds.size(),
                call, "replay tail of {} tokens leaves nothing of row {}'s {}-token prompt",
                admission.replayTailLength, i, admission.sequences[i].tokenIds.size());
  }
}

/// The prompt of sequence `i`: not empty, within int32 positions, and within a row (base, and
/// draft when `paired`) with its headroom.
void validatePrompt(char const* call, std::size_t i, ContextCacheSequenceAdmission const& sequence,
                    DecodingKvHeadroom const& headroom, AdmissionLimits const& limits,
                    bool paired) {
  int32_t const pageSize = limits.pageSize;
  MKV_REQUIRE(!sequence.tokenIds.empty(), call, "sequence {} has an empty prompt", i);
  MKV_REQUIRE(sequence.tokenIds.size() <
                  static_cast<std::size_t>(std::numeric_limits<int32_t>::max() - pageSize),
              call, "sequence {} has {} tokens, more than int32 positions", i,
              sequence.tokenIds.size());
  if (limits.hasKv) {
    int32_t const width = limits.baseRowPages;
    int64_t const needed = pagesFor(
        static_cast<int64_t>(sequence.tokenIds.size()) + headroom.baseExtraTokens, pageSize);
    MKV_REQUIRE(needed <= width, call,
                "sequence {} needs {} pages ({} tokens + {} headroom) but a row holds {}", i,
                needed, sequence.tokenIds.size(), headroom.baseExtraTokens, width);
  }
  if (paired) {
    int32_t const width = limits.draftRowPages;
    int64_t const needed = pagesFor(
        static_cast<int64_t>(sequence.tokenIds.size()) + headroom.draftExtraTokens, pageSize);
    MKV_REQUIRE(needed <= width, call,
                "sequence {} needs {} draft pages ({} tokens + {} headroom) but a draft row "
                "holds {}",
                i, needed, sequence.tokenIds.size(), headroom.draftExtraTokens, width);
  }
}

}  // namespace

void validateSequence(char const* call, std::size_t i,
                      ContextCacheSequenceAdmission const& sequence,
                      DecodingKvHeadroom const& headroom, AdmissionLimits const& limits,
                      bool paired) {
  validatePrompt(call, i, sequence, headroom, limits, paired);
  MKV_REQUIRE(sequence.media.empty() || sequence.media.size() == sequence.tokenIds.size(), call,
              "sequence {} has {} media positions for {} tokens", i, sequence.media.size(),
              sequence.tokenIds.size());
  requirePoliciesInRange(call, fmt::format("sequence {}", i), sequence);
}

void validateBatchAdmission(char const* call, ContextCacheBatchAdmission const& admission,
                            DecodingKvHeadroom const& headroom, AdmissionLimits const& limits) {
  validateBatchShape(call, admission, headroom, limits);
  bool const paired = admission.speculativeRequest && limits.pagedDraft;
  std::vector<uint8_t> seen(static_cast<std::size_t>(limits.maxBatch), 0);
  for (std::size_t i = 0; i < admission.sequences.size(); ++i) {
    auto const& sequence = admission.sequences[i];
    validateResident(call, i, sequence.resident, limits.maxBatch, limits.residentSlots, seen);
    validateSequence(call, i, sequence, headroom, limits, paired);
    requireValidRetention(call, sequence.retention);
  }
}

void validateJoinedRequest(char const* call, CoordinatorRequest const& request, bool liveAdmission,
                           int32_t maxBatch) {
  MKV_REQUIRE(liveAdmission, call,
              "this request admits no sequences in flight (a Hybrid-MTP request, or a deployment "
              "without attention layers)");
  MKV_REQUIRE(request.stage == RequestStage::kSettled, call,
              "admission needs an executing request with no pending work or compaction");
  MKV_REQUIRE(!request.sequences.empty(), call, "the request has no founding sequence");
  // A joiner is finalised with its lookahead token (committed == prompt): the fully committed
  // contract, where every listed token has KV, could never advance it.
  MKV_REQUIRE(request.contract == DecodingTokenStateContract::kCommittedPlusLookahead, call,
              "in-flight admission needs the committed-plus-lookahead contract");
  MKV_REQUIRE(request.sequences.size() < static_cast<std::size_t>(maxBatch), call,
              "the batch is full ({} sequences)", request.sequences.size());
}

void validateJoiner(char const* call, ContextCacheSequenceAdmission const& admission,
                    DecodingKvHeadroom const& headroom, int32_t maxBatch, int32_t rowPages,
                    int32_t pageSize, ResidentSlotPool const* residentSlots) {
  ResidentRef const ref = admission.resident;
  MKV_REQUIRE(ref.slot >= 0 && ref.slot < maxBatch && ref.epoch != 0, call,
              "invalid resident (slot {}, epoch {})", ref.slot, ref.epoch);
  if (residentSlots != nullptr) {
    residentSlots->requireHeld(call, ref);
  }
  MKV_REQUIRE(!admission.tokenIds.empty(), call, "empty prompt");
  int64_t const needed = pagesFor(
      static_cast<int64_t>(admission.tokenIds.size()) + headroom.baseExtraTokens, pageSize);
  MKV_REQUIRE(needed <= rowPages, call, "the prompt needs {} pages but a row holds {}", needed,
              rowPages);
  MKV_REQUIRE(admission.media.empty() || admission.media.size() == admission.tokenIds.size(), call,
              "{} media positions for {} tokens", admission.media.size(),
              admission.tokenIds.size());
  requirePoliciesInRange(call, "the joiner", admission);
  requireValidRetention(call, admission.retention);
}

void validatePrefillAdvance(char const* call, std::size_t row, int32_t ledger,
                            ContextCacheSequenceAdvance const& advance,
                            DecodingTokenStateContract contract) {
  if (contract == DecodingTokenStateContract::kFullyCommitted) {
    MKV_REQUIRE(advance.acceptedTokenCount == 0 && advance.committedStateLength == ledger, call,
                "row {}: a fully committed prefill accepts 0 tokens and commits {}, got {} / {}",
                row, ledger, advance.acceptedTokenCount, advance.committedStateLength);
  } else {
    MKV_REQUIRE(advance.acceptedTokenCount == 1 && advance.acceptedTokenIds != nullptr &&
                    advance.committedStateLength == ledger,
                call,
                "row {}: a prefill accepts the 1 lookahead token and commits the {} prompt "
                "tokens, got {} accepted / {} committed",
                row, ledger, advance.acceptedTokenCount, advance.committedStateLength);
  }
}

void validateCommonLengths(char const* call, bool speculative, std::size_t batch,
                           std::span<int32_t const> common, bool required) {
  if (!speculative) {
    MKV_REQUIRE(common.empty(), call, "common state lengths are for speculative requests, got {}",
                common.size());
    return;
  }
  MKV_REQUIRE(common.size() == batch || (common.empty() && !required), call,
              "{} common state lengths for a batch of {}{}", common.size(), batch,
              required ? " (one per sequence is required with a paged draft)" : "");
}

namespace {

/// One decode advance of row `i` (not a hold) under the request's contract.
void validateDecodeAdvance(char const* call, std::size_t i, CoordinatorRequest const& req,
                           ContextCacheSequenceAdvance const& advance) {
  auto const& sequence = req.sequences[i];
  MKV_REQUIRE(sequence.joined, call,
              "row {} was admitted in flight and not finalised: it must hold (0 tokens, "
              "committed {})",
              i, kHoldCommittedStateLength);
  MKV_REQUIRE(advance.acceptedTokenCount > 0 && advance.acceptedTokenIds != nullptr, call,
              "row {}: a zero advance must use the hold sentinel (committed {}), got {} "
              "tokens / committed {}",
              i, kHoldCommittedStateLength, advance.acceptedTokenCount,
              advance.committedStateLength);
  auto const ledger = static_cast<int64_t>(sequence.tokens.size());
  if (req.contract == DecodingTokenStateContract::kFullyCommitted) {
    MKV_REQUIRE(advance.committedStateLength == ledger + advance.acceptedTokenCount &&
                    ledger == sequence.committed,
                call, "row {}: committed {} but ledger {} + accepted {}", i,
                advance.committedStateLength, ledger, advance.acceptedTokenCount);
  } else if (req.mode->speculativeRounds()) {
    MKV_REQUIRE(
        advance.committedStateLength == int64_t{sequence.committed} + advance.acceptedTokenCount &&
            ledger == int64_t{sequence.committed} + 1,
        call,
        "row {}: a speculative step commits the previous {} + accepted {} (ledger {}), "
        "got committed {}",
        i, sequence.committed, advance.acceptedTokenCount, ledger, advance.committedStateLength);
  } else {
    MKV_REQUIRE(advance.acceptedTokenCount == 1 &&
                    advance.committedStateLength == sequence.committed + 1 &&
                    ledger == int64_t{sequence.committed} + 1,
                call,
                "row {}: vanilla decode accepts 1 token and commits {} (ledger {}), got {} "
                "accepted / committed {}",
                i, sequence.committed + 1, ledger, advance.acceptedTokenCount,
                advance.committedStateLength);
  }
}

}  // namespace

std::vector<uint8_t> validateDecodeCompletion(char const* call, CoordinatorRequest const& req,
                                              std::span<ContextCacheSequenceAdvance const> advances,
                                              std::span<ExecutionRow const> completedRows,
                                              std::span<int32_t const> commonStateLengths) {
  for (std::size_t i = 0; i < advances.size(); ++i) {
    if (!isHold(advances[i])) {
      validateDecodeAdvance(call, i, req, advances[i]);
    }
  }
  for (std::size_t i = 0; i < advances.size() && !commonStateLengths.empty(); ++i) {
    int32_t const common = commonStateLengths[i];
    MKV_REQUIRE(isHold(advances[i]) || (common >= req.sequences[i].common &&
                                        common <= advances[i].committedStateLength),
                call, "row {}: common state length {} outside [{}, committed {}]", i, common,
                req.sequences[i].common, advances[i].committedStateLength);
  }
  std::vector<uint8_t> completed(req.sequences.size(), 0);
  for (ExecutionRow row : completedRows) {
    MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
                "completed row {} outside the batch of {}", row, req.sequences.size());
    MKV_REQUIRE(completed[static_cast<std::size_t>(row)] == 0, call,
                "completed row {} listed twice", row);
    MKV_REQUIRE(req.sequences[static_cast<std::size_t>(row)].joined, call,
                "completed row {} was never finalised", row);
    completed[static_cast<std::size_t>(row)] = 1;
  }
  return completed;
}

void validateHiddenRow(char const* call, ContextCacheDeploymentProfile const& profile,
                       DeviceType device, Tensor const& hidden, int32_t row) {
  MKV_REQUIRE(hidden.rank() == 2 && hidden.dim(1) == profile.boundaryHiddenWidth &&
                  hidden.dataType() == profile.boundaryHiddenType && hidden.deviceType() == device,
              call, "the hidden states must be [rows, {}] of {} on {}, got {} of {} on {}",
              profile.boundaryHiddenWidth, toString(profile.boundaryHiddenType), toString(device),
              hidden.shape().toString(), toString(hidden.dataType()),
              toString(hidden.deviceType()));
  MKV_REQUIRE(row >= 0 && row < hidden.dim(0), call, "hidden row {} outside [0, {})", row,
              hidden.dim(0));
}

}  // namespace mkv::detail
