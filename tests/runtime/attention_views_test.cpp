// AttentionViews (include/mkv/attention_views.h): the block table, lengths, FlashInfer CSR and
// slot mapping of a step, on both devices. Every view is checked against an independent reading
// of its kernel's contract (expectedViews), and the GPU's views, built by one launch from the
// table's device copy, against the host twin's bit for bit. A real request runs on each device: the
// step's K and V go into the pool through slotMapping only, and a naive paged attention that reads
// the pool through blockTable + seqLensAfter (FlashAttention / vLLM) or through kvIndptr /
// kvIndices / kvLastPageLen (FlashInfer) must equal attention over dense K and V that never touched
// the pool. Prefix reuse, a chunked joiner, a held row, resident slots out of execution order,
// sparse-window tables, random steps of every launch capacity and the contract errors, which change
// nothing, are covered; so are the launch count and, on the GPU, that build() is one kernel and
// waits for nothing (it survives a global-mode stream capture).
#include "mkv/attention_views.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device.h"
#include "mkv/error.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/managed_kv_cache_request.h"
#include "support/test_util.h"

#if MKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mkv {
namespace {

constexpr int32_t kPage = 16;
constexpr int32_t kHeads = 2;
constexpr int32_t kHeadDim = 4;
constexpr int32_t kPoolPages = 48;

/// Every view of the last build, copied to the host (any device).
struct HostViews {
  int32_t rows = 0;
  int64_t tableWidth = 0;
  std::vector<int32_t> blockTable;
  std::vector<int32_t> before;
  std::vector<int32_t> after;
  std::vector<int32_t> queryStart;
  std::vector<int32_t> indptr;
  std::vector<int32_t> indices;
  std::vector<int32_t> lastPageLen;
  std::vector<int64_t> slotMapping;
  /// [rows, numPages], empty for views made without PhysicalPageMap::kPerRow.
  std::vector<int32_t> physicalToLogical;
};

HostViews readViews(AttentionViews const& views) {
  HostViews out;
  out.rows = views.rows();
  Tensor const& table = views.blockTable();
  EXPECT_EQ(table.rank(), 2);
  EXPECT_EQ(table.dim(0), views.rows());
  out.tableWidth = table.dim(1);
  out.blockTable = test::readAs<int32_t>(table);
  out.before = test::readAs<int32_t>(views.seqLensBefore());
  out.after = test::readAs<int32_t>(views.seqLensAfter());
  out.queryStart = test::readAs<int32_t>(views.queryStartLoc());
  out.indptr = test::readAs<int32_t>(views.kvIndptr());
  out.indices = test::readAs<int32_t>(views.kvIndices());
  out.lastPageLen = test::readAs<int32_t>(views.kvLastPageLen());
  out.slotMapping = test::readAs<int64_t>(views.slotMapping());
  EXPECT_EQ(static_cast<int64_t>(out.slotMapping.size()), views.newTokenCount());
  if (views.hasPhysicalPageMap()) {
    EXPECT_EQ(views.physicalToLogical().rank(), 2);
    EXPECT_EQ(views.physicalToLogical().dim(0), views.rows());
    out.physicalToLogical = test::readAs<int32_t>(views.physicalToLogical());
  }
  return out;
}

/// Passes when every view (shape and values) is the same in both, else names the first that is
/// not.
::testing::AssertionResult sameViews(HostViews const& actual, HostViews const& expected) {
  auto differ = [](char const* name) {
    return ::testing::AssertionFailure() << name << " differs";
  };
  if (actual.rows != expected.rows || actual.tableWidth != expected.tableWidth) {
    return ::testing::AssertionFailure()
           << actual.rows << " rows of " << actual.tableWidth << " entries, expected "
           << expected.rows << " of " << expected.tableWidth;
  }
  if (actual.blockTable != expected.blockTable) {
    return differ("blockTable");
  }
  if (actual.before != expected.before) {
    return differ("seqLensBefore");
  }
  if (actual.after != expected.after) {
    return differ("seqLensAfter");
  }
  if (actual.queryStart != expected.queryStart) {
    return differ("queryStartLoc");
  }
  if (actual.indptr != expected.indptr) {
    return differ("kvIndptr");
  }
  if (actual.indices != expected.indices) {
    return differ("kvIndices");
  }
  if (actual.lastPageLen != expected.lastPageLen) {
    return differ("kvLastPageLen");
  }
  if (actual.slotMapping != expected.slotMapping) {
    return differ("slotMapping");
  }
  if (actual.physicalToLogical != expected.physicalToLogical) {
    return differ("physicalToLogical");
  }
  return ::testing::AssertionSuccess();
}

/// The views of a step read straight from each kernel's contract (the class comment of
/// AttentionViews), from the table's host rows: written apart from the library on purpose.
HostViews expectedViews(KVPageTable const& table, int32_t tokensPerPage,
                        std::vector<CacheSlot> const& slots, std::vector<int32_t> const& before,
                        std::vector<int32_t> const& fresh, PageId nullPage,
                        bool withPageMap = false) {
  HostViews out;
  out.rows = static_cast<int32_t>(slots.size());
  out.tableWidth = table.maxPagesPerSeq();
  out.queryStart = {0};
  out.indptr = {0};
  for (std::size_t i = 0; i < slots.size(); ++i) {
    int32_t const after = before[i] + fresh[i];
    int32_t const pages = (after + tokensPerPage - 1) / tokensPerPage;
    std::vector<int32_t> row;
    for (int32_t j = 0; j < table.maxPagesPerSeq(); ++j) {
      PageId const id = j < pages ? table.entry(slots[i], j) : kNoPage;
      row.push_back(id == kNoPage ? nullPage : id);
    }
    out.blockTable.insert(out.blockTable.end(), row.begin(), row.end());
    out.before.push_back(before[i]);
    out.after.push_back(after);
    out.queryStart.push_back(out.queryStart.back() + fresh[i]);
    out.indptr.push_back(out.indptr.back() + pages);
    out.indices.insert(out.indices.end(), row.begin(), row.begin() + pages);
    out.lastPageLen.push_back(pages == 0 ? 0 : after - (pages - 1) * tokensPerPage);
    for (int32_t position = before[i]; position < after; ++position) {
      out.slotMapping.push_back(int64_t{row[static_cast<std::size_t>(position / tokensPerPage)]} *
                                    tokensPerPage +
                                position % tokensPerPage);
    }
    if (withPageMap) {  // FlexAttention: which logical page of the row each physical page is
      std::vector<int32_t> map(static_cast<std::size_t>(table.numPages()), -1);
      for (int32_t j = 0; j < pages; ++j) {
        if (PageId const id = table.entry(slots[i], j); id != kNoPage) {
          map[static_cast<std::size_t>(id)] = j;
        }
      }
      out.physicalToLogical.insert(out.physicalToLogical.end(), map.begin(), map.end());
    }
  }
  return out;
}

/// Makes every row of `to` (a host table of the same geometry) hold `from`'s host rows.
void mirrorRows(KVPageTable const& from, KVPageTable& to) {
  for (CacheSlot slot = 0; slot < from.maxBatch(); ++slot) {
    std::span<int32_t const> const kIds =
        from.hostRow(slot).first(static_cast<std::size_t>(from.maxPagesPerSeq()));
    auto const last =
        std::find_if(kIds.rbegin(), kIds.rend(), [](int32_t id) { return id != kNoPage; });
    to.setRow(slot, kIds.first(static_cast<std::size_t>(kIds.rend() - last)));
  }
}

/// The views under test over `table` (on its device) beside the host twin's over a host copy of
/// its rows: build() runs both and checks them against each other and against expectedViews.
class TwinViews {
 public:
  TwinViews(KVPageTable const& table, int32_t tokensPerPage, int32_t maxRows, int32_t maxNewTokens,
            cudaStream_t stream = nullptr)
      : mTable(table),
        mTokensPerPage(tokensPerPage),
        mMirror(table.maxBatch(), table.maxPagesPerSeq(), table.numPages(), table.mode(),
                DeviceType::kCPU),
        mViews(table, tokensPerPage, maxRows, maxNewTokens, stream, PhysicalPageMap::kPerRow),
        mTwin(mMirror, tokensPerPage, maxRows, maxNewTokens, nullptr, PhysicalPageMap::kPerRow) {}

  /// Builds the views of the step and returns them, read back, after checking them.
  HostViews build(std::vector<CacheSlot> const& slots, std::vector<int32_t> const& before,
                  std::vector<int32_t> const& fresh, PageId nullPage) {
    mirrorRows(mTable, mMirror);
    mViews.build(slots, before, fresh, nullPage);
    mTwin.build(slots, before, fresh, nullPage);
    HostViews actual = readViews(mViews);
    EXPECT_TRUE(sameViews(actual, readViews(mTwin))) << "the host twin's views";
    EXPECT_TRUE(sameViews(
        actual, expectedViews(mTable, mTokensPerPage, slots, before, fresh, nullPage, true)))
        << "the contract's views";
    return actual;
  }

  AttentionViews& views() { return mViews; }

 private:
  KVPageTable const& mTable;
  int32_t mTokensPerPage;
  KVPageTable mMirror;
  AttentionViews mViews;
  AttentionViews mTwin;
};

class AttentionViewsTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, AttentionViewsTest, test::allDeviceTypes(), test::deviceName);

/// A value that depends on every token of the prefix [0, position] (as a model's K, V and Q do)
/// and on which of them (0 K, 1 V, 2 Q), the head and the element.
float modelValue(std::vector<int32_t> const& tokens, int32_t position, int32_t which, int32_t head,
                 int32_t element) {
  constexpr uint64_t kPrime = 1099511628211U;
  uint64_t hash = 1469598103934665603U;
  for (int32_t p = 0; p <= position; ++p) {
    hash = (hash ^ static_cast<uint64_t>(tokens[static_cast<std::size_t>(p)] + 7)) * kPrime;
  }
  hash = (hash ^ static_cast<uint64_t>(which * 131 + head * 17 + element)) * kPrime;
  return static_cast<float>(hash % 2001) / 1000.0F - 1.0F;
}

/// Attention of the query at `position` of one head over keys [0, keyCount), where key(j, d) and
/// value(j, d) read one element; a plain softmax in double.
template <typename Key, typename Value>
std::vector<double> attend(std::vector<int32_t> const& tokens, int32_t position, int32_t head,
                           int32_t keyCount, Key const& key, Value const& value) {
  std::vector<double> scores(static_cast<std::size_t>(keyCount));
  double best = -std::numeric_limits<double>::infinity();
  for (int32_t j = 0; j < keyCount; ++j) {
    double dot = 0;
    for (int32_t d = 0; d < kHeadDim; ++d) {
      dot += static_cast<double>(modelValue(tokens, position, 2, head, d)) * key(j, d);
    }
    scores[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(kHeadDim));
    best = std::max(best, scores[static_cast<std::size_t>(j)]);
  }
  double total = 0;
  for (double& score : scores) {
    score = std::exp(score - best);
    total += score;
  }
  std::vector<double> out(kHeadDim, 0.0);
  for (int32_t j = 0; j < keyCount; ++j) {
    for (int32_t d = 0; d < kHeadDim; ++d) {
      out[static_cast<std::size_t>(d)] += scores[static_cast<std::size_t>(j)] / total * value(j, d);
    }
  }
  return out;
}

/// The engine side of the test: one runtime on the device, fp32 KV, sequences whose tokens the
/// test keeps; each step writes K and V through the views and checks attention three ways. The
/// pool is the runtime's on the host; on the GPU the test keeps a host pool of the same layout,
/// written and read through the views copied back (what the views address is the point, not the
/// memory).
class ViewsRig {
 public:
  explicit ViewsRig(DeviceType device) : mDevice(device) {
    KVCacheRuntimeConfig config;
    config.model.numFullAttentionLayers = 1;
    config.model.numKVHeads = kHeads;
    config.model.headDim = kHeadDim;
    config.model.kvDataType = DataType::kFloat32;
    config.maxBatchSize = 4;
    config.maxSequenceLength = 256;
    config.tokensPerPage = kPage;
    config.numPages = kPoolPages;
    config.contextReuse = true;
    config.deviceType = device;
    runtime = KVCacheRuntime::create(config);
    views.emplace(*runtime->fullPageTable(), kPage, 4, 512, runtime->config().stream);
    EXPECT_EQ(views->views().deviceType(), device);
    if (device == DeviceType::kGPU) {
      mHostPool.assign(static_cast<std::size_t>(2 * halfElements()), 0.0F);
    }
  }

  float* pool() {
    return mDevice == DeviceType::kGPU ? mHostPool.data()
                                       : runtime->fullPool()->layer(0).dataPointer<float>();
  }
  static int64_t halfElements() { return int64_t{kPoolPages} * kPage * kHeads * kHeadDim; }
  /// Element (head, d) of token slot `slot` (page * P + offset) in half `half` of the pool.
  float& poolAt(int32_t half, int64_t slot, int32_t head, int32_t d) {
    return pool()[half * halfElements() + (slot * kHeads + head) * kHeadDim + d];
  }

  /// Builds the views for `rows` (sequences' tokens, KV lengths before, new tokens), checks them
  /// against the host twin and the contract, writes the new tokens' K and V through slotMapping,
  /// and checks every new query three ways.
  void step(std::vector<CacheSlot> const& slots, std::vector<std::vector<int32_t>> const& tokens,
            std::vector<int32_t> const& before, std::vector<int32_t> const& fresh) {
    current = views->build(slots, before, fresh, /*nullPage=*/kPoolPages - 1);
    auto const n = static_cast<int32_t>(slots.size());
    ASSERT_EQ(current.rows, n);
    ASSERT_FALSE(::testing::Test::HasFailure()) << "views unlike the host twin's or the contract's";
    ASSERT_EQ(static_cast<int32_t>(current.slotMapping.size()), current.queryStart.back());
    for (int32_t i = 0; i < n; ++i) {
      for (int32_t t = 0; t < fresh[static_cast<std::size_t>(i)]; ++t) {
        int32_t const position = before[static_cast<std::size_t>(i)] + t;
        int32_t const entry = current.queryStart[static_cast<std::size_t>(i)] + t;
        int64_t const slot = current.slotMapping[static_cast<std::size_t>(entry)];
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, int64_t{kPoolPages} * kPage);
        for (int32_t h = 0; h < kHeads; ++h) {
          for (int32_t d = 0; d < kHeadDim; ++d) {
            poolAt(0, slot, h, d) =
                modelValue(tokens[static_cast<std::size_t>(i)], position, 0, h, d);
            poolAt(1, slot, h, d) =
                modelValue(tokens[static_cast<std::size_t>(i)], position, 1, h, d);
          }
        }
      }
    }
    for (int32_t i = 0; i < n; ++i) {
      checkRow(i, tokens[static_cast<std::size_t>(i)], before[static_cast<std::size_t>(i)],
               fresh[static_cast<std::size_t>(i)]);
    }
    ++steps;
  }

  void checkRow(int32_t i, std::vector<int32_t> const& tokens, int32_t before, int32_t fresh) {
    SCOPED_TRACE("step " + std::to_string(steps) + ", row " + std::to_string(i));
    int32_t const width = views->views().maxPagesPerRow();
    auto const row = static_cast<std::size_t>(i);
    int32_t const* table = current.blockTable.data() + int64_t{i} * width;
    int32_t const after = current.after[row];
    ASSERT_EQ(current.before[row], before);
    ASSERT_EQ(after, before + fresh);
    // FlashAttention / vLLM: any entry may be read (a kernel's tile can run past the length).
    for (int32_t j = 0; j < width; ++j) {
      ASSERT_GE(table[j], 0) << "entry " << j;
      ASSERT_LT(table[j], kPoolPages) << "entry " << j;
    }
    int32_t const* indptr = current.indptr.data();
    int32_t const* indices = current.indices.data();
    int32_t const lastPageLen = current.lastPageLen[row];
    int32_t const csrPages = indptr[i + 1] - indptr[i];
    int32_t const csrLength = csrPages == 0 ? 0 : (csrPages - 1) * kPage + lastPageLen;
    ASSERT_EQ(csrLength, after) << "FlashInfer's length from the CSR";
    if (csrPages > 0) {
      ASSERT_GE(lastPageLen, 1);
      ASSERT_LE(lastPageLen, kPage);
    }
    for (int32_t t = 0; t < fresh; ++t) {
      int32_t const position = before + t;
      for (int32_t h = 0; h < kHeads; ++h) {
        std::vector<double> const dense = attend(
            tokens, position, h, position + 1,
            [&](int32_t j, int32_t d) {
              return static_cast<double>(modelValue(tokens, j, 0, h, d));
            },
            [&](int32_t j, int32_t d) {
              return static_cast<double>(modelValue(tokens, j, 1, h, d));
            });
        auto faSlot = [&](int32_t j) { return int64_t{table[j / kPage]} * kPage + j % kPage; };
        std::vector<double> const flash = attend(
            tokens, position, h, position + 1,
            [&](int32_t j, int32_t d) { return static_cast<double>(poolAt(0, faSlot(j), h, d)); },
            [&](int32_t j, int32_t d) { return static_cast<double>(poolAt(1, faSlot(j), h, d)); });
        // FlashInfer: query t of q_len `fresh` sits at kv_len - q_len + t.
        int32_t const csrPosition = csrLength - fresh + t;
        auto csrSlot = [&](int32_t j) {
          return int64_t{indices[indptr[i] + j / kPage]} * kPage + j % kPage;
        };
        std::vector<double> const infer = attend(
            tokens, csrPosition, h, csrPosition + 1,
            [&](int32_t j, int32_t d) { return static_cast<double>(poolAt(0, csrSlot(j), h, d)); },
            [&](int32_t j, int32_t d) { return static_cast<double>(poolAt(1, csrSlot(j), h, d)); });
        for (std::size_t d = 0; d < dense.size(); ++d) {
          ASSERT_EQ(flash[d], dense[d]) << "block_table, position " << position << " head " << h;
          ASSERT_EQ(infer[d], dense[d]) << "CSR, position " << position << " head " << h;
        }
        ++checkedQueries;
      }
    }
  }

  std::unique_ptr<KVCacheRuntime> runtime;
  std::optional<TwinViews> views;
  HostViews current;
  int32_t steps = 0;
  int64_t checkedQueries = 0;

 private:
  DeviceType mDevice;
  std::vector<float> mHostPool;
};

std::vector<int32_t> tokenRun(int32_t first, int32_t count) {
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<std::size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    tokens.push_back((first + i * 7) % 97);
  }
  return tokens;
}

TEST_P(AttentionViewsTest, PagedReadsThroughEveryViewEqualDenseAttention) {
  ViewsRig rig(device());
  KVCacheRuntime& runtime = *rig.runtime;
  KVCachePool& pool = *runtime.fullPool();
  // Residents out of execution order: slot 0 is taken and given back, so the founders sit in
  // slots 1 and 2 and the joiner later in slot 0.
  ResidentRef const spare = runtime.residentSlots().acquire().value();
  std::vector<ResidentRef> residents{runtime.residentSlots().acquire().value(),
                                     runtime.residentSlots().acquire().value()};
  ASSERT_TRUE(runtime.residentSlots().release(spare));

  std::vector<std::vector<int32_t>> prompts{tokenRun(3, 37), tokenRun(11, 50)};
  LLMGenerationRequest request;
  request.requests.resize(2);
  DecodingInferenceContext context;
  context.activeBatchSize = 2;
  context.rawBatchedInputIds = prompts;
  context.generatedTokenIds.resize(2);
  context.residentRefs = residents;
  context.finishReasons.assign(2, FinishReason::kNotFinished);
  std::optional<ManagedKVCacheRequest> managed = ManagedKVCacheRequest::begin(
      runtime.contextCache(), nullptr, request, context, false, {1, 0},
      DecodingTokenStateContract::kCommittedPlusLookahead, request.contextCacheCommitPolicy);
  ASSERT_TRUE(managed.has_value());
  ASSERT_TRUE(managed->preparePrefill());
  std::vector<CacheSlot> slots{residents[0].slot, residents[1].slot};
  ASSERT_EQ(slots, (std::vector<CacheSlot>{1, 2}));
  std::vector<int32_t> lengths{0, 0};
  rig.step(slots, prompts, lengths, {37, 50});
  lengths = {37, 50};
  pool.writeLengths(0, lengths, nullptr);
  context.generatedTokenIds = {{5}, {6}};
  ASSERT_TRUE(managed->completePrefill(context, {}));

  auto sequenceOf = [&](std::size_t row) {
    std::vector<int32_t> all = context.rawBatchedInputIds[row];
    all.insert(all.end(), context.generatedTokenIds[row].begin(),
               context.generatedTokenIds[row].end());
    return all;
  };
  // Decode steps: each row writes its lookahead token at its committed length. Row 0 crosses a
  // page boundary at 48.
  auto decode = [&](std::vector<int32_t> const& fresh, int32_t nextToken) {
    ASSERT_TRUE(managed->prepareDecodeStep(context, {1, 0}));
    std::vector<std::vector<int32_t>> tokens;
    for (std::size_t row = 0; row < slots.size(); ++row) {
      tokens.push_back(sequenceOf(row));
    }
    rig.step(slots, tokens, lengths, fresh);
    for (std::size_t row = 0; row < slots.size(); ++row) {
      if (fresh[row] == 1) {
        lengths[row] += 1;
        context.generatedTokenIds[row].push_back(nextToken + static_cast<int32_t>(row));
      }
    }
    pool.writeLengths(0, lengths, nullptr);
    ASSERT_TRUE(managed->completeDecodeStep(context, {}));
  };
  for (int32_t s = 0; s < 12; ++s) {
    decode({1, 1}, 20 + s);
  }

  // A joiner sharing row 1's first 40 prompt tokens (2 full pages published at completePrefill):
  // admitted with 32 reused tokens, prefilled in two chunks beside the decoding rows, then held.
  std::vector<int32_t> joinerPrompt(prompts[1].begin(), prompts[1].begin() + 40);
  std::vector<int32_t> const tail = tokenRun(50, 21);
  joinerPrompt.insert(joinerPrompt.end(), tail.begin(), tail.end());
  ResidentRef const joiner = runtime.residentSlots().acquire().value();
  ASSERT_EQ(joiner.slot, 0);
  int32_t prefillStart = -1;
  ASSERT_EQ(managed->admitSequence(joinerPrompt, "", {1, 0}, prefillStart, joiner, nullptr),
            AdmitSequenceStatus::kAdmitted);
  ASSERT_EQ(prefillStart, 32);
  pool.setActiveBatchSize(3);
  lengths.push_back(prefillStart);
  pool.writeLengths(2, std::span<int32_t const>(&lengths[2], 1), nullptr);
  slots.push_back(joiner.slot);
  context.rawBatchedInputIds.push_back(joinerPrompt);
  context.generatedTokenIds.emplace_back();
  context.residentRefs.push_back(joiner);
  context.finishReasons.push_back(FinishReason::kNotFinished);
  context.activeBatchSize = 3;
  // The joiner's sequence is its prompt: the helper's lambda reads the context.
  decode({1, 1, 20}, 40);  // chunk 1: positions [32, 52)
  lengths[2] = 52;
  pool.writeLengths(2, std::span<int32_t const>(&lengths[2], 1), nullptr);
  ASSERT_TRUE(managed->completePrefillChunk(2, 52));
  decode({1, 1, 0}, 50);  // the joiner holds
  decode({1, 1, 9}, 60);  // chunk 2: positions [52, 61)
  lengths[2] = 61;
  pool.writeLengths(2, std::span<int32_t const>(&lengths[2], 1), nullptr);
  context.generatedTokenIds[2].push_back(77);
  ASSERT_TRUE(managed->finalizeSequenceAdmission(2, 77, 61));
  for (int32_t s = 0; s < 3; ++s) {
    decode({1, 1, 1}, 70 + s);
  }
  ASSERT_TRUE(managed->finish());
  managed.reset();

  // A second request reusing the first row's prompt and generated blocks: its reused KV was
  // written through the first request's slot mappings.
  std::vector<int32_t> const first = sequenceOf(0);
  std::vector<int32_t> secondPrompt(first.begin(), first.begin() + 44);
  secondPrompt.push_back(3);
  DecodingInferenceContext second;
  second.activeBatchSize = 1;
  second.rawBatchedInputIds = {secondPrompt};
  second.generatedTokenIds.resize(1);
  second.residentRefs = {residents[1]};
  second.finishReasons = {FinishReason::kNotFinished};
  LLMGenerationRequest secondRequest;
  secondRequest.requests.resize(1);
  std::optional<ManagedKVCacheRequest> reusing = ManagedKVCacheRequest::begin(
      runtime.contextCache(), nullptr, secondRequest, second, false, {1, 0},
      DecodingTokenStateContract::kCommittedPlusLookahead, secondRequest.contextCacheCommitPolicy);
  ASSERT_TRUE(reusing.has_value());
  ASSERT_EQ((*reusing->prefillStarts())[0], 32);
  ASSERT_TRUE(reusing->preparePrefill());
  rig.step({residents[1].slot}, {secondPrompt}, {32}, {13});
  ASSERT_TRUE(reusing->finish());
  EXPECT_GT(rig.checkedQueries, 2 * (37 + 50 + 24 + 29 + 13));
}

using Ints = std::vector<int32_t>;

TEST_P(AttentionViewsTest, ExactValuesOfADenseTable) {
  KVPageTable table(3, 4, 10, PageTableMode::kDense, device());
  table.setRow(0, std::vector<PageId>{7, 2});
  table.setRow(2, std::vector<PageId>{4, 5, 6});
  ASSERT_TRUE(table.upload(nullptr));
  AttentionViews views(table, 16, 3, 64);
  EXPECT_EQ(views.deviceType(), device());
  EXPECT_EQ(views.blockTable().deviceType(), device());
  // Row 0: 30 tokens, 2 new (pages 7, 2); row 1 (slot 2): 32 + 1 (a third page); row 2 (slot 1):
  // an empty row.
  views.build(std::vector<CacheSlot>{0, 2, 1}, Ints{30, 32, 0}, Ints{2, 1, 0}, 9);
  HostViews const v = readViews(views);
  EXPECT_EQ(views.blockTable().shape(), (Coords{3, 4}));
  EXPECT_EQ(v.blockTable, (Ints{7, 2, 9, 9, 4, 5, 6, 9, 9, 9, 9, 9}));
  EXPECT_EQ(v.before, (Ints{30, 32, 0}));
  EXPECT_EQ(v.after, (Ints{32, 33, 0}));
  EXPECT_EQ(v.queryStart, (Ints{0, 2, 3, 3}));
  EXPECT_EQ(v.indptr, (Ints{0, 2, 5, 5}));
  EXPECT_EQ(v.indices, (Ints{7, 2, 4, 5, 6}));
  EXPECT_EQ(v.lastPageLen, (Ints{16, 1, 0}));
  EXPECT_EQ(v.slotMapping, (std::vector<int64_t>{2 * 16 + 14, 2 * 16 + 15, 6 * 16 + 0}));
  EXPECT_EQ(views.newTokenCount(), 3);
  EXPECT_FALSE(views.hasPhysicalPageMap());
  EXPECT_TRUE(v.physicalToLogical.empty());
  EXPECT_TRUE(test::throwsError([&] { (void)views.physicalToLogical(); },
                                {"AttentionViews::physicalToLogical", "PhysicalPageMap::kPerRow"}));

  // FlexAttention's map: page 7 is row 0's logical 0, page 2 its logical 1; row 1 holds pages
  // 4, 5, 6 as 0, 1, 2; the empty row holds none. The null page (9) is no row's.
  AttentionViews flex(table, 16, 3, 64, nullptr, PhysicalPageMap::kPerRow);
  flex.build(std::vector<CacheSlot>{0, 2, 1}, Ints{30, 32, 0}, Ints{2, 1, 0}, 9);
  EXPECT_EQ(flex.physicalToLogical().shape(), (Coords{3, 10}));
  EXPECT_EQ(readViews(flex).physicalToLogical, (Ints{-1, -1, 1,  -1, -1, -1, -1, 0,  -1, -1,  //
                                                     -1, -1, -1, -1, 0,  1,  2,  -1, -1, -1,  //
                                                     -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
  // The next step's map holds only that step's rows: row 0 now reads slot 2.
  flex.build(std::vector<CacheSlot>{2}, Ints{16}, Ints{1}, 9);
  EXPECT_EQ(readViews(flex).physicalToLogical, (Ints{-1, -1, -1, -1, 0, 1, -1, -1, -1, -1}));
}

TEST_P(AttentionViewsTest, SparseWindowEntriesBecomeTheNullPage) {
  // A sliding-window row holds absolute logical pages 2 and 3 only.
  KVPageTable table(1, 5, 8, PageTableMode::kSparseWindow, device());
  table.setEntry(0, 2, 5);
  table.setEntry(0, 3, 6);
  ASSERT_TRUE(table.upload(nullptr));
  AttentionViews views(table, 16, 1, 8);
  views.build(std::vector<CacheSlot>{0}, Ints{50}, Ints{1}, 0);
  HostViews const v = readViews(views);
  EXPECT_EQ(v.blockTable, (Ints{0, 0, 5, 6, 0}));
  EXPECT_EQ(v.indptr, (Ints{0, 4}));
  EXPECT_EQ(v.indices, (Ints{0, 0, 5, 6}));
  EXPECT_EQ(v.lastPageLen, (Ints{3}));
  EXPECT_EQ(v.slotMapping, (std::vector<int64_t>{6 * 16 + 2}));
  // FlexAttention's map holds the live pages only, never the null page the empty entries read.
  AttentionViews flex(table, 16, 1, 8, nullptr, PhysicalPageMap::kPerRow);
  flex.build(std::vector<CacheSlot>{0}, Ints{50}, Ints{1}, 0);
  EXPECT_EQ(readViews(flex).physicalToLogical, (Ints{-1, -1, -1, -1, -1, 2, 3, -1}));
  // The page a step writes must be live, even in a sparse table.
  EXPECT_THROW(views.build(std::vector<CacheSlot>{0}, Ints{64}, Ints{1}, 0), Error);
}

TEST_P(AttentionViewsTest, ContractViolationsNameTheCallAndChangeNothing) {
  KVPageTable table(4, 4, 10, PageTableMode::kDense, device());
  table.setRow(0, std::vector<PageId>{1, 2});
  table.setRow(1, std::vector<PageId>{3});
  ASSERT_TRUE(table.upload(nullptr));
  AttentionViews views(table, 16, 3, 8);
  views.build(std::vector<CacheSlot>{0, 1}, Ints{20, 5}, Ints{1, 1}, 0);
  HostViews const built = readViews(views);
  auto expectRefused = [&](std::vector<CacheSlot> const& slots, Ints const& lens, Ints const& fresh,
                           PageId nullPage, std::string const& needle) {
    try {
      views.build(slots, lens, fresh, nullPage);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (Error const& error) {
      EXPECT_EQ(error.call(), "AttentionViews::build");
      EXPECT_NE(error.detail().find(needle), std::string::npos) << error.what();
    }
    EXPECT_EQ(views.rows(), 2);
    EXPECT_EQ(views.newTokenCount(), 2);
    EXPECT_EQ(views.launches(), 1);
    EXPECT_TRUE(sameViews(readViews(views), built)) << needle;
  };
  expectRefused({0, 1}, {20}, {1, 1}, 0, "1 lengths");
  expectRefused({0, 1, 2, 3}, {0, 0, 0, 0}, {0, 0, 0, 0}, 0, "at most maxRows = 3");
  expectRefused({0, 0}, {1, 1}, {1, 1}, 0, "resident slot 0 appears twice");
  expectRefused({0, 4}, {1, 1}, {1, 1}, 0, "resident slot 4 outside [0, 4)");
  expectRefused({0, 1}, {-1, 1}, {1, 1}, 0, "length -1");
  expectRefused({0, 1}, {20, 5}, {1, 1}, 10, "nullPage is 10");
  expectRefused({0, 1}, {20, 5}, {1, -2}, 0, "-2 new tokens");
  expectRefused({0, 1}, {32, 5}, {1, 1}, 0, "logical page 2 is empty");
  expectRefused({0, 2}, {20, 1}, {1, 0}, 0, "row 1 (slot 2): logical page 0 is empty");
  expectRefused({0, 1}, {60, 5}, {5, 1}, 0, "65 tokens after the step, beyond the 64");
  expectRefused({0, 1}, {20, 5}, {5, 4}, 0, "9 new tokens, at most maxNewTokens = 8");
  try {
    AttentionViews tooWide(table, 16, 5, 8);
    ADD_FAILURE() << "maxRows beyond the table accepted";
  } catch (Error const& error) {
    EXPECT_EQ(error.call(), "AttentionViews");
    EXPECT_NE(error.detail().find("maxRows is 5"), std::string::npos) << error.what();
  }
  KVPageTable wide(kernels::kMaxAttentionViewRows + 1, 1, 4, PageTableMode::kDense, device());
  EXPECT_TRUE(test::throwsError(
      [&] { AttentionViews const tooMany(wide, 16, kernels::kMaxAttentionViewRows + 1, 1); },
      {"AttentionViews: maxRows is 2001, expected [1, 2000]"}));
  EXPECT_THROW(AttentionViews(table, 0, 1, 1), Error);
  EXPECT_THROW(AttentionViews(table, 16, 1, 0), Error);
}

// The GPU views are built from the table's device copy and the checks read the host rows, so a
// table whose rows have not reached the device is refused there; the host twin reads the rows.
TEST_P(AttentionViewsTest, AGpuTableIsRefusedUntilItsRowsAreUploaded) {
  KVPageTable table(2, 4, 10, PageTableMode::kDense, device());
  table.setRow(0, std::vector<PageId>{1, 2});
  ASSERT_TRUE(table.upload(nullptr));
  AttentionViews views(table, 16, 2, 8);
  views.build(std::vector<CacheSlot>{0}, Ints{20}, Ints{1}, 0);
  table.setEntry(0, 2, 3);  // appended on the host only
  if (device() == DeviceType::kGPU) {
    HostViews const built = readViews(views);
    EXPECT_TRUE(
        test::throwsError([&] { views.build(std::vector<CacheSlot>{0}, Ints{32}, Ints{1}, 0); },
                          {"AttentionViews::build", "not yet uploaded", "flushDeviceWrites"}));
    EXPECT_TRUE(sameViews(readViews(views), built));
    EXPECT_EQ(views.launches(), 1);
    ASSERT_TRUE(table.upload(nullptr));
  }
  views.build(std::vector<CacheSlot>{0}, Ints{32}, Ints{1}, 0);
  EXPECT_EQ(readViews(views).blockTable, (Ints{1, 2, 3, 0}));
  EXPECT_EQ(views.launches(), 2);
}

// The launcher's own checks (kernels::buildAttentionViews, for callers other than AttentionViews,
// which checks the step first): each names the launcher and the value, and nothing is written or
// reshaped. It does not check which entries are live: an empty needed entry reads as nullPage.
TEST_P(AttentionViewsTest, TheLauncherRefusesWhatItCannotBuildAndWritesNothing) {
  KVPageTable table(3, 4, 10, PageTableMode::kDense, device());
  table.setRow(0, std::vector<PageId>{1, 2});
  ASSERT_TRUE(table.upload(nullptr));
  auto int32s = [this](int64_t n) { return Tensor({n}, DataType::kInt32, device()); };
  Tensor blockTable({3, 4}, DataType::kInt32, device());
  Tensor before = int32s(3);
  Tensor after = int32s(3);
  Tensor queryStart = int32s(4);
  Tensor indptr = int32s(4);
  Tensor indices = int32s(12);
  Tensor lastPageLen = int32s(3);
  Tensor slotMapping({8}, DataType::kInt64, device());
  kernels::AttentionViewTensors const views{&blockTable, &before,  &after,       &queryStart,
                                            &indptr,     &indices, &lastPageLen, &slotMapping};
  std::vector<CacheSlot> const slots{2, 0};
  Ints const lens{3, 17};
  Ints const fresh{0, 2};
  kernels::AttentionViewStep const step{slots, lens, fresh, 16, 10, 9};
  auto refused = [&](kernels::AttentionViewStep const& bad, kernels::AttentionViewTensors const& to,
                     Tensor const& from, std::string_view needle) {
    EXPECT_TRUE(test::throwsError([&] { kernels::buildAttentionViews(from, bad, to, nullptr); },
                                  {"buildAttentionViews: ", needle}));
    EXPECT_EQ(blockTable.shape(), (Coords{3, 4})) << needle;
    EXPECT_EQ(test::readAs<int32_t>(blockTable), Ints(12, 0)) << needle;
  };
  Tensor const& deviceTable = table.deviceTable();
  kernels::AttentionViewStep bad = step;
  bad.nullPage = 10;
  refused(bad, views, deviceTable, "nullPage is 10, expected a page in [0, numPages = 10)");
  bad = step;
  bad.tokensPerPage = 0;
  refused(bad, views, deviceTable, "tokensPerPage is 0");
  std::vector<CacheSlot> const outside{3, 0};
  bad = step;
  bad.residentSlots = outside;
  refused(bad, views, deviceTable, "row 0: resident slot 3 outside [0, 3)");
  Ints const tooLong{3, 63};
  bad = step;
  bad.seqLens = tooLong;
  refused(bad, views, deviceTable, "row 1: 65 tokens after the step, beyond the 64");
  std::vector<CacheSlot> const many(kernels::kMaxAttentionViewRows + 1, 0);
  Ints const zeros(many.size(), 0);
  refused({many, zeros, zeros, 16, 10, 9}, views, deviceTable,
          "2001 rows, at most kMaxAttentionViewRows = 2000");
  Tensor small = int32s(2);
  kernels::AttentionViewTensors narrow = views;
  narrow.kvIndices = &small;
  refused(step, narrow, deviceTable, "kvIndices has room for 8 bytes, the step needs 12");
  Tensor int32Slots = int32s(8);
  narrow = views;
  narrow.slotMapping = &int32Slots;
  refused(step, narrow, deviceTable, "slotMapping must be int64, got int32");
  narrow = views;
  narrow.seqLensAfter = nullptr;
  refused(step, narrow, deviceTable, "no seqLensAfter tensor given");
  Tensor shortMap = int32s(19);  // the page map of 2 rows needs 2 x 10 entries
  narrow = views;
  narrow.physicalToLogical = &shortMap;
  refused(step, narrow, deviceTable, "physicalToLogical has room for 76 bytes, the step needs 80");
  refused(step, views, indices, "table must be int32 [maxBatch, 2, maxPagesPerSeq]");
  if (device() == DeviceType::kGPU) {
    Tensor hostLengths({3}, DataType::kInt32, DeviceType::kCPU);
    narrow = views;
    narrow.seqLensBefore = &hostLengths;
    refused(step, narrow, deviceTable, "seqLensBefore is on cpu but the table is on gpu");
  }
  kernels::buildAttentionViews(deviceTable, step, views, nullptr);
  EXPECT_EQ(blockTable.shape(), (Coords{2, 4}));
  EXPECT_EQ(test::readAs<int32_t>(blockTable), (Ints{9, 9, 9, 9, 1, 2, 9, 9}));
  EXPECT_EQ(test::readAs<int32_t>(indices), (Ints{9, 1, 2}));
  EXPECT_EQ(test::readAs<int64_t>(slotMapping), (std::vector<int64_t>{2 * 16 + 1, 2 * 16 + 2}));
}

/// A table shape of RandomStepsOfEveryLaunchCapacityFollowTheContract and the row counts of its
/// steps.
struct RandomShape {
  int32_t maxBatch;
  int32_t width;
  int32_t tokensPerPage;
  int32_t numPages;
  PageTableMode mode;
  int32_t maxFresh;  ///< most new tokens of a row
  std::vector<int32_t> stepRows;
};

/// Fills every row of `table`: dense rows a random live prefix (`full`: every entry), sparse rows a
/// random window [first, end); distinct random ids within a row. Returns each row's live range.
std::vector<std::pair<int32_t, int32_t>> fillRandomRows(KVPageTable& table, bool full,
                                                        std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<std::size_t>(table.numPages()));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<std::pair<int32_t, int32_t>> live;
  std::uniform_int_distribution<int32_t> entry(0, table.maxPagesPerSeq());
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    std::shuffle(ids.begin(), ids.end(), rng);
    int32_t first = 0;
    int32_t end = full ? table.maxPagesPerSeq() : entry(rng);
    if (table.mode() == PageTableMode::kSparseWindow) {
      first = entry(rng);
      if (first > end) {
        std::swap(first, end);
      }
    }
    std::vector<PageId> row(ids.begin(), ids.begin() + end);
    std::fill(row.begin(), row.begin() + first, kNoPage);
    table.setRow(slot, row);
    live.emplace_back(first, end);
  }
  return live;
}

// Steps of random rows (out of execution order, decode, prefill and held rows) at every launch
// capacity and across its boundaries, on a table wider than a CTA's chunk of 512 pages (prefills
// whose slot mappings cross it), on sparse windows and with one-token pages: the views equal the
// contract's, and on the GPU the host twin's.
TEST_P(AttentionViewsTest, RandomStepsOfEveryLaunchCapacityFollowTheContract) {
  std::vector<RandomShape> const shapes{
      {kernels::kMaxAttentionViewRows,
       8,
       16,
       64,
       PageTableMode::kDense,
       16,
       {0, 1, 64, 65, 512, 513, kernels::kMaxAttentionViewRows}},
      {4, 1100, 4, 1200, PageTableMode::kDense, 2600, {1, 4, 3, 4, 2}},
      {16, 40, 8, 100, PageTableMode::kSparseWindow, 40, {16, 9, 16, 1}},
      {8, 64, 1, 80, PageTableMode::kDense, 64, {8, 5, 8}},
  };
  std::mt19937_64 rng(39);
  for (RandomShape const& shape : shapes) {
    SCOPED_TRACE(::testing::Message() << shape.maxBatch << " rows of " << shape.width
                                      << " pages of " << shape.tokensPerPage);
    KVPageTable table(shape.maxBatch, shape.width, shape.numPages, shape.mode, device());
    bool const full = shape.width > 512;
    std::vector<std::pair<int32_t, int32_t>> const live = fillRandomRows(table, full, rng);
    ASSERT_TRUE(table.upload(nullptr));
    int32_t const maxRows = std::min(shape.maxBatch, kernels::kMaxAttentionViewRows);
    TwinViews views(table, shape.tokensPerPage, maxRows, 1 << 20);
    int64_t const pageSize = shape.tokensPerPage;
    std::vector<CacheSlot> order(static_cast<std::size_t>(shape.maxBatch));
    std::iota(order.begin(), order.end(), 0);
    for (int32_t const n : shape.stepRows) {
      SCOPED_TRACE(::testing::Message() << n << " rows");
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<CacheSlot> const slots(order.begin(), order.begin() + n);
      Ints before;
      Ints fresh;
      for (CacheSlot const slot : slots) {
        auto const [first, end] = live[static_cast<std::size_t>(slot)];
        auto pick = [&rng](int64_t low, int64_t high) {
          return static_cast<int32_t>(std::uniform_int_distribution<int64_t>(low, high)(rng));
        };
        bool const hold = end == first || pick(0, 3) == 0;
        int32_t after = 0;
        int32_t written = 0;
        if (shape.mode == PageTableMode::kDense) {
          after = pick(0, end * pageSize);
          written = pick(0, std::min<int64_t>(after, shape.maxFresh));
        } else if (hold) {
          after = pick(0, shape.width * pageSize);  // a held row reads no page it needs
        } else {
          after = pick(first * pageSize + 1, end * pageSize);
          written = pick(0, std::min<int64_t>(after - first * pageSize, shape.maxFresh));
        }
        before.push_back(after - written);
        fresh.push_back(written);
      }
      if (full && n > 1) {  // a prefill across the first chunk's last page
        before[0] = 2048 - 300;
        fresh[0] = 2500;
      }
      auto const nullPage = static_cast<PageId>(rng() % static_cast<uint64_t>(shape.numPages));
      views.build(slots, before, fresh, nullPage);
      ASSERT_FALSE(HasFailure());
      EXPECT_EQ(views.views().rows(), n);
    }
  }
}

// build() is one launch and waits for nothing. On the GPU it is captured into a graph in global
// mode, where an allocation, a synchronisation or any other call unsafe during a capture fails
// the capture: the graph holds one kernel node, and its replay writes the step's views.
TEST_P(AttentionViewsTest, BuildIsOneLaunchThatWaitsForNothing) {
  KVPageTable table(4, 6, 20, PageTableMode::kDense, device());
  table.setRow(0, std::vector<PageId>{3, 4, 5});
  table.setRow(3, std::vector<PageId>{6, 7});
  detail::OwnedStream const stream(device());
  ASSERT_TRUE(table.upload(stream.get()));
  // With FlexAttention's page map too: still one launch.
  AttentionViews views(table, 8, 4, 32, stream.get(), PhysicalPageMap::kPerRow);
  EXPECT_EQ(views.launches(), 0) << "construction launched";
  views.build(std::vector<CacheSlot>{3, 0}, Ints{9, 20}, Ints{3, 1}, 19);
  EXPECT_EQ(views.launches(), 1);
  EXPECT_THROW(views.build(std::vector<CacheSlot>{0}, Ints{30}, Ints{1}, 19), Error);
  EXPECT_EQ(views.launches(), 1) << "a refused build launched";
  std::vector<CacheSlot> const slots{0, 3};
  Ints const before{17, 0};
  Ints const fresh{7, 16};
  HostViews const expected = expectedViews(table, 8, slots, before, fresh, 0, true);
  if (device() == DeviceType::kCPU) {
    views.build(slots, before, fresh, 0);
    EXPECT_EQ(views.launches(), 2);
    EXPECT_TRUE(sameViews(readViews(views), expected));
    return;
  }
#if MKV_WITH_CUDA
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    views.build(slots, before, fresh, 0);
  } catch (...) {
    (void)cudaStreamEndCapture(stream.get(), &graph);
    throw;
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess)
      << "build() made a call a stream capture refuses";
  EXPECT_EQ(views.launches(), 2);
  std::size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  ASSERT_EQ(nodes, 1U) << "one launch per build";
  cudaGraphNode_t node = nullptr;
  ASSERT_EQ(cudaGraphGetNodes(graph, &node, &nodes), cudaSuccess);
  cudaGraphNodeType type{};
  ASSERT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
  EXPECT_EQ(type, cudaGraphNodeTypeKernel);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  ASSERT_EQ(stream.synchronize(), cudaSuccess);
  EXPECT_TRUE(sameViews(readViews(views), expected)) << "the replay's views";
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
#endif
}

}  // namespace
}  // namespace mkv
