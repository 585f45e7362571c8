#pragma once
/// \file media.h
/// Media payloads a request may carry. Context reuse keys every position of a media run on
/// a digest of the item's content (docs/context_cache.md, "Keys").

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mkv/tensor.h"

namespace mkv::imageUtils {

/// One image. `buffer` holds the pixels (kUInt8). Only host-resident packed RGB
/// (channels == 3, exactly width*height*3 bytes) can be hashed on the host; any other image
/// puts the request on context-cache bypass rather than failing it.
struct ImageData {
  std::shared_ptr<Tensor> buffer;
  int32_t width = 0;
  int32_t height = 0;
  int32_t channels = 3;

  /// Host pointer to the packed RGB bytes, or nullptr when the pixels are not host-readable
  /// packed RGB (GPU buffer, wrong type, wrong size, no buffer).
  uint8_t const* data() const noexcept;
  /// width * height * channels.
  int64_t packedBytes() const noexcept;
};

}  // namespace mkv::imageUtils

namespace mkv::audioUtils {

/// One audio clip: mono float PCM samples on the host, or only the path of a precomputed mel
/// spectrogram (then the path string is what is hashed).
struct AudioData {
  std::shared_ptr<std::vector<float>> pcm;
  std::string melSpectrogramPath;
};

}  // namespace mkv::audioUtils
