/// detail::PatchRing: inline patches launched as a graph reading mapped host slots.
#include "patch_ring.h"

#include <atomic>
#include <bit>

#include "core/check.h"
#include "core/device.h"

namespace mkv::kernels::detail {
namespace {

static_assert(std::has_single_bit(PatchRing::kSlots), "slot indices must survive the wrap");
/// The execution word has a slot's worth of bytes to itself, so the slots stay 16-byte aligned.
constexpr std::size_t kHeaderBytes = sizeof(Int32InlinePatchLaunch);

}  // namespace

PatchRing::PatchRing(uint32_t firstExecution) : mIssued(firstExecution) {
  constexpr char const* kCall = "PatchRing";
  void* device = nullptr;
  mHost = mkv::detail::allocateMappedHost(kHeaderBytes + kSlots * sizeof(Int32InlinePatchLaunch),
                                          device);
  // NOLINTBEGIN(cppcoreguidelines-prefer-member-initializer): both point into mHost, allocated
  // above in the body (clang-tidy 14 does not see that assignment)
  mExecutions = static_cast<uint32_t*>(mHost);
  *mExecutions = firstExecution;
  mSlots = reinterpret_cast<Int32InlinePatchLaunch*>(static_cast<char*>(mHost) + kHeaderBytes);
  // NOLINTEND(cppcoreguidelines-prefer-member-initializer)
  Int32RingPatchLaunch ring{};
  ring.executions = static_cast<uint32_t*>(device);
  ring.slots =
      reinterpret_cast<Int32InlinePatchLaunch const*>(static_cast<char*>(device) + kHeaderBytes);
  ring.numSlots = kSlots;
  cudaError_t status = cudaErrorNotSupported;
#if MKV_WITH_CUDA
  status = createInt32RingPatchGraph(ring, &mGraphExec);
#else
  (void)ring;
#endif
  if (status != cudaSuccess) {
    mkv::detail::freePinnedHost(mHost);
    mkv::detail::checkCuda(status, kCall);
  }
}

PatchRing::~PatchRing() {
  uint32_t const executed = std::atomic_ref<uint32_t>(*mExecutions).load(std::memory_order_acquire);
#if MKV_WITH_CUDA
  if (executed != mIssued) {
    // A launch may still read its slot: wait for the device (the ring's stream may be gone
    // already). An error there (a failed context) ends every launch: not reported again.
    (void)synchronizeRingDevice();
  }
  destroyInt32RingPatchGraph(mGraphExec);
#else
  (void)executed;
#endif
  mkv::detail::freePinnedHost(mHost);
}

Int32InlinePatchLaunch* PatchRing::acquire(cudaStream_t stream) {
  bool capturing = false;
#if MKV_WITH_CUDA
  mkv::detail::checkCuda(streamIsCapturing(stream, &capturing), "InlinePatchBatch::flush");
#else
  (void)stream;
#endif
  // Acquire: the slot's earlier contents were read before the kernel counted its execution.
  uint32_t const executed = std::atomic_ref<uint32_t>(*mExecutions).load(std::memory_order_acquire);
  if (capturing || (mBound && stream != mStream) || mIssued - executed >= kSlots) {
    return nullptr;
  }
  return mSlots + (mIssued & (kSlots - 1));
}

void PatchRing::launch(char const* call, cudaStream_t stream) {
  std::atomic_thread_fence(std::memory_order_release);  // the slot's bytes before the launch
  cudaError_t status = cudaErrorNotSupported;
#if MKV_WITH_CUDA
  status = launchInt32RingPatchGraph(mGraphExec, stream);
#else
  (void)stream;
#endif
  mkv::detail::checkCuda(status, call);
  ++mIssued;
  mStream = stream;
  mBound = true;
}

}  // namespace mkv::kernels::detail
