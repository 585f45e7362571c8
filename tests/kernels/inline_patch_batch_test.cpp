// kernels::InlinePatchBatch: writes to several tensors in one launch, with the effect of
// applying them one by one in the order they were added. Every batch here but one is made for
// its device, so on the GPU it launches through its ring (tests/gpu/patch_ring_test.cpp covers
// the ring's own cases: wrapping, a full ring, stream capture).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

constexpr char const* kCall = "InlinePatchBatchTest";

class InlinePatchBatchTest : public test::DeviceTest {};

TEST_P(InlinePatchBatchTest, WritesSeveralTensorsInOneLaunchAndNothingElse) {
  std::vector<int32_t> tableModel(24, -1);
  std::vector<int32_t> lengthModel(4, 0);
  std::vector<int32_t> draftModel(24, -1);
  Tensor table = test::int32Tensor(tableModel, device());
  Tensor lengths = test::int32Tensor(lengthModel, device());
  Tensor draft = test::int32Tensor(draftModel, device());
  kernels::InlinePatchBatch batch(device());
  std::vector<int32_t> const row{3, 4, 5};
  std::vector<int32_t> const rowLengths{128, 7};
  batch.add(kCall, table, 2, row, nullptr);
  batch.add(kCall, lengths, 1, rowLengths, nullptr);
  batch.add(kCall, draft, 20, row, nullptr);
  batch.add(kCall, table, 14, row, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(table), tableModel) << "queued writes are not applied yet";
  batch.flush(nullptr);
  EXPECT_EQ(batch.launches(), 1);
  EXPECT_TRUE(batch.empty());
  std::copy(row.begin(), row.end(), tableModel.begin() + 2);
  std::copy(row.begin(), row.end(), tableModel.begin() + 14);
  std::copy(rowLengths.begin(), rowLengths.end(), lengthModel.begin() + 1);
  std::copy(row.begin(), row.end(), draftModel.begin() + 20);
  EXPECT_EQ(test::readAs<int32_t>(table), tableModel);
  EXPECT_EQ(test::readAs<int32_t>(lengths), lengthModel);
  EXPECT_EQ(test::readAs<int32_t>(draft), draftModel);
}

TEST_P(InlinePatchBatchTest, AnOverlappingWriteLandsAfterTheOneBeforeIt) {
  Tensor table = test::int32Tensor(std::vector<int32_t>(16, -1), device());
  // A second tensor viewing the upper half of the same memory: overlap is found by address.
  Tensor upperHalf =
      Tensor::view(table.dataPointer<int32_t>() + 8, {8}, DataType::kInt32, device());
  kernels::InlinePatchBatch batch(device());
  batch.add(kCall, table, 6, std::vector<int32_t>{1, 1, 1, 1}, nullptr);  // entries 6..9
  batch.add(kCall, table, 8, std::vector<int32_t>{2}, nullptr);      // inside: replaces, no launch
  batch.add(kCall, upperHalf, 1, std::vector<int32_t>{3}, nullptr);  // entry 9, by address
  EXPECT_EQ(batch.launches(), 0);
  batch.add(kCall, upperHalf, 1, std::vector<int32_t>{5, 5}, nullptr);  // 9..10: flushes first
  EXPECT_EQ(batch.launches(), 1);
  batch.add(kCall, table, 0, std::vector<int32_t>{4}, nullptr);  // disjoint: stays queued
  EXPECT_EQ(batch.launches(), 1);
  batch.flush(nullptr);
  std::vector<int32_t> expected(16, -1);
  expected[0] = 4;
  expected[6] = 1;
  expected[7] = 1;
  expected[8] = 2;
  expected[9] = 5;
  expected[10] = 5;
  EXPECT_EQ(test::readAs<int32_t>(table), expected);
}

TEST_P(InlinePatchBatchTest, FlushesFirstWhenTheValuesOrTheTargetsAreFull) {
  Tensor big = test::int32Tensor(std::vector<int32_t>(2000, 0), device());
  kernels::InlinePatchBatch batch(device());
  std::vector<int32_t> const block(600, 5);
  batch.add(kCall, big, 0, block, nullptr);
  EXPECT_EQ(batch.launches(), 0);
  batch.add(kCall, big, 1000, block, nullptr);  // 1,206 entries would exceed the limit
  EXPECT_EQ(batch.launches(), 1);
  batch.flush(nullptr);
  std::vector<int32_t> expected(2000, 0);
  std::fill_n(expected.begin(), 600, 5);
  std::fill_n(expected.begin() + 1000, 600, 5);
  EXPECT_EQ(test::readAs<int32_t>(big), expected);

  std::vector<Tensor> small;
  for (int32_t t = 0; t <= kernels::kMaxInlinePatchTargets; ++t) {
    small.push_back(test::int32Tensor({0, 0}, device()));
  }
  for (int32_t t = 0; t <= kernels::kMaxInlinePatchTargets; ++t) {
    batch.add(kCall, small[static_cast<std::size_t>(t)], 1, std::vector<int32_t>{t + 1}, nullptr);
  }
  EXPECT_EQ(batch.launches(), 3) << "the fifth tensor flushes the four before it";
  batch.flush(nullptr);
  for (int32_t t = 0; t <= kernels::kMaxInlinePatchTargets; ++t) {
    EXPECT_EQ(test::readAs<int32_t>(small[static_cast<std::size_t>(t)]),
              (std::vector<int32_t>{0, t + 1}));
  }
}

TEST_P(InlinePatchBatchTest, RejectsABadWriteAndKeepsWhatWasQueued) {
  Tensor table = test::int32Tensor(std::vector<int32_t>(8, -1), device());
  Tensor floats({8}, DataType::kFloat32, device());
  kernels::InlinePatchBatch batch(device());
  batch.add(kCall, table, 0, std::vector<int32_t>{9}, nullptr);
  EXPECT_TRUE(throwsError([&] { batch.add(kCall, floats, 0, std::vector<int32_t>{1}, nullptr); },
                          {kCall, "must be int32"}));
  EXPECT_TRUE(throwsError(
      [&] {
        batch.add(kCall, table, 6, std::vector<int32_t>{1, 2, 3}, nullptr);
      },
      {kCall, "[6, 9)", "8 entries"}));
  EXPECT_TRUE(throwsError([&] { batch.add(kCall, table, -1, std::vector<int32_t>{1}, nullptr); },
                          {kCall, "[-1, 0)"}));
  std::vector<int32_t> const tooMany(static_cast<std::size_t>(kernels::kMaxInlinePatchValues), 1);
  Tensor big = test::int32Tensor(std::vector<int32_t>(2000, 0), device());
  EXPECT_TRUE(throwsError([&] { batch.add(kCall, big, 0, tooMany, nullptr); },
                          {kCall, "exceed the inline limit"}));
  if (device() == DeviceType::kGPU) {
    Tensor host = test::int32Tensor({0}, DeviceType::kCPU);
    EXPECT_TRUE(throwsError([&] { batch.add(kCall, host, 0, std::vector<int32_t>{1}, nullptr); },
                            {kCall, "a cpu tensor joins writes queued for gpu tensors"}));
  }
  EXPECT_EQ(batch.launches(), 0);
  EXPECT_EQ(test::readAs<int32_t>(table), std::vector<int32_t>(8, -1));
  batch.flush(nullptr);
  std::vector<int32_t> expected(8, -1);
  expected[0] = 9;
  EXPECT_EQ(test::readAs<int32_t>(table), expected);
}

TEST_P(InlinePatchBatchTest, FlushAfterAppliesWhatWasQueuedWhenTheQueueingThrows) {
  Tensor table = test::int32Tensor(std::vector<int32_t>(4, 0), device());
  kernels::InlinePatchBatch batch(device());
  EXPECT_THROW(batch.flushAfter(nullptr,
                                [&] {
                                  batch.add(kCall, table, 0, std::vector<int32_t>{7}, nullptr);
                                  throw std::runtime_error("a later check failed");
                                }),
               std::runtime_error);
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(test::readAs<int32_t>(table), (std::vector<int32_t>{7, 0, 0, 0}));
  batch.add(kCall, table, 3, std::vector<int32_t>{1}, nullptr);
  batch.discard();
  batch.flush(nullptr);
  EXPECT_EQ(batch.launches(), 1) << "nothing left to launch after discard()";
  EXPECT_EQ(test::readAs<int32_t>(table), (std::vector<int32_t>{7, 0, 0, 0}));
}

TEST_P(InlinePatchBatchTest, AFailedLaunchThrowsAndKeepsTheQueueForTheNextFlush) {
  Tensor table = test::int32Tensor(std::vector<int32_t>(4, 0), device());
  kernels::InlinePatchBatch batch(device());
  int32_t asked = 0;
  cudaError_t status = cudaErrorUnknown;
  batch.setFaults([&](FaultSite site) {
    asked += site == FaultSite::kDeviceWriteLaunch ? 1 : 100;  // 100: asked about another site
    return status;
  });
  batch.flush(nullptr);
  EXPECT_EQ(asked, 0) << "an empty batch has nothing to launch";
  batch.add(kCall, table, 1, std::vector<int32_t>{5, 6}, nullptr);
  EXPECT_TRUE(
      throwsError([&] { batch.flush(nullptr); }, {"InlinePatchBatch::flush", "cudaErrorUnknown"}));
  EXPECT_EQ(asked, 1);
  EXPECT_FALSE(batch.empty()) << "the failed flush dropped its writes";
  EXPECT_EQ(batch.launches(), 0);
  EXPECT_EQ(test::readAs<int32_t>(table), (std::vector<int32_t>{0, 0, 0, 0}));
  status = cudaSuccess;
  batch.add(kCall, table, 3, std::vector<int32_t>{7}, nullptr);
  batch.flush(nullptr);
  EXPECT_EQ(batch.launches(), 1) << "the kept and the new write in one launch";
  EXPECT_EQ(test::readAs<int32_t>(table), (std::vector<int32_t>{0, 5, 6, 7}));
}

TEST_P(InlinePatchBatchTest, RandomWritesMatchApplyingThemOneByOne) {
  // With and without a ring: on the GPU the ring's graph launches and the inline launches it
  // hands over to when the GPU lags must interleave in order.
  for (bool const withRing : {false, true}) {
    SCOPED_TRACE(withRing ? "with a ring" : "inline launches only");
    std::mt19937_64 rng(20261203);
    constexpr int32_t kTensors = 6;
    constexpr int32_t kSize = 300;
    std::vector<std::vector<int32_t>> models(kTensors, std::vector<int32_t>(kSize, 0));
    std::vector<Tensor> tensors;
    for (auto const& model : models) {
      tensors.push_back(test::int32Tensor(model, device()));
    }
    kernels::InlinePatchBatch batch =
        withRing ? kernels::InlinePatchBatch(device()) : kernels::InlinePatchBatch();
    for (int32_t op = 0; op < 2000; ++op) {
      auto const t = static_cast<std::size_t>(rng() % kTensors);
      auto const count = static_cast<int32_t>(1 + rng() % 40);
      auto const offset = static_cast<int32_t>(rng() % static_cast<uint64_t>(kSize - count + 1));
      std::vector<int32_t> values(static_cast<std::size_t>(count));
      for (int32_t& value : values) {
        value = static_cast<int32_t>(rng() % 1000);
      }
      batch.add(kCall, tensors[t], offset, values, nullptr);
      std::copy(values.begin(), values.end(), models[t].begin() + offset);
      if (rng() % 16 == 0) {
        batch.flush(nullptr);
      }
    }
    batch.flush(nullptr);
    for (std::size_t t = 0; t < models.size(); ++t) {
      EXPECT_EQ(test::readAs<int32_t>(tensors[t]), models[t]) << "tensor " << t;
    }
    EXPECT_LT(batch.launches(), 2000) << "disjoint writes share launches";
    if (!withRing || device() == DeviceType::kCPU) {
      EXPECT_EQ(batch.ringLaunches(), 0);
    } else {
      EXPECT_GT(batch.ringLaunches(), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, InlinePatchBatchTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
