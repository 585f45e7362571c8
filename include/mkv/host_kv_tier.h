#pragma once
/// \file host_kv_tier.h
/// The bytes of the host tier: a KV pool in pinned host memory beside a GPU pool, and the copies
/// between them on a stream of its own (docs/architecture.md, "The host tier's copies";
/// docs/context_cache.md, "Host tier" for what the context cache keeps there).

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

namespace detail {
class Event;
class OwnedStream;
}  // namespace detail

/// One page copied between the tiers, every layer, K and V.
struct HostPageCopy {
  PageId from = kNoPage;
  PageId to = kNoPage;
};

/// Test seam of the fault model (docs/errors.md, "Poison and quarantine"): called before the CUDA
/// work of each operation with its name ("offload", "onboard", "order", "synchronize"); a status
/// other than cudaSuccess makes that operation fail as the CUDA call would (mkv::Error, or the
/// status from synchronize), before it enqueues anything. Empty: no faults.
using HostTierFaults = std::function<cudaError_t(std::string_view operation)>;

struct HostKvTierConfig {
  int32_t numPages = 0;  ///< host pages (each holds one page of every layer, K and V)
  HostTierFaults faults;
};

/// A host pool of `numPages` pages with the layer geometry of a GPU pool, and the copies between
/// the two. With a kGPU pool the host pages are pinned and mapped into the device's address space
/// (cudaHostAllocMapped), and every copy is one copyPages launch on the tier's own non-blocking
/// stream, the kernel reading or writing host memory through its mapped address; the stream, an
/// event and the page-id buffer are created here, so no copy allocates. With a kCPU pool the pages
/// are plain host memory and copies run synchronously (the host twin).
///
/// Thread-safety: one writer (the engine thread).
class HostKvTier {
 public:
  /// Throws mkv::Error for numPages <= 0 or more than int32 max / 2, or when an allocation fails.
  /// `gpuPool` is borrowed and must outlive this.
  HostKvTier(HostKvTierConfig config, KVCachePool& gpuPool);
  /// Waits for the tier's stream before freeing the host pages.
  ~HostKvTier();
  HostKvTier(HostKvTier const&) = delete;
  HostKvTier& operator=(HostKvTier const&) = delete;

  int32_t numPages() const noexcept { return mNumPages; }
  /// Bytes of one page over every layer, K and V: what one offload or onboarding moves.
  int64_t bytesPerPage() const noexcept;
  /// Bytes of the whole host pool.
  int64_t totalBytes() const noexcept { return bytesPerPage() * mNumPages; }
  DeviceType deviceType() const noexcept { return mDevice; }

  /// Enqueues on the tier's stream, in this order: one copy GPU pool -> host pool of `offloads`
  /// (from = GPU page, to = host page), then one copy host pool -> GPU pool of `onboards` (from =
  /// host page, to = GPU page), then records the tier's event. Page ids travel in kernel
  /// parameters (an inline patch into the id buffer), so the host never waits. Validates first:
  /// ids in range, at most the GPU pool's page count per list, destinations distinct within each
  /// list; mkv::Error naming `call` and the value, nothing enqueued. A failed launch throws
  /// mkv::Error (the caller poisons; copies enqueued before it may still run).
  void transfer(char const* call, std::span<HostPageCopy const> offloads,
                std::span<HostPageCopy const> onboards);
  /// Orders `stream` after every transfer enqueued so far: a device-side wait on the tier's event,
  /// skipped when the event has completed. The host never waits. kCPU: nothing to order.
  void orderBefore(char const* call, cudaStream_t stream);
  /// Blocks until every enqueued transfer has finished (shutdown and tests); the CUDA status.
  cudaError_t synchronize() noexcept;

  /// Descriptor of the host pool for the copy kernels: device-visible (mapped) addresses.
  kernels::PagedBuffers pagedBuffers() const noexcept;
  /// Host address of page `page` of half `half` (0 = K, 1 = V) of layer `layer`, for tests and
  /// the oracle. Throws mkv::Error for an index out of range.
  void const* hostPage(int32_t layer, int32_t half, PageId page) const;

 private:
  void checkCopies(char const* call, std::span<HostPageCopy const> copies, bool offload);
  void launch(std::span<HostPageCopy const> copies, bool offload);
  void fault(char const* call, std::string_view operation) const;

  HostKvTierConfig mConfig;
  KVCachePool& mGpu;
  DeviceType mDevice;
  int32_t mNumPages;
  void* mHost = nullptr;        ///< host address of layer 0
  void* mDeviceView = nullptr;  ///< the address kernels use (== mHost for kCPU)
  std::vector<void*> mLayerBases;
  std::unique_ptr<detail::OwnedStream> mStream;
  std::unique_ptr<detail::Event> mDone;
  Tensor mIds;  ///< int32 [2 * GPU pool pages]: source ids, then destination ids
  kernels::InlinePatchBatch mIdWrites;
  std::vector<int32_t> mSourceIds;       ///< scratch, reserved at construction
  std::vector<int32_t> mDestinationIds;  ///< scratch, reserved at construction
  std::vector<uint8_t> mSeen;            ///< destination marks of checkCopies
};

}  // namespace mkv
