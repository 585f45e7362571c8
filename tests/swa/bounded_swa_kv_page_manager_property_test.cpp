/// BoundedSwaKVPageManager under random operation sequences (seeded): several concurrent
/// requests with random batch sizes and prompt lengths, prefill and decode transitions whose
/// completion is interleaved with other requests' work, cancellations compacted away,
/// finishes, abandonments, illegal calls, injected synchronisation failures and shutdowns.
///
/// A model predicts every status and every page count. The KV oracle writes each executed
/// position through the SWA table as an engine would (prefill: the retained window
/// [max(0, L - W), L); decode: position e) and, after every operation, verifies the last
/// min(W, e) positions of every live sequence -- including quarantined ones, whose pages must
/// not be handed to anyone. A page given to a sequence while another sequence (or its own
/// stale window) still needs it shows up as a mismatch.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/logging.h"
#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

struct Geometry {
  int32_t window;
  int32_t pageSize;
  uint64_t seed;
  /// Steps of the one operation sequence the CPU instance runs (the GPU instance: kGpuSteps).
  int64_t cpuSteps;
};

/// The GPU oracle stages every row through synchronous copies: device runs are shorter.
constexpr int64_t kGpuSteps = 2500;

int64_t stepsOf(DeviceType device, Geometry const& geometry) {
  return device == DeviceType::kCPU ? geometry.cpuSteps : kGpuSteps;
}

enum class Stage {
  kAdmitted,
  kPrefillStaged,
  kDecoding,
  kDecodeStaged,
  kCompactionStaged,
  kFinishing  ///< every row compacted away: only finish remains
};

bool pendingWork(Stage stage) {
  return stage == Stage::kPrefillStaged || stage == Stage::kDecodeStaged ||
         stage == Stage::kCompactionStaged;
}

struct ModelRequest {
  Handle handle;
  std::vector<EngineSequence> rows;
  Stage stage = Stage::kAdmitted;
  std::vector<int32_t> compaction;  // staged oldToNew
  int32_t compactionSize = 0;
  /// Rarely finished or abandoned: decodes far beyond 2W, up to the table width.
  bool longLived = false;
};

struct QuarantinedRequest {
  std::vector<EngineSequence> mappedRows;  // rows whose table entries are still live
  int32_t pages = 0;
};

/// Counts of what a run exercised; the test asserts every path was reached.
struct Coverage {
  int64_t admitted = 0, refusedNoPages = 0, refusedPoisoned = 0, prefills = 0, decodeSteps = 0,
          widthFailures = 0, compactions = 0, droppedRows = 0, finishes = 0, abandons = 0,
          quarantines = 0, failedShutdowns = 0, drains = 0, illegalCalls = 0, maxConcurrent = 0,
          positionsVerified = 0, mapAndRetireSteps = 0;
};

class PropertyRun {
 public:
  PropertyRun(DeviceType device, Geometry const& geometry)
      : mGeometry(geometry), mRandom(geometry.seed) {
    RigConfig config;
    config.device = device;
    config.window = geometry.window;
    config.pageSize = geometry.pageSize;
    config.maxBatch = kMaxBatch;
    int32_t const m = BoundedSwaKVPageManager::windowPages(geometry.window, geometry.pageSize);
    // Room for about three admitted sequences at once: admission pressure is real.
    config.numPages = 2 * (2 * m + 1) + 2 * (m + 1) + 1;
    // A few windows wide: long prompts and long-lived sequences reach the table width.
    config.maxPagesPerSeq =
        retainedEnd(6 * geometry.window + 8 * geometry.pageSize, geometry.pageSize);
    config.withLengthPools = false;  // concurrent batches cannot share one KV-length tensor
    mRig = std::make_unique<SwaRig>(config);
    mAdmission = 2 * m + 1;
    mDecode = m + 1;
    mSlotBusy.assign(kMaxBatch, false);
  }

  ~PropertyRun() {
    mRequests.clear();  // handles abandon before the rig goes
  }
  PropertyRun(PropertyRun const&) = delete;
  PropertyRun& operator=(PropertyRun const&) = delete;

  Coverage const& coverage() const { return mCoverage; }

  /// One random operation, then the invariants. Returns false after the first failure.
  bool step(int64_t index) {
    mStep = index;
    double const r = uniform();
    bool const slotsLeft = std::find(mSlotBusy.begin(), mSlotBusy.end(), false) != mSlotBusy.end();
    if (mPoisoned && !mTriedPoisonedAdmission) {
      mTriedPoisonedAdmission = true;
      admitWhilePoisoned();
      // NOLINTNEXTLINE(bugprone-branch-clone): two reasons to shut down, in this order
    } else if (mPoisoned && (mRequests.empty() || r < 0.15)) {
      shutdownRandom();  // nothing can be admitted until the quarantine drains
    } else if (mRequests.empty() || (slotsLeft && r < 0.3)) {
      admitRandom();
    } else if (r < 0.31) {
      shutdownRandom();
    } else {
      std::size_t const which = pick(mRequests.size());
      actOn(which);
    }
    checkInvariants();
    return !::testing::Test::HasFailure();
  }

  /// Ends the run: every request finished, the quarantine drained, every page free.
  void drain() {
    mRig->faults().disarm();
    while (!mRequests.empty()) {
      finishRequest(mRequests.size() - 1, false);
    }
    SwaKVCacheStatus const status = manager().shutdown();
    EXPECT_EQ(status, SwaKVCacheStatus::kOk);
    mQuarantine.clear();
    mPoisoned = false;
    checkInvariants();
    EXPECT_EQ(manager().freePageCount(), manager().totalPageCount());
    EXPECT_FALSE(manager().poisoned());
  }

 private:
  static constexpr int32_t kMaxBatch = 5;

  BoundedSwaKVPageManager& manager() { return mRig->manager(); }
  int32_t window() const { return mGeometry.window; }
  int32_t pageSize() const { return mGeometry.pageSize; }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(mRandom); }
  std::size_t pick(std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(mRandom);
  }
  int32_t between(int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(mRandom);
  }
  /// Arms one synchronisation failure with probability p; returns whether it did.
  bool maybeArmFailure(double p) {
    if (uniform() >= p) {
      return false;
    }
    if (uniform() < 0.2) {
      mRig->faults().throwNext();
    } else {
      mRig->faults().failNext();
    }
    return true;
  }
  /// Disarms; `consumed` says whether the model expected a synchronisation to take the failure.
  void expectFailureConsumed(bool armed, bool synchronised) {
    int32_t const left = mRig->faults().disarm();
    if (armed) {
      EXPECT_EQ(left, synchronised ? 0 : 1) << "step " << mStep;
    }
  }

  int32_t heldPerRow(Stage stage) const {
    return stage == Stage::kAdmitted || stage == Stage::kPrefillStaged ? mAdmission : mDecode;
  }
  int32_t expectedFree() const {
    int32_t used = 0;
    for (auto const& request : mRequests) {
      used += heldPerRow(request->stage) * static_cast<int32_t>(request->rows.size());
    }
    for (auto const& quarantined : mQuarantine) {
      used += quarantined.pages;
    }
    return mRig->manager().totalPageCount() - used;
  }

  /// Once per poisoned period: any slots, busy ones included (held by an active or a
  /// quarantined request), are refused with kPoisoned, not with a contract error.
  void admitWhilePoisoned() {
    std::vector<int32_t> slots(kMaxBatch);
    for (int32_t slot = 0; slot < kMaxBatch; ++slot) {
      slots[static_cast<std::size_t>(slot)] = slot;
    }
    std::shuffle(slots.begin(), slots.end(), mRandom);
    slots.resize(static_cast<std::size_t>(between(1, 3)));
    int32_t const freeBefore = manager().freePageCount();
    auto const result = manager().beginRequest(residentsFor(slots, ++mEpoch), SwaRig::stream());
    EXPECT_EQ(result.status, SwaKVCacheStatus::kPoisoned) << "step " << mStep;
    EXPECT_FALSE(result.request.has_value());
    EXPECT_EQ(manager().freePageCount(), freeBefore);
    ++mCoverage.refusedPoisoned;
  }

  void admitRandom() {
    std::vector<int32_t> freeSlots;
    for (int32_t slot = 0; slot < kMaxBatch; ++slot) {
      if (!mSlotBusy[static_cast<std::size_t>(slot)]) {
        freeSlots.push_back(slot);
      }
    }
    if (freeSlots.empty()) {
      return;
    }
    std::shuffle(freeSlots.begin(), freeSlots.end(), mRandom);
    auto const batch = static_cast<std::size_t>(
        between(1, std::min<int32_t>(3, static_cast<int32_t>(freeSlots.size()))));
    freeSlots.resize(batch);
    int32_t const freeBefore = manager().freePageCount();
    auto result = manager().beginRequest(residentsFor(freeSlots, ++mEpoch), SwaRig::stream());
    if (mPoisoned) {
      EXPECT_EQ(result.status, SwaKVCacheStatus::kPoisoned) << "step " << mStep;
      ++mCoverage.refusedPoisoned;
    } else if (freeBefore < mAdmission * static_cast<int32_t>(batch)) {
      EXPECT_EQ(result.status, SwaKVCacheStatus::kRequestFailed) << "step " << mStep;
      ++mCoverage.refusedNoPages;
    } else {
      EXPECT_EQ(result.status, SwaKVCacheStatus::kOk) << "step " << mStep;
    }
    if (result.status != SwaKVCacheStatus::kOk) {
      EXPECT_FALSE(result.request.has_value());
      return;
    }
    auto request = std::make_unique<ModelRequest>();
    request->handle = std::move(*result.request);
    request->longLived = uniform() < 0.2;
    for (int32_t slot : freeSlots) {
      request->rows.emplace_back(slot, mRandom());
      mSlotBusy[static_cast<std::size_t>(slot)] = true;
    }
    fillRecurrent(freeSlots);
    mRequests.push_back(std::move(request));
    ++mCoverage.admitted;
    mCoverage.maxConcurrent =
        std::max<int64_t>(mCoverage.maxConcurrent, static_cast<int64_t>(mRequests.size()));
  }

  void actOn(std::size_t which) {
    ModelRequest& request = *mRequests[which];
    double const r = uniform();
    double const end = request.longLived ? 0.1 : 1.0;  // scales the chance to end the request
    if (r < 0.02) {
      illegalCall(request);
      return;
    }
    if (r < 0.02 + 0.02 * end) {
      finishRequest(which, true);
      return;
    }
    if (r < 0.02 + 0.035 * end) {
      abandonRequest(which);
      return;
    }
    switch (request.stage) {
      case Stage::kAdmitted:
        prefill(request);
        break;
      case Stage::kPrefillStaged:
        manager().completePrefill(request.handle);
        request.stage = Stage::kDecoding;
        break;
      case Stage::kDecoding:
        if (r < 0.02 + 0.035 * end + 0.03) {
          beginCompaction(request);
        } else {
          decode(request);
        }
        break;
      case Stage::kDecodeStaged:
        manager().completeDecodeStep(request.handle);
        request.stage = Stage::kDecoding;
        break;
      case Stage::kCompactionStaged:
        compact(which);
        break;
      case Stage::kFinishing:
        finishRequest(which, true);
        break;
    }
  }

  int32_t randomPromptLength() {
    int32_t const maxTokens = mRig->table().maxPagesPerSeq() * pageSize();
    double const r = uniform();
    if (r < 0.1) {
      return between(maxTokens - pageSize(), maxTokens);  // reaches the table width soon
    }
    if (r < 0.3) {
      return between(1, maxTokens);
    }
    return between(1, 2 * window() + pageSize());
  }

  void prefill(ModelRequest& request) {
    std::vector<int32_t> lengths;
    for (std::size_t i = 0; i < request.rows.size(); ++i) {
      lengths.push_back(randomPromptLength());
    }
    manager().preparePrefill(request.handle, lengths);
    for (std::size_t i = 0; i < request.rows.size(); ++i) {
      request.rows[i].prefill(mRig->oracle(), lengths[i], window());
    }
    request.stage = Stage::kPrefillStaged;
    ++mCoverage.prefills;
  }

  void decode(ModelRequest& request) {
    int32_t const maxPages = mRig->table().maxPagesPerSeq();
    bool fits = true;
    for (EngineSequence const& row : request.rows) {
      fits = fits && retainedEnd(row.written() + 1, pageSize()) <= maxPages;
    }
    SwaKVCacheStatus const status = manager().prepareDecodeStep(request.handle);
    if (!fits) {
      // The row fails alone: nothing staged, the request goes on (a compaction may drop the row).
      EXPECT_EQ(status, SwaKVCacheStatus::kRequestFailed) << "step " << mStep;
      EXPECT_EQ(manager().lastFailure(request.handle).reason,
                manager().poisoned() ? RowFailureReason::kPoisoned : RowFailureReason::kTableFull)
          << "step " << mStep;
      ++mCoverage.widthFailures;
      return;
    }
    ASSERT_EQ(status, SwaKVCacheStatus::kOk) << "step " << mStep;
    for (int32_t row = 0; row < static_cast<int32_t>(request.rows.size()); ++row) {
      SwaSequenceState const& state = manager().state(request.handle, row);
      EXPECT_LE(state.newBindings.size(), 1u);
      EXPECT_LE(state.pendingRetire.size(), 1u);
      EXPECT_LE(state.heldPages(), mDecode);
      if (state.newBindings.size() == 1 && state.pendingRetire.size() == 1) {
        ++mCoverage.mapAndRetireSteps;  // the new page and the retiring one meet on one step
      }
      request.rows[static_cast<std::size_t>(row)].decode(mRig->oracle());
    }
    request.stage = Stage::kDecodeStaged;
    ++mCoverage.decodeSteps;
  }

  void beginCompaction(ModelRequest& request) {
    std::vector<int32_t> mapping;
    int32_t next = 0;
    for (std::size_t i = 0; i < request.rows.size(); ++i) {
      mapping.push_back(uniform() < 0.35 ? -1 : next++);
    }
    manager().beginBatchCompaction(request.handle, mapping, next, mRig->mapping());
    request.compaction = mapping;
    request.compactionSize = next;
    request.stage = Stage::kCompactionStaged;
  }

  void compact(std::size_t which) {
    ModelRequest& request = *mRequests[which];
    bool const armed = maybeArmFailure(0.15);
    SwaKVCacheStatus const status = manager().compactBatch(request.handle);
    expectFailureConsumed(armed, true);
    std::vector<EngineSequence> survivors;
    std::vector<CacheSlot> dropped;
    for (std::size_t i = 0; i < request.rows.size(); ++i) {
      if (request.compaction[i] < 0) {
        dropped.push_back(request.rows[i].slot());
      } else {
        survivors.push_back(std::move(request.rows[i]));
      }
    }
    expectRecurrentZeroed(dropped);
    for (CacheSlot slot : dropped) {
      EXPECT_EQ(hostRow(mRig->table(), slot), emptyRow(mRig->table()));
      EXPECT_EQ(deviceRow(mRig->table(), slot), emptyRow(mRig->table()));
    }
    if (armed) {
      EXPECT_EQ(status, SwaKVCacheStatus::kPoisoned) << "step " << mStep;
      EXPECT_FALSE(request.handle.valid());
      QuarantinedRequest quarantined;
      quarantined.pages = mDecode * static_cast<int32_t>(request.compaction.size());
      quarantined.mappedRows = std::move(survivors);
      mQuarantine.push_back(std::move(quarantined));
      mPoisoned = true;
      mRequests.erase(mRequests.begin() + static_cast<std::ptrdiff_t>(which));
      ++mCoverage.quarantines;
      return;
    }
    EXPECT_EQ(status, SwaKVCacheStatus::kOk) << "step " << mStep;
    for (CacheSlot slot : dropped) {
      mSlotBusy[static_cast<std::size_t>(slot)] = false;
    }
    request.rows = std::move(survivors);
    ASSERT_EQ(manager().batchSize(request.handle), static_cast<int32_t>(request.rows.size()));
    for (std::size_t i = 0; i < request.rows.size(); ++i) {
      EXPECT_EQ(manager().state(request.handle, static_cast<int32_t>(i)).resident.slot,
                request.rows[i].slot());
    }
    request.stage = request.rows.empty() ? Stage::kFinishing : Stage::kDecoding;
    ++mCoverage.compactions;
    mCoverage.droppedRows += static_cast<int64_t>(dropped.size());
  }

  void finishRequest(std::size_t which, bool mayFail) {
    std::unique_ptr<ModelRequest> request = std::move(mRequests[which]);
    mRequests.erase(mRequests.begin() + static_cast<std::ptrdiff_t>(which));
    bool const pending = pendingWork(request->stage);
    bool const armed = mayFail && maybeArmFailure(0.25);
    SwaKVCacheStatus const status = manager().finish(request->handle);
    expectFailureConsumed(armed, pending);
    EXPECT_FALSE(request->handle.valid());
    settle(*request, armed && pending);
    EXPECT_EQ(status, mPoisoned ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kOk)
        << "step " << mStep;
    ++mCoverage.finishes;
  }

  void abandonRequest(std::size_t which) {
    std::unique_ptr<ModelRequest> request = std::move(mRequests[which]);
    mRequests.erase(mRequests.begin() + static_cast<std::ptrdiff_t>(which));
    bool const pending = pendingWork(request->stage);
    bool const armed = maybeArmFailure(0.25);
    { Handle dropped = std::move(request->handle); }
    expectFailureConsumed(armed, pending);
    settle(*request, armed && pending);
    ++mCoverage.abandons;
  }

  /// After finish / abandonment: either quarantined (rows still mapped) or released.
  void settle(ModelRequest& request, bool failed) {
    if (failed) {
      QuarantinedRequest quarantined;
      quarantined.pages = heldPerRow(request.stage) * static_cast<int32_t>(request.rows.size());
      quarantined.mappedRows = std::move(request.rows);
      mQuarantine.push_back(std::move(quarantined));
      mPoisoned = true;
      ++mCoverage.quarantines;
      return;
    }
    for (EngineSequence const& row : request.rows) {
      mSlotBusy[static_cast<std::size_t>(row.slot())] = false;
      EXPECT_EQ(hostRow(mRig->table(), row.slot()), emptyRow(mRig->table()));
      EXPECT_EQ(deviceRow(mRig->table(), row.slot()), emptyRow(mRig->table()));
    }
  }

  void shutdownRandom() {
    bool const draining = !mQuarantine.empty();
    // The first drain of every run fails, so even a short run covers a failing shutdown.
    bool const armed =
        draining && mCoverage.failedShutdowns == 0 ? maybeArmFailure(1.0) : maybeArmFailure(0.3);
    SwaKVCacheStatus const status = manager().shutdown();
    expectFailureConsumed(armed, draining);
    if (draining && armed) {
      EXPECT_EQ(status, SwaKVCacheStatus::kPoisoned) << "step " << mStep;
      ++mCoverage.failedShutdowns;
      return;
    }
    EXPECT_EQ(status, mRequests.empty() ? SwaKVCacheStatus::kOk : SwaKVCacheStatus::kRequestFailed)
        << "step " << mStep;
    for (QuarantinedRequest const& quarantined : mQuarantine) {
      for (EngineSequence const& row : quarantined.mappedRows) {
        EXPECT_EQ(hostRow(mRig->table(), row.slot()), emptyRow(mRig->table()));
      }
    }
    if (draining) {
      ++mCoverage.drains;
    }
    mQuarantine.clear();
    mPoisoned = false;
    mTriedPoisonedAdmission = false;
    // Residents of drained requests are free again.
    mSlotBusy.assign(kMaxBatch, false);
    for (auto const& request : mRequests) {
      for (EngineSequence const& row : request->rows) {
        mSlotBusy[static_cast<std::size_t>(row.slot())] = true;
      }
    }
  }

  /// A call the request's stage does not allow: mkv::Error, and nothing changes.
  void illegalCall(ModelRequest& request) {
    int32_t const freeBefore = manager().freePageCount();
    int64_t const uploadsBefore = mRig->table().totalUploadStats().entries;
    bool threw = false;
    try {
      switch (request.stage) {
        case Stage::kAdmitted:
        case Stage::kPrefillStaged:
          manager().completeDecodeStep(request.handle);
          break;
        case Stage::kDecoding:
          manager().completePrefill(request.handle);
          break;
        case Stage::kDecodeStaged:
          (void)manager().prepareDecodeStep(request.handle);
          break;
        case Stage::kCompactionStaged:
          manager().completeDecodeStep(request.handle);
          break;
        case Stage::kFinishing:
          (void)manager().prepareDecodeStep(request.handle);
          break;
      }
    } catch (Error const&) {
      threw = true;
    }
    EXPECT_TRUE(threw) << "step " << mStep;
    EXPECT_EQ(manager().freePageCount(), freeBefore);
    EXPECT_EQ(mRig->table().totalUploadStats().entries, uploadsBefore);
    ++mCoverage.illegalCalls;
  }

  static uint8_t pattern(CacheSlot slot, std::size_t buffer, int64_t byte) {
    return static_cast<uint8_t>(
        (static_cast<int64_t>(slot) * 41 + static_cast<int64_t>(buffer) * 7 + byte) % 251 + 1);
  }
  void fillRecurrent(std::vector<int32_t> const& slots) {
    auto const buffers = mRig->recurrent()->rowBuffers();
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      for (CacheSlot slot : slots) {
        std::vector<uint8_t> bytes(static_cast<std::size_t>(buffers[b].rowBytes));
        for (std::size_t i = 0; i < bytes.size(); ++i) {
          bytes[i] = pattern(slot, b, static_cast<int64_t>(i));
        }
        writeBytes(static_cast<uint8_t*>(buffers[b].data) + slot * buffers[b].rowBytes,
                   mRig->recurrent()->deviceType(), bytes);
      }
    }
    for (CacheSlot slot : slots) {
      mRecurrentFilled[static_cast<std::size_t>(slot)] = true;
    }
  }
  /// Dropped residents' rows are zero; every other filled row is intact (rows of residents
  /// dropped by a compaction whose synchronisation failed stay zero in the quarantine).
  void expectRecurrentZeroed(std::vector<CacheSlot> const& dropped) {
    auto const buffers = mRig->recurrent()->rowBuffers();
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      auto const bytes =
          readBytes(buffers[b].data, mRig->recurrent()->deviceType(),
                    static_cast<std::size_t>(buffers[b].rowBytes * buffers[b].numRows));
      for (CacheSlot slot = 0; slot < kMaxBatch; ++slot) {
        bool const zero = std::find(dropped.begin(), dropped.end(), slot) != dropped.end();
        if (!zero && !mRecurrentFilled[static_cast<std::size_t>(slot)]) {
          continue;
        }
        for (int64_t i = 0; i < buffers[b].rowBytes; ++i) {
          uint8_t const expected = zero ? 0 : pattern(slot, b, i);
          ASSERT_EQ(bytes[static_cast<std::size_t>(slot * buffers[b].rowBytes + i)], expected)
              << "step " << mStep << " slot " << slot << " buffer " << b;
        }
      }
    }
    for (CacheSlot slot : dropped) {
      mRecurrentFilled[static_cast<std::size_t>(slot)] = false;
    }
  }

  void checkInvariants() {
    BoundedSwaKVPageManager& m = manager();
    EXPECT_EQ(m.freePageCount(), expectedFree()) << "step " << mStep;
    int32_t quarantined = 0;
    for (auto const& q : mQuarantine) {
      quarantined += q.pages;
    }
    EXPECT_EQ(m.quarantinedPageCount(), quarantined) << "step " << mStep;
    EXPECT_EQ(m.poisoned(), mPoisoned) << "step " << mStep;
    EXPECT_EQ(m.activeRequestCount(), static_cast<int32_t>(mRequests.size()));
    std::vector<Handle const*> handles;
    for (auto const& request : mRequests) {
      handles.push_back(&request->handle);
      ASSERT_EQ(m.batchSize(request->handle), static_cast<int32_t>(request->rows.size()));
    }
    expectPagesAccountedFor(m, handles);
    std::string error;
    EXPECT_TRUE(mRig->table().checkInvariants(&error)) << error;
    // The oracle: every sequence that still has KV reads back exactly its own window.
    auto verify = [&](EngineSequence const& row) {
      if (row.written() == 0) {
        return;
      }
      auto const report = row.verifyWindow(mRig->oracle(), window());
      mCoverage.positionsVerified += report.positionsChecked;
      EXPECT_TRUE(report.ok()) << "step " << mStep << ": " << report.firstMismatch;
    };
    for (auto const& request : mRequests) {
      for (EngineSequence const& row : request->rows) {
        verify(row);
      }
    }
    for (auto const& q : mQuarantine) {
      for (EngineSequence const& row : q.mappedRows) {
        verify(row);
      }
    }
  }

  Geometry mGeometry;
  std::mt19937_64 mRandom;
  std::unique_ptr<SwaRig> mRig;
  int32_t mAdmission = 0;
  int32_t mDecode = 0;
  std::vector<bool> mSlotBusy;
  std::vector<bool> mRecurrentFilled = std::vector<bool>(kMaxBatch, false);
  std::vector<std::unique_ptr<ModelRequest>> mRequests;
  std::vector<QuarantinedRequest> mQuarantine;
  bool mPoisoned = false;
  bool mTriedPoisonedAdmission = false;
  uint64_t mEpoch = 0;
  int64_t mStep = 0;
  Coverage mCoverage;
};

class BoundedSwaPropertyTest : public ::testing::TestWithParam<std::tuple<DeviceType, Geometry>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == DeviceType::kGPU && !cudaDeviceAvailable()) {
      GTEST_SKIP() << "no CUDA device";
    }
    // Injected failures log one error each; thousands of them would bury the test output.
    setLogger(std::make_shared<spdlog::logger>("managedkv-property",
                                               std::make_shared<spdlog::sinks::null_sink_mt>()));
  }
  void TearDown() override { setLogger(nullptr); }
};

TEST_P(BoundedSwaPropertyTest, RandomOperationSequencesKeepWindowsExactAndPagesAccounted) {
  auto const [device, geometry] = GetParam();
  // One operation sequence of `steps` steps; the test name says how many.
  int64_t const steps = stepsOf(device, geometry);
  SCOPED_TRACE(::testing::Message() << "W " << geometry.window << " P " << geometry.pageSize
                                    << " seed " << geometry.seed);
  PropertyRun run(device, geometry);
  for (int64_t i = 0; i < steps; ++i) {
    if (!run.step(i)) {
      FAIL() << "stopped at step " << i;
    }
  }
  run.drain();
  Coverage const& c = run.coverage();
  std::cout << "[ coverage ] admitted " << c.admitted << ", refused (pages) " << c.refusedNoPages
            << ", refused (poisoned) " << c.refusedPoisoned << ", prefills " << c.prefills
            << ", decode steps " << c.decodeSteps << ", width failures " << c.widthFailures
            << ", compactions " << c.compactions << " (" << c.droppedRows << " rows dropped)"
            << ", finishes " << c.finishes << ", abandons " << c.abandons << ", quarantines "
            << c.quarantines << ", failed shutdowns " << c.failedShutdowns << ", drains "
            << c.drains << ", illegal calls " << c.illegalCalls << ", max concurrent "
            << c.maxConcurrent << ", positions verified " << c.positionsVerified
            << ", decode steps mapping and retiring " << c.mapAndRetireSteps << "\n";
  // Every path the run is meant to prove was actually taken.
  int64_t const scale = steps / 2500;
  EXPECT_GT(c.admitted, 10 * scale);
  EXPECT_GT(c.refusedNoPages, 0);
  EXPECT_GT(c.refusedPoisoned, 0);
  EXPECT_GT(c.decodeSteps, 200 * scale);
  EXPECT_GT(c.widthFailures, 0);
  EXPECT_GT(c.compactions, scale);
  EXPECT_GT(c.droppedRows, scale);
  EXPECT_GT(c.quarantines, scale);
  EXPECT_GT(c.failedShutdowns, 0);
  EXPECT_GT(c.drains, scale);
  EXPECT_GT(c.illegalCalls, scale);
  EXPECT_GE(c.maxConcurrent, 3);
  // The oracle really ran: after every prefill and decode step each sequence of the request
  // verified at least the position it just wrote.
  EXPECT_GE(c.positionsVerified, c.decodeSteps + c.prefills);
  // A decode step opens a page at e = 0 (mod P) and its window leaves one at e = W - 1 (mod P):
  // both at once exactly when W = 1 (mod P).
  if (geometry.window % geometry.pageSize == 1) {
    EXPECT_GT(c.mapAndRetireSteps, scale);
  } else {
    EXPECT_EQ(c.mapAndRetireSteps, 0);
  }
}

std::string propertyName(::testing::TestParamInfo<std::tuple<DeviceType, Geometry>> const& info) {
  Geometry const& g = std::get<1>(info.param);
  DeviceType const device = std::get<0>(info.param);
  return std::string(device == DeviceType::kCPU ? "Cpu" : "Gpu") + "_W" + std::to_string(g.window) +
         "_P" + std::to_string(g.pageSize) + "_Steps" + std::to_string(stepsOf(device, g));
}

// W mod P = 5, 0, 1, 7 and 8. W = 17 (W = 1 mod P: a decode step can map a page and retire one
// at once) runs the long sequence, 10^5 steps on the host, about 10 s of CPU time in a Debug +
// ASan build; the others run 25,000 steps each.
INSTANTIATE_TEST_SUITE_P(Random, BoundedSwaPropertyTest,
                         ::testing::Combine(::testing::Values(DeviceType::kCPU, DeviceType::kGPU),
                                            ::testing::Values(Geometry{5, 16, 0x5eed0001, 25000},
                                                              Geometry{16, 16, 0x5eed0002, 25000},
                                                              Geometry{17, 16, 0x5eed0005, 100000},
                                                              Geometry{23, 16, 0x5eed0003, 25000},
                                                              Geometry{40, 16, 0x5eed0004, 25000})),
                         propertyName);

}  // namespace
}  // namespace mkv::swa_test
