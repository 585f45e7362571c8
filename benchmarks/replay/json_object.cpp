#include "json_object.h"

#include <fmt/format.h>

#include <charconv>

namespace mkv::replay {
namespace {

/// Nesting limit of skipped values (keeps a hostile line from exhausting the stack).
constexpr int kMaxDepth = 128;

class Parser {
 public:
  explicit Parser(std::string_view text) : mText(text) {}

  JsonObject::Members parseTopLevel() {
    skipWhitespace();
    expect('{', "'{' (a line holds one JSON object)");
    JsonObject::Members members;
    skipWhitespace();
    if (peek() == '}') {
      ++mPos;
    } else {
      while (true) {
        skipWhitespace();
        std::size_t const keyAt = mPos;
        if (peek() != '"') {
          fail("a string key");
        }
        std::string key = parseString();
        for (auto const& member : members) {
          if (member.first == key) {
            throw JsonSyntaxError(fmt::format("duplicate key \"{}\"", key), keyAt + 1);
          }
        }
        skipWhitespace();
        expect(':', "':' after the key");
        skipWhitespace();
        members.emplace_back(std::move(key), parseMemberValue());
        skipWhitespace();
        if (peek() == ',') {
          ++mPos;
          continue;
        }
        expect('}', "',' or '}'");
        break;
      }
    }
    skipWhitespace();
    if (mPos != mText.size()) {
      fail("the end of the line after the object");
    }
    return members;
  }

 private:
  char peek() const noexcept { return mPos < mText.size() ? mText[mPos] : '\0'; }
  bool atEnd() const noexcept { return mPos >= mText.size(); }

  [[noreturn]] void fail(std::string_view expected) const {
    std::string found;
    if (atEnd()) {
      found = "the end of the line";
    } else {
      auto const c = static_cast<unsigned char>(mText[mPos]);
      found = c >= 0x20 && c < 0x7F ? fmt::format("'{}'", static_cast<char>(c))
                                    : fmt::format("byte {:#04x}", c);
    }
    throw JsonSyntaxError(fmt::format("expected {}, found {}", expected, found), mPos + 1);
  }

  void expect(char c, std::string_view what) {
    if (atEnd() || peek() != c) {
      fail(what);
    }
    ++mPos;
  }

  void skipWhitespace() noexcept {
    while (!atEnd()) {
      char const c = mText[mPos];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
        return;
      }
      ++mPos;
    }
  }

  void expectLiteral(std::string_view literal) {
    if (mText.substr(mPos, literal.size()) != literal) {
      fail("a JSON value");
    }
    mPos += literal.size();
  }

  JsonValue parseMemberValue() {
    JsonValue value;
    char const c = peek();
    if (c == '"') {
      value.kind = JsonValue::Kind::kString;
      value.string = parseString();
    } else if (c == '[') {
      std::size_t const start = mPos;
      if (parseNumberArray(value.numbers)) {
        value.kind = JsonValue::Kind::kNumberArray;
      } else {
        mPos = start;
        value.numbers.clear();
        skipValue(0);
        value.kind = JsonValue::Kind::kOther;
      }
    } else if (c == '{') {
      skipValue(0);
      value.kind = JsonValue::Kind::kOther;
    } else if (c == 't') {
      expectLiteral("true");
      value.kind = JsonValue::Kind::kBool;
      value.boolean = true;
    } else if (c == 'f') {
      expectLiteral("false");
      value.kind = JsonValue::Kind::kBool;
    } else if (c == 'n') {
      expectLiteral("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      value.kind = JsonValue::Kind::kNumber;
      value.number = parseNumber();
    } else {
      fail("a JSON value");
    }
    return value;
  }

  /// Parses `[n, n, ...]`. Returns false (position undefined) at the first non-number element so
  /// the caller can re-read the array as an opaque value; throws for broken syntax.
  bool parseNumberArray(std::vector<JsonNumber>& out) {
    expect('[', "'['");
    skipWhitespace();
    if (peek() == ']') {
      ++mPos;
      return true;
    }
    while (true) {
      skipWhitespace();
      char const c = peek();
      if (c != '-' && (c < '0' || c > '9')) {
        return false;
      }
      out.push_back(parseNumber());
      skipWhitespace();
      if (peek() == ',') {
        ++mPos;
        continue;
      }
      expect(']', "',' or ']'");
      return true;
    }
  }

  void skipValue(int depth) {
    if (depth > kMaxDepth) {
      throw JsonSyntaxError(fmt::format("values nested deeper than {} levels", kMaxDepth),
                            mPos + 1);
    }
    skipWhitespace();
    char const c = peek();
    if (c == '{' || c == '[') {
      char const close = c == '{' ? '}' : ']';
      ++mPos;
      skipWhitespace();
      if (peek() == close) {
        ++mPos;
        return;
      }
      while (true) {
        skipWhitespace();
        if (c == '{') {
          if (peek() != '"') {
            fail("a string key");
          }
          parseString();
          skipWhitespace();
          expect(':', "':' after the key");
        }
        skipValue(depth + 1);
        skipWhitespace();
        if (peek() == ',') {
          ++mPos;
          continue;
        }
        expect(close, c == '{' ? "',' or '}'" : "',' or ']'");
        return;
      }
    }
    (void)parseMemberValue();
  }

  static void appendUtf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  uint32_t parseHex4() {
    uint32_t value = 0;
    for (int i = 0; i < 4; ++i) {
      char const c = peek();
      uint32_t digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<uint32_t>(c - 'A' + 10);
      } else {
        fail("four hex digits after \\u");
      }
      value = value * 16 + digit;
      ++mPos;
    }
    return value;
  }

  std::string parseString() {
    expect('"', "'\"'");
    std::string out;
    while (true) {
      if (atEnd()) {
        fail("the closing '\"' of the string");
      }
      auto const c = static_cast<unsigned char>(mText[mPos]);
      if (c == '"') {
        ++mPos;
        return out;
      }
      if (c < 0x20) {
        fail("an escaped control character (raw ones are not allowed in strings)");
      }
      if (c != '\\') {
        out.push_back(static_cast<char>(c));
        ++mPos;
        continue;
      }
      ++mPos;
      char const e = peek();
      ++mPos;
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          std::size_t const escapeAt = mPos - 2;
          uint32_t cp = parseHex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) {
            throw JsonSyntaxError("unpaired low surrogate in \\u escape", escapeAt + 1);
          }
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (mText.substr(mPos, 2) != "\\u") {
              throw JsonSyntaxError("unpaired high surrogate in \\u escape", escapeAt + 1);
            }
            mPos += 2;
            uint32_t const low = parseHex4();
            if (low < 0xDC00 || low > 0xDFFF) {
              throw JsonSyntaxError("unpaired high surrogate in \\u escape", escapeAt + 1);
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          appendUtf8(out, cp);
          break;
        }
        default: --mPos; fail("an escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
      }
    }
  }

  JsonNumber parseNumber() {
    std::size_t const start = mPos;
    bool const negative = peek() == '-';
    if (negative) {
      ++mPos;
    }
    char const first = peek();
    if (first < '0' || first > '9') {
      fail("a digit");
    }
    ++mPos;
    if (first != '0') {
      while (peek() >= '0' && peek() <= '9') {
        ++mPos;
      }
    }
    std::size_t const integerEnd = mPos;
    bool fractional = false;
    if (peek() == '.') {
      fractional = true;
      ++mPos;
      if (peek() < '0' || peek() > '9') {
        fail("a digit after the decimal point");
      }
      while (peek() >= '0' && peek() <= '9') {
        ++mPos;
      }
    }
    if (peek() == 'e' || peek() == 'E') {
      fractional = true;
      ++mPos;
      if (peek() == '+' || peek() == '-') {
        ++mPos;
      }
      if (peek() < '0' || peek() > '9') {
        fail("a digit in the exponent");
      }
      while (peek() >= '0' && peek() <= '9') {
        ++mPos;
      }
    }
    JsonNumber number;
    // Locale-independent; a literal outside the double range leaves value at 0.
    std::from_chars(mText.data() + start, mText.data() + mPos, number.value);
    if (!fractional) {
      int64_t integer = 0;
      auto const result = std::from_chars(mText.data() + start, mText.data() + integerEnd, integer);
      if (result.ec == std::errc() && result.ptr == mText.data() + integerEnd) {
        number.integer = integer;
        number.integral = true;
      }
    }
    return number;
  }

  std::string_view mText;
  std::size_t mPos = 0;
};

}  // namespace

std::string_view describe(JsonValue::Kind kind) noexcept {
  switch (kind) {
    case JsonValue::Kind::kNull: return "null";
    case JsonValue::Kind::kBool: return "a boolean";
    case JsonValue::Kind::kNumber: return "a number";
    case JsonValue::Kind::kString: return "a string";
    case JsonValue::Kind::kNumberArray: return "an array of numbers";
    case JsonValue::Kind::kOther: return "an object or a mixed array";
  }
  return "unknown";
}

JsonValue const* JsonObject::find(std::string_view key) const noexcept {
  for (auto const& member : mMembers) {
    if (member.first == key) {
      return &member.second;
    }
  }
  return nullptr;
}

JsonObject parseJsonObject(std::string_view text) {
  JsonObject object;
  object.mMembers = Parser(text).parseTopLevel();
  return object;
}

}  // namespace mkv::replay
