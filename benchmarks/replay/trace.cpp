#include "trace.h"

#include <fmt/format.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <unordered_set>

#include "json_object.h"

namespace mkv::replay {
namespace {

uint64_t splitmix64(uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

bool isBlank(std::string_view text) noexcept {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

[[noreturn]] void wrongType(std::string_view key, std::string_view expected, JsonValue const& v) {
  throw TraceLineError(fmt::format("\"{}\" must be {}, got {}", key, expected, describe(v.kind)));
}

int64_t integerField(JsonValue const& value, std::string_view key, int64_t min, int64_t max) {
  if (value.kind != JsonValue::Kind::kNumber) {
    wrongType(key, "an integer", value);
  }
  if (!value.number.integral) {
    throw TraceLineError(fmt::format("\"{}\" must be an integer, got {}", key, value.number.value));
  }
  if (value.number.integer < min || value.number.integer > max) {
    throw TraceLineError(
        fmt::format("\"{}\" is {}, outside [{}, {}]", key, value.number.integer, min, max));
  }
  return value.number.integer;
}

JsonValue const& required(JsonObject const& object, std::string_view key, std::string_view format) {
  JsonValue const* value = object.find(key);
  if (value == nullptr) {
    throw TraceLineError(fmt::format("missing \"{}\" (required in the {} format)", key, format));
  }
  return *value;
}

template <typename T>
std::vector<T> integerArray(JsonValue const& value, std::string_view key, int64_t min,
                            int64_t max) {
  if (value.kind != JsonValue::Kind::kNumberArray) {
    wrongType(key, "an array of integers", value);
  }
  if (value.numbers.empty()) {
    throw TraceLineError(fmt::format("\"{}\" is empty", key));
  }
  std::vector<T> out;
  out.reserve(value.numbers.size());
  for (std::size_t i = 0; i < value.numbers.size(); ++i) {
    JsonNumber const& n = value.numbers[i];
    if (!n.integral) {
      throw TraceLineError(fmt::format("\"{}\"[{}] must be an integer, got {}", key, i, n.value));
    }
    if (n.integer < min || n.integer > max) {
      throw TraceLineError(
          fmt::format("\"{}\"[{}] is {}, outside [{}, {}]", key, i, n.integer, min, max));
    }
    out.push_back(static_cast<T>(n.integer));
  }
  return out;
}

void readCommon(JsonObject const& object, TraceRecord& record) {
  if (JsonValue const* salt = object.find("salt")) {
    if (salt->kind != JsonValue::Kind::kString) {
      wrongType("salt", "a string", *salt);
    }
    record.salt = salt->string;
  }
  if (JsonValue const* lora = object.find("lora")) {
    if (lora->kind != JsonValue::Kind::kString) {
      wrongType("lora", "a string", *lora);
    }
    record.lora = lora->string;
  }
  if (JsonValue const* id = object.find("id")) {
    if (id->kind == JsonValue::Kind::kString) {
      record.id = id->string;
    } else if (id->kind == JsonValue::Kind::kNumber && id->number.integral) {
      record.id = std::to_string(id->number.integer);
    } else {
      wrongType("id", "a string or an integer", *id);
    }
  }
  if (JsonValue const* timestamp = object.find("timestamp")) {
    if (timestamp->kind != JsonValue::Kind::kNumber) {
      wrongType("timestamp", "a number", *timestamp);
    }
    record.timestampMs = timestamp->number.value;
  }
}

void readMooncake(JsonObject const& object, TraceRecord& record) {
  constexpr std::string_view kFormat = "mooncake";
  record.format = TraceFormat::kMooncake;
  record.inputLength = static_cast<int32_t>(
      integerField(required(object, "input_length", kFormat), "input_length", 1, kMaxTraceTokens));
  int64_t const output =
      integerField(required(object, "output_length", kFormat), "output_length", 0, kMaxTraceTokens);
  record.maxNewTokens = static_cast<int32_t>(std::max<int64_t>(output, 1));
  record.hashIds = integerArray<int64_t>(required(object, "hash_ids", kFormat), "hash_ids", 0,
                                         std::numeric_limits<int64_t>::max());
  int64_t const capacity =
      int64_t{kMooncakeBlockTokens} * static_cast<int64_t>(record.hashIds.size());
  if (record.inputLength > capacity) {
    throw TraceLineError(fmt::format(
        "\"input_length\" {} is longer than the {} tokens of its {} \"hash_ids\" blocks ({} tokens "
        "each)",
        record.inputLength, capacity, record.hashIds.size(), kMooncakeBlockTokens));
  }
}

void readTokens(JsonObject const& object, TraceRecord& record) {
  constexpr std::string_view kFormat = "tokens";
  record.format = TraceFormat::kTokens;
  record.tokens = integerArray<int32_t>(required(object, "prompt", kFormat), "prompt", 0,
                                        std::numeric_limits<int32_t>::max());
  if (record.tokens.size() > static_cast<std::size_t>(kMaxTraceTokens)) {
    throw TraceLineError(fmt::format("\"prompt\" has {} tokens, more than {}", record.tokens.size(),
                                     kMaxTraceTokens));
  }
  record.inputLength = static_cast<int32_t>(record.tokens.size());
  record.maxNewTokens = static_cast<int32_t>(integerField(
      required(object, "max_new_tokens", kFormat), "max_new_tokens", 1, kMaxTraceTokens));
}

struct DigestHash {
  std::size_t operator()(XXH128_hash_t const& h) const noexcept {
    return static_cast<std::size_t>(h.low64 ^ (h.high64 * 0x9E3779B97F4A7C15ULL));
  }
};
struct DigestEqual {
  bool operator()(XXH128_hash_t const& a, XXH128_hash_t const& b) const noexcept {
    return XXH128_isEqual(a, b) != 0;
  }
};

}  // namespace

std::string_view toString(TraceFormat format) noexcept {
  switch (format) {
    case TraceFormat::kAuto: return "auto";
    case TraceFormat::kMooncake: return "mooncake";
    case TraceFormat::kTokens: return "tokens";
  }
  return "unknown";
}

std::optional<TraceFormat> parseTraceFormat(std::string_view name) noexcept {
  for (TraceFormat format : {TraceFormat::kAuto, TraceFormat::kMooncake, TraceFormat::kTokens}) {
    if (toString(format) == name) {
      return format;
    }
  }
  return std::nullopt;
}

int32_t mooncakeToken(int64_t blockId, int32_t offset) noexcept {
  uint64_t const key =
      static_cast<uint64_t>(blockId) * uint64_t{1000003} + static_cast<uint32_t>(offset);
  return 1000 + static_cast<int32_t>(splitmix64(key) % 30000);
}

std::vector<int32_t> expandMooncakePrompt(std::span<int64_t const> hashIds, int32_t inputLength) {
  if (inputLength < 0 ||
      inputLength > int64_t{kMooncakeBlockTokens} * static_cast<int64_t>(hashIds.size())) {
    throw std::invalid_argument(fmt::format("expandMooncakePrompt: {} blocks cannot hold {} tokens",
                                            hashIds.size(), inputLength));
  }
  std::vector<int32_t> tokens(static_cast<std::size_t>(inputLength));
  for (int32_t i = 0; i < inputLength; ++i) {
    tokens[static_cast<std::size_t>(i)] = mooncakeToken(
        hashIds[static_cast<std::size_t>(i / kMooncakeBlockTokens)], i % kMooncakeBlockTokens);
  }
  return tokens;
}

TraceRecord parseTraceLine(std::string_view text, TraceFormat format) {
  JsonObject object;
  try {
    object = parseJsonObject(text);
  } catch (JsonSyntaxError const& error) {
    throw TraceLineError(fmt::format("column {}: {}", error.column(), error.what()));
  }
  TraceRecord record;
  if (format == TraceFormat::kAuto) {
    bool const tokens = object.find("prompt") != nullptr;
    bool const mooncake = object.find("hash_ids") != nullptr ||
                          object.find("input_length") != nullptr ||
                          object.find("output_length") != nullptr;
    if (tokens && mooncake) {
      throw TraceLineError(
          "the object has both \"prompt\" (tokens format) and Mooncake keys; choose one with "
          "--format");
    }
    if (!tokens && !mooncake) {
      throw TraceLineError(
          "neither a Mooncake record (\"input_length\", \"output_length\", \"hash_ids\") nor a "
          "tokens record (\"prompt\", \"max_new_tokens\")");
    }
    format = tokens ? TraceFormat::kTokens : TraceFormat::kMooncake;
  }
  if (format == TraceFormat::kMooncake) {
    readMooncake(object, record);
  } else {
    readTokens(object, record);
  }
  readCommon(object, record);
  return record;
}

std::vector<TraceRecord> parseTrace(std::istream& input, std::string const& name,
                                    TraceFormat format, std::size_t limit) {
  std::vector<TraceRecord> records;
  std::string line;
  int64_t number = 0;
  while ((limit == 0 || records.size() < limit) && std::getline(input, line)) {
    ++number;
    if (isBlank(line)) {
      continue;
    }
    try {
      records.push_back(parseTraceLine(line, format));
    } catch (TraceLineError const& error) {
      throw TraceError(fmt::format("{}:{}: {}", name, number, error.what()));
    }
    records.back().line = number;
  }
  if (input.bad()) {
    throw TraceError(fmt::format("{}: read error after line {}", name, number));
  }
  return records;
}

std::vector<TraceRecord> loadTrace(std::string const& path, TraceFormat format, std::size_t limit) {
  std::ifstream file(path);
  if (!file) {
    throw TraceError(fmt::format("cannot open trace {}: {}", path, std::strerror(errno)));
  }
  return parseTrace(file, path, format, limit);
}

std::vector<int32_t> promptOf(TraceRecord const& record) {
  if (record.format == TraceFormat::kMooncake) {
    return expandMooncakePrompt(record.hashIds, record.inputLength);
  }
  return record.tokens;
}

TraceSource::TraceSource(std::vector<TraceRecord> records, std::string description)
    : mRecords(std::move(records)), mDescription(std::move(description)) {}

ReplayRequest TraceSource::materialize(std::size_t index) {
  TraceRecord const& record = mRecords.at(index);
  ReplayRequest request;
  request.prompt = promptOf(record);
  request.maxNewTokens = record.maxNewTokens;
  request.salt = record.salt;
  request.lora = record.lora;
  request.id = record.id;
  request.timestampMs = record.timestampMs;
  return request;
}

int64_t TraceSource::longestSequenceTokens(int32_t maxOutputCap) const {
  int64_t longest = 0;
  for (TraceRecord const& record : mRecords) {
    longest = std::max<int64_t>(
        longest, int64_t{record.inputLength} + cappedOutput(record.maxNewTokens, maxOutputCap));
  }
  return longest;
}

int64_t TraceSource::cachedPagesBound(int32_t pageSize, int32_t maxOutputCap) const {
  // Distinct chained page-aligned prompt prefixes (keyed like the library's blocks: parent
  // digest + page tokens, the root seeded by salt and LoRA), plus every page a request's
  // generated tokens can fill: ceil(generated / page) + 1 (the page the prompt's tail shares).
  std::unordered_set<XXH128_hash_t, DigestHash, DigestEqual> pages;
  auto const page = static_cast<std::size_t>(pageSize);
  std::vector<uint8_t> buffer(sizeof(XXH128_hash_t) + page * sizeof(int32_t));
  int64_t generatedPages = 0;
  for (TraceRecord const& record : mRecords) {
    std::string const identity = record.salt + '\0' + record.lora;
    XXH128_hash_t parent = XXH3_128bits(identity.data(), identity.size());
    std::vector<int32_t> const prompt = promptOf(record);
    for (std::size_t begin = 0; begin + page <= prompt.size(); begin += page) {
      std::memcpy(buffer.data(), &parent, sizeof(parent));
      std::memcpy(buffer.data() + sizeof(parent), prompt.data() + begin, page * sizeof(int32_t));
      parent = XXH3_128bits(buffer.data(), buffer.size());
      pages.insert(parent);
    }
    int32_t const generated = cappedOutput(record.maxNewTokens, maxOutputCap);
    generatedPages += (generated + pageSize - 1) / pageSize + 1;
  }
  return static_cast<int64_t>(pages.size()) + generatedPages;
}

}  // namespace mkv::replay
