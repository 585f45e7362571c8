#include "mkv/media.h"

#include <gtest/gtest.h>

#include <memory>

namespace mkv {
namespace {

using imageUtils::ImageData;

ImageData rgbImage(int32_t width, int32_t height) {
  ImageData image;
  image.buffer =
      std::make_shared<Tensor>(Coords{height, width, 3}, DataType::kUInt8, DeviceType::kCPU);
  image.width = width;
  image.height = height;
  image.channels = 3;
  return image;
}

TEST(ImageDataTest, HostPackedRgbIsReadable) {
  ImageData const image = rgbImage(4, 2);
  EXPECT_EQ(image.packedBytes(), 24);
  EXPECT_EQ(image.data(), image.buffer->dataPointer<uint8_t>());
}

TEST(ImageDataTest, MissingBufferIsNotReadable) {
  ImageData image = rgbImage(4, 2);
  image.buffer.reset();
  EXPECT_EQ(image.data(), nullptr);
}

TEST(ImageDataTest, NonRgbOrMismatchedSizeIsNotReadable) {
  ImageData rgba = rgbImage(4, 2);
  rgba.channels = 4;
  EXPECT_EQ(rgba.data(), nullptr);
  ImageData wrongSize = rgbImage(4, 2);
  wrongSize.width = 5;
  EXPECT_EQ(wrongSize.data(), nullptr);
  ImageData empty = rgbImage(4, 2);
  empty.height = 0;
  EXPECT_EQ(empty.data(), nullptr);
}

TEST(ImageDataTest, NonByteBufferIsNotReadable) {
  ImageData image = rgbImage(4, 2);
  image.buffer = std::make_shared<Tensor>(Coords{6}, DataType::kInt32, DeviceType::kCPU);
  EXPECT_EQ(image.packedBytes(), 24);  // 6 int32 = 24 bytes, but not uint8 pixels
  EXPECT_EQ(image.data(), nullptr);
}

}  // namespace
}  // namespace mkv
