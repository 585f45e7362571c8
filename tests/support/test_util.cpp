#include "support/test_util.h"

#include <fstream>
#include <optional>
#include <sstream>

#include "core/device.h"

namespace mkv::test {

namespace {

/// The file's text, or nullopt when it cannot be opened.
std::optional<std::string> readText(std::string const& path) {
  std::ifstream in(path);
  if (!in) {
    return std::nullopt;
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

::testing::AssertionResult pageShowsFile(std::string const& docPath, std::string_view marker,
                                         std::string const& codePath) {
  std::optional<std::string> const doc = readText(docPath);
  std::optional<std::string> const code = readText(codePath);
  if (!doc || !code || code->empty()) {
    return ::testing::AssertionFailure() << "cannot read " << (doc ? codePath : docPath);
  }
  std::string const begin = "<!-- " + std::string(marker) + ":begin -->\n```cpp\n";
  std::string const end = "```\n<!-- " + std::string(marker) + ":end -->";
  auto const from = doc->find(begin);
  auto const to = doc->find(end);
  if (from == std::string::npos || to == std::string::npos || to < from) {
    return ::testing::AssertionFailure() << docPath << " has no " << marker << " code block";
  }
  if (doc->compare(from + begin.size(), to - from - begin.size(), *code) != 0) {
    return ::testing::AssertionFailure()
           << "the " << marker << " block of " << docPath << " differs from " << codePath;
  }
  return ::testing::AssertionSuccess();
}

std::string deviceName(::testing::TestParamInfo<DeviceType> const& info) {
  return std::string(toString(info.param));
}

void DeviceTest::SetUp() {
  if (GetParam() == DeviceType::kGPU && !cudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  }
}

void synchronize(DeviceType device) {
  if (device == DeviceType::kGPU) {
    detail::synchronizeDevice();
  }
}

std::vector<uint8_t> readBytes(Tensor const& tensor) {
  std::vector<uint8_t> bytes(static_cast<std::size_t>(tensor.sizeBytes()));
  synchronize(tensor.deviceType());
  detail::copyBytes(bytes.data(), DeviceType::kCPU, tensor.rawPointer(), tensor.deviceType(),
                    bytes.size(), nullptr);
  synchronize(tensor.deviceType());
  return bytes;
}

void writeBytes(Tensor& tensor, std::span<uint8_t const> bytes) {
  if (static_cast<int64_t>(bytes.size()) != tensor.sizeBytes()) {
    throw Error("writeBytes: size mismatch");
  }
  synchronize(tensor.deviceType());
  detail::copyBytes(tensor.rawPointer(), tensor.deviceType(), bytes.data(), DeviceType::kCPU,
                    bytes.size(), nullptr);
  synchronize(tensor.deviceType());
}

Tensor int32Tensor(std::span<int32_t const> values, DeviceType device) {
  Tensor tensor({static_cast<int64_t>(values.size())}, DataType::kInt32, device);
  writeBytes(tensor, std::span<uint8_t const>(reinterpret_cast<uint8_t const*>(values.data()),
                                              values.size_bytes()));
  return tensor;
}

std::vector<uint8_t> randomBytes(std::size_t count, std::mt19937_64& rng) {
  std::vector<uint8_t> bytes(count);
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : bytes) {
    b = static_cast<uint8_t>(byte(rng));
  }
  return bytes;
}

std::vector<uint8_t> fillRandom(Tensor& tensor, std::mt19937_64& rng) {
  std::vector<uint8_t> bytes = randomBytes(static_cast<std::size_t>(tensor.sizeBytes()), rng);
  writeBytes(tensor, bytes);
  return bytes;
}

std::vector<uint8_t> fillConstant(Tensor& tensor, uint8_t value) {
  std::vector<uint8_t> bytes(static_cast<std::size_t>(tensor.sizeBytes()), value);
  writeBytes(tensor, bytes);
  return bytes;
}

}  // namespace mkv::test
