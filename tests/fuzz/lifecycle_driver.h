#pragma once
/// \file lifecycle_driver.h
/// A lifecycle fuzzer driven by a byte string. The bytes choose a runtime (context reuse, full
/// storage or bounded SWA, hybrid checkpoint reuse, EAGLE-style speculative reuse or
/// Hybrid-MTP, small pools on the CPU), then a sequence of operations: requests
/// begun through ManagedKVCacheRequest or directly on the ContextCacheCoordinator /
/// BoundedSwaKVPageManager, their lifecycle steps, in-flight joins, compactions, drops,
/// injected synchronisation failures, shutdowns, and invalid calls of every kind (wrong order,
/// bad sizes, stale residents and handles, bad mappings, oversized prompts, calls the backend
/// does not offer). After every operation the driver checks:
///
/// * an invalid call threw mkv::Error and left the observable state unchanged (page tables,
///   device mirrors, KV lengths, KV bytes, pools, refcounts, records, request states);
/// * a valid call did not throw, and its status is the documented one for what happened
///   (synchronisation failures, capacity, poison);
/// * page conservation per pool, refcounts against leases and records, records against the
///   block index, page-table invariants, no page live twice within one row (dense rows of the
///   coordinator as well as sparse SWA rows), cleared rows of unbound residents;
/// * the KV oracle on every live sequence and on every quarantined one (whose pages must not
///   be reused), and the device KV lengths of the executing batch.
///
/// At the end it finishes everything, shuts the backend down and checks that every page is
/// back. The same driver serves the seeded gtest (lifecycle_fuzz_test.cpp), the fault
/// injection test and the libFuzzer target (lifecycle_fuzzer.cpp). docs/reliability.md.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mkv::fuzz {

/// Synchronisation faults injected on top of the ones the input asks for.
struct SyncFaultPlan {
  int64_t failAt = 0;       ///< the failAt-th synchronisation (1-based) fails; 0 = none
  bool persistent = false;  ///< every synchronisation from failAt on fails, until teardown
};

struct LifecycleOptions {
  SyncFaultPlan syncFaults;
  /// Honour the input's "fail the next synchronisation" operations.
  bool inputFaults = true;
  /// Stop after this many operations even when input is left.
  int64_t maxOperations = int64_t{1} << 40;
  /// Print one line per operation to stderr.
  bool trace = false;
};

/// What a run exercised (summed over runs by the tests).
struct LifecycleStats {
  int64_t operations = 0;
  int64_t libraryCalls = 0;
  int64_t rejectedCalls = 0;  ///< invalid calls that threw mkv::Error and changed nothing
  int64_t refusals = 0;       ///< nullopt / kRequestFailed / kNoCapacity / false outcomes
  int64_t requests = 0;       ///< admitted requests
  int64_t prefills = 0;
  int64_t decodeSteps = 0;
  int64_t compactions = 0;
  int64_t joins = 0;
  int64_t retractions = 0;
  int64_t drops = 0;  ///< requests abandoned by destroying their handle
  int64_t failedSynchronizations = 0;
  int64_t quarantines = 0;  ///< requests that went to quarantine
  int64_t shutdowns = 0;
  int64_t cacheResets = 0;        ///< successful resetPrefixCache calls (context-reuse backends)
  int64_t cacheResetRecords = 0;  ///< records those resets dropped
  int64_t badAllocs = 0;          ///< library calls that threw std::bad_alloc (allocation faults)
  int64_t oraclePositions = 0;    ///< KV positions verified
  // The runtimes with a recurrent or a draft model (hybrid checkpoints, speculative, Hybrid-MTP).
  int64_t hybridLifecycles = 0;       ///< lifecycles on a hybrid checkpoint runtime
  int64_t speculativeLifecycles = 0;  ///< lifecycles on a speculative (EAGLE-style) runtime
  int64_t mtpLifecycles = 0;          ///< lifecycles on a Hybrid-MTP runtime
  int64_t recurrentChecks = 0;        ///< recurrent rows verified against the prefix they hold
  int64_t checkpointsRestored = 0;    ///< rows that resumed from a checkpoint, verified
  int64_t checkpointsPublished = 0;   ///< checkpoints committed (prefill and decode end)
  int64_t checkpointSlabChecks = 0;   ///< checkpoint records whose slabs were compared
  int64_t snapshotPressureSkips = 0;  ///< captures skipped for want of a snapshot slot
  int64_t prefillChunks = 0;  ///< chunks of joiners' prefills completed (completePrefillChunk)
  /// Founders whose first chunk completed in the prefill and who went on as joiners.
  int64_t heldFounders = 0;
  int64_t preemptions = 0;            ///< rows preempted (preemptSequence accepted)
  int64_t checkpointPreemptions = 0;  ///< of them, on a checkpoint runtime, their state captured
  /// Preemptions whose capture's synchronisation failed (the request quarantined).
  int64_t checkpointPreemptionQuarantines = 0;
  /// Joiners' chunks whose pages preparePrefillChunk allocated (JoinerPageAllocation::kPerChunk),
  /// and chunks it refused for capacity (the model said they did not fit; nothing changed).
  int64_t chunkPagePrepares = 0;
  int64_t chunkPageRefusals = 0;
  int64_t reusePointsWritten = 0;    ///< reuse points the engine captured into named slots
  int64_t reusePointsRestored = 0;   ///< rows that resumed from a reuse point, verified
  int64_t draftOraclePositions = 0;  ///< draft KV positions verified
  int64_t pairedReuses = 0;          ///< speculative rows that resumed on reused base + draft KV
  int64_t pairedJoins = 0;  ///< joiners of speculative requests with a paged draft (draft rows)
  int64_t verificationRounds = 0;      ///< speculative decode steps completed
  int64_t acceptedTokens = 0;          ///< tokens accepted by those rounds
  int64_t mtpEndpoints = 0;            ///< Hybrid-MTP endpoints committed
  int64_t mtpBatchEndpoints = 0;       ///< of them, by a row of a request of several rows
  int64_t mtpJoinerEndpoints = 0;      ///< of them, joiners' endpoints
  int64_t boundaryHiddenRestores = 0;  ///< boundary hidden rows restored and verified
  // Sliding-window reuse and engine-step device writes.
  int64_t slidingReuseLifecycles = 0;  ///< lifecycles on a sliding-window reuse runtime
  int64_t slidingWindowReuses = 0;     ///< sliding-reuse rows resumed on a reused window, verified
  int64_t engineStepLifecycles = 0;    ///< lifecycles with DeviceWriteTiming::kEngineStep
  int64_t deviceFlushes = 0;           ///< the engine's flushDeviceWrites() calls
  int64_t forgottenFlushes = 0;        ///< completions refused because the step's flush was missing
  // Bounded SWA's joiners (in-flight admission without a cache, chunked prefill).
  int64_t swaJoins = 0;          ///< joiners admitted (2M + 1 pages each)
  int64_t swaChunksRun = 0;      ///< their prefill chunks the engine ran (window checked first)
  int64_t swaStepChunks = 0;     ///< of which within a decode step of the batch
  int64_t swaPrefillChunks = 0;  ///< chunks completed (the window rotated)
  int64_t swaFinalizations = 0;  ///< joiners finalised (trimmed to M + 1 pages)
  int64_t swaRetractions = 0;    ///< joiners retracted (2M + 1 pages back)
  int64_t swaHeldFounders = 0;   ///< founders whose first chunk ran in the prefill (held)
  /// Operations per runtime kind (tests/fuzz/lifecycle/lifecycle.h, Runtime; kRuntimeNames).
  int64_t runtimeOperations[7] = {};
  int64_t engineStepOperations = 0;  ///< operations of engine-step lifecycles

  LifecycleStats& operator+=(LifecycleStats const& other);
};

/// The runtime kinds of LifecycleStats::runtimeOperations, in its order.
inline constexpr char const* kRuntimeNames[7] = {
    "context reuse", "bounded SWA", "full storage",         "hybrid checkpoints",
    "speculative",   "Hybrid-MTP",  "sliding-window reuse",
};

struct LifecycleResult {
  bool ok = true;
  std::string failure;  ///< the first violated property and the last operations
  LifecycleStats stats;
};

/// The input of seed `seed`: `bytes` bytes of std::mt19937_64(seed). The seeded gtest, the
/// allocation fault test and `mkv_lifecycle_replay --seeds` run these inputs.
std::vector<uint8_t> seededInput(uint64_t seed, std::size_t bytes);

/// Rewrites the set-up bytes of `input` (at least three bytes) so that it runs runtime kind
/// `kind` (an index of kRuntimeNames), keeping what else those bytes choose: the runtime byte, and
/// for bounded SWA and sliding-window reuse the full-layer byte's bits 0 and 3.
void forceRuntime(std::vector<uint8_t>& input, int32_t kind);
/// Sets (or clears) the first byte's bits 6 and 7, which select engine-step device writes.
void forceEngineStep(std::vector<uint8_t>& input, bool engineStep);

/// Runs one lifecycle. Never throws; a violated property is reported in the result.
LifecycleResult runLifecycle(std::span<uint8_t const> data, LifecycleOptions const& options = {});

}  // namespace mkv::fuzz
