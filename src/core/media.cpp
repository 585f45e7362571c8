#include "mkv/media.h"

namespace mkv::imageUtils {

int64_t ImageData::packedBytes() const noexcept {
  return static_cast<int64_t>(width) * height * channels;
}

uint8_t const* ImageData::data() const noexcept {
  if (!buffer || buffer->deviceType() != DeviceType::kCPU || channels != 3 || width <= 0 ||
      height <= 0 || buffer->dataType() != DataType::kUInt8 ||
      buffer->sizeBytes() != packedBytes() || buffer->rawPointer() == nullptr) {
    return nullptr;
  }
  return buffer->dataPointer<uint8_t>();
}

}  // namespace mkv::imageUtils
