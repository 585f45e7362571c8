/// \file lifecycle_driver.cpp
/// runLifecycle and the seeded inputs (lifecycle_driver.h); the driver itself is
/// tests/fuzz/lifecycle/ (lifecycle.h describes its structure).

#include "fuzz/lifecycle_driver.h"

#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <iterator>
#include <memory>
#include <random>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/logging.h"

namespace mkv::fuzz {

LifecycleStats& LifecycleStats::operator+=(LifecycleStats const& other) {
  operations += other.operations;
  libraryCalls += other.libraryCalls;
  rejectedCalls += other.rejectedCalls;
  refusals += other.refusals;
  requests += other.requests;
  prefills += other.prefills;
  decodeSteps += other.decodeSteps;
  compactions += other.compactions;
  joins += other.joins;
  retractions += other.retractions;
  drops += other.drops;
  failedSynchronizations += other.failedSynchronizations;
  quarantines += other.quarantines;
  shutdowns += other.shutdowns;
  cacheResets += other.cacheResets;
  cacheResetRecords += other.cacheResetRecords;
  badAllocs += other.badAllocs;
  oraclePositions += other.oraclePositions;
  hybridLifecycles += other.hybridLifecycles;
  speculativeLifecycles += other.speculativeLifecycles;
  mtpLifecycles += other.mtpLifecycles;
  recurrentChecks += other.recurrentChecks;
  checkpointsRestored += other.checkpointsRestored;
  checkpointsPublished += other.checkpointsPublished;
  checkpointSlabChecks += other.checkpointSlabChecks;
  snapshotPressureSkips += other.snapshotPressureSkips;
  prefillChunks += other.prefillChunks;
  heldFounders += other.heldFounders;
  preemptions += other.preemptions;
  checkpointPreemptions += other.checkpointPreemptions;
  checkpointPreemptionQuarantines += other.checkpointPreemptionQuarantines;
  reusePointsWritten += other.reusePointsWritten;
  reusePointsRestored += other.reusePointsRestored;
  draftOraclePositions += other.draftOraclePositions;
  pairedReuses += other.pairedReuses;
  pairedJoins += other.pairedJoins;
  chunkPagePrepares += other.chunkPagePrepares;
  chunkPageRefusals += other.chunkPageRefusals;
  verificationRounds += other.verificationRounds;
  acceptedTokens += other.acceptedTokens;
  mtpEndpoints += other.mtpEndpoints;
  mtpBatchEndpoints += other.mtpBatchEndpoints;
  mtpJoinerEndpoints += other.mtpJoinerEndpoints;
  boundaryHiddenRestores += other.boundaryHiddenRestores;
  slidingReuseLifecycles += other.slidingReuseLifecycles;
  slidingWindowReuses += other.slidingWindowReuses;
  engineStepLifecycles += other.engineStepLifecycles;
  deviceFlushes += other.deviceFlushes;
  forgottenFlushes += other.forgottenFlushes;
  swaJoins += other.swaJoins;
  swaChunksRun += other.swaChunksRun;
  swaStepChunks += other.swaStepChunks;
  swaPrefillChunks += other.swaPrefillChunks;
  swaHeldFounders += other.swaHeldFounders;
  swaFinalizations += other.swaFinalizations;
  swaRetractions += other.swaRetractions;
  for (std::size_t i = 0; i < std::size(runtimeOperations); ++i) {
    runtimeOperations[i] += other.runtimeOperations[i];
  }
  engineStepOperations += other.engineStepOperations;
  return *this;
}

namespace {

/// Library log lines go nowhere while a lifecycle runs (refusals are logged by design).
class QuietLogger {
 public:
  QuietLogger() {
    auto sink = std::make_shared<spdlog::sinks::null_sink_st>();
    auto quiet = std::make_shared<spdlog::logger>("managedkv-fuzz", sink);
    quiet->set_level(spdlog::level::warn);  // format what the library would log
    setLogger(std::move(quiet));
  }
  ~QuietLogger() { setLogger(nullptr); }
  QuietLogger(QuietLogger const&) = delete;
  QuietLogger& operator=(QuietLogger const&) = delete;
};

}  // namespace

std::vector<uint8_t> seededInput(uint64_t seed, std::size_t bytes) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> input(bytes);
  for (uint8_t& byte : input) {
    byte = static_cast<uint8_t>(rng());
  }
  return input;
}

void forceRuntime(std::vector<uint8_t>& input, int32_t kind) {
  if (kind < 3) {  // context reuse, bounded SWA, full storage: byte % 3 below 0xC0
    input.at(1) = static_cast<uint8_t>(3 * (input.at(1) % 64) + kind);
    input.at(2) = kind == 1 ? static_cast<uint8_t>(input.at(2) & ~0x08) : input.at(2);
  } else if (kind < 6) {  // 0xC0 + k picks runtime 3 + k % 3
    input.at(1) = static_cast<uint8_t>(0xC0 + (kind - 3) + 3 * (input.at(1) % 21));
  } else {  // sliding-window reuse: bounded SWA's byte, bits 0 and 3 of the next one
    input.at(1) = static_cast<uint8_t>(3 * (input.at(1) % 64) + 1);
    input.at(2) = static_cast<uint8_t>(input.at(2) | 0x09);
  }
}

void forceEngineStep(std::vector<uint8_t>& input, bool engineStep) {
  input.at(0) = engineStep ? static_cast<uint8_t>(input.at(0) | 0xC0)
                           : static_cast<uint8_t>(input.at(0) & 0x3F);
}

LifecycleResult runLifecycle(std::span<uint8_t const> data, LifecycleOptions const& options) {
  QuietLogger const quiet;
  lifecycle::Lifecycle run(data, options);
  return run.run();
}

}  // namespace mkv::fuzz
