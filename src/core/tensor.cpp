#include "mkv/tensor.h"

#include <fmt/format.h>

#include <utility>

#include "core/check.h"
#include "core/device.h"

namespace mkv {

Coords::Coords(std::initializer_list<int64_t> extents) {
  MKV_REQUIRE(extents.size() <= static_cast<std::size_t>(kMaxRank), "Coords",
              "at most {} dimensions, got {}", kMaxRank, extents.size());
  for (int64_t extent : extents) {
    MKV_REQUIRE(extent >= 0, "Coords", "extent must be >= 0, got {}", extent);
    mExtents[static_cast<std::size_t>(mRank++)] = extent;
  }
}

int64_t Coords::operator[](int32_t dim) const {
  MKV_REQUIRE(dim >= 0 && dim < mRank, "Coords::operator[]", "dimension {} outside rank {}", dim,
              mRank);
  return mExtents[static_cast<std::size_t>(dim)];
}

int64_t Coords::numel() const noexcept {
  int64_t product = 1;
  for (int32_t d = 0; d < mRank; ++d) {
    product *= mExtents[static_cast<std::size_t>(d)];
  }
  return product;
}

std::string Coords::toString() const {
  std::string text = "[";
  for (int32_t d = 0; d < mRank; ++d) {
    text += fmt::format("{}{}", d == 0 ? "" : ", ", mExtents[static_cast<std::size_t>(d)]);
  }
  return text + "]";
}

bool operator==(Coords const& a, Coords const& b) noexcept {
  if (a.mRank != b.mRank) {
    return false;
  }
  for (int32_t d = 0; d < a.mRank; ++d) {
    if (a.mExtents[static_cast<std::size_t>(d)] != b.mExtents[static_cast<std::size_t>(d)]) {
      return false;
    }
  }
  return true;
}

Tensor::Tensor(Coords const& shape, DataType dataType, DeviceType deviceType)
    : mShape(shape),
      mDataType(dataType),
      mDeviceType(deviceType),
      mCapacityBytes(sizeBytes()),
      mOwning(true) {
  auto const bytes = static_cast<std::size_t>(mCapacityBytes);
  if (bytes == 0) {
    return;
  }
  if (deviceType == DeviceType::kGPU) {
    mData = detail::allocateDevice(bytes);
    try {
      detail::fillBytes(mData, deviceType, 0, bytes, nullptr);
      detail::synchronizeDevice();
    } catch (...) {
      detail::freeDevice(mData);
      throw;
    }
  } else {
    mData = ::operator new(bytes);
    detail::fillBytes(mData, deviceType, 0, bytes, nullptr);
  }
}

Tensor::~Tensor() { release(); }

void Tensor::release() noexcept {
  if (mOwning && mData != nullptr) {
    if (mDeviceType == DeviceType::kGPU) {
      detail::freeDevice(mData);
    } else {
      ::operator delete(mData);
    }
  }
  mData = nullptr;
  mOwning = false;
  mCapacityBytes = 0;
  mShape = Coords();
}

Tensor::Tensor(Tensor&& other) noexcept
    : mData(std::exchange(other.mData, nullptr)),
      mShape(std::exchange(other.mShape, Coords())),
      mDataType(other.mDataType),
      mDeviceType(other.mDeviceType),
      mCapacityBytes(std::exchange(other.mCapacityBytes, 0)),
      mOwning(std::exchange(other.mOwning, false)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release();
    mData = std::exchange(other.mData, nullptr);
    mShape = std::exchange(other.mShape, Coords());
    mDataType = other.mDataType;
    mDeviceType = other.mDeviceType;
    mCapacityBytes = std::exchange(other.mCapacityBytes, 0);
    mOwning = std::exchange(other.mOwning, false);
  }
  return *this;
}

Tensor Tensor::view(void* data, Coords const& shape, DataType dataType, DeviceType deviceType,
                    int64_t capacityBytes) {
  Tensor tensor;
  tensor.mShape = shape;
  tensor.mDataType = dataType;
  tensor.mDeviceType = deviceType;
  int64_t const needed = tensor.sizeBytes();
  tensor.mCapacityBytes = capacityBytes < 0 ? needed : capacityBytes;
  MKV_REQUIRE(tensor.mCapacityBytes >= needed, "Tensor::view",
              "capacity {} bytes is smaller than shape {} of {} ({} bytes)", tensor.mCapacityBytes,
              shape.toString(), toString(dataType), needed);
  MKV_REQUIRE(data != nullptr || tensor.mCapacityBytes == 0, "Tensor::view",
              "null data for shape {} with {} bytes of capacity", shape.toString(),
              tensor.mCapacityBytes);
  tensor.mData = data;
  return tensor;
}

Tensor Tensor::viewOf(Tensor const& other) {
  return view(const_cast<void*>(other.rawPointer()), other.shape(), other.dataType(),
              other.deviceType(), other.capacityBytes());
}

int64_t Tensor::stride(int32_t d) const {
  MKV_REQUIRE(d >= 0 && d < rank(), "Tensor::stride", "dimension {} outside rank {}", d, rank());
  int64_t product = 1;
  for (int32_t inner = d + 1; inner < rank(); ++inner) {
    product *= mShape[inner];
  }
  return product;
}

bool Tensor::reshape(Coords const& shape) noexcept {
  if (shape.numel() * static_cast<int64_t>(dataTypeSize(mDataType)) > mCapacityBytes) {
    return false;
  }
  mShape = shape;
  return true;
}

}  // namespace mkv
