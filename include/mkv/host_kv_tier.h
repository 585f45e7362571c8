#pragma once
/// \file host_kv_tier.h
/// The host tier's memory and copies: a second paged KV pool in host memory with the geometry of
/// a GPU pool, and the batched, stream-ordered copies between the two (docs/architecture.md,
/// "The host tier's copies"). Which pages go where is the context cache's bookkeeping.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

namespace detail {
class Event;
class OwnedStream;
}  // namespace detail

/// One page, every layer, K and V: page `from` of the source pool to page `to` of the other.
struct HostPageCopy {
  PageId from = kNoPage;
  PageId to = kNoPage;
};

struct HostKvTierConfig {
  int32_t numPages = 0;  ///< host pages (each holds one GPU page: every layer, K and V)
  /// Consulted before each CUDA step of the tier (FaultSite::kHostTierOffload, kHostTierOnboard,
  /// kHostTierOrder), kCPU tiers too; a failure makes that step throw mkv::Error naming the call
  /// and the site. Empty = no faults.
  FaultInjector faults;
};

/// Owns the host pool and moves pages between it and a GPU pool.
///
/// Memory: per layer `[2, numPages, tokensPerPage, numKVHeads, headDim]` of the GPU pool's
/// geometry, in one allocation made at construction and zero-filled. For a kGPU pool it is pinned
/// host memory mapped into the device (cudaHostAllocMapped), which the copy kernel reads and
/// writes through its device address; the tier also creates one non-blocking stream (the tier
/// stream), two events and a device id buffer there. Nothing is allocated afterwards. For a kCPU
/// pool it is plain host memory and every copy runs synchronously (the host twin).
///
/// Ordering: every copy of the tier runs on the tier stream, in the order transfer() was called.
/// transfer() orders the tier stream after the caller's stream first (the KV an offload reads was
/// written there, and a GPU page an onboard overwrites may still be read there); orderBefore()
/// orders a caller's stream after every transfer so far (the KV an onboard wrote is read there, and
/// a GPU page an offload read may be rewritten there). Neither waits on the host. Thread-safety:
/// one caller (the engine thread).
class HostKvTier {
 public:
  /// A host pool of config.numPages pages with the layer geometry of `gpuPool` (borrowed, must
  /// outlive this). Throws mkv::Error naming "HostKvTier" for numPages <= 0, a size beyond
  /// int64, or a failed allocation.
  HostKvTier(HostKvTierConfig config, KVCachePool& gpuPool);
  /// Waits for the tier stream (the copies may still read or write the host pool), then frees.
  ~HostKvTier();
  HostKvTier(HostKvTier const&) = delete;
  HostKvTier& operator=(HostKvTier const&) = delete;

  int32_t numPages() const noexcept { return mNumPages; }
  DeviceType deviceType() const noexcept;
  /// Bytes of one page over every layer, K and V (what one offload or onboard of a page moves).
  int64_t bytesPerPage() const noexcept;
  /// Bytes of the whole host pool: numPages() * bytesPerPage().
  int64_t totalBytes() const noexcept;

  /// Moves pages; `offloads` go GPU pool -> host pool (from = GPU page, to = host page),
  /// `onboards` host pool -> GPU pool (from = host page, to = GPU page).
  /// Validates first: every id in range of its pool, the destinations of each list distinct;
  /// otherwise throws mkv::Error naming `call` and the value, and enqueues nothing.
  /// Then, on the tier stream: waits (on the device) for the work enqueued on `producer` so far,
  /// writes the page ids into the tier's device id buffer (InlinePatchBatch flushes: the ids travel
  /// in a slot of its ring or in the launch parameters), launches one copyPages for the offloads,
  /// then one for the onboards, and records the tier event. So an onboard reading a host page that
  /// an offload of the same call writes reads the new bytes, and an onboard writing a GPU page that
  /// an offload of the same call reads writes it after the read. An empty list launches nothing;
  /// two empty lists do nothing at all. kCPU: the same copies, synchronously. A failed CUDA step
  /// throws mkv::Error (the caller poisons): a failure before the offload launch leaves nothing
  /// enqueued; one at the onboard launch leaves the offloads enqueued and recorded by the tier
  /// event.
  void transfer(char const* call, std::span<HostPageCopy const> offloads,
                std::span<HostPageCopy const> onboards, cudaStream_t producer);
  /// Orders `stream` after every transfer enqueued so far: cudaStreamWaitEvent on the tier event
  /// unless cudaEventQuery says it has completed (the host never waits). kCPU: nothing to order
  /// (the fault seam is still consulted). Throws mkv::Error naming `call` on a CUDA failure.
  void orderBefore(char const* call, cudaStream_t stream);
  /// Host wait for every enqueued transfer (shutdown and tests only); returns the CUDA status of
  /// the tier stream (kCPU: cudaSuccess).
  cudaError_t synchronize() noexcept;
  /// Whether every transfer enqueued so far has completed, asked without waiting (kCPU: always):
  /// then the host may read and write any host page that no later transfer uses (the remote
  /// tier's saves and loads). Throws mkv::Error naming `call` on a CUDA failure.
  bool transfersComplete(char const* call);

  /// Descriptor of the host pool for the copy kernels: for a kGPU pool the layer bases are the
  /// device addresses of the mapped memory and deviceType is kGPU.
  kernels::PagedBuffers pagedBuffers() const noexcept;
  /// Host address of layer `layer`, half `half` (0 = K, 1 = V), host page `page`: the
  /// tokensPerPage token rows of that page, for tests and the oracle. Throws for an index out of
  /// range.
  void const* hostPage(int32_t layer, int32_t half, PageId page) const;
  /// The same address, writable: the remote tier fills a host page with a block loaded from its
  /// store, once transfersComplete() and while no queued transfer uses the page.
  void* hostPage(int32_t layer, int32_t half, PageId page);

  /// Copies enqueued so far (page copies, each covering every layer, K and V), and launches.
  int64_t pagesOffloaded() const noexcept { return mPagesOffloaded; }
  int64_t pagesOnboarded() const noexcept { return mPagesOnboarded; }
  int64_t launches() const noexcept;

 private:
  void validate(char const* call, std::span<HostPageCopy const> copies, bool offload);
  void fault(char const* call, FaultSite site) const;
  /// hostPage's address after its checks.
  uint8_t* pageAddress(int32_t layer, int32_t half, PageId page) const;
  void launch(std::span<HostPageCopy const> copies, bool offload);

  int32_t mNumPages;
  FaultInjector mFaults;
  KVCachePool& mGpu;
  int64_t mLayerBytes = 0;         ///< bytes of one layer of the host pool (both halves)
  void* mHost = nullptr;           ///< host address of the allocation
  void* mMapped = nullptr;         ///< the address kernels use (== mHost on kCPU)
  std::vector<void*> mLayerBases;  ///< per layer, the addresses kernels use
  /// Device ids: [offload from: numPages][offload to: numPages][onboard from: gpu pages]
  /// [onboard to: gpu pages], written by inline patches on the tier stream.
  Tensor mIds;
  kernels::InlinePatchBatch mIdWrites;
  std::vector<int32_t> mScratch;     ///< ids of one chunk on the host (reserved at construction)
  std::vector<uint32_t> mHostMarks;  ///< duplicate-destination check, by generation
  std::vector<uint32_t> mGpuMarks;
  uint32_t mGeneration = 0;
  std::unique_ptr<detail::OwnedStream> mStream;
  std::unique_ptr<detail::Event> mProducerDone;  ///< recorded on the producer's stream
  std::unique_ptr<detail::Event> mTierDone;      ///< recorded on the tier stream
  int64_t mPagesOffloaded = 0;
  int64_t mPagesOnboarded = 0;
  int64_t mCopyLaunches = 0;
};

}  // namespace mkv
