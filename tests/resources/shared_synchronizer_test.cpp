// detail::SharedSynchronizer: the one synchronisation per completion point that the two halves
// of a sliding-window reuse request share (docs/architecture.md, "Sliding windows with context
// reuse").
#include "resources/shared_synchronizer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace mkv::detail {
namespace {

/// A wrapped synchroniser that records the streams it was called for and returns `next`.
struct Recorder {
  std::vector<cudaStream_t> calls;
  cudaError_t next = cudaSuccess;
  bool throws = false;
  StreamSynchronizer synchronizer() {
    return [this](cudaStream_t stream) {
      calls.push_back(stream);
      if (throws) {
        throw std::runtime_error("synchroniser threw");
      }
      return next;
    };
  }
};

cudaStream_t streamNumber(int n) {
  return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(n));
}

TEST(SharedSynchronizerTest, OutsideAScopeEveryCallSynchronises) {
  Recorder real;
  SharedSynchronizer shared(real.synchronizer());
  StreamSynchronizer const first = shared.view();
  StreamSynchronizer const second = shared.view();
  EXPECT_EQ(first(streamNumber(1)), cudaSuccess);
  EXPECT_EQ(second(streamNumber(1)), cudaSuccess);
  EXPECT_EQ(real.calls.size(), 2U);
  EXPECT_EQ(shared.realSynchronizations(), 2);
}

TEST(SharedSynchronizerTest, InsideAScopeTheFirstResultAnswersEveryLaterCallOfItsStream) {
  Recorder real;
  SharedSynchronizer shared(real.synchronizer());
  StreamSynchronizer const coordinator = shared.view();
  StreamSynchronizer const swa = shared.view();
  {
    SharedSynchronizer::Scope const once(&shared);
    real.next = cudaErrorUnknown;
    EXPECT_EQ(coordinator(streamNumber(1)), cudaErrorUnknown);
    real.next = cudaSuccess;  // a second real call would now succeed: it must not be made
    EXPECT_EQ(swa(streamNumber(1)), cudaErrorUnknown) << "the failure reaches both halves";
    {
      SharedSynchronizer::Scope const nested(&shared);
      EXPECT_EQ(swa(streamNumber(1)), cudaErrorUnknown) << "a nested scope shares the outer one";
    }
    EXPECT_EQ(coordinator(streamNumber(1)), cudaErrorUnknown) << "still inside the outer scope";
    EXPECT_EQ(swa(streamNumber(2)), cudaSuccess) << "another stream synchronises";
    EXPECT_EQ(real.calls, (std::vector<cudaStream_t>{streamNumber(1), streamNumber(2)}));
  }
  EXPECT_EQ(coordinator(streamNumber(1)), cudaSuccess) << "a closed scope keeps nothing";
  EXPECT_EQ(real.calls.size(), 3U);
  SharedSynchronizer::Scope const none(nullptr);  // a backend without a shared synchroniser
  EXPECT_EQ(swa(streamNumber(1)), cudaSuccess);
  EXPECT_EQ(real.calls.size(), 4U);
}

TEST(SharedSynchronizerTest, AThrowInsideAScopeIsAFailureForTheLaterCalls) {
  Recorder real;
  SharedSynchronizer shared(real.synchronizer());
  StreamSynchronizer const view = shared.view();
  SharedSynchronizer::Scope const once(&shared);
  real.throws = true;
  EXPECT_THROW(view(streamNumber(1)), std::runtime_error);
  real.throws = false;
  EXPECT_EQ(view(streamNumber(1)), cudaErrorUnknown);
  EXPECT_EQ(real.calls.size(), 1U);
}

}  // namespace
}  // namespace mkv::detail
