#include "support/prometheus_text_parser.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <utility>

namespace mkv::test {
namespace {

bool isMetricStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}
bool isMetricChar(char c) { return isMetricStart(c) || (c >= '0' && c <= '9'); }
bool isLabelStart(char c) { return isMetricStart(c) && c != ':'; }
bool isLabelChar(char c) { return isMetricChar(c) && c != ':'; }

bool validMetricName(std::string_view s) {
  if (s.empty() || !isMetricStart(s[0])) {
    return false;
  }
  for (char c : s) {
    if (!isMetricChar(c)) {
      return false;
    }
  }
  return true;
}

/// One line being read, with the reason of the first failure.
class Cursor {
 public:
  explicit Cursor(std::string_view line) : mLine(line) {}
  bool done() const { return mPos == mLine.size(); }
  char peek() const { return done() ? '\0' : mLine[mPos]; }
  bool eat(char c) {
    if (peek() != c) {
      return false;
    }
    ++mPos;
    return true;
  }
  std::string_view takeWhile(bool (*pred)(char)) {
    std::size_t const start = mPos;
    while (!done() && pred(mLine[mPos])) {
      ++mPos;
    }
    return mLine.substr(start, mPos - start);
  }
  std::string_view token() {  // up to the next blank
    std::size_t const start = mPos;
    while (!done() && mLine[mPos] != ' ' && mLine[mPos] != '\t') {
      ++mPos;
    }
    return mLine.substr(start, mPos - start);
  }
  bool blanks() {  // one or more
    std::size_t const start = mPos;
    while (!done() && (mLine[mPos] == ' ' || mLine[mPos] == '\t')) {
      ++mPos;
    }
    return mPos > start;
  }
  std::string_view rest() {
    std::string_view const r = mLine.substr(mPos);
    mPos = mLine.size();
    return r;
  }

 private:
  std::string_view mLine;
  std::size_t mPos = 0;
};

std::optional<double> parseValue(std::string_view s) {
  if (s == "NaN") {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (s == "+Inf" || s == "Inf") {
    return std::numeric_limits<double>::infinity();
  }
  if (s == "-Inf") {
    return -std::numeric_limits<double>::infinity();
  }
  // Go's ParseFloat: an optional sign, digits with an optional point, an optional exponent.
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) {
    ++i;
  }
  std::size_t digits = 0;
  while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.')) {
    digits += s[i] == '.' ? 0U : 1U;
    ++i;
  }
  if (digits == 0) {
    return std::nullopt;
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) {
      ++i;
    }
    std::size_t const start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      ++i;
    }
    if (i == start) {
      return std::nullopt;
    }
  }
  if (i != s.size() || s.find('.') != s.rfind('.')) {
    return std::nullopt;
  }
  std::string const copy(s);
  return std::strtod(copy.c_str(), nullptr);
}

bool validTimestamp(std::string_view s) {
  std::string const copy(s);
  if (copy.empty() || copy == "-") {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  (void)std::strtoll(copy.c_str(), &end, 10);
  return errno == 0 && end == copy.c_str() + copy.size() && copy[0] != '+';
}

/// Undoes the escapes `allowed` permits after a backslash ('n' always means a newline).
std::optional<std::string> unescape(std::string_view s, std::string_view allowed) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out.push_back(s[i]);
      continue;
    }
    if (++i == s.size() || allowed.find(s[i]) == std::string_view::npos) {
      return std::nullopt;
    }
    out.push_back(s[i] == 'n' ? '\n' : s[i]);
  }
  return out;
}

std::string familyOf(std::string const& name, std::map<std::string, PrometheusFamily> const& f) {
  for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      std::string const base = name.substr(0, name.size() - suffix.size());
      auto const it = f.find(base);
      if (it != f.end() && (it->second.type == "histogram" || it->second.type == "summary")) {
        return base;
      }
    }
  }
  return name;
}

}  // namespace

PrometheusParse parsePrometheusText(std::string_view text) {
  PrometheusParse result;
  PrometheusText out;
  std::set<std::string> closed;  // families whose lines ended
  std::set<std::string> sampled;
  std::string current;
  auto enter = [&](std::string const& family) -> bool {
    if (family == current) {
      return true;
    }
    if (closed.count(family) != 0) {
      return false;
    }
    if (!current.empty()) {
      closed.insert(current);
    }
    current = family;
    if (out.families.emplace(family, PrometheusFamily{"", "untyped"}).second) {
      out.familyOrder.push_back(family);
    }
    return true;
  };
  if (!text.empty() && text.back() != '\n') {
    result.error = "the text does not end with a newline";
    return result;
  }
  std::size_t lineNumber = 0;
  std::set<std::string> helped;
  std::set<std::string> typed;
  while (!text.empty()) {
    ++lineNumber;
    std::size_t const end = text.find('\n');
    Cursor c(text.substr(0, end));
    text.remove_prefix(end + 1);
    auto fail = [&](std::string const& what) {
      result.error = "line " + std::to_string(lineNumber) + ": " + what;
      return result;
    };
    if (c.done()) {
      return fail("empty line");
    }
    if (c.eat('#')) {
      if (!c.blanks()) {
        continue;  // a plain comment
      }
      std::string_view const keyword = c.token();
      if (keyword != "HELP" && keyword != "TYPE") {
        continue;  // a plain comment
      }
      if (!c.blanks()) {
        return fail(std::string(keyword) + " without a metric name");
      }
      std::string const name(c.token());
      if (!validMetricName(name)) {
        return fail("invalid metric name '" + name + "'");
      }
      if (!enter(name)) {
        return fail("family " + name + " continues after other families");
      }
      if (keyword == "HELP") {
        if (!helped.insert(name).second) {
          return fail("second HELP for " + name);
        }
        std::string_view docstring;
        if (c.blanks()) {
          docstring = c.rest();
        } else if (!c.done()) {
          return fail("HELP name not followed by a blank");
        }
        std::optional<std::string> help = unescape(docstring, "\\n");
        if (!help) {
          return fail("invalid escape in the HELP of " + name);
        }
        out.families[name].help = std::move(*help);
      } else {
        if (!typed.insert(name).second) {
          return fail("second TYPE for " + name);
        }
        if (sampled.count(name) != 0) {
          return fail("TYPE of " + name + " after its samples");
        }
        if (!c.blanks()) {
          return fail("TYPE without a type");
        }
        std::string const type(c.token());
        c.blanks();
        if (!c.done() || (type != "counter" && type != "gauge" && type != "histogram" &&
                          type != "summary" && type != "untyped")) {
          return fail("invalid TYPE line for " + name);
        }
        out.families[name].type = type;
      }
      continue;
    }
    std::string const name(c.takeWhile(isMetricChar));
    if (!validMetricName(name)) {
      return fail("a sample line must start with a metric name");
    }
    std::string key = name;
    if (c.eat('{')) {
      key += '{';
      std::set<std::string> labels;
      bool first = true;
      while (!c.eat('}')) {
        if (!first) {
          if (!c.eat(',')) {
            return fail("labels must be separated by ','");
          }
          if (c.eat('}')) {
            break;  // a trailing comma
          }
        }
        std::string const label(c.takeWhile(isLabelChar));
        if (label.empty() || !isLabelStart(label[0]) || label.rfind("__", 0) == 0) {
          return fail("invalid label name in " + name);
        }
        if (!labels.insert(label).second) {
          return fail("label " + label + " repeated in " + name);
        }
        if (!c.eat('=') || !c.eat('"')) {
          return fail("label " + label + " needs =\"value\"");
        }
        std::string raw;
        while (true) {
          if (c.done()) {
            return fail("unterminated label value in " + name);
          }
          char const ch = c.peek();
          c.eat(ch);
          if (ch == '"') {
            break;
          }
          raw.push_back(ch);
          if (ch == '\\') {
            if (c.done()) {
              return fail("unterminated escape in " + name);
            }
            raw.push_back(c.peek());
            c.eat(c.peek());
          }
        }
        std::optional<std::string> value = unescape(raw, "\\\"n");
        if (!value) {
          return fail("invalid escape in a label value of " + name);
        }
        key += (first ? "" : ",") + label + "=\"" + *value + "\"";
        first = false;
      }
      key += '}';
    }
    if (!c.blanks()) {
      return fail("a blank must separate " + name + " from its value");
    }
    std::optional<double> const value = parseValue(c.token());
    if (!value) {
      return fail("invalid value for " + name);
    }
    if (c.blanks() && !c.done() && !validTimestamp(c.token())) {
      return fail("invalid timestamp for " + name);
    }
    c.blanks();
    if (!c.done()) {
      return fail("trailing characters after the sample of " + name);
    }
    std::string const family = familyOf(name, out.families);
    if (!enter(family)) {
      return fail("family " + family + " continues after other families");
    }
    sampled.insert(family);
    if (!out.samples.emplace(key, *value).second) {
      return fail("sample " + key + " repeated");
    }
  }
  result.text = std::move(out);
  return result;
}

}  // namespace mkv::test
