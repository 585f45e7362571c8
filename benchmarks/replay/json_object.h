#pragma once
/// \file json_object.h
/// A strict parser for the one-object-per-line JSON of request traces (RFC 8259 syntax).
///
/// It keeps what a trace line needs: numbers, strings (every escape, \u with surrogate pairs,
/// encoded as UTF-8), booleans, null and arrays of numbers. Any other value (a nested object, an
/// array holding anything but numbers) is checked for syntax and kept as kOther, so unknown keys
/// never make a line fail. No external JSON library exists on the build machines.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mkv::replay {

/// A malformed line. `column` is 1-based and points at the offending character.
class JsonSyntaxError : public std::runtime_error {
 public:
  JsonSyntaxError(std::string const& message, std::size_t column)
      : std::runtime_error(message), mColumn(column) {}
  std::size_t column() const noexcept { return mColumn; }

 private:
  std::size_t mColumn;
};

/// One JSON number. `integral` is true when the literal has no fraction and no exponent and its
/// value fits int64 exactly; `integer` is then that value. `value` is always set.
struct JsonNumber {
  double value = 0.0;
  int64_t integer = 0;
  bool integral = false;
};

struct JsonValue {
  enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kNumberArray, kOther };
  Kind kind = Kind::kNull;
  bool boolean = false;
  JsonNumber number;
  std::string string;
  std::vector<JsonNumber> numbers;  ///< kNumberArray (an empty array is one too)
};

/// Name of a kind for messages: "null", "a boolean", "a number", "a string", "an array of
/// numbers", "an object or a mixed array".
std::string_view describe(JsonValue::Kind kind) noexcept;

/// The members of one top-level object, in line order. Duplicate keys are a syntax error.
class JsonObject {
 public:
  using Members = std::vector<std::pair<std::string, JsonValue>>;

  /// nullptr when the key is absent.
  JsonValue const* find(std::string_view key) const noexcept;
  Members const& members() const noexcept { return mMembers; }

 private:
  friend JsonObject parseJsonObject(std::string_view text);
  Members mMembers;
};

/// Parses exactly one object (surrounding whitespace allowed, nothing else). Throws
/// JsonSyntaxError naming what was expected and where.
JsonObject parseJsonObject(std::string_view text);

}  // namespace mkv::replay
