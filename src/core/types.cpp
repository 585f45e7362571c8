#include "mkv/types.h"

namespace mkv {

std::string_view toString(DataType type) noexcept {
  switch (type) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFp8E4M3:
      return "fp8e4m3";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
  }
  return "unknown";
}

std::string_view toString(DeviceType type) noexcept {
  return type == DeviceType::kCPU ? "cpu" : "gpu";
}

std::string_view toString(FinishReason reason) noexcept {
  switch (reason) {
    case FinishReason::kNotFinished:
      return "not-finished";
    case FinishReason::kEndOfSequence:
      return "end-of-sequence";
    case FinishReason::kStopString:
      return "stop-string";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

std::string_view toString(ResidentRowState state) noexcept {
  switch (state) {
    case ResidentRowState::kFree:
      return "free";
    case ResidentRowState::kActive:
      return "active";
    case ResidentRowState::kQuarantined:
      return "quarantined";
  }
  return "unknown";
}

std::string_view toString(KvStatus status) noexcept {
  switch (status) {
    case KvStatus::kOk:
      return "ok";
    case KvStatus::kRequestFailed:
      return "request-failed";
    case KvStatus::kPoisoned:
      return "poisoned";
  }
  return "unknown";
}

std::string_view toString(RowFailureReason reason) noexcept {
  switch (reason) {
    case RowFailureReason::kNone:
      return "none";
    case RowFailureReason::kNoCapacity:
      return "no-capacity";
    case RowFailureReason::kTableFull:
      return "table-full";
    case RowFailureReason::kPoisoned:
      return "poisoned";
  }
  return "unknown";
}

std::string_view toString(DeviceWriteTiming timing) noexcept {
  switch (timing) {
    case DeviceWriteTiming::kEachCall:
      return "each-call";
    case DeviceWriteTiming::kEngineStep:
      return "engine-step";
  }
  return "unknown";
}

}  // namespace mkv
