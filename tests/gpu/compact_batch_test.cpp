/// compactBatch on the GPU against its host twin and against the intended result ("new row d
/// holds old row i"), in place with overlapping rows. The kernel moves row tiles in different
/// CTAs that order themselves through per-tile flags in a workspace (kernels/compact_batch.cu),
/// so the mappings stress that ordering: dropping row 0 (every row shifts by one, a chain of
/// waits across every tile), every other row, a long run at the front (destinations many tiles
/// back), nothing, everything, random survivors with and without a cut; 1 to 40000 rows; buffers
/// of 4 B to 64 KiB in one launch at each access width; spare rows past the batch that must stay
/// poisoned; one workspace reused by every launch of a test; and the generation wrap-around.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <ostream>
#include <random>
#include <span>
#include <vector>

#include "gpu/gpu_parity.h"
#include "kernel_params.h"
#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

using kernels::RowBuffer;

/// Rows each buffer holds past the old batch, poisoned: no launch may write them.
constexpr int32_t kSpareRows = 2;

/// Random bytes, eight at a time (the large cases hold hundreds of MiB).
std::vector<uint8_t> fastRandomBytes(std::size_t count, std::mt19937_64& rng) {
  std::vector<uint8_t> bytes(count);
  for (std::size_t i = 0; i < count; i += sizeof(uint64_t)) {
    uint64_t const word = rng();
    std::memcpy(bytes.data() + i, &word, std::min(sizeof(uint64_t), count - i));
  }
  return bytes;
}

class CompactBatchInPlaceTest : public GpuTest {
 protected:
  /// The test's one workspace, grown (zero-filled: a fresh valid state) when a launch needs more.
  Tensor& workspace(std::vector<int64_t> const& rowBytes, int32_t oldBatch) {
    int64_t const bytes = kernels::compactBatchWorkspaceBytes(oldBatch, rowBytes);
    if (mWorkspace.sizeBytes() < bytes) {
      mWorkspace = Tensor({bytes / static_cast<int64_t>(sizeof(int32_t))}, DataType::kInt32,
                          DeviceType::kGPU);
    }
    return mWorkspace;
  }

  /// Compacts buffers of the given widths with `oldToNew` on both devices and checks parity
  /// and the intended result, spare rows included.
  void compactAndCheck(std::vector<int64_t> const& rowBytes, int32_t oldBatch,
                       std::vector<int32_t> const& oldToNew, int32_t newBatch) {
    int64_t const rows = int64_t{oldBatch} + kSpareRows;
    std::vector<std::vector<uint8_t>> original;
    std::vector<MirroredBytes> buffers;
    for (int64_t width : rowBytes) {
      original.push_back(fastRandomBytes(static_cast<std::size_t>(width * rows), mRng));
      std::fill(original.back().begin() + width * oldBatch, original.back().end(), kPoison);
      buffers.emplace_back(original.back());
    }
    MirroredInt32 const mapping(oldToNew);
    Tensor& gpuWorkspace = workspace(rowBytes, oldBatch);
    Tensor none;
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      std::vector<RowBuffer> descriptors;
      for (std::size_t b = 0; b < buffers.size(); ++b) {
        descriptors.push_back(RowBuffer{buffers[b].on(device), rowBytes[b], rows});
      }
      bool const gpu = device == DeviceType::kGPU;
      kernels::compactBatch(descriptors, device, mapping.on(device), newBatch,
                            gpu ? gpuWorkspace : none, gpu ? stream() : nullptr);
    }
    synchronize();
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      SCOPED_TRACE(::testing::Message() << "buffer " << b << " of " << rowBytes[b] << " B rows");
      EXPECT_TRUE(sameBytes(buffers[b]));
      std::vector<uint8_t> expected = original[b];
      auto const width = static_cast<std::size_t>(rowBytes[b]);
      for (int32_t i = 0; i < oldBatch; ++i) {
        int32_t const d = oldToNew[static_cast<std::size_t>(i)];
        if (d >= 0 && d < newBatch) {
          std::memcpy(expected.data() + static_cast<std::size_t>(d) * width,
                      original[b].data() + static_cast<std::size_t>(i) * width, width);
        }
      }
      EXPECT_TRUE(expected == buffers[b].gpuBytes())
          << "new row d must hold old row i; other rows, spare rows included, are unchanged";
    }
  }

  std::mt19937_64 mRng{1202};
  Tensor mWorkspace;
};

/// Which rows survive.
enum class Survivors { kRandomHalf, kAllButRowZero, kEveryOther, kLastQuarter, kAll, kNone };

struct MappingCase {
  Survivors survivors;
  int32_t oldBatch;
};

void PrintTo(MappingCase const& c, std::ostream* os) {
  static constexpr char const* kNames[] = {"random half",  "all but row 0", "every other",
                                           "last quarter", "all",           "none"};
  *os << kNames[static_cast<int>(c.survivors)] << " of " << c.oldBatch << " rows";
}

/// The order-preserving mapping of `c`; returns the survivor count.
int32_t makeMapping(MappingCase const& c, std::vector<int32_t>& oldToNew, std::mt19937_64& rng) {
  std::bernoulli_distribution half(0.5);
  oldToNew.assign(static_cast<std::size_t>(c.oldBatch), -1);
  int32_t next = 0;
  for (int32_t i = 0; i < c.oldBatch; ++i) {
    bool keep = false;
    switch (c.survivors) {
      case Survivors::kRandomHalf:
        keep = half(rng);
        break;
      case Survivors::kAllButRowZero:
        keep = i != 0;
        break;
      case Survivors::kEveryOther:
        keep = i % 2 == 1;
        break;
      case Survivors::kLastQuarter:
        keep = i >= c.oldBatch - c.oldBatch / 4;
        break;
      case Survivors::kAll:
        keep = true;
        break;
      case Survivors::kNone:
        keep = false;
        break;
    }
    if (keep) {
      oldToNew[static_cast<std::size_t>(i)] = next++;
    }
  }
  return next;
}

class CompactBatchMappingTest : public CompactBatchInPlaceTest,
                                public ::testing::WithParamInterface<MappingCase> {};

TEST_P(CompactBatchMappingTest, MatchesHostTwinAtEveryAccessWidth) {
  MappingCase const& c = GetParam();
  std::vector<int32_t> oldToNew;
  int32_t const survivors = makeMapping(c, oldToNew, mRng);
  bool const large = c.oldBatch > 4096;  // 64 KiB rows only where the buffers stay small
  // One launch per width set: 4-byte accesses (4 B, 100 B, 2 KiB, 64 KiB rows together),
  // 16-byte accesses, and the byte path (odd widths; 2050 B rows have a partial second chunk).
  std::vector<std::vector<int64_t>> const widthSets =
      large ? std::vector<std::vector<int64_t>>{{4, 100, 2048}, {16, 2048}}
            : std::vector<std::vector<int64_t>>{
                  {4, 100, 2048, 65536}, {16, 2048, 65536}, {1, 17, 2050}};
  for (std::vector<int64_t> const& widths : widthSets) {
    SCOPED_TRACE(::testing::Message() << widths.size() << " buffers, widest " << widths.back());
    compactAndCheck(widths, c.oldBatch, oldToNew, survivors);
  }
}

std::vector<MappingCase> mappingCases() {
  std::vector<MappingCase> cases;
  for (Survivors s : {Survivors::kRandomHalf, Survivors::kAllButRowZero, Survivors::kEveryOther,
                      Survivors::kLastQuarter, Survivors::kAll, Survivors::kNone}) {
    for (int32_t n : {1, 2, 7, 300, 2049, 10000, 40000}) {
      cases.push_back(MappingCase{s, n});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Mappings, CompactBatchMappingTest, ::testing::ValuesIn(mappingCases()));

struct RandomCase {
  int32_t oldBatch;
  double keep;  // survival probability of each row
  int32_t cut;  // newBatchSize = survivors - cut (survivors beyond it are ignored)
  std::vector<int64_t> rowBytes;
};

void PrintTo(RandomCase const& c, std::ostream* os) {
  *os << c.oldBatch << " rows, keep " << c.keep << ", cut " << c.cut << ", widths";
  for (int64_t w : c.rowBytes) {
    *os << ' ' << w;
  }
}

class CompactBatchGpuTest : public CompactBatchInPlaceTest,
                            public ::testing::WithParamInterface<RandomCase> {};

TEST_P(CompactBatchGpuTest, RandomOrderPreservingMappingsMatchHostTwin) {
  RandomCase const& c = GetParam();
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    std::vector<int32_t> oldToNew;
    int32_t const survivors = orderPreservingMapping(oldToNew, c.oldBatch, c.keep, mRng);
    compactAndCheck(c.rowBytes, c.oldBatch, oldToNew, std::max(0, survivors - c.cut));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Mappings, CompactBatchGpuTest,
    ::testing::Values(RandomCase{1, 1.0, 0, {4, 2048}}, RandomCase{7, 0.5, 0, {4, 16, 2048}},
                      RandomCase{256, 0.5, 0, {4, 8, 2048, 8192}},     // KV lengths + state rows
                      RandomCase{256, 0.5, 0, {65536, 4}},             // wide rows: many chunks
                      RandomCase{256, 0.9, 0, {8192, 16384}},          // mostly kept: short waits
                      RandomCase{300, 0.5, 0, {1, 4, 100, 2050, 17}},  // odd widths: byte path
                      RandomCase{2000, 0.6, 25, {4, 2048}},            // survivors beyond newBatch
                      RandomCase{5000, 0.3, 0, {4, 2048}},             // many tiles
                      RandomCase{10000, 0.9, 0, {4, 96}},              // many tiles of small rows
                      RandomCase{33000, 0.5, 7, {2048, 8192}}));       // the benchmark's regime

TEST_F(CompactBatchInPlaceTest, EveryBufferSlotInOneLaunch) {
  std::vector<int64_t> widths;
  for (int32_t b = 0; b < kernels::kMaxRowBuffers; ++b) {
    widths.push_back(16 * (1 + b % 5));
  }
  std::vector<int32_t> oldToNew;
  int32_t const survivors = orderPreservingMapping(oldToNew, 5000, 0.5, mRng);
  compactAndCheck(widths, 5000, oldToNew, survivors);
}

// White box (layout: kernels/kernel_params.h). Flags are never cleared except when the 32-bit
// generation wraps; a stale flag equal to the first generation's "loaded" value must not
// survive that wrap, or a later launch could store before an earlier tile has loaded.
TEST_F(CompactBatchInPlaceTest, TheGenerationWrapClearsEveryFlag) {
  using kernels::detail::kCompactHeaderWords;
  using kernels::detail::kCompactWrapGeneration;
  int32_t const oldBatch = 4096;
  std::vector<int64_t> const widths{2048};
  std::vector<int32_t> oldToNew(static_cast<std::size_t>(oldBatch));
  for (int32_t i = 0; i < oldBatch; ++i) {
    oldToNew[static_cast<std::size_t>(i)] = i - 1;  // every row shifts by one
  }
  Tensor& words = workspace(widths, oldBatch);
  // Ticket 0, the generation before the last of the cycle, finished 0, padding; every flag 1.
  std::vector<uint32_t> state(static_cast<std::size_t>(words.numel()), 1);
  std::fill_n(state.begin(), kCompactHeaderWords, 0);
  state[1] = kCompactWrapGeneration - 1;
  test::writeBytes(words, std::span(reinterpret_cast<uint8_t const*>(state.data()),
                                    state.size() * sizeof(uint32_t)));
  auto header = [&] {
    std::vector<uint32_t> const now = test::readAs<uint32_t>(words);
    return std::vector<uint32_t>(now.begin(), now.begin() + kCompactHeaderWords);
  };

  compactAndCheck(widths, oldBatch, oldToNew, oldBatch - 1);
  EXPECT_EQ(header()[1], kCompactWrapGeneration);
  compactAndCheck(widths, oldBatch, oldToNew, oldBatch - 1);  // the wrap launch
  std::vector<uint32_t> const cleared = test::readAs<uint32_t>(words);
  EXPECT_EQ(std::vector<uint32_t>(cleared.begin(), cleared.begin() + kCompactHeaderWords),
            (std::vector<uint32_t>{0, 0, 0, 0}))
      << "ticket 0, generation 0, finished 0";
  EXPECT_TRUE(std::all_of(cleared.begin() + kCompactHeaderWords, cleared.end(), [](uint32_t flag) {
    return flag == 0;
  })) << "every flag, also those of units this launch did not have, is cleared";
  compactAndCheck(widths, oldBatch, oldToNew, oldBatch - 1);
  EXPECT_EQ(header()[1], 1u);
}

}  // namespace
}  // namespace mkv::gputest
