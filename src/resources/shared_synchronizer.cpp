#include "resources/shared_synchronizer.h"

#include <utility>

namespace mkv::detail {

SharedSynchronizer::SharedSynchronizer(StreamSynchronizer real) : mReal(std::move(real)) {}

StreamSynchronizer SharedSynchronizer::view() {
  return [this](cudaStream_t stream) { return synchronize(stream); };
}

cudaError_t SharedSynchronizer::synchronize(cudaStream_t stream) {
  if (mDepth > 0 && mHasResult && mStream == stream) {
    return mResult;
  }
  ++mRealCalls;
  cudaError_t result = cudaErrorUnknown;
  try {
    result = mReal(stream);
  } catch (...) {
    if (mDepth > 0) {  // a throw is a failed synchronisation (synchronizeStream's rule)
      mHasResult = true;
      mStream = stream;
      mResult = cudaErrorUnknown;
    }
    throw;
  }
  if (mDepth > 0) {
    mHasResult = true;
    mStream = stream;
    mResult = result;
  }
  return result;
}

SharedSynchronizer::Scope::Scope(SharedSynchronizer* shared) noexcept : mShared(shared) {
  if (mShared != nullptr) {
    ++mShared->mDepth;
  }
}

SharedSynchronizer::Scope::~Scope() {
  if (mShared != nullptr && --mShared->mDepth == 0) {
    mShared->mHasResult = false;
  }
}

}  // namespace mkv::detail
