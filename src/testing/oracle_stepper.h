#pragma once
/// \file oracle_stepper.h
/// The reference engine's per-step oracle work (design: oracle_step.h). An engine step gathers
/// its staged digests, KV writes, recurrent executions and verifications into one plan in a
/// preallocated pinned buffer; `submit` uploads it with one copy and makes one write launch and
/// one verify launch on the engine's stream; `snapshotLengths` makes one launch that copies the
/// KV-length rows into the plan; `complete` copies the findings back with one copy and waits
/// once on the stream (the step's completion point), then describes the first finding of each
/// kind as the host oracle would. With CPU pools the host twins do the same work in place.
/// Everything is allocated at construction. Private to the testing library.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/tensor.h"
#include "testing/oracle_step.h"

namespace mkv::testing::oracle {

/// What one completed step found.
struct StepFindings {
  int64_t positionsChecked = 0;  ///< KV positions verified
  int64_t kvMismatches = 0;      ///< of them with a wrong byte or no page
  std::string kvFirst;           ///< the first, as KvOracle::verify describes it
  int64_t recurrentChecks = 0;
  int64_t recurrentMismatches = 0;
  std::string recurrentFirst;   ///< as RecurrentOracle::verify describes it
  int64_t draftChecked = 0;     ///< of positionsChecked, those in the draft pool
  int64_t draftMismatches = 0;  ///< of kvMismatches, those in the draft pool
  int64_t hiddenChecks = 0;     ///< boundary hidden rows verified (Hybrid-MTP)
  int64_t hiddenMismatches = 0;
  std::string hiddenFirst;  ///< the first, as describeHidden describes it
  /// Snapshot rows of the full, sliding-window and draft pools, if taken.
  std::vector<int32_t> const* lengths[kOraclePools] = {nullptr, nullptr, nullptr};
};

class OracleStepper {
 public:
  static constexpr int32_t kFull = 0;
  static constexpr int32_t kSwa = 1;
  /// The draft model's pool (runtime.draftPool()); its digests live in a plane of their own.
  static constexpr int32_t kDraft = kOracleDraftPool;

  /// `recurrent`: also execute the runtime's recurrent state pool. `hidden` (Hybrid-MTP): the
  /// engine's boundary hidden rows [rows, width], on the runtime's device; must outlive the
  /// stepper.
  OracleStepper(KVCacheRuntime& runtime, bool recurrent, Tensor* hidden = nullptr);
  ~OracleStepper();
  OracleStepper(OracleStepper const&) = delete;
  OracleStepper& operator=(OracleStepper const&) = delete;

  /// Starts a step (waits first if a previous step was submitted and never completed).
  void begin();
  /// Stages the digests of positions [begin, begin + digests.size()) of `slot` (they enter the
  /// digest store at submit, in the plane `pool` reads: the draft pool's, or the base pools'
  /// shared one); returns the staged index of position `begin` for `write`.
  int64_t stage(int32_t slot, int32_t begin, std::span<uint64_t const> digests,
                int32_t pool = kFull);
  /// Whether the runtime has a draft pool the oracle addresses.
  bool hasDraft() const noexcept { return mGeometry.pools[kDraft].present != 0; }
  /// Writes positions [begin, end) of `slot` in `pool`, from staged digests starting at `index`.
  void write(int32_t pool, int32_t slot, int32_t begin, int32_t end, int64_t index);
  /// Verifies positions [begin, end) of `slot` in `pool` (their digests staged now or earlier).
  void verify(int32_t pool, int32_t slot, int32_t begin, int32_t end, OracleRangeKind kind);
  /// A recurrent execution (see OracleRecurrentItem); digests are ignored for length 0.
  void recurrent(int32_t slot, bool verify, int32_t from, uint64_t fromDigest, int32_t to,
                 uint64_t toDigest);
  /// A reuse point: writes the state after the `to`-token prefix (digest toDigest) into row
  /// `snapshotSlot` of the coordinator's snapshot slabs, as the engine's scan would.
  void reusePoint(int32_t snapshotSlot, int32_t to, uint64_t toDigest);
  /// Boundary hidden row `row` (Hybrid-MTP): verify it holds the row of the `from`-token prefix
  /// (digest fromDigest), then write the row of the `to`-token prefix (digest toDigest).
  void hidden(int32_t row, bool verify, int32_t from, uint64_t fromDigest, int32_t to,
              uint64_t toDigest);
  /// One upload, one write launch, one verify launch (kCPU: the twins, in place).
  void submit(cudaStream_t stream);
  /// One launch copying KV-length rows [0, rows[p]) of each present pool into the plan.
  void snapshotLengths(int32_t rowsFull, int32_t rowsSwa, int32_t rowsDraft, cudaStream_t stream);
  /// One copy back and one wait on `stream`; throws mkv::Error naming `call` when a write found
  /// a position without a page. The returned reference is valid until the next `begin`.
  StepFindings const& complete(cudaStream_t stream, char const* call);

  DeviceType deviceType() const noexcept { return mDevice; }

 private:
  std::string describeKv(OracleResult const& result) const;
  std::string describeRecurrent(OracleResult const& result) const;
  std::string describeHidden(OracleResult const& result) const;
  uint64_t storedDigest(int32_t pool, int32_t slot, int64_t position) const;
  std::size_t pack();  // returns the plan bytes
  void requireCapacity(std::size_t used, std::size_t capacity, char const* what) const;

  DeviceType mDevice;
  OracleGeometry mGeometry{};
  Tensor mGeometryDevice;  // kGPU: a copy of mGeometry
  Tensor mDigestStore;     // int64 [storeRows (x 2 with a draft pool), storePitch]
  Tensor mPlanDevice;      // kGPU: the uploaded plan
  ::mkv::detail::HostBuffer mStaging;
  ::mkv::detail::Event mDone;
  std::size_t mStagingBytes = 0;
  std::size_t mResultBytes = 0;  // header + length snapshot

  std::vector<OracleRange> mStores;
  std::vector<OracleRange> mWrites;
  std::vector<OracleRange> mVerifies;
  std::vector<OracleRecurrentItem> mRecurrent;
  std::vector<uint64_t> mDigests;
  std::size_t mMaxRanges = 0;
  std::size_t mMaxDigests = 0;
  OracleStepHeader mHeader{};
  bool mSubmitted = false;
  bool mSnapshot = false;
  bool mPending = false;  // work on the stream not yet waited for
  int32_t mSnapshotRows[kOraclePools] = {0, 0, 0};
  std::vector<int32_t> mLengths[kOraclePools];
  StepFindings mFindings;
};

/// Timing events on the engine's stream, created once: `mark(i)` records event i; once the
/// stream has passed both marks (after a step's completion point), `elapsedNanos(a, b)` is the
/// stream time between them. Inert (and disabled) for kCPU.
class StreamMarks {
 public:
  static constexpr int32_t kMarks = 4;
  explicit StreamMarks(DeviceType deviceType);
  ~StreamMarks();
  StreamMarks(StreamMarks const&) = delete;
  StreamMarks& operator=(StreamMarks const&) = delete;

  bool enabled() const noexcept { return mEnabled; }
  void mark(int32_t index, cudaStream_t stream);
  int64_t elapsedNanos(int32_t from, int32_t to) const;

 private:
  bool mEnabled = false;
  [[maybe_unused]] void* mEvents[kMarks] = {};  // cudaEvent_t, CUDA builds only
};

}  // namespace mkv::testing::oracle
