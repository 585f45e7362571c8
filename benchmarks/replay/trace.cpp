#include "trace.h"

#include <fmt/format.h>
#include <simdjson.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <unordered_set>

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

namespace od = simdjson::ondemand;

/// Nesting limit of the values validate() walks, recursively: it keeps a hostile line from
/// exhausting the stack (simdjson 3.0.1's On-Demand API let 5,000 levels through).
constexpr int kMaxDepth = 128;

/// One trace line, read with simdjson's On-Demand API: forward only, every value validated as it
/// is read (the values of unknown keys by a walk that reads each of them), every failure a
/// TraceLineError (syntax ones with the 1-based column simdjson stopped at, when it knows it).
class LineReader {
 public:
  explicit LineReader(std::string_view text) : mText(text) {
    // Reused by every line of a thread: the parser, and the line copied with the zero bytes
    // simdjson may read past its end.
    thread_local od::parser parser;
    thread_local std::string padded;
    padded.assign(text);
    padded.append(simdjson::SIMDJSON_PADDING, '\0');
    mLine = padded.data();
    check(parser.iterate(simdjson::padded_string_view(padded.data(), text.size(), padded.size()))
              .get(mDocument));
    mIterating = true;
    od::json_type type{};
    check(mDocument.type().get(type));
    if (type != od::json_type::object) {
      throw TraceLineError(fmt::format("column {}: a line holds one JSON object, found {}",
                                       column(), describe(type)));
    }
  }

  od::document& document() noexcept { return mDocument; }

  /// Fails on anything but whitespace after the object.
  void expectEnd() {
    if (!mDocument.current_location().error()) {
      syntax(simdjson::TRAILING_CONTENT);
    }
  }

  void check(simdjson::error_code error) {
    if (error != simdjson::SUCCESS) {
      syntax(error);
    }
  }

  /// 1-based column of simdjson's current position; 0 when it has none.
  std::size_t column() {
    char const* at = nullptr;
    if (!mIterating || mDocument.current_location().get(at) != simdjson::SUCCESS) {
      return 0;
    }
    return columnOf(at);
  }

  std::size_t columnOf(char const* at) const noexcept {
    return static_cast<std::size_t>(at - mLine) + 1;
  }

  [[noreturn]] void syntax(simdjson::error_code error) {
    // An object or array left open ends at the end of the line; errors found while indexing the
    // whole line (an unclosed string, a raw control character, bad UTF-8) have no position.
    std::size_t const at =
        error == simdjson::INCOMPLETE_ARRAY_OR_OBJECT ? mText.size() + 1 : column();
    std::string_view const message = simdjson::error_message(error);
    throw TraceLineError(at == 0 ? std::string(message)
                                 : fmt::format("column {}: {}", at, message));
  }

  /// Reads (and so validates) a value of any kind, recursively.
  void validate(od::value value, int depth = 0) {
    if (depth >= kMaxDepth) {
      throw TraceLineError(fmt::format("column {}: values nested deeper than {} levels",
                                       columnOf(value.raw_json_token().data()), kMaxDepth));
    }
    od::json_type type{};
    check(value.type().get(type));
    switch (type) {
      case od::json_type::object: {
        od::object object;
        check(value.get_object().get(object));
        for (auto field : object) {
          std::string_view key;
          check(field.unescaped_key().get(key));
          od::value member;
          check(field.value().get(member));
          validate(member, depth + 1);
        }
        return;
      }
      case od::json_type::array: {
        od::array array;
        check(value.get_array().get(array));
        for (auto element : array) {
          od::value item;
          check(element.get(item));
          validate(item, depth + 1);
        }
        return;
      }
      case od::json_type::number: {
        od::number number;
        check(value.get_number().get(number));
        return;
      }
      case od::json_type::string: {
        std::string_view text;
        check(value.get_string().get(text));
        return;
      }
      case od::json_type::boolean: {
        // simdjson reports a misspelt true or false as a value of another type.
        bool flag = false;
        if (value.get_bool().get(flag) != simdjson::SUCCESS) {
          syntax(value.raw_json_token().front() == 't' ? simdjson::T_ATOM_ERROR
                                                       : simdjson::F_ATOM_ERROR);
        }
        return;
      }
      case od::json_type::null: {
        bool null = false;
        if (value.is_null().get(null) != simdjson::SUCCESS || !null) {
          syntax(simdjson::N_ATOM_ERROR);
        }
        return;
      }
    }
  }

  static std::string_view describe(od::json_type type) noexcept {
    switch (type) {
      case od::json_type::object:
        return "an object";
      case od::json_type::array:
        return "an array";
      case od::json_type::number:
        return "a number";
      case od::json_type::string:
        return "a string";
      case od::json_type::boolean:
        return "a boolean";
      case od::json_type::null:
        return "null";
    }
    return "unknown";
  }

  /// Throws `LABEL must be EXPECTED, got KIND` once the value is known to be well-formed.
  [[noreturn]] void wrongType(std::string_view label, std::string_view expected, od::value value) {
    od::json_type const type = typeOf(value);
    validate(value);
    throw TraceLineError(fmt::format("{} must be {}, got {}", label, expected, describe(type)));
  }

  od::json_type typeOf(od::value& value) {
    od::json_type type{};
    check(value.type().get(type));
    return type;
  }

  /// `"key"`, or `"key"[index]` for an element (index >= 0).
  static std::string label(std::string_view key, int64_t index) {
    return index < 0 ? fmt::format("\"{}\"", key) : fmt::format("\"{}\"[{}]", key, index);
  }

  /// A number that must be an integer in [min, max]; `key` and `index` name it (see label).
  static int64_t bounded(od::number number, std::string_view key, int64_t index, int64_t min,
                         int64_t max) {
    switch (number.get_number_type()) {
      case od::number_type::floating_point_number:
        throw TraceLineError(
            fmt::format("{} must be an integer, got {}", label(key, index), number.get_double()));
      case od::number_type::unsigned_integer:  // at least 2^63
        throw TraceLineError(fmt::format("{} is {}, outside [{}, {}]", label(key, index),
                                         number.get_uint64(), min, max));
      case od::number_type::signed_integer:
        break;
    }
    int64_t const value = number.get_int64();
    if (value < min || value > max) {
      throw TraceLineError(
          fmt::format("{} is {}, outside [{}, {}]", label(key, index), value, min, max));
    }
    return value;
  }

  int64_t integer(od::value value, std::string_view key, int64_t min, int64_t max) {
    if (typeOf(value) != od::json_type::number) {
      wrongType(label(key, -1), "an integer", value);
    }
    od::number number;
    check(value.get_number().get(number));
    return bounded(number, key, -1, min, max);
  }

  template <typename T>
  std::vector<T> integerArray(od::value value, std::string_view key, int64_t min, int64_t max) {
    if (typeOf(value) != od::json_type::array) {
      wrongType(label(key, -1), "an array of integers", value);
    }
    od::array array;
    check(value.get_array().get(array));
    std::vector<T> out;
    for (auto element : array) {
      od::value item;
      check(element.get(item));
      auto const index = static_cast<int64_t>(out.size());
      if (typeOf(item) != od::json_type::number) {
        wrongType(label(key, index), "an integer", item);
      }
      od::number number;
      check(item.get_number().get(number));
      out.push_back(static_cast<T>(bounded(number, key, index, min, max)));
    }
    if (out.empty()) {
      throw TraceLineError(fmt::format("\"{}\" is empty", key));
    }
    return out;
  }

  std::string string(od::value value, std::string_view key) {
    if (typeOf(value) != od::json_type::string) {
      wrongType(label(key, -1), "a string", value);
    }
    std::string_view text;
    check(value.get_string().get(text));
    return std::string(text);
  }

  double number(od::value value, std::string_view key) {
    if (typeOf(value) != od::json_type::number) {
      wrongType(label(key, -1), "a number", value);
    }
    od::number number;
    check(value.get_number().get(number));
    return number.as_double();
  }

  /// "id": a string as written, or an integer's digits.
  std::string id(od::value value) {
    od::json_type const type = typeOf(value);
    if (type == od::json_type::string) {
      return string(value, "id");
    }
    od::number number;
    if (type == od::json_type::number) {
      check(value.get_number().get(number));
    }
    if (type != od::json_type::number ||
        number.get_number_type() == od::number_type::floating_point_number) {
      throw TraceLineError(fmt::format(
          "\"id\" must be a string or an integer, got {}",
          type == od::json_type::number ? "a fraction or an exponent" : describe(type)));
    }
    return number.is_int64() ? std::to_string(number.get_int64())
                             : std::to_string(number.get_uint64());
  }

 private:
  std::string_view mText;
  char const* mLine = nullptr;  ///< the padded copy of the line simdjson reads
  od::document mDocument;
  bool mIterating = false;  ///< iterate() succeeded: mDocument has positions
};

/// Reads one line in a single pass, in line order: the keys of `format` and the common ones into
/// the record, any other key's value validated and ignored. With kAuto the first key that belongs
/// to one format only ("prompt"; "hash_ids", "input_length", "output_length") decides; a key of
/// the other one after it is an error. A duplicate key is an error.
TraceRecord readRecord(LineReader& reader, TraceFormat const requested) {
  TraceRecord record;
  TraceFormat format = requested;
  auto belongs = [&](TraceFormat keyFormat) {
    if (requested != TraceFormat::kAuto) {
      return requested == keyFormat;
    }
    if (format != TraceFormat::kAuto && format != keyFormat) {
      throw TraceLineError(
          "the object has both \"prompt\" (tokens format) and Mooncake keys; choose one with "
          "--format");
    }
    format = keyFormat;
    return true;
  };
  std::optional<int64_t> input;
  std::optional<int64_t> output;
  // "max_new_tokens" is read before the format may be known, and checked once it is.
  std::optional<od::json_type> maxNewTokensType;
  od::number maxNewTokens{};
  bool hashIds = false;
  bool prompt = false;
  std::vector<std::string> keys;
  od::object object;
  reader.check(reader.document().get_object().get(object));
  for (auto member : object) {
    od::field field;
    reader.check(std::move(member).get(field));
    char const* const keyAt = field.key().raw() - 1;  // raw(): just after the opening quote
    std::string_view key;
    reader.check(field.unescaped_key().get(key));
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
      throw TraceLineError(
          fmt::format("column {}: duplicate key \"{}\"", reader.columnOf(keyAt), key));
    }
    keys.emplace_back(key);
    od::value value = field.value();
    if (key == "input_length" && belongs(TraceFormat::kMooncake)) {
      input = reader.integer(value, key, 1, kMaxTraceTokens);
    } else if (key == "output_length" && belongs(TraceFormat::kMooncake)) {
      output = reader.integer(value, key, 0, kMaxTraceTokens);
    } else if (key == "hash_ids" && belongs(TraceFormat::kMooncake)) {
      record.hashIds =
          reader.integerArray<int64_t>(value, key, 0, std::numeric_limits<int64_t>::max());
      hashIds = true;
    } else if (key == "prompt" && belongs(TraceFormat::kTokens)) {
      record.tokens =
          reader.integerArray<int32_t>(value, key, 0, std::numeric_limits<int32_t>::max());
      prompt = true;
    } else if (key == "max_new_tokens" && requested != TraceFormat::kMooncake) {
      maxNewTokensType = reader.typeOf(value);
      if (*maxNewTokensType == od::json_type::number) {
        reader.check(value.get_number().get(maxNewTokens));
      } else {
        reader.validate(value);
      }
    } else if (key == "salt") {
      record.salt = reader.string(value, key);
    } else if (key == "lora") {
      record.lora = reader.string(value, key);
    } else if (key == "id") {
      record.id = reader.id(value);
    } else if (key == "timestamp") {
      record.timestampMs = reader.number(value, key);
    } else {
      reader.validate(value);
    }
  }
  reader.expectEnd();

  if (format == TraceFormat::kAuto) {
    throw TraceLineError(
        "neither a Mooncake record (\"input_length\", \"output_length\", \"hash_ids\") nor a "
        "tokens record (\"prompt\", \"max_new_tokens\")");
  }
  record.format = format;
  auto require = [format](bool present, std::string_view key) {
    if (!present) {
      throw TraceLineError(
          fmt::format("missing \"{}\" (required in the {} format)", key, toString(format)));
    }
  };
  if (format == TraceFormat::kMooncake) {
    require(input.has_value(), "input_length");
    require(output.has_value(), "output_length");
    require(hashIds, "hash_ids");
    record.inputLength = static_cast<int32_t>(*input);
    record.maxNewTokens = static_cast<int32_t>(std::max<int64_t>(*output, 1));
    int64_t const capacity =
        int64_t{kMooncakeBlockTokens} * static_cast<int64_t>(record.hashIds.size());
    if (record.inputLength > capacity) {
      throw TraceLineError(fmt::format(
          "\"input_length\" {} is longer than the {} tokens of its {} \"hash_ids\" blocks ({} "
          "tokens each)",
          record.inputLength, capacity, record.hashIds.size(), kMooncakeBlockTokens));
    }
  } else {
    require(prompt, "prompt");
    require(maxNewTokensType.has_value(), "max_new_tokens");
    if (*maxNewTokensType != od::json_type::number) {
      throw TraceLineError(fmt::format("\"max_new_tokens\" must be an integer, got {}",
                                       LineReader::describe(*maxNewTokensType)));
    }
    record.maxNewTokens = static_cast<int32_t>(
        LineReader::bounded(maxNewTokens, "max_new_tokens", -1, 1, kMaxTraceTokens));
    if (record.tokens.size() > static_cast<std::size_t>(kMaxTraceTokens)) {
      throw TraceLineError(fmt::format("\"prompt\" has {} tokens, more than {}",
                                       record.tokens.size(), kMaxTraceTokens));
    }
    record.inputLength = static_cast<int32_t>(record.tokens.size());
  }
  return record;
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
    case TraceFormat::kAuto:
      return "auto";
    case TraceFormat::kMooncake:
      return "mooncake";
    case TraceFormat::kTokens:
      return "tokens";
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
  LineReader reader(text);
  return readRecord(reader, format);
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
