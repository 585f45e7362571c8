#pragma once
/// \file test_util.h
/// Helpers shared by the gtest suites: the device-type parameter, host <-> device copies for
/// comparisons, random and poison fills, and error-message matching.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/error.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv::test {

/// Whether the page at `docPath` shows the file at `codePath` verbatim, as the code block between
/// "<!-- MARKER:begin -->" + "```cpp" and "```" + "<!-- MARKER:end -->" (the documentation's
/// compiled examples); the failure names what is missing or differs.
::testing::AssertionResult pageShowsFile(std::string const& docPath, std::string_view marker,
                                         std::string const& codePath);

/// Parameter list of every device-parameterised suite.
inline auto allDeviceTypes() { return ::testing::Values(DeviceType::kCPU, DeviceType::kGPU); }

/// Test-name suffix: "cpu" / "gpu".
std::string deviceName(::testing::TestParamInfo<DeviceType> const& info);

/// Fixture base of TEST_P suites over DeviceType. The kGPU instantiation skips without a
/// CUDA device (or in a build without CUDA). Derived fixtures that override SetUp call
/// DeviceTest::SetUp() first and return when IsSkipped().
class DeviceTest : public ::testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override;
  DeviceType device() const { return GetParam(); }
};

/// Waits for all device work (no-op for kCPU).
void synchronize(DeviceType device);

/// All bytes of the tensor's current shape, copied to the host (synchronous).
std::vector<uint8_t> readBytes(Tensor const& tensor);
/// Overwrites the tensor's current-shape bytes with `bytes` (synchronous; sizes must match).
void writeBytes(Tensor& tensor, std::span<uint8_t const> bytes);

template <typename T>
std::vector<T> readAs(Tensor const& tensor) {
  std::vector<uint8_t> const bytes = readBytes(tensor);
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) {  // memcpy of an empty vector's null data() is undefined
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  }
  return values;
}

/// Owning int32 tensor `[values.size()]` on `device` holding `values`.
Tensor int32Tensor(std::span<int32_t const> values, DeviceType device);
inline Tensor int32Tensor(std::initializer_list<int32_t> values, DeviceType device) {
  return int32Tensor(std::span<int32_t const>(values.begin(), values.size()), device);
}

/// Fills the tensor with random bytes and returns them.
std::vector<uint8_t> fillRandom(Tensor& tensor, std::mt19937_64& rng);
/// Fills the tensor with `value` and returns the bytes.
std::vector<uint8_t> fillConstant(Tensor& tensor, uint8_t value);
std::vector<uint8_t> randomBytes(std::size_t count, std::mt19937_64& rng);

/// Succeeds when `call` throws mkv::Error whose message contains every fragment.
template <typename Call>
::testing::AssertionResult throwsError(Call&& call,
                                       std::initializer_list<std::string_view> fragments) {
  try {
    call();
  } catch (Error const& error) {
    std::string const message = error.what();
    for (std::string_view fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        return ::testing::AssertionFailure()
               << "message \"" << message << "\" does not contain \"" << fragment << "\"";
      }
    }
    return ::testing::AssertionSuccess() << message;
  } catch (std::exception const& other) {
    return ::testing::AssertionFailure() << "threw a non-mkv exception: " << other.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace mkv::test
