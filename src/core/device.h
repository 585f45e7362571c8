#pragma once
/// \file device.h
/// The one boundary between the library and the CUDA runtime (not installed). Every CUDA call
/// of the host code goes through these helpers, and every result is checked here. In a build
/// without CUDA the GPU branches throw mkv::Error("... built without CUDA").

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv::detail {

/// Throws mkv::Error("<what>: <cuda error name>: <description>") unless status is cudaSuccess.
void checkCuda(cudaError_t status, std::string_view what);
/// Human-readable name of a CUDA status (works without CUDA too).
std::string_view cudaErrorName(cudaError_t status) noexcept;

void* allocateDevice(std::size_t bytes);
void freeDevice(void* pointer) noexcept;
void* allocatePinnedHost(std::size_t bytes);
void freePinnedHost(void* pointer) noexcept;
/// Pinned host memory mapped into the device's address space (cudaHostAlloc with
/// cudaHostAllocMapped): returns the host address and sets `devicePointer` to the address kernels
/// use for the same bytes (cudaHostGetDevicePointer). Free with freePinnedHost. Nothing is
/// returned for 0 bytes.
void* allocateMappedHost(std::size_t bytes, void*& devicePointer);

/// Stream-ordered copy. Host-to-host copies run synchronously with memcpy; any copy that
/// touches kGPU memory is one cudaMemcpyAsync on `stream`.
void copyBytes(void* dst, DeviceType dstType, void const* src, DeviceType srcType,
               std::size_t bytes, cudaStream_t stream);
/// Stream-ordered fill of `bytes` bytes with `value` (memset / cudaMemsetAsync).
void fillBytes(void* dst, DeviceType type, int value, std::size_t bytes, cudaStream_t stream);
/// Waits for all work on the current device (construction-time initialisation only).
void synchronizeDevice();
/// Bytes a new allocation of `type` can take now: kGPU the current device's free memory
/// (cudaMemGetInfo), kCPU the host's available memory (MemAvailable of /proc/meminfo, else the
/// free physical pages), capped by what a cgroup v2 memory limit leaves. -1 when unknown.
int64_t availableMemoryBytes(DeviceType type);

/// A CUDA event used to know when staged host memory may be rewritten. For kCPU it is inert.
class Event {
 public:
  explicit Event(DeviceType deviceType);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(Event const&) = delete;
  Event& operator=(Event const&) = delete;

  void record(cudaStream_t stream);
  /// Blocks until the last recorded point has been reached (no-op if never recorded).
  void synchronize();
  /// True when the last recorded point has been reached, or nothing was recorded, or the event is
  /// inert (cudaEventQuery; never waits). Throws mkv::Error for a CUDA failure.
  bool query() const;
  /// Makes `stream` wait, on the device, for the last recorded point (cudaStreamWaitEvent); the
  /// host does not wait. No-op if never recorded or inert.
  void orderBefore(cudaStream_t stream) const;

 private:
  void* mEvent = nullptr;  // cudaEvent_t
  bool mRecorded = false;
};

/// A non-blocking CUDA stream owned by its creator (cudaStreamCreateWithFlags with
/// cudaStreamNonBlocking, destroyed with the object). For kCPU nothing is created and get() is
/// the null handle. Move-only.
class OwnedStream {
 public:
  explicit OwnedStream(DeviceType deviceType);
  ~OwnedStream();
  OwnedStream(OwnedStream&& other) noexcept;
  OwnedStream& operator=(OwnedStream&& other) = delete;
  OwnedStream(OwnedStream const&) = delete;
  OwnedStream& operator=(OwnedStream const&) = delete;

  cudaStream_t get() const noexcept { return mStream; }
  /// Blocks until all work on the stream has finished and returns its CUDA status
  /// (cudaStreamSynchronize; kCPU: cudaSuccess).
  cudaError_t synchronize() const noexcept;

 private:
  cudaStream_t mStream = nullptr;
};

/// Host memory for staging uploads: pinned (page-locked) when it feeds a kGPU copy, plain
/// heap memory for kCPU. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(std::size_t bytes, DeviceType forDevice);
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(HostBuffer const&) = delete;
  HostBuffer& operator=(HostBuffer const&) = delete;

  void* data() noexcept { return mData; }
  std::size_t size() const noexcept { return mBytes; }

 private:
  void release() noexcept;
  void* mData = nullptr;
  std::size_t mBytes = 0;
  bool mPinned = false;
};

/// Fixed-capacity int32 upload area: host staging plus a buffer on the target device, reused
/// by every operation of its owner. One `Batch` gathers several arrays and submits them with a
/// single copy; views returned by `add` are valid on the target device once the copy is
/// stream-ordered before their use. Before the staging is rewritten, the previous submission's
/// event is waited on, so a pending copy never reads overwritten bytes. Nothing is allocated
/// after construction.
class Int32Staging {
 public:
  Int32Staging(int64_t capacity, DeviceType deviceType);

  class Batch {
   public:
    /// Appends `values`; returns a view of them on the target device ([values.size()], int32).
    /// Throws mkv::Error when the staging capacity would be exceeded.
    Tensor add(std::span<int32_t const> values);
    /// One host-to-device copy of everything added (kCPU: values are already in place).
    void submit();

   private:
    friend class Int32Staging;
    Batch(Int32Staging& owner, cudaStream_t stream) : mOwner(owner), mStream(stream) {}
    Int32Staging& mOwner;
    cudaStream_t mStream;
    int64_t mUsed = 0;
  };

  /// Starts a batch on `stream`; waits for the previous batch's copy to finish reading.
  Batch begin(cudaStream_t stream);
  int64_t capacity() const noexcept { return mCapacity; }
  DeviceType deviceType() const noexcept { return mDeviceType; }

 private:
  int64_t mCapacity;
  DeviceType mDeviceType;
  HostBuffer mHost;
  Tensor mDevice;
  Event mEvent;
};

/// Pinned staging for small int32 uploads into caller-owned device buffers, split into `regions`
/// fixed regions of `capacity` entries each, every region guarded by its own event. Created once
/// with its owner (a backend keys one region per resident slot); nothing allocates afterwards,
/// so a request's lifecycle never calls cudaMalloc/cudaFree (both synchronise the device).
/// A region is used by one owner at a time. The backends use the region of a resident slot only
/// while their request holds that slot, and a compaction synchronises the stream before it
/// releases a slot, so there the event wait in upload() returns at once; KVCachePool's single
/// region (length writes beyond the inline limit) may wait for its previous copy.
class Int32UploadRegions {
 public:
  Int32UploadRegions(int32_t regions, int64_t capacity, DeviceType deviceType);

  /// Copies `values` into region `region`'s host staging and enqueues one copy of them into
  /// `dst` ([values.size()] int32 on the target device) on `stream`; kCPU: a plain copy into
  /// `dst`. Waits for the region's previous copy to have read its staging first.
  /// Throws mkv::Error when `region` is out of range or `values` exceed the capacity.
  void upload(int32_t region, std::span<int32_t const> values, void* dst, cudaStream_t stream);

  int32_t regions() const noexcept { return static_cast<int32_t>(mEvents.size()); }
  int64_t capacity() const noexcept { return mCapacity; }

 private:
  int64_t mCapacity;
  DeviceType mDeviceType;
  HostBuffer mHost;
  std::vector<Event> mEvents;
};

}  // namespace mkv::detail
