#pragma once
/// \file reference_engine.h
/// A model-free engine loop that drives ManagedKVCacheRequest exactly as a runtime would, with
/// the KV oracle checking every byte attention would read. Used by the scenario tests, the
/// benchmarks and mkv-replay; integrators can use it to check their own wiring
/// (docs/integration.md, "Checking your own wiring").

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mkv/generation_request.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/media.h"
#include "mkv/testing/kv_oracle.h"
#include "mkv/types.h"

namespace mkv::testing {

/// What a sequence the engine preempted carries back to the waiting queue
/// (ReferenceEngineOptions::preemption): its EngineSequence's prompt then ends with the
/// `generatedTokens` it sampled before (the last of them without KV), and maxNewTokens counts the
/// tokens it has left. Its outcome reports the original prompt, every sampled token and the
/// figures of its first admission, as if it had never been preempted.
/// A sequence preempted while it prefilled (an unfinalised joiner) has sampled nothing: 0
/// generated tokens, and its first completed prefill still counts as its first admission's.
struct EngineResume {
  int32_t generatedTokens = 0;  ///< the prompt's last tokens that the sequence sampled
  int32_t prefillStart = 0;     ///< the first admission's reused tokens (generatedTokens > 0)
  bool joinedInFlight = false;  ///< the first admission joined a running batch
  int32_t decodeSteps = 0;      ///< decode steps it took part in before
  int64_t lastTokenStep = 0;    ///< EngineStats::decodeSteps when it sampled its last token
  int64_t seatedAtStep = 0;     ///< EngineStats::decodeSteps when it was first seated
  int32_t prefillChunks = 0;    ///< chunks it ran in prefills that a preemption cut short
};

/// A joiner's own cache identity (ManagedKVCacheRequest::admitSequence's overload for a joiner
/// of another request): its adapter and salt key its blocks and seed its KV oracle.
struct EngineIdentity {
  std::string loraWeightsName;
  std::string cacheSalt;
};

/// One sequence to run.
struct EngineSequence {
  std::vector<int32_t> prompt;
  int32_t maxNewTokens = 8;  ///< generation stops with kLength after this many sampled tokens
  std::vector<imageUtils::ImageData> images;
  std::vector<audioUtils::AudioData> audios;
  std::optional<ContextCacheLookupPolicy> lookupPolicy;
  /// Cancel the sequence before decode step number `cancelAtStep` (0-based); -1 = never.
  int32_t cancelAtStep = -1;
  /// Caller's id, reported back in the outcome.
  int64_t tag = 0;
  /// Set by the engine on a preempted sequence it queues again; empty for a new one.
  std::optional<EngineResume> resume{};
  /// A joiner's own identity, admitted with the request's lookup and commit policies and its
  /// own lookup override (`lookupPolicy`); unset: the request's (the seed's admitSequence).
  /// Founders take the request's.
  std::optional<EngineIdentity> identity{};
};

/// One runtime request: a founding batch of sequences sharing request-level settings.
struct EngineRequest {
  std::vector<EngineSequence> sequences;
  std::string loraWeightsName;
  std::string cacheSalt;
  ContextCacheLookupPolicy lookupPolicy = ContextCacheLookupPolicy::kUseCache;
  ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  /// {image placeholder, audio placeholder} token ids, or empty.
  std::vector<int32_t> mediaTokenIds;
};

enum class VerifyMode : uint8_t {
  kAll,     ///< every position attention reads, at every step
  kSample,  ///< reused positions and newly written ones fully; a few random positions per step
  kNone,
};

/// What the engine does when a decode step's page growth exceeds what the pool can give.
enum class PreemptionMode : uint8_t {
  kNone,  ///< nothing: the step fails the batch (the library's contract), as the seed's engine
  /// vLLM's recompute: preempt the newest running sequences (preemptSequence, then compaction)
  /// until the growth fits, queue them first for in-flight admission with their sampled tokens
  /// appended to the prompt; re-admitted, they reuse what they published.
  kRecompute,
  /// vLLM's swap: as kRecompute, but each preempted row is preempted with PreemptionKind::kSwap
  /// (an unfinalised joiner, which preemptSequence refuses, only compacted away): at the
  /// compaction its published blocks move to the host tier, and its resumption onboards them.
  /// Needs a context-reuse runtime with a host tier (KVCacheRuntimeConfig::hostPoolTokens).
  kSwap,
};

struct ReferenceEngineOptions {
  VerifyMode verify = VerifyMode::kAll;
  uint64_t seed = 1;
  /// A sampled token is the end-of-sequence token with probability 1 / eosEvery (0: never).
  int32_t eosEvery = 0;
  /// Throw mkv::Error on the first oracle mismatch (tests) instead of only counting it.
  bool throwOnMismatch = true;
  /// Called after every decode step with the step index (tests inject faults here).
  std::function<void(int64_t)> onStep;
  /// Speculative decoding: 0 = vanilla (one token per decode step). K > 0 needs a runtime built
  /// with KVCacheRuntimeConfig::speculative: on an attention-only model EAGLE-style or MTP, on a
  /// model with recurrent layers and context reuse Hybrid-MTP (requests under
  /// ContextCacheCommitPolicy::kPrefillStateOnly). Every request is then a speculative request
  /// with headroom {K + 1, K} (paged draft) or {K + 1, 0}, and every decode step a verification
  /// round in which the draft proposes K tokens and the base verifies them; how many are
  /// accepted is drawn from the seed and the prefix.
  int32_t speculativeWidth = 0;
  /// Chunked prefill of joiners (docs/lifecycle.md, "Chunked prefill"). 0: a joiner prefills its
  /// whole prompt in the step it joins. N > 0: a per-step token budget spent as vLLM's scheduler
  /// spends it: one token per decoding row first, then the rest on prefill chunks of the joiners
  /// still prefilling, in join order (at least one token when the decodes use up the budget, so
  /// no joiner waits for ever); a waiting sequence joins only while the step's budget has tokens
  /// left after the running rows' (so none holds its prompt's pages through steps that give it
  /// none). A joiner holds in the decode steps of its chunks; the library
  /// publishes its full blocks after each (completePrefillChunk), and after its last chunk it
  /// samples its lookahead token and is finalised. On context reuse, full storage and
  /// sliding-window reuse the founders' prefill step spends the budget too, founders in order: a
  /// founder it does not cover publishes its first chunk, holds at completePrefill and goes on as a
  /// joiner.
  int32_t maxBatchedTokens = 0;
  /// Preemption under pool pressure (needs in-flight admission and a join queue: the preempted
  /// wait there). kRecompute: before each decode step the engine counts the pages the step's
  /// growth takes (a finalised row's committed tokens plus the headroom, in pages, beyond those
  /// mapped in its row) against the base pool's free and reclaimable pages
  /// (KVCacheRuntime::capacity(); on sliding-window reuse also one sliding page per row starting a
  /// page); while they do not fit and more than one row runs, it preempts the newest running row:
  /// preemptSequence (an unfinalised joiner has nothing of its own to publish besides its chunks:
  /// it is only compacted away), compaction, and the sequence waits first in line, ahead of the
  /// join queue, with its sampled tokens appended to its prompt (EngineResume). Admitted again
  /// (in flight, or as a founder of a later run: RequestOutcome::preempted), it reuses what it
  /// published and samples on to its maxNewTokens. A batch whose only running row cannot grow
  /// fails as with kNone.
  PreemptionMode preemption = PreemptionMode::kNone;
};

struct SequenceOutcome {
  int64_t tag = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;  ///< sampled tokens (the last one has no KV)
  FinishReason reason = FinishReason::kNotFinished;
  int32_t prefillStart = 0;  ///< reused tokens
  bool joinedInFlight = false;
  int32_t decodeSteps = 0;  ///< decode steps (verification rounds) the sequence took part in
  /// The sequence was preempted here and went back to the waiting queue: its outcome is reported
  /// again, whole, by the entry of the run that finishes it (same tag). reason stays
  /// kNotFinished.
  bool preempted = false;
  /// -1, or the tokens it had sampled when it was last resumed (re-admitted after a preemption).
  int32_t resumedAtToken = -1;
  /// Decode steps of the run before this entry's row was seated (0 for founders).
  int64_t seatedAtRunStep = 0;
};

struct RequestOutcome {
  bool admitted = false;  ///< false: the backend refused the founding batch (no capacity)
  bool failed = false;    ///< a lifecycle call returned false (request failed / poisoned)
  std::vector<SequenceOutcome> sequences;  ///< founders, then joiners, in admission order
  int64_t decodeSteps = 0;
  /// Preempted sequences still waiting when the run ended, first in line first: the caller runs
  /// them again (first in its queue, same salt and adapter).
  std::vector<EngineSequence> preempted{};
};

/// Cumulative figures of an engine.
namespace oracle {
class OracleStepper;
class StreamMarks;
}  // namespace oracle

struct EngineStats {
  int64_t requests = 0;
  int64_t sequences = 0;
  int64_t promptTokens = 0;
  int64_t reusedTokens = 0;
  int64_t prefillTokensComputed = 0;
  int64_t decodeSteps = 0;
  int64_t generatedTokens = 0;
  int64_t joins = 0;
  int64_t joinRefusals = 0;
  int64_t oracleChecks = 0;      ///< positions verified
  int64_t oracleMismatches = 0;  ///< positions with wrong bytes
  std::string firstMismatch;
  int64_t lengthChecks = 0;     ///< device KV-length rows verified
  int64_t recurrentChecks = 0;  ///< recurrent states verified (checkpoint deployments)
  /// Of oracleMismatches: recurrent states with a wrong byte (one per verified execution).
  int64_t recurrentMismatches = 0;
  /// Max pages not free of the pool the backend manages: the full pool (context reuse, full
  /// storage, sliding-window reuse) or the SWA pool (bounded SWA).
  int64_t peakPagesInUse = 0;
  /// Bounded SWA and sliding-window reuse: the most SWA pages the running windows hold per row of
  /// the batch at a decode step (right after prepareDecodeStep, pages leaving the window still
  /// held), rounded up; with one row, the pages one decoding sequence holds. 0 elsewhere.
  int64_t peakSwaPagesPerDecodingRow = 0;
  /// The same right after a prefill's prepareSwaPrefill (sliding-window reuse: the reused window
  /// and every executed prompt page; bounded SWA: 2M + 1).
  int64_t peakSwaPagesPerPrefillRow = 0;
  /// Sliding-window reuse: max sliding pages not free (held by windows or caching blocks).
  int64_t peakSwaPagesInUse = 0;
  std::vector<int64_t> stepHostNanoseconds;  ///< library time per decode step (facade calls)
  /// GPU pools only: stream time of the library's work per decode step, measured with CUDA
  /// events recorded right before and after prepareDecodeStep and completeDecodeStep (the
  /// engine's own write and verify launches are outside). Empty with CPU pools.
  std::vector<int64_t> stepGpuNanoseconds;
  // Speculative decoding (ReferenceEngineOptions::speculativeWidth > 0); every decode step is a
  // verification round.
  int64_t speculativeRounds = 0;      ///< rows x rounds: one per running row and round
  int64_t proposedTokens = 0;         ///< draft tokens proposed (K per running row and round)
  int64_t acceptedTokens = 0;         ///< of them accepted by the base and committed
  int64_t draftReusedTokens = 0;      ///< draft KV positions taken from the cache (paired paths)
  int64_t peakDraftPagesInUse = 0;    ///< max draft pages not free (speculative deployments)
  int64_t draftOracleChecks = 0;      ///< of oracleChecks, draft KV positions
  int64_t draftOracleMismatches = 0;  ///< of oracleMismatches, draft KV positions
  // Hybrid-MTP (speculative decoding on a model with recurrent layers).
  int64_t hiddenRestores = 0;   ///< restoreHybridMtpBoundaryHidden calls (prefills from a hit)
  int64_t hiddenEndpoints = 0;  ///< publishHybridMtpEndpoint calls (one per prefill)
  /// Reuse points the prefills wrote into the snapshot slots the library named
  /// (ManagedKVCacheRequest::reusePointCaptures).
  int64_t reusePointsWritten = 0;
  // Chunked prefill (ReferenceEngineOptions::maxBatchedTokens > 0).
  int64_t prefillChunks = 0;    ///< prefill chunks executed for joiners and held founders
  int64_t chunkedPrefills = 0;  ///< sequences whose prefill took more than one chunk
  int64_t heldFounders = 0;     ///< founders whose prefill step ran only a first chunk
  /// Per joiner and per founder whose prefill went on in chunks: decode steps from its admission
  /// (a founder's: the request's prefill) to the step of its last chunk (0: its whole prompt in
  /// its first step).
  std::vector<int32_t> timeToFirstTokenSteps;
  /// Per sampled token after a sequence's first: decode steps since its previous token (1 for a
  /// row that decodes every step; more after a preemption; 0 for the second and later tokens a
  /// verification round commits).
  std::vector<int32_t> timeBetweenTokensSteps{};
  // Preemption (ReferenceEngineOptions::preemption).
  int64_t preemptions = 0;  ///< sequences preempted (a sequence preempted twice counts twice)
  int64_t resumed = 0;      ///< preempted sequences admitted again
  /// Prompt tokens of the resumptions, and of them those reused: a resumption is not counted in
  /// promptTokens / reusedTokens / prefillTokensComputed (those count first admissions).
  int64_t resumedPromptTokens = 0;
  int64_t resumedReusedTokens = 0;
  /// Of resumedPromptTokens, those the sequences had generated before their preemptions (what a
  /// commit policy that keeps the prompt only never lets a resumption reuse).
  int64_t resumedGeneratedTokens = 0;
  /// Of resumedReusedTokens, those the host tier held (onboarded; ContextCacheMetrics::
  /// hostTierHitTokens of the resumptions' admissions).
  int64_t resumedHostTierTokens = 0;
  int64_t hiddenChecks = 0;  ///< restored boundary hidden rows verified
  /// Of oracleMismatches: restored boundary hidden rows with a wrong byte.
  int64_t hiddenMismatches = 0;
};

/// Drives requests through a KVCacheRuntime. Executes no model: for every executed position it
/// writes KV bytes that are a function of the whole prefix (the KvOracle's bytes), then checks
/// what the attention of that step would read: all positions of full layers, the last W of
/// sliding ones. Also checks the device KV-length tensor after every execution. On checkpoint
/// deployments (hybrid models with context reuse) it also writes each execution's recurrent
/// state (the RecurrentOracle's bytes) and, before every execution, checks that the row holds
/// the state of exactly the positions it resumes from (zero for a fresh sequence, the restored
/// checkpoint after reuse).
///
/// Speculative decoding (speculativeWidth K > 0, EAGLE-style or MTP draft on an attention-only
/// model): the draft's KV row at position p depends on the prefix up to p + 1 (the token after
/// it), so its bytes are the KvOracle's bytes of a digest distinct from the base row's at p + 1
/// (draftRowDigest); the engine writes them through the draft page table and checks them as it
/// checks the base. The prefill writes the base rows from the reuse point; the draft
/// initialisation writes draft rows [reuse, prompt) once the lookahead token is sampled (the
/// reused draft rows are checked first). A round with base length m (lookahead at m) and draft
/// length D: the draft writes rows [D, m + K - 1) with its proposals d1..dK as the following
/// tokens, the base writes positions [m, m + K] (lookahead, d1..dK); a (0..K, from the seed and
/// the prefix) proposals are accepted, the others differ from the base's tokens, and the rows
/// commit the accepted ones plus the base's bonus token (fewer when the sequence finishes
/// first). Base length becomes m + n, draft length min(m + K - 1, m + a, m + n), and that is
/// the common length the round passes to completeDecodeStep. Rejected positions are written
/// (as an engine writes them) but never verified.
///
/// Hybrid-MTP (speculativeWidth K > 0 on a model with recurrent layers and context reuse; a
/// paged draft, requests committing their prefill state only): the engine owns a boundary hidden
/// row per execution row [maxBatch, boundaryHiddenWidth], whose bytes for a prefix are the
/// oracle's row of a row-seed of their own (oracle_step.h, kOracleHiddenHalf). A row's prefill
/// from a hit of R tokens restores the checkpoint's row into its row
/// (restoreHybridMtpBoundaryHidden) and checks it
/// holds the row of the R-token prefix (the base hidden state at token R - 1, which the MTP
/// head combines with token R); the draft resumes at R - 1 (its reused rows [0, R - 1) are
/// checked). The prefill then writes the row of the whole prompt (length L) and publishes the
/// endpoint at L (publishHybridMtpEndpoint, each row) before completePrefill. Rounds run the
/// recurrent layers over the committed tokens (the state is checked as after m tokens, then
/// written as after m + n).
///
/// Works at engine speed on either device: an engine step (the founding batch's prefill, one
/// joiner's prefill, one decode step of the whole batch) stages its digests and ranges in a
/// buffer allocated at construction, uploads them with one copy, writes every layer's K and V
/// of the step in one launch and verifies every position the step reads in one launch; the
/// findings come back with one copy and one wait on the runtime's stream, the step's
/// completion point. CPU pools run bit-identical host twins of the kernels, so both devices
/// produce the same figures. Mismatches are counted and described as the oracles describe
/// them; with throwOnMismatch the step's first one throws once the step completes.
class ReferenceEngine {
 public:
  explicit ReferenceEngine(KVCacheRuntime& runtime, ReferenceEngineOptions options = {});
  ~ReferenceEngine();
  ReferenceEngine(ReferenceEngine const&) = delete;
  ReferenceEngine& operator=(ReferenceEngine const&) = delete;

  /// Runs `request` to completion. While it runs, sequences from `joinQueue` (front first) join
  /// the batch through in-flight admission whenever a row and the pools allow it and the backend
  /// supports it; joiners inherit the request's salt, LoRA and policies. Joined sequences are
  /// popped from the queue; the others stay.
  RequestOutcome run(EngineRequest const& request, std::deque<EngineSequence>* joinQueue = nullptr);

  EngineStats const& stats() const noexcept { return mStats; }
  /// Pages currently not free in every pool of the runtime (leased or cached).
  int64_t pagesInUse() const;
  /// The deterministic token the engine samples after a prefix with this digest.
  int32_t sampleToken(uint64_t prefixDigest) const;
  int32_t endOfSequenceToken() const noexcept { return kEndOfSequence; }

  static constexpr int32_t kEndOfSequence = 2;
  /// Largest ReferenceEngineOptions::speculativeWidth.
  static constexpr int32_t kMaxSpeculativeWidth = 64;

 private:
  struct Row;
  struct Run;

  uint64_t identitySeed(EngineRequest const& request) const;
  std::vector<uint64_t> positionKeys(EngineSequence const& sequence,
                                     std::vector<int32_t> const& mediaTokenIds) const;
  // run's phases, in order (each takes the request's state).
  /// Acquires a resident slot per founding sequence and seeds its row and outcome; throws (with
  /// every slot given back) when the batch exceeds the slots.
  void acquireResidents(Run& run);
  /// Gives back every row's resident slot and drops the rows.
  void releaseAll(Run& run);
  /// Fills run.generation and run.context from the request and its founding rows.
  void buildContext(Run& run);
  /// ManagedKVCacheRequest::begin; false (slots given back, outcome not admitted) when refused.
  bool beginRequest(Run& run);
  /// The founding batch's prefill (prepare, Hybrid-MTP restore, then prefillStep); false on
  /// failure.
  bool prefill(Run& run);
  /// The prefill step: writes, captures and lookahead tokens, then completePrefill.
  bool prefillStep(Run& run);
  /// Whether the founders' prefill takes the token budget too (maxBatchedTokens, on every backend,
  /// for requests that take joiners): a founder it does not cover holds and goes on in chunks.
  bool chunksFounders() const;
  /// Decode steps with compaction and joins until no row is left or a call fails (false).
  bool decodeLoop(Run& run);
  /// Compacts finished rows out of the batch (with a length step); false when compaction fails.
  bool compactFinished(Run& run);
  /// Admits queued sequences while slots and pools allow; false when an admission fails.
  bool tryJoins(Run& run);
  /// After a joiner's admission when it prefills whole (no token budget): preparePrefillChunk to
  /// its prompt's end; when that fails the joiner is retracted (false; lastFailure() says why).
  bool prepareWholePrefill(Run& run, EngineSequence const& spec, int32_t prefillStart);
  /// Seats the admitted front of `queue` (the join queue, or the preempted sequences waiting
  /// before it): row, prefill, lookahead, finalize; false on failure.
  bool seatJoiner(Run& run, std::deque<EngineSequence>& queue, ResidentRef resident,
                  int32_t prefillStart);
  /// Preemption: whether every pool covers the next decode step's page growth and the pages of
  /// the chunks planChunks planned (ManagedKVCacheRequest::decodeStepDemand and
  /// prefillChunkDemand against KVCacheRuntime::capacity()).
  bool growthFits(Run const& run) const;
  /// The pages the next step takes: decodeStepDemand and the prefillChunkDemand of every chunk
  /// planChunks planned.
  DecodeStepDemand stepDemand(Run const& run) const;
  /// Pages per chunk: whether the pools can give the first chunk of `spec` (what the step's
  /// `budget` leaves it past its reusable prefix; its whole prompt without a budget) beside the
  /// step's own demand and the reclaimable pages its admission would pin (estimateAdmission) —
  /// vLLM schedules a waiting request only when its first chunk's slots can be allocated.
  bool firstChunkFits(Run const& run, EngineSequence const& spec, int64_t budget) const;
  /// Preemption before a decode step: preempts the newest running rows while the step's growth
  /// does not fit and another row runs; false when a library call fails.
  bool preemptForGrowth(Run& run);
  /// Preempts row `index` (preemptSequence unless it is an unfinalised joiner) and compacts it
  /// away; the sequence waits first in line (Run::preempted). False when a call fails.
  bool preemptRow(Run& run, std::size_t index);
  /// The context-reuse coordinator's ContextCacheMetrics::hostTierHitTokens (0 without one).
  int64_t hostTierHitTokens() const;
  /// A seated row's decode figures carried over from before a preemption (EngineResume).
  static void resumeRow(Row& row);
  /// The sequence a preempted row resumes as: its sampled tokens appended to its prompt.
  EngineSequence resumeOf(Run const& run, std::size_t index) const;
  /// Cancels rows whose cancelAtStep is due; true while a row still runs.
  bool cancelDue(Run& run);
  /// One decode step of the running rows; false (after the step's checks) when a call fails.
  bool decodeStep(Run& run);
  /// Stages row `i`'s decode step (a verification round when speculative).
  void stageDecodeRow(Run& run, std::size_t i);
  /// Appends the step's tokens of the first `batch` running rows (and counts their step).
  void collectTokens(Run& run, std::size_t batch);
  /// Appends `token` to row `index` and sets its finish reason; `step` is the decode step count
  /// at which the token is sampled (time between tokens).
  void appendToken(Run& run, Row& row, std::size_t index, int32_t token, int64_t step);
  /// Samples and appends the token after row's materialized prefix, between decode steps.
  void sampleAfter(Run& run, Row& row, std::size_t index);
  /// Settles every row's outcome, finishes the managed request and gives back the slots.
  RequestOutcome finishRun(Run& run, bool ok);
  /// The whole prompt of row `index` from `start` in one step: startPrefill, one chunk,
  /// finishPrefill.
  void executePrefill(Run& run, std::size_t index, int32_t start);
  /// A row's prefill from `start` (its reuse length) begins: its prompt digests.
  void startPrefill(Run& run, Row& row, int32_t start);
  /// Writes prompt positions [materialized, end) of a prefilling row into this step's plan (the
  /// first chunk checks the reused prefix and window first) and advances its recurrent state.
  void executePrefillChunk(Row& row, int32_t end);
  /// After the last chunk of row `index`: its Hybrid-MTP hidden row (mHidden's row of its
  /// resident slot), the prefill's figures, the attention check of the whole prompt, the draft's
  /// prefill.
  void finishPrefill(Run& run, std::size_t index);
  /// Hybrid-MTP: row `index`'s hit's boundary hidden row into mHidden's row of its resident slot
  /// (true without a hit or off Hybrid-MTP); false as the call returns it.
  bool restoreBoundaryHidden(Run& run, std::size_t index);
  /// Hybrid-MTP: row `index`'s whole-prompt endpoint, after the step that finished its prefill
  /// and before its finalisation (true off Hybrid-MTP); false as the call returns it.
  bool publishEndpoint(Run& run, std::size_t index);
  /// Chunked prefill: plans this step's chunks of the prefilling joiners (Row::chunkEnd), within
  /// the token budget left after the decode rows (vLLM's order).
  void planChunks(Run& run) const;
  /// Before the step's prepareDecodeStep: makes each planned chunk ready with
  /// preparePrefillChunk. False when a call failed.
  bool prepareChunks(Run& run);
  /// Runs the chunks prepareChunks planned.
  void stagePrefillChunks(Run& run);
  /// After the step: each chunk completed (completePrefillChunk), or, after a joiner's last,
  /// its lookahead token sampled and the joiner finalised. False when a call failed.
  bool completeChunks(Run& run);
  /// Writes the state after each reuse point of execution row `index` in (`from`, `to`] (the
  /// positions the prefill or chunk that ran [`from`, `to`) passed) into its snapshot slot.
  void captureReusePoints(Run const& run, ExecutionRow index, int32_t from, int32_t to);
  void verifyRow(Run& run, Row& row, bool full);
  /// Verifies positions [begin, stop) of `slot` in `pool`: all of them when `full` or
  /// VerifyMode::kAll, else the last one and two drawn at random.
  void verifyRange(int32_t pool, int32_t slot, int32_t begin, int32_t stop, bool full);
  /// Snapshots the device KV-length rows (checked by finishStep).
  void checkLengths(Run& run);
  /// KVCacheRuntime::flushDeviceWrites, timed as library time: what an engine calls before the
  /// launches of a step that read the tables and lengths (a no-op with kEachCall).
  void flushWrites(Run& run);
  /// The step's completion point: collects and reports its findings.
  void finishStep(Run& run);
  /// A step that only checks the KV lengths (after a compaction).
  void lengthStep(Run& run);
  /// Writes the KV length of the rows in [first, last) that `include` selects, one call per
  /// contiguous run and pool.
  template <typename Include>
  void writeLengths(Run& run, std::size_t first, std::size_t last, Include include);
  /// Recurrent state: verify the row resumes from `from` tokens, then write the state after `to`.
  void executeRecurrent(Row& row, int32_t from, int32_t to);
  void notePages();
  /// Decode steps: notePages and, on bounded SWA, peakSwaPagesPerDecodingRow (over the rows
  /// past their prefill).
  void noteDecodePages(Run const& run);
  /// SWA pages the running windows hold per row of the batch, rounded up (0 without SWA rows).
  /// `prefillingJoiners` rows are left out, with the 2M + 1 pages each holds on bounded SWA.
  int64_t swaPagesPerRow(int64_t prefillingJoiners = 0) const;
  void report(std::string const& what);
  // Speculative decoding (reference_engine_speculative.cpp).
  bool pairsDraft() const noexcept;
  uint64_t draftRowDigest(uint64_t nextPrefixDigest) const noexcept;
  /// The draft initialisation after the prefill: draft rows [start, prompt) of `row`.
  void executeDraftPrefill(Row& row, int32_t start);
  /// One verification round of `row` (decode step); stages its tokens in row.pendingTokens.
  void executeRound(Row& row, std::vector<int32_t> const& generated);
  /// executeRound's proposals: fills row.pendingTokens with the tokens the round commits, extends
  /// row.digests over the proposed prefix and returns how many proposals the base accepts.
  int32_t proposeRound(Row& row, std::vector<int32_t> const& generated);
  /// executeRound's draft half: the draft catches up and runs its proposal steps (a draft reading
  /// the base KV only follows the base); `committed` tokens are committed this round.
  void runDraftSteps(Row& row, int32_t accepted, int32_t committed);
  void verifyDraft(Row& row, int32_t begin, int32_t end, bool full);
  /// mCommonLengths: each row's common base-and-draft length (speculative), else empty.
  void commonLengths(Run& run, bool speculative);

  KVCacheRuntime& mRuntime;
  ReferenceEngineOptions mOptions;
  std::unique_ptr<oracle::OracleStepper> mSteps;
  std::unique_ptr<oracle::StreamMarks> mMarks;
  bool mHasFull = false;
  bool mHasSwa = false;
  bool mRecurrent = false;
  bool mHybridMtp = false;  // speculative on a Hybrid-MTP deployment
  int32_t mSpecWidth = 0;
  PreemptionKind mPreemptionKind = PreemptionKind::kRecompute;  // what preemptRow asks for
  // Joiners take their pages per chunk (ContextCacheConfig::joinerPages on a coordinator
  // backend): a waiting sequence joins only when its first chunk fits (firstChunkFits).
  bool mPagesPerChunk = false;
  Tensor mHidden;  // Hybrid-MTP: a boundary hidden row per resident slot [maxBatch, width]
  std::vector<int32_t> mLengthValues;
  std::vector<int32_t> mDraftLengthValues;
  std::vector<uint64_t> mDraftDigests;  // scratch: the draft rows' digests of one execution
  std::vector<int32_t> mCommonLengths;  // scratch: what completePrefill / completeDecodeStep get
  Tensor mDeviceMapping;
  EngineStats mStats;
  uint64_t mRandom;
};

}  // namespace mkv::testing
