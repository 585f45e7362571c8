#pragma once
/// \file prometheus_text_parser.h
/// A strict parser of the Prometheus text exposition format (version 0.0.4), written from the
/// format's grammar for the tests: it accepts exactly what a conforming scraper accepts and says
/// why and where a text is not. Used on every exposition the library renders.

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mkv::test {

struct PrometheusFamily {
  std::string help;  ///< unescaped; empty without a HELP line
  std::string type;  ///< counter, gauge, histogram, summary or untyped (the default)
};

struct PrometheusText {
  std::vector<std::string> familyOrder;              ///< in order of first appearance
  std::map<std::string, PrometheusFamily> families;  ///< by family name
  /// Sample values by "name{label="value",...}" with labels in text order (escapes undone).
  std::map<std::string, double> samples;
};

/// The parsed text, or the first violation as "line N: what" in `error`.
struct PrometheusParse {
  std::optional<PrometheusText> text;
  std::string error;
};

/// Grammar and rules checked: lines end with '\n' (the last one too), no empty line; comment
/// lines `# HELP name docstring` (escapes \\ and \n only) and `# TYPE name type`, each at most once
/// per family and TYPE before the family's first sample; samples
/// `name[{label="value"(,label="value")*[,]}] value [timestamp]` with metric names
/// [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* not starting with "__" and unique
/// within a sample, label values with the escapes \\ \" \n only, values as Go's ParseFloat reads
/// them (NaN, +Inf, -Inf included), timestamps as int64; a family's lines contiguous; no sample
/// repeated. A sample belongs to family `name`, or for histogram and summary families to the
/// family its _bucket / _sum / _count suffix extends.
PrometheusParse parsePrometheusText(std::string_view text);

}  // namespace mkv::test
