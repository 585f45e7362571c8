#include "core/device.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "core/check.h"
#include "mkv/stream.h"

#if MKV_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mkv::detail {
namespace {
[[noreturn, maybe_unused]] void throwNoCuda(std::string_view what) {
  throwError(fmt::format("{}: GPU memory requested, but managedkv was built without CUDA", what));
}
}  // namespace

std::string_view cudaErrorName(cudaError_t status) noexcept {
#if MKV_WITH_CUDA
  return cudaGetErrorName(status);
#else
  switch (status) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    case cudaErrorUnknown:
      return "cudaErrorUnknown";
  }
  return "cudaError(unknown)";
#endif
}

void checkCuda(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) [[likely]] {
    return;
  }
#if MKV_WITH_CUDA
  throwError(fmt::format("{}: {}: {}", what, cudaGetErrorName(status), cudaGetErrorString(status)));
#else
  throwError(fmt::format("{}: {}", what, cudaErrorName(status)));
#endif
}

void* allocateDevice(std::size_t bytes) {
#if MKV_WITH_CUDA
  void* pointer = nullptr;
  if (bytes == 0) {
    return nullptr;
  }
  checkCuda(cudaMalloc(&pointer, bytes), fmt::format("cudaMalloc({} bytes)", bytes));
  return pointer;
#else
  (void)bytes;
  throwNoCuda("allocateDevice");
#endif
}

void freeDevice(void* pointer) noexcept {
#if MKV_WITH_CUDA
  if (pointer != nullptr) {
    (void)cudaFree(pointer);
  }
#else
  (void)pointer;
#endif
}

void* allocatePinnedHost(std::size_t bytes) {
#if MKV_WITH_CUDA
  void* pointer = nullptr;
  if (bytes == 0) {
    return nullptr;
  }
  checkCuda(cudaMallocHost(&pointer, bytes), fmt::format("cudaMallocHost({} bytes)", bytes));
  return pointer;
#else
  (void)bytes;
  throwNoCuda("allocatePinnedHost");
#endif
}

void freePinnedHost(void* pointer) noexcept {
#if MKV_WITH_CUDA
  if (pointer != nullptr) {
    (void)cudaFreeHost(pointer);
  }
#else
  (void)pointer;
#endif
}

void* allocateMappedHost(std::size_t bytes, void*& devicePointer) {
  devicePointer = nullptr;
#if MKV_WITH_CUDA
  if (bytes == 0) {
    return nullptr;
  }
  void* pointer = nullptr;
  checkCuda(cudaHostAlloc(&pointer, bytes, cudaHostAllocMapped),
            fmt::format("cudaHostAlloc({} bytes, cudaHostAllocMapped)", bytes));
  void* mapped = nullptr;
  cudaError_t const status = cudaHostGetDevicePointer(&mapped, pointer, 0);
  if (status != cudaSuccess) {
    (void)cudaFreeHost(pointer);
    checkCuda(status, "cudaHostGetDevicePointer");
  }
  devicePointer = mapped;
  return pointer;
#else
  (void)bytes;
  throwNoCuda("allocateMappedHost");
#endif
}

void copyBytes(void* dst, DeviceType dstType, void const* src, DeviceType srcType,
               std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) {
    return;
  }
  if (dstType == DeviceType::kCPU && srcType == DeviceType::kCPU) {
    std::memmove(dst, src, bytes);
    return;
  }
#if MKV_WITH_CUDA
  checkCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
#else
  (void)stream;
  throwNoCuda("copyBytes");
#endif
}

void fillBytes(void* dst, DeviceType type, int value, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) {
    return;
  }
  if (type == DeviceType::kCPU) {
    std::memset(dst, value, bytes);
    return;
  }
#if MKV_WITH_CUDA
  checkCuda(cudaMemsetAsync(dst, value, bytes, stream), "cudaMemsetAsync");
#else
  (void)stream;
  throwNoCuda("fillBytes");
#endif
}

namespace {
/// MemAvailable of /proc/meminfo in bytes, -1 when it cannot be read.
int64_t memAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kib) == 1) {
      return static_cast<int64_t>(kib) * 1024;
    }
  }
  return -1;
}

/// What the cgroup v2 memory limit of this process leaves (memory.max - memory.current), -1
/// without a limit or when it cannot be read.
int64_t cgroupHeadroomBytes() {
  std::ifstream maxFile("/sys/fs/cgroup/memory.max");
  std::ifstream currentFile("/sys/fs/cgroup/memory.current");
  std::string max;
  long long current = 0;
  if (!(maxFile >> max) || max == "max" || !(currentFile >> current)) {
    return -1;
  }
  long long const limit = std::atoll(max.c_str());
  return limit > 0 ? std::max<int64_t>(0, limit - current) : -1;
}
}  // namespace

int64_t availableMemoryBytes(DeviceType type) {
  if (type == DeviceType::kGPU) {
#if MKV_WITH_CUDA
    std::size_t free = 0;
    std::size_t total = 0;
    return cudaMemGetInfo(&free, &total) == cudaSuccess ? static_cast<int64_t>(free) : -1;
#else
    throwNoCuda("availableMemoryBytes(kGPU)");
#endif
  }
  int64_t available = memAvailableBytes();
  if (available < 0) {
    long const pages = sysconf(_SC_AVPHYS_PAGES);
    long const pageSize = sysconf(_SC_PAGESIZE);
    available = pages > 0 && pageSize > 0 ? int64_t{pages} * pageSize : -1;
  }
  int64_t const cgroup = cgroupHeadroomBytes();
  return cgroup >= 0 && (available < 0 || cgroup < available) ? cgroup : available;
}

void synchronizeDevice() {
#if MKV_WITH_CUDA
  checkCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

Event::Event(DeviceType deviceType) {
  if (deviceType == DeviceType::kGPU) {
#if MKV_WITH_CUDA
    cudaEvent_t event = nullptr;
    checkCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    mEvent = event;
#else
    throwNoCuda("Event");
#endif
  }
}

Event::~Event() {
#if MKV_WITH_CUDA
  if (mEvent != nullptr) {
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(mEvent));
  }
#endif
}

Event::Event(Event&& other) noexcept
    : mEvent(std::exchange(other.mEvent, nullptr)),
      mRecorded(std::exchange(other.mRecorded, false)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event dying(std::move(*this));
    mEvent = std::exchange(other.mEvent, nullptr);
    mRecorded = std::exchange(other.mRecorded, false);
  }
  return *this;
}

void Event::record(cudaStream_t stream) {
#if MKV_WITH_CUDA
  if (mEvent != nullptr) {
    checkCuda(cudaEventRecord(static_cast<cudaEvent_t>(mEvent), stream), "cudaEventRecord");
    mRecorded = true;
  }
#else
  (void)stream;
#endif
}

void Event::synchronize() {
#if MKV_WITH_CUDA
  if (mEvent != nullptr && mRecorded) {
    checkCuda(cudaEventSynchronize(static_cast<cudaEvent_t>(mEvent)), "cudaEventSynchronize");
  }
#endif
}

bool Event::query() const {
#if MKV_WITH_CUDA
  if (mEvent == nullptr || !mRecorded) {
    return true;
  }
  cudaError_t const status = cudaEventQuery(static_cast<cudaEvent_t>(mEvent));
  if (status == cudaErrorNotReady) {
    return false;
  }
  checkCuda(status, "cudaEventQuery");
  return true;
#else
  return true;
#endif
}

void Event::orderBefore(cudaStream_t stream) const {
#if MKV_WITH_CUDA
  if (mEvent != nullptr && mRecorded) {
    checkCuda(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(mEvent), 0),
              "cudaStreamWaitEvent");
  }
#else
  (void)stream;
#endif
}

OwnedStream::OwnedStream(DeviceType deviceType) {
  if (deviceType == DeviceType::kGPU) {
#if MKV_WITH_CUDA
    cudaStream_t stream = nullptr;
    checkCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    mStream = stream;
#else
    throwNoCuda("OwnedStream");
#endif
  }
}

OwnedStream::~OwnedStream() {
#if MKV_WITH_CUDA
  if (mStream != nullptr) {
    (void)cudaStreamDestroy(mStream);
  }
#endif
}

OwnedStream::OwnedStream(OwnedStream&& other) noexcept
    : mStream(std::exchange(other.mStream, nullptr)) {}

cudaError_t OwnedStream::synchronize() const noexcept {
#if MKV_WITH_CUDA
  if (mStream != nullptr) {
    return cudaStreamSynchronize(mStream);
  }
#endif
  return cudaSuccess;
}

HostBuffer::HostBuffer(std::size_t bytes, DeviceType forDevice)
    : mBytes(bytes), mPinned(forDevice == DeviceType::kGPU) {
  if (bytes == 0) {
    return;
  }
  mData = mPinned ? allocatePinnedHost(bytes) : ::operator new(bytes);
  std::memset(mData, 0, bytes);
}

HostBuffer::~HostBuffer() { release(); }

void HostBuffer::release() noexcept {
  if (mData != nullptr) {
    if (mPinned) {
      freePinnedHost(mData);
    } else {
      ::operator delete(mData);
    }
  }
  mData = nullptr;
  mBytes = 0;
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : mData(std::exchange(other.mData, nullptr)),
      mBytes(std::exchange(other.mBytes, 0)),
      mPinned(other.mPinned) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    mData = std::exchange(other.mData, nullptr);
    mBytes = std::exchange(other.mBytes, 0);
    mPinned = other.mPinned;
  }
  return *this;
}

Int32Staging::Int32Staging(int64_t capacity, DeviceType deviceType)
    : mCapacity(capacity),
      mDeviceType(deviceType),
      mHost(static_cast<std::size_t>(capacity) * sizeof(int32_t), deviceType),
      mDevice(deviceType == DeviceType::kGPU ? Tensor({capacity}, DataType::kInt32, deviceType)
                                             : Tensor()),
      mEvent(deviceType) {
  MKV_REQUIRE(capacity > 0, "Int32Staging", "capacity must be positive, got {}", capacity);
}

Int32Staging::Batch Int32Staging::begin(cudaStream_t stream) {
  mEvent.synchronize();
  return Batch(*this, stream);
}

Tensor Int32Staging::Batch::add(std::span<int32_t const> values) {
  auto const count = static_cast<int64_t>(values.size());
  MKV_REQUIRE(mUsed + count <= mOwner.mCapacity, "Int32Staging::add",
              "{} values do not fit: {} of {} already used", count, mUsed, mOwner.mCapacity);
  auto* host = static_cast<int32_t*>(mOwner.mHost.data()) + mUsed;
  if (count > 0) {
    std::memcpy(host, values.data(), values.size_bytes());
  }
  int32_t* target =
      mOwner.mDeviceType == DeviceType::kGPU ? mOwner.mDevice.dataPointer<int32_t>() + mUsed : host;
  mUsed += count;
  return Tensor::view(target, {count}, DataType::kInt32, mOwner.mDeviceType);
}

void Int32Staging::Batch::submit() {
  if (mOwner.mDeviceType == DeviceType::kGPU && mUsed > 0) {
    copyBytes(mOwner.mDevice.rawPointer(), DeviceType::kGPU, mOwner.mHost.data(), DeviceType::kCPU,
              static_cast<std::size_t>(mUsed) * sizeof(int32_t), mStream);
    mOwner.mEvent.record(mStream);
  }
}

Int32UploadRegions::Int32UploadRegions(int32_t regions, int64_t capacity, DeviceType deviceType)
    : mCapacity(capacity), mDeviceType(deviceType) {
  MKV_REQUIRE(regions > 0 && capacity > 0, "Int32UploadRegions",
              "regions and capacity must be positive, got {} and {}", regions, capacity);
  if (deviceType == DeviceType::kGPU) {
    mHost = HostBuffer(
        static_cast<std::size_t>(regions) * static_cast<std::size_t>(capacity) * sizeof(int32_t),
        deviceType);
  }
  mEvents.reserve(static_cast<std::size_t>(regions));
  for (int32_t r = 0; r < regions; ++r) {
    mEvents.emplace_back(deviceType);
  }
}

void Int32UploadRegions::upload(int32_t region, std::span<int32_t const> values, void* dst,
                                cudaStream_t stream) {
  MKV_REQUIRE(region >= 0 && region < regions(), "Int32UploadRegions::upload",
              "region {} outside [0, {})", region, regions());
  MKV_REQUIRE(static_cast<int64_t>(values.size()) <= mCapacity, "Int32UploadRegions::upload",
              "{} values exceed the region capacity {}", values.size(), mCapacity);
  if (values.empty()) {
    return;
  }
  if (mDeviceType == DeviceType::kCPU) {
    std::memmove(dst, values.data(), values.size_bytes());
    return;
  }
  Event& event = mEvents[static_cast<std::size_t>(region)];
  event.synchronize();
  auto* staged = static_cast<int32_t*>(mHost.data()) + static_cast<int64_t>(region) * mCapacity;
  std::memcpy(staged, values.data(), values.size_bytes());
  copyBytes(dst, DeviceType::kGPU, staged, DeviceType::kCPU, values.size_bytes(), stream);
  event.record(stream);
}

}  // namespace mkv::detail

namespace mkv {

StreamSynchronizer defaultStreamSynchronizer(DeviceType deviceType) {
  if (deviceType == DeviceType::kCPU) {
    return [](cudaStream_t) { return cudaSuccess; };
  }
#if MKV_WITH_CUDA
  return [](cudaStream_t stream) { return cudaStreamSynchronize(stream); };
#else
  return [](cudaStream_t) { return cudaErrorNoDevice; };
#endif
}

bool cudaDeviceAvailable() noexcept { return cudaDeviceCount() > 0; }

int32_t cudaDeviceCount() noexcept {
#if MKV_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

void setCurrentCudaDevice(int32_t device) {
  int32_t const count = cudaDeviceCount();
  MKV_REQUIRE(device >= 0 && device < count, "setCurrentCudaDevice",
              "device {} is not one of the {} visible CUDA devices", device, count);
#if MKV_WITH_CUDA
  detail::checkCuda(cudaSetDevice(device), "setCurrentCudaDevice");
#endif
}

}  // namespace mkv
