#pragma once
/// \file prometheus_text.h
/// Builder of Prometheus text exposition (format 0.0.4) shared by the metric renderers (internal).

#include <fmt/format.h>

#include <iterator>
#include <string>
#include <string_view>

#include "core/check.h"

namespace mkv::detail {

/// Appends metric families under one name prefix: a `# HELP` and a `# TYPE` line, then samples.
/// Names and label names passed in are fixed identifiers of the library; label values are
/// escaped as the format requires.
class PrometheusWriter {
 public:
  /// Throws mkv::Error naming `call` when `prefix` is not a valid metric-name prefix
  /// ([a-zA-Z_:][a-zA-Z0-9_:]*, may be empty).
  PrometheusWriter(char const* call, std::string_view prefix) : mPrefix(prefix) {
    bool valid = true;
    for (std::size_t i = 0; i < prefix.size(); ++i) {
      char const c = prefix[i];
      bool const alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
      valid = valid && (alpha || (i > 0 && c >= '0' && c <= '9'));
    }
    MKV_REQUIRE(valid, call, "invalid metric name prefix '{}'", prefix);
  }

  void header(std::string_view name, std::string_view type, std::string_view help) {
    fmt::format_to(std::back_inserter(mOut), "# HELP {}{} {}\n# TYPE {}{} {}\n", mPrefix, name,
                   help, mPrefix, name, type);
  }
  template <typename T>
  void sample(std::string_view name, T value) {
    fmt::format_to(std::back_inserter(mOut), "{}{} {}\n", mPrefix, name, value);
  }
  template <typename T>
  void sample(std::string_view name, std::string_view label, std::string_view labelValue, T value) {
    fmt::format_to(std::back_inserter(mOut), "{}{}{{{}=\"", mPrefix, name, label);
    for (char c : labelValue) {
      if (c == '\\' || c == '"') {
        mOut.push_back('\\');
        mOut.push_back(c);
      } else if (c == '\n') {
        mOut += "\\n";
      } else {
        mOut.push_back(c);
      }
    }
    fmt::format_to(std::back_inserter(mOut), "\"}} {}\n", value);
  }
  template <typename T>
  void counter(std::string_view name, std::string_view help, T value) {
    header(name, "counter", help);
    sample(name, value);
  }
  template <typename T>
  void gauge(std::string_view name, std::string_view help, T value) {
    header(name, "gauge", help);
    sample(name, value);
  }
  std::string take() { return std::move(mOut); }

 private:
  std::string_view mPrefix;
  std::string mOut;
};

}  // namespace mkv::detail
