#pragma once
/// \file tensor.h
/// A linear (row-major, dense) tensor of up to 8 dimensions on the host or a GPU.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "mkv/types.h"

namespace mkv {

/// Shape of a Tensor: 0 to 8 extents, each >= 0.
class Coords {
 public:
  static constexpr int32_t kMaxRank = 8;

  Coords() = default;
  /// Throws mkv::Error for more than 8 extents or a negative extent.
  Coords(std::initializer_list<int64_t> extents);

  int32_t rank() const noexcept { return mRank; }
  int64_t operator[](int32_t dim) const;  ///< Throws for dim outside [0, rank).
  int64_t numel() const noexcept;         ///< Product of extents (1 for rank 0).
  std::string toString() const;           ///< e.g. "[2, 16, 128]".

  friend bool operator==(Coords const& a, Coords const& b) noexcept;

 private:
  int32_t mRank = 0;
  std::array<int64_t, kMaxRank> mExtents{};
};

/// Owning or non-owning dense tensor.
///
/// * Owning: allocates `numel * dataTypeSize` bytes, zero-filled, with `new` on kCPU or
///   `cudaMalloc` on kGPU (never managed memory). Move-only; the destructor frees.
/// * Non-owning view (`Tensor::view`): wraps memory the caller keeps alive.
///
/// `reshape` changes the shape within the capacity fixed at construction (both kinds), so a
/// buffer sized for the maximum batch can be viewed as the current batch without reallocating.
/// A Tensor is not thread-safe; it does no synchronisation of its own.
class Tensor {
 public:
  Tensor() = default;
  /// Allocates an owning, zero-filled tensor. Throws mkv::Error when the allocation fails or
  /// when kGPU is requested from a build without CUDA.
  Tensor(Coords const& shape, DataType dataType, DeviceType deviceType);
  ~Tensor();

  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(Tensor const&) = delete;
  Tensor& operator=(Tensor const&) = delete;

  /// Non-owning view of `data` (`capacityBytes` defaults to exactly the shape's bytes).
  /// Throws for a null pointer with a non-empty shape or a capacity smaller than the shape.
  static Tensor view(void* data, Coords const& shape, DataType dataType, DeviceType deviceType,
                     int64_t capacityBytes = -1);

  /// Non-owning view of the whole of `other` (same pointer, shape, type and capacity).
  static Tensor viewOf(Tensor const& other);

  Coords const& shape() const noexcept { return mShape; }
  int32_t rank() const noexcept { return mShape.rank(); }
  int64_t dim(int32_t d) const { return mShape[d]; }
  int64_t numel() const noexcept { return mShape.numel(); }
  /// Bytes covered by the current shape.
  int64_t sizeBytes() const noexcept {
    return numel() * static_cast<int64_t>(dataTypeSize(mDataType));
  }
  int64_t capacityBytes() const noexcept { return mCapacityBytes; }
  /// Row-major stride of dimension d, in elements.
  int64_t stride(int32_t d) const;
  DataType dataType() const noexcept { return mDataType; }
  DeviceType deviceType() const noexcept { return mDeviceType; }
  bool isOwning() const noexcept { return mOwning; }
  bool empty() const noexcept { return mData == nullptr || numel() == 0; }

  void* rawPointer() noexcept { return mData; }
  void const* rawPointer() const noexcept { return mData; }
  template <typename T>
  T* dataPointer() noexcept {
    return static_cast<T*>(mData);
  }
  template <typename T>
  T const* dataPointer() const noexcept {
    return static_cast<T const*>(mData);
  }

  /// Changes the shape when it fits the capacity; returns false (nothing changed) otherwise.
  [[nodiscard]] bool reshape(Coords const& shape) noexcept;

 private:
  void release() noexcept;

  void* mData = nullptr;
  Coords mShape;
  DataType mDataType = DataType::kUInt8;
  DeviceType mDeviceType = DeviceType::kCPU;
  int64_t mCapacityBytes = 0;
  bool mOwning = false;
};

}  // namespace mkv
