// AttentionViews (include/mkv/attention_views.h): the block table, lengths, FlashInfer CSR and
// slot mapping of a step, each checked against an independent reading of its kernel's contract.
// A real request runs on host tensors: the step's K and V go into the pool through slotMapping
// only, and a naive paged attention that reads the pool through blockTable + seqLensAfter
// (FlashAttention / vLLM) or through kvIndptr / kvIndices / kvLastPageLen (FlashInfer) must equal
// attention over dense K and V that never touched the pool. Prefix reuse, a chunked joiner, a
// held row, resident slots out of execution order and a sparse-window table are covered; so are
// the contract errors, which change nothing.
#include "mkv/attention_views.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mkv/error.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/managed_kv_cache_request.h"

namespace mkv {
namespace {

constexpr int32_t kPage = 16;
constexpr int32_t kHeads = 2;
constexpr int32_t kHeadDim = 4;
constexpr int32_t kPoolPages = 48;

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

/// The engine side of the test: one runtime on host tensors, fp32 KV, sequences whose tokens the
/// test keeps; each step writes K and V through the views and checks attention three ways.
class ViewsRig {
 public:
  ViewsRig() {
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
    config.deviceType = DeviceType::kCPU;
    runtime = KVCacheRuntime::create(config);
    views.emplace(*runtime->fullPageTable(), kPage, 4, 512);
  }

  float* pool() { return runtime->fullPool()->layer(0).dataPointer<float>(); }
  int64_t halfElements() const { return int64_t{kPoolPages} * kPage * kHeads * kHeadDim; }
  /// Element (head, d) of token slot `slot` (page * P + offset) in half `half` of the pool.
  float& poolAt(int32_t half, int64_t slot, int32_t head, int32_t d) {
    return pool()[half * halfElements() + (slot * kHeads + head) * kHeadDim + d];
  }

  /// Builds the views for `rows` (sequences' tokens, KV lengths before, new tokens), writes the
  /// new tokens' K and V through slotMapping, and checks every new query three ways.
  void step(std::vector<CacheSlot> const& slots, std::vector<std::vector<int32_t>> const& tokens,
            std::vector<int32_t> const& before, std::vector<int32_t> const& fresh) {
    views->build(slots, before, fresh, /*nullPage=*/kPoolPages - 1);
    auto const n = static_cast<int32_t>(slots.size());
    ASSERT_EQ(views->rows(), n);
    int64_t const* slotMap = views->slotMapping().dataPointer<int64_t>();
    int32_t const* queryStart = views->queryStartLoc().dataPointer<int32_t>();
    ASSERT_EQ(views->slotMapping().dim(0), queryStart[n]);
    for (int32_t i = 0; i < n; ++i) {
      for (int32_t t = 0; t < fresh[static_cast<std::size_t>(i)]; ++t) {
        int32_t const position = before[static_cast<std::size_t>(i)] + t;
        int64_t const slot = slotMap[queryStart[i] + t];
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
    int32_t const width = views->maxPagesPerRow();
    int32_t const* table = views->blockTable().dataPointer<int32_t>() + int64_t{i} * width;
    int32_t const after = views->seqLensAfter().dataPointer<int32_t>()[i];
    ASSERT_EQ(views->seqLensBefore().dataPointer<int32_t>()[i], before);
    ASSERT_EQ(after, before + fresh);
    // FlashAttention / vLLM: any entry may be read (a kernel's tile can run past the length).
    for (int32_t j = 0; j < width; ++j) {
      ASSERT_GE(table[j], 0) << "entry " << j;
      ASSERT_LT(table[j], kPoolPages) << "entry " << j;
    }
    int32_t const* indptr = views->kvIndptr().dataPointer<int32_t>();
    int32_t const* indices = views->kvIndices().dataPointer<int32_t>();
    int32_t const lastPageLen = views->kvLastPageLen().dataPointer<int32_t>()[i];
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
  std::optional<AttentionViews> views;
  int32_t steps = 0;
  int64_t checkedQueries = 0;
};

std::vector<int32_t> tokenRun(int32_t first, int32_t count) {
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<std::size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    tokens.push_back((first + i * 7) % 97);
  }
  return tokens;
}

TEST(AttentionViewsTest, PagedReadsThroughEveryViewEqualDenseAttention) {
  ViewsRig rig;
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

TEST(AttentionViewsTest, ExactValuesOfADenseTable) {
  KVPageTable table(3, 4, 10, PageTableMode::kDense, DeviceType::kCPU);
  table.setRow(0, std::vector<PageId>{7, 2});
  table.setRow(2, std::vector<PageId>{4, 5, 6});
  AttentionViews views(table, 16, 3, 64);
  // Row 0: 30 tokens, 2 new (pages 7, 2); row 1 (slot 2): 32 + 1 (a third page); row 2 (slot 1):
  // an empty row.
  views.build(std::vector<CacheSlot>{0, 2, 1}, std::vector<int32_t>{30, 32, 0},
              std::vector<int32_t>{2, 1, 0}, 9);
  auto values = [](Tensor const& t) {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < t.numel(); ++i) {
      out.push_back(t.dataType() == DataType::kInt64 ? t.dataPointer<int64_t>()[i]
                                                     : t.dataPointer<int32_t>()[i]);
    }
    return out;
  };
  using V = std::vector<int64_t>;
  EXPECT_EQ(views.blockTable().shape(), (Coords{3, 4}));
  EXPECT_EQ(values(views.blockTable()), (V{7, 2, 9, 9, 4, 5, 6, 9, 9, 9, 9, 9}));
  EXPECT_EQ(values(views.seqLensBefore()), (V{30, 32, 0}));
  EXPECT_EQ(values(views.seqLensAfter()), (V{32, 33, 0}));
  EXPECT_EQ(values(views.queryStartLoc()), (V{0, 2, 3, 3}));
  EXPECT_EQ(values(views.kvIndptr()), (V{0, 2, 5, 5}));
  EXPECT_EQ(values(views.kvIndices()), (V{7, 2, 4, 5, 6}));
  EXPECT_EQ(values(views.kvLastPageLen()), (V{16, 1, 0}));
  EXPECT_EQ(values(views.slotMapping()), (V{2 * 16 + 14, 2 * 16 + 15, 6 * 16 + 0}));
  EXPECT_EQ(views.newTokenCount(), 3);
}

TEST(AttentionViewsTest, SparseWindowEntriesBecomeTheNullPage) {
  // A sliding-window row holds absolute logical pages 2 and 3 only.
  KVPageTable table(1, 5, 8, PageTableMode::kSparseWindow, DeviceType::kCPU);
  table.setEntry(0, 2, 5);
  table.setEntry(0, 3, 6);
  AttentionViews views(table, 16, 1, 8);
  views.build(std::vector<CacheSlot>{0}, std::vector<int32_t>{50}, std::vector<int32_t>{1}, 0);
  std::vector<int32_t> const row(views.blockTable().dataPointer<int32_t>(),
                                 views.blockTable().dataPointer<int32_t>() + 5);
  EXPECT_EQ(row, (std::vector<int32_t>{0, 0, 5, 6, 0}));
  EXPECT_EQ(views.kvIndptr().dataPointer<int32_t>()[1], 4);
  EXPECT_EQ(views.kvLastPageLen().dataPointer<int32_t>()[0], 3);
  EXPECT_EQ(views.slotMapping().dataPointer<int64_t>()[0], 6 * 16 + 2);
  // The page a step writes must be live, even in a sparse table.
  EXPECT_THROW(
      views.build(std::vector<CacheSlot>{0}, std::vector<int32_t>{64}, std::vector<int32_t>{1}, 0),
      Error);
}

TEST(AttentionViewsTest, ContractViolationsNameTheCallAndChangeNothing) {
  KVPageTable table(4, 4, 10, PageTableMode::kDense, DeviceType::kCPU);
  table.setRow(0, std::vector<PageId>{1, 2});
  table.setRow(1, std::vector<PageId>{3});
  AttentionViews views(table, 16, 3, 8);
  views.build(std::vector<CacheSlot>{0, 1}, std::vector<int32_t>{20, 5}, std::vector<int32_t>{1, 1},
              0);
  std::vector<int32_t> const tableBefore(views.blockTable().dataPointer<int32_t>(),
                                         views.blockTable().dataPointer<int32_t>() + 8);
  auto expectRefused = [&](std::vector<CacheSlot> const& slots, std::vector<int32_t> const& lens,
                           std::vector<int32_t> const& fresh, PageId nullPage,
                           std::string const& needle) {
    try {
      views.build(slots, lens, fresh, nullPage);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (Error const& error) {
      EXPECT_EQ(error.call(), "AttentionViews::build");
      EXPECT_NE(error.detail().find(needle), std::string::npos) << error.what();
    }
    EXPECT_EQ(views.rows(), 2);
    EXPECT_EQ(views.newTokenCount(), 2);
    EXPECT_EQ(std::vector<int32_t>(views.blockTable().dataPointer<int32_t>(),
                                   views.blockTable().dataPointer<int32_t>() + 8),
              tableBefore);
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
  EXPECT_THROW(AttentionViews(table, 0, 1, 1), Error);
  EXPECT_THROW(AttentionViews(table, 16, 1, 0), Error);
}

}  // namespace
}  // namespace mkv
