#pragma once
/// \file runtime_test_rig.h
/// Shared pieces of the runtime suites: the (backend, device) parameter of TEST_P suites, small
/// KVCacheRuntime configurations for both backends on either device, a stream synchroniser whose
/// calls can be made to fail (the fault model: docs/errors.md, "Poison and quarantine"), observers
/// of the backend's pages and tables, and FacadeDriver, which runs one request through
/// ManagedKVCacheRequest call by call as an engine would, writing KV for every executed position
/// and checking with the KV oracle what attention reads.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/stream.h"
#include "mkv/testing/kv_oracle.h"
#include "support/fault_arming.h"
#include "support/token_runs.h"

namespace mkv::runtime_test {

inline constexpr DecodingKvHeadroom kVanilla{1, 0};
inline constexpr int32_t kPageTokens = 16;
inline constexpr int32_t kWindowTokens = 24;  ///< SWA runtime: M = ceil(24 / 16) + 1 = 3

/// The backends a runtime can hand to ManagedKVCacheRequest::begin: context reuse alone, bounded
/// SWA alone, and both composed (sliding layers with context reuse).
enum class Backend : uint8_t { kContextReuse, kBoundedSwa, kSlidingWindowReuse };
std::string backendName(::testing::TestParamInfo<Backend> const& info);
void PrintTo(Backend backend, std::ostream* out);

/// Skips the calling test (GTEST_SKIP) on kGPU without a CUDA device or in a build without CUDA.
/// A macro: GTEST_SKIP returns from the function that expands it.
#define MKV_SKIP_WITHOUT_DEVICE(device)                                         \
  do {                                                                          \
    if ((device) == ::mkv::DeviceType::kGPU && !::mkv::cudaDeviceAvailable()) { \
      GTEST_SKIP() << "no CUDA device (or a build without CUDA)";               \
    }                                                                           \
  } while (false)

/// Parameter of the suites that run on both backends and both devices.
struct RuntimeCase {
  Backend backend;
  DeviceType device;
};
void PrintTo(RuntimeCase const& runtimeCase, std::ostream* out);
/// "reuse_cpu", "swa_gpu", ...
std::string runtimeCaseName(::testing::TestParamInfo<RuntimeCase> const& info);
/// Context reuse and bounded SWA on every device (for ::testing::ValuesIn): the suites whose
/// expected messages name one backend's checks.
std::vector<RuntimeCase> allRuntimeCases();
/// allRuntimeCases plus the composed backend on every device: the suites that hold for any
/// backend (the fault model, compaction).
std::vector<RuntimeCase> everyBackendCase();

/// Fixture base of TEST_P suites over RuntimeCase; the kGPU cases skip without a CUDA device.
class RuntimeCaseTest : public ::testing::TestWithParam<RuntimeCase> {
 protected:
  void SetUp() override { MKV_SKIP_WITHOUT_DEVICE(device()); }
  Backend backend() const { return GetParam().backend; }
  DeviceType device() const { return GetParam().device; }
  bool reuse() const { return backend() != Backend::kBoundedSwa; }
};

/// Runtimes with 4 resident rows, pages of 16 tokens and 8-byte token rows, on `device`.
/// kContextReuse: 2 full-attention layers, 64 pages (16 a row). kBoundedSwa: a Gemma-style model,
/// 1 full layer (identity-mapped) and 1 sliding layer with W = 24 in 4 x (2M + 1) = 28 pages.
/// kSlidingWindowReuse: the same two layers with reuse on, 64 pages in each pool.
KVCacheRuntimeConfig configFor(Backend backend, DeviceType device);

using test::concatenated;
using test::tokenRun;

using test::FaultArming;

/// What a rejected call must leave exactly as it was: the observable state of the runtime and
/// its backend, compared field by field (RuntimeRig::expectUnchanged). Page tables are taken
/// twice, the host rows and the device copy read back; KV lengths of every length tensor (full,
/// SWA, draft) with their active batch.
struct BackendState {
  int32_t freePages = 0;
  int32_t heldPages = 0;
  int32_t activeRequests = 0;
  int32_t quarantinedRequests = 0;
  bool poisoned = false;
  int32_t availableResidents = 0;
  std::vector<int32_t> fullTable;     ///< every host row of the full pool's table
  std::vector<int32_t> swaTable;      ///< every host row of the SWA table (bounded SWA)
  std::vector<int32_t> draftTable;    ///< every host row of the draft table (paged draft)
  std::vector<int32_t> deviceTables;  ///< the device copies of those tables, read back
  std::vector<int32_t> kvLengths;     ///< active batch and active rows of every length tensor
  std::vector<int32_t> pageRefs;      ///< context reuse: active and cache refs of every page
  std::vector<int32_t> freeRing;      ///< context reuse: the base pool's free ring, in order
  std::vector<uint64_t> records;      ///< context reuse: record ids, LRU to MRU
  std::vector<int32_t> snapshotRefs;  ///< context reuse: active and cache refs of every
                                      ///< draft page and snapshot slot, then free counts
  /// Sliding-window reuse: the holders and the cached digest (low bits, 0 for none) of every
  /// page of the sliding pool, then its free, evictable and read-tier counts.
  std::vector<int64_t> windowPages;
  int32_t liveLeases = 0;
  int64_t synchronizations = 0;
};

/// A KVCacheRuntime whose backend synchronises through FaultArming. Declare drivers and facades
/// after the rig, so they are destroyed first.
class RuntimeRig {
 public:
  explicit RuntimeRig(KVCacheRuntimeConfig config);
  /// Drains what a failed test left quarantined (the backend's destructor would terminate).
  ~RuntimeRig();
  RuntimeRig(RuntimeRig const&) = delete;
  RuntimeRig& operator=(RuntimeRig const&) = delete;

  KVCacheRuntime& runtime() { return *mRuntime; }
  FaultArming& faults() { return mFaults; }
  bool boundedSwa() const { return mRuntime->backend() == KVCacheBackend::kBoundedSwa; }
  bool slidingReuse() const { return mRuntime->backend() == KVCacheBackend::kSlidingWindowReuse; }
  /// The backend's page pool: base KV pages (coordinator) or SWA pages.
  int32_t freePages() const;
  int32_t totalPages() const;
  /// Pages that a request holds or quarantines (neither free nor only cached by a record); with
  /// sliding-window reuse, those of both pools.
  int32_t heldPages() const;
  bool poisoned() const;
  int32_t activeRequests() const;
  BackendState observe() const;
  /// Every field of `before` still holds. `ringOrder` false compares the free ring as a set (a
  /// successful undo, such as a retraction, returns its pages to the ring's other end).
  void expectUnchanged(BackendState const& before, bool ringOrder = true) const;
  /// No request, no poison, no held page (free == total; with reuse free + cached == total and
  /// every cached page reclaimable), every row of the backend's table empty, every resident
  /// available.
  void expectIdle() const;

 private:
  FaultArming mFaults;
  std::unique_ptr<KVCacheRuntime> mRuntime;
};

/// One request driven through ManagedKVCacheRequest as an engine drives it: residents from the
/// runtime, the LLMGenerationRequest and DecodingInferenceContext, KV bytes written through the
/// oracles for every executed position, the device KV lengths, and compaction of its own view.
/// Sampled tokens are a deterministic function of the prefix.
class FacadeDriver {
 public:
  struct Row {
    std::vector<int32_t> prompt;
    ResidentRef resident;
    testing::PrefixDigests digests;  ///< prompt, then every sampled token
    int32_t prefillStart = 0;
    int32_t materialized = 0;  ///< positions with KV
    bool seated = true;        ///< false: admitted in flight, prefill not run yet
  };

  explicit FacadeDriver(RuntimeRig& rig);
  /// Drops the facade (abandoning a live request) and releases the residents.
  ~FacadeDriver();
  FacadeDriver(FacadeDriver const&) = delete;
  FacadeDriver& operator=(FacadeDriver const&) = delete;

  /// Adds a founding row on a fresh resident (before begin).
  void add(std::vector<int32_t> prompt);
  /// ManagedKVCacheRequest::begin on the runtime's backend, vanilla decoding.
  bool begin();
  /// preparePrefill, then prepareSwaPrefill with the executed lengths.
  bool preparePrefill();
  /// The engine's prefill: KV of every row from its prefill start, lengths, one lookahead token.
  void executePrefill();
  bool completePrefill();
  bool prefill();
  /// prepareDecodeStep; then the engine writes the KV of each running row's last token and
  /// samples the next one (executeDecode).
  bool prepareDecode();
  void executeDecode();
  bool completeDecode();
  bool decode();
  /// Stops a row before the next step (no token): kCancelled.
  void cancel(std::size_t row);
  /// Marks a row finished by its last sampled token (kLength).
  void finishRow(std::size_t row);
  /// beginBatchCompaction + completeBatchCompaction, then compactView on success.
  bool compact(std::vector<int32_t> const& oldToNew);
  /// The engine's view follows a completed compaction: rows mapped to -1 leave and their
  /// residents are released.
  void compactView(std::vector<int32_t> const& oldToNew);
  /// admitSequence on a fresh resident; the row joins unseated. The resident is released again
  /// unless the status is kAdmitted. `joiner` null: the overload that inherits the founder's
  /// identity (with the context's LoRA); else the overload for a joiner of its own.
  AdmitSequenceStatus admit(std::vector<int32_t> prompt,
                            LLMGenerationRequest const* joiner = nullptr);
  /// The joiner's prefill, KV length and lookahead, then finalizeSequenceAdmission.
  bool seatNewest();
  /// retractSequenceAdmission; on success the newest row leaves the view.
  bool retractNewest();
  bool finish();
  /// Destroys the facade (abandonment).
  void drop() { managed.reset(); }
  /// Oracle over every running row (all positions of full layers, the last W of sliding ones)
  /// and the device KV lengths of the batch.
  void verify() const;
  /// The sampled tokens of a row.
  std::vector<int32_t> const& generated(std::size_t row) const {
    return context.generatedTokenIds[row];
  }
  ManagedKVCacheRequest& facade() { return *managed; }

  LLMGenerationRequest request;
  DecodingInferenceContext context;
  std::vector<Row> rows;
  std::optional<ManagedKVCacheRequest> managed;
  Tensor deviceMapping;

 private:
  void executeRowPrefill(std::size_t row);
  void sample(std::size_t row);
  void writeLength(std::size_t row);
  void appendRow(std::vector<int32_t> prompt, ResidentRef resident, bool seated);
  void popRow();

  RuntimeRig& mRig;
  std::unique_ptr<testing::KvOracle> mFullOracle;
  std::unique_ptr<testing::KvOracle> mSwaOracle;
};

}  // namespace mkv::runtime_test
