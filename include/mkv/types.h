#pragma once
/// \file types.h
/// Value types shared by every layer. Plain data, no behaviour beyond comparisons.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace mkv {

/// Physical page id inside one page pool (a KV pool has its own id space; a reduced SWA pool
/// has another). Live page-table entries are in [0, numPages); kNoPage marks an empty entry.
using PageId = int32_t;
/// Resident slot: a stable physical row (page-table row == recurrent-state row), handed out by
/// ResidentSlotPool. "Slot" names only this index kind at the public boundaries.
using CacheSlot = int32_t;
/// Execution row: a sequence's position in its request's current batch (the order of the
/// engine's per-step tensors). Compaction renumbers execution rows; a resident slot never moves.
using ExecutionRow = int32_t;
/// Sentinel for an unused page-table entry.
inline constexpr PageId kNoPage = -1;

/// A stable physical state row handed out by ResidentSlotPool. Epoch 0 is invalid; the pool
/// bumps the epoch on release, so work tagged with a stale ref cannot commit into a reused row.
struct ResidentRef {
  CacheSlot slot = -1;
  uint64_t epoch = 0;
  friend bool operator==(ResidentRef const&, ResidentRef const&) = default;
};

/// What a backend does with a resident row (KVCacheRuntime::residentRowState): the engine may
/// release a resident to its ResidentSlotPool and reuse the row only once it is kFree.
enum class ResidentRowState : uint8_t {
  kFree,         ///< no request of the backend holds the row
  kActive,       ///< a live request holds it (until its finish or compaction drops the row)
  kQuarantined,  ///< a request quarantined by a failed synchronisation holds it: device work may
                 ///< still read the row and its pages; kFree after a successful shutdown()
};

/// KV positions (tokens) one execution may address beyond the committed endpoint.
/// Vanilla decoding: {1, 0}. EAGLE: {verify size, drafting steps x top-k}.
struct DecodingKvHeadroom {
  int32_t baseExtraTokens = 1;
  int32_t draftExtraTokens = 0;
  friend bool operator==(DecodingKvHeadroom const&, DecodingKvHeadroom const&) = default;
};

/// Whether the runtime's per-sequence token list ends with one sampled token whose KV is not
/// written yet (kCommittedPlusLookahead, the default) or every listed token already has KV.
enum class DecodingTokenStateContract : uint8_t { kCommittedPlusLookahead, kFullyCommitted };

/// kPrefillStateOnly suppresses every decode-end publication of a request.
enum class ContextCacheCommitPolicy : uint8_t { kIncludingGeneratedTokens, kPrefillStateOnly };

/// kBypass: the sequence uses coordinator-managed private pages but never looks up or publishes.
enum class ContextCacheLookupPolicy : uint8_t { kUseCache, kBypass };

/// Why a sequence stopped. Cancelled and errored sequences are never published.
/// Retention priorities of cached prefixes (docs/context_cache.md, "Retention priorities"):
/// higher is evicted later; records outside every range, and records whose range's duration ran
/// out, have the default.
inline constexpr int32_t kMinRetentionPriority = 0;
inline constexpr int32_t kMaxRetentionPriority = 100;
inline constexpr int32_t kDefaultRetentionPriority = 35;

/// Tokens [tokenStart, tokenEnd) of a sequence (prompt then generated tokens) and the retention
/// priority of the cached prefixes that end in them. A record published by the sequence takes
/// the range of its last token.
struct RetentionRange {
  int32_t tokenStart = 0;
  std::optional<int32_t> tokenEnd;  ///< one past the last token; nullopt = to the sequence's end
  int32_t priority = kDefaultRetentionPriority;  ///< 0 (evicted first) .. 100
  /// Clock units (ContextCacheConfig::retentionClock) after which the priority falls back to the
  /// default; nullopt = for the record's whole life.
  std::optional<int64_t> duration;
  friend bool operator==(RetentionRange const&, RetentionRange const&) = default;
};

enum class FinishReason : uint8_t {
  kNotFinished,
  kEndOfSequence,
  kStopString,
  kLength,
  kCancelled,
  kError
};

/// Expected outcome of a KV backend's lifecycle call (ContextCacheCoordinator,
/// BoundedSwaKVPageManager); contract violations throw mkv::Error instead. kOk: done.
/// kRequestFailed: not done, the backend healthy (too few pages for an admission; a row that
/// cannot grow, the request then finishing; requests still active at shutdown). kPoisoned: the
/// backend is poisoned (a failed synchronisation, launch or row update) and refuses admissions
/// until shutdown() drains its quarantine.
enum class KvStatus : uint8_t { kOk, kRequestFailed, kPoisoned };
/// The names each backend's API spells (one type).
using SwaKVCacheStatus = KvStatus;
using ContextCacheStatus = KvStatus;

/// Why a lifecycle call answered false (ManagedKVCacheRequest::lastFailure()): what a scheduler
/// needs to tell "free pages and retry" from "this sequence cannot grow here" from "the backend
/// is down".
enum class RowFailureReason : uint8_t {
  kNone,        ///< no call of the request failed
  kNoCapacity,  ///< a row needed a page the pool could not give, even after eviction
  kTableFull,   ///< a row would pass its page-table width (maxPagesPerSequence() pages)
  kPoisoned,    ///< the backend is poisoned (a failed synchronisation or device write)
};

/// The row that made a request fail and why; row -1 where no one row is to blame (kNone,
/// kPoisoned).
struct RowFailure {
  RowFailureReason reason = RowFailureReason::kNone;
  ExecutionRow row = -1;
  friend bool operator==(RowFailure const&, RowFailure const&) = default;
};

/// What a request's next decode step would take (ManagedKVCacheRequest::decodeStepDemand): the
/// pages prepareDecodeStep would allocate from each pool, to compare with
/// KVCacheRuntime::capacity() (free + reclaimable pages) before the step, and a row that would pass
/// its table width.
struct DecodeStepDemand {
  int32_t basePages = 0;   ///< the full-attention pool (context reuse; sliding reuse's full half)
  int32_t draftPages = 0;  ///< a paired draft's pool
  /// The sliding pool's page source: sliding-window reuse (rows whose next window page has no
  /// spare); 0 on bounded SWA, whose rows keep their M + 1 pages.
  int32_t slidingPages = 0;
  /// The first row that would pass its table width (kTableFull: the step fails whatever the pools
  /// hold; its pages are not counted), else kNone.
  RowFailure tableFull;
  friend bool operator==(DecodeStepDemand const&, DecodeStepDemand const&) = default;
};

/// Outcome of an in-flight admission (ContextCacheRequest / BoundedSwaRequest::admitSequence):
/// kNoCapacity is transient pool pressure (retry at a later step boundary); kFailed a poisoned
/// backend or one without in-flight admission.
enum class AdmitSequenceStatus : uint8_t { kAdmitted, kNoCapacity, kFailed };

/// How a preempted row's published blocks wait for its resumption (preemptSequence;
/// docs/lifecycle.md, "Preemption"). kRecompute: they stay cached on the GPU. kSwap: when the
/// compaction that drops the row releases its pages, its published blocks that no running row
/// holds move to the host tier at once and their GPU pages are freed (needs a host tier).
enum class PreemptionKind : uint8_t { kRecompute, kSwap };

/// When the page-table and KV-length writes of the lifecycle calls reach the device
/// (KVCacheRuntimeConfig::deviceWrites; docs/architecture.md, "Device writes at the engine step").
enum class DeviceWriteTiming : uint8_t {
  /// Every call that writes ends with them applied on its stream: one launch per writing call.
  kEachCall,
  /// They wait, in call order, until the engine's KVCacheRuntime::flushDeviceWrites(): one launch
  /// per engine step, none in a request's calls.
  kEngineStep,
};

/// Element types of Tensor.
enum class DataType { kFloat32, kFloat16, kBFloat16, kFp8E4M3, kInt8, kUInt8, kInt32, kInt64 };
/// Where a Tensor's bytes live. kGPU means device memory from cudaMalloc (never managed memory).
enum class DeviceType { kCPU, kGPU };

/// Bytes of one element of `type`.
constexpr std::size_t dataTypeSize(DataType type) noexcept {
  switch (type) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kFp8E4M3:
    case DataType::kInt8:
    case DataType::kUInt8:
      return 1;
    case DataType::kInt32:
      return 4;
    case DataType::kInt64:
      return 8;
  }
  return 0;
}

std::string_view toString(DataType type) noexcept;
std::string_view toString(DeviceType type) noexcept;
std::string_view toString(FinishReason reason) noexcept;
std::string_view toString(ResidentRowState state) noexcept;
/// "ok", "request-failed", "poisoned".
std::string_view toString(KvStatus status) noexcept;
std::string_view toString(DeviceWriteTiming timing) noexcept;
/// "none", "no-capacity", "table-full", "poisoned".
std::string_view toString(RowFailureReason reason) noexcept;

/// A reuse point the engine captures during a prefill (hybrid and pure-recurrent deployments
/// with ContextCacheConfig::checkpointInterval): once the prefill has run `position` prompt
/// tokens, the sequence's recurrent state and conv rows are written into row `snapshotSlot` of
/// every layer's snapshot slabs (SnapshotStorage::recurrentStateSlab / recurrentConvSlab), by the
/// engine's own kernels (a chunked scan computes these states anyway), stream-ordered before the
/// prefill's synchronisation. `position` is a multiple of the interval (so of the page size);
/// the KV before it is the prefill's own pages. docs/context_cache.md, "Reuse points".
struct ReusePointCapture {
  int32_t position = 0;
  int32_t snapshotSlot = -1;
  friend bool operator==(ReusePointCapture const&, ReusePointCapture const&) = default;
};

}  // namespace mkv
