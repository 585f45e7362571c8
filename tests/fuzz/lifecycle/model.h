#pragma once
/// \file model.h
/// What the lifecycle driver (lifecycle.h) knows about the requests it holds: the input it reads,
/// the stage of each request, its rows as the engine sees them, and the small pure helpers the
/// operation files share. Private to tests/fuzz/lifecycle/.

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/kv_oracle.h"

namespace mkv::fuzz::lifecycle {

inline constexpr int32_t kPage = 16;            ///< tokens per page
inline constexpr int32_t kMaxLiveRequests = 3;  ///< requests kept at once (plus spent ones)
inline constexpr cudaStream_t kStream = nullptr;
inline constexpr DecodingKvHeadroom kVanilla{1, 0};
/// Elements of a Hybrid-MTP boundary hidden row (fp16).
inline constexpr int64_t kHiddenWidth = 8;
/// The seed mixed into a row's identity seed for its draft digests.
inline constexpr uint64_t kDraftSeed = 0xd7af7;

/// A stream the runtime was not created with (contract violation).
inline cudaStream_t foreignStream() {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(0x1000));
}

/// splitmix64: prompt tokens and the snapshot's byte digest.
inline uint64_t mix(uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline int32_t ceilPages(int64_t tokens) {
  return static_cast<int32_t>((tokens + kPage - 1) / kPage);
}

/// A violated property: ends the run with a report.
struct Violation {
  std::string what;
};

/// A library call threw std::bad_alloc (allocation fault injection).
struct AllocationFailed {};

[[noreturn]] inline void violate(std::string what) { throw Violation{std::move(what)}; }

inline void expect(bool condition, std::string_view what) {
  if (!condition) {
    violate(std::string(what));
  }
}

/// expect() with a message formatted only on failure (the checks run after every operation).
template <typename... Args>
void expectf(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) {
    violate(fmt::format(format, std::forward<Args>(args)...));
  }
}

/// The byte string, read front to back; past its end every byte reads 0 and the run ends.
class Input {
 public:
  explicit Input(std::span<uint8_t const> data) : mData(data) {}
  bool exhausted() const noexcept { return mNext >= mData.size(); }
  uint8_t byte() noexcept { return mNext < mData.size() ? mData[mNext++] : uint8_t{0}; }
  /// A value in [0, n), n in [1, 256].
  int32_t below(int32_t n) noexcept { return n <= 1 ? 0 : byte() % n; }
  /// True with probability about 1 / n.
  bool oneIn(int32_t n) noexcept { return below(n) == 0; }

 private:
  std::span<uint8_t const> mData;
  std::size_t mNext = 0;
};

/// How a request was begun: through ManagedKVCacheRequest or on the backend itself.
enum class Via : uint8_t { kFacade, kDirect };

/// Where a request is in its lifecycle, as the driver drove it.
enum class Stage : uint8_t {
  kAdmitted,    ///< begun; rows not bound yet
  kPrefill,     ///< preparePrefill done: prefill work pending
  kIdle,        ///< executing, nothing pending
  kDecode,      ///< prepareDecodeStep done: decode work pending
  kCompaction,  ///< beginBatchCompaction done
  kFinishing,   ///< every row compacted away: only finish remains
  kGone,        ///< finished, or quarantined by a failed compaction: the handle is invalid
};

char const* toString(Stage stage);

/// A stage in which the coordinator considers the request executing.
inline bool executing(Stage stage) {
  return stage == Stage::kPrefill || stage == Stage::kIdle || stage == Stage::kDecode ||
         stage == Stage::kCompaction;
}

/// Device work is pending (a finish or an abandonment synchronises).
inline bool pendingWork(Stage stage) {
  return stage == Stage::kPrefill || stage == Stage::kDecode || stage == Stage::kCompaction;
}

/// One sequence (execution row) as the engine sees it.
struct Row {
  ResidentRef resident;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;  ///< sampled tokens (the digests cover prompt + generated)
  testing::PrefixDigests digests;
  int32_t start = 0;         ///< prefill start (reuse length)
  int32_t materialized = 0;  ///< positions whose KV the engine wrote
  /// A chunked joiner: the prefill length the library was last told (completePrefillChunk; the
  /// reuse length before), the least it accepts next.
  int32_t chunkCompleted = 0;
  /// SWA: endpoint of the window (the staged one while a step is pending; a bounded-SWA joiner's:
  /// the end of its staged prefill chunk)
  int32_t endpoint = 0;
  /// SWA: endpoint whose window pages are still mapped (committed; a bounded-SWA joiner's: the
  /// end of its completed chunks, the manager's endpoint)
  int32_t windowFrom = 0;
  bool bound = false;  ///< the backend mapped the row
  bool joined = true;  ///< false: admitted in flight, not finalised
  /// A founder whose prefill chunk (completePrefillChunk in the prefill) stopped short of its
  /// prompt: completePrefill holds it, and it goes on as an unfinalised joiner.
  bool heldPrefill = false;
  bool decoded = false;  ///< produced a token in the pending decode step
  int32_t accepted = 0;  ///< tokens the pending step accepted (speculative rounds: 1 or more)
  FinishReason reason = FinishReason::kNotFinished;
  /// Draft model (speculative requests with a paged draft): entry p covers the tokens [0, p + 1]
  /// when the draft row of position p depends on the next token (EAGLE's and MTP's do), else
  /// [0, p] (appendTokens).
  testing::PrefixDigests draft;
  bool paired = false;  ///< keeps draft digests and a draft row
  int32_t drafted = 0;  ///< draft positions the engine wrote (the draft KV length)
  int32_t common = 0;   ///< the last common (base and draft) length the backend was given
  // Rows of a Hybrid-MTP request: each restores its own hit and publishes its own endpoint.
  bool bypass = false;             ///< looks nothing up (its policy, or the request's)
  bool endpointPublished = false;  ///< publishHybridMtpEndpoint made its capture
  bool pinsReleased = false;       ///< the restored checkpoint's pins are gone
  bool hiddenRestored = false;     ///< its boundary hidden row was restored
};

/// Appends tokens to a row's ledger (prompt + generated): its digests and, for a paired row, its
/// draft digests. A draft whose rows depend on the next token (`draftLookahead`: EAGLE, MTP) keys
/// draft entry p by token p + 1 (entry 0 by tokens 0 and 1, as the speculative facade suite's
/// draft ledger); one without (DFlash-like) by token p, under the draft's own seed.
inline void appendTokens(Row& row, std::span<int32_t const> tokens, int32_t draftLookahead) {
  int64_t const before = row.digests.size();
  row.digests.extendTokens(tokens);
  if (!row.paired) {
    return;
  }
  if (draftLookahead == 0) {
    row.draft.extendTokens(tokens);
    return;
  }
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    int64_t const position = before + static_cast<int64_t>(i);
    if (position == 0) {
      continue;  // draft entry p needs token p + 1
    }
    uint64_t key = static_cast<uint32_t>(tokens[i]);
    if (position == 1) {
      key |= static_cast<uint64_t>(static_cast<uint32_t>(row.prompt.front())) << 32;
    }
    row.draft.extend(std::span<uint64_t const>(&key, 1));
  }
}

/// One request the driver holds, through whichever handle it was begun with.
struct Req {
  uint64_t serial = 0;
  Via via = Via::kFacade;
  Stage stage = Stage::kAdmitted;
  std::optional<ManagedKVCacheRequest> facade;
  ContextCacheCoordinator::RequestHandle coordinator;
  BoundedSwaKVPageManager::RequestHandle swa;
  std::vector<Row> rows;
  DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
  std::string lora;
  std::string salt;
  uint64_t seed = 0;
  bool trimmed = false;          ///< SWA: completePrefill ran (M + 1 pages a row)
  std::vector<int32_t> mapping;  ///< pending compaction
  int32_t newBatchSize = 0;
  // Speculative requests (KVCacheRuntimeConfig::speculative deployments).
  bool speculative = false;                ///< begun as a speculative request
  bool paired = false;                     ///< binds base and draft rows (a paged draft)
  bool mtp = false;                        ///< a speculative request on a Hybrid-MTP deployment
  DecodingKvHeadroom headroom = kVanilla;  ///< of every decode step
  /// EAGLE: the prompt endpoint waits for the draft initialisation (completePrefill until the
  /// first round, compaction or finish): abandoning or finishing synchronises.
  bool draftInitPending = false;
  /// Sliding-window reuse: a prepareDecodeStep ran out of host memory, which may have left the
  /// full half's step prepared (errors.md, "Out of host memory"): dropping the request may wait.
  bool stepMaybePrepared = false;
  std::vector<Tensor> hidden;  ///< Hybrid-MTP: per row, the base hidden rows of its prefill
};

/// A prefix a checkpoint may have been captured for (the driver's checkpoint ledger): its key as
/// the coordinator files it (HybridKey), and the digests of the state it must hold.
struct CheckpointPrefix {
  Hash128 exactDigest;
  int32_t length = 0;
  bool mtp = false;
  testing::PrefixDigests digests;  ///< the base prefix (positions [0, length))
  testing::PrefixDigests draft;    ///< the draft's (Hybrid-MTP)
};

/// Rows of a quarantined request: their pages must keep their KV until shutdown drains them.
struct Quarantined {
  std::vector<Row> rows;
  int32_t swaPages = 0;
};

/// Prompt token `position` of prompt family `family` (families share prefixes).
inline int32_t promptToken(int32_t family, int32_t position) {
  return 100 + static_cast<int32_t>(
                   mix(static_cast<uint64_t>(family) * 1000003u + static_cast<uint64_t>(position)) %
                   20000);
}

/// The token the engine samples after a prefix of digest `digest`.
inline int32_t sampleToken(uint64_t digest) { return 30000 + static_cast<int32_t>(digest % 10000); }

inline bool stoppedWithoutPublishing(FinishReason reason) {
  return reason == FinishReason::kCancelled || reason == FinishReason::kError;
}

}  // namespace mkv::fuzz::lifecycle
