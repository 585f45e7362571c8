// Trace formats of mkv-replay: the Mooncake and token line parsers (simdjson), strict JSON with
// the column of a syntax error, format detection, the loader's line numbers, and the
// deterministic expansion of Mooncake block ids.
#include "trace.h"

#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <string>
#include <string_view>

namespace mkv::replay {
namespace {

std::string errorOf(std::string const& line, TraceFormat format = TraceFormat::kAuto) {
  try {
    parseTraceLine(line, format);
  } catch (TraceLineError const& error) {
    return error.what();
  }
  return "accepted";
}

TEST(TraceTest, ParsesAMooncakeLine) {
  TraceRecord const record = parseTraceLine(
      R"({"timestamp": 277, "input_length": 1100, "output_length": 92, "hash_ids": [198, 199, 200]})",
      TraceFormat::kAuto);
  EXPECT_EQ(record.format, TraceFormat::kMooncake);
  EXPECT_EQ(record.inputLength, 1100);
  EXPECT_EQ(record.maxNewTokens, 92);
  EXPECT_EQ(record.hashIds, (std::vector<int64_t>{198, 199, 200}));
  ASSERT_TRUE(record.timestampMs.has_value());
  EXPECT_DOUBLE_EQ(*record.timestampMs, 277.0);
  EXPECT_TRUE(record.tokens.empty());
  EXPECT_EQ(promptOf(record).size(), 1100u);
}

TEST(TraceTest, ParsesATokensLine) {
  TraceRecord const record = parseTraceLine(
      R"({"id": "req-7", "prompt": [5, 6, 7], "max_new_tokens": 4, "salt": "tenant-a",)"
      R"( "lora": "adapter", "extra": {"ignored": [1, "x"]}})",
      TraceFormat::kAuto);
  EXPECT_EQ(record.format, TraceFormat::kTokens);
  EXPECT_EQ(record.tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(record.inputLength, 3);
  EXPECT_EQ(record.maxNewTokens, 4);
  EXPECT_EQ(record.salt, "tenant-a");
  EXPECT_EQ(record.lora, "adapter");
  EXPECT_EQ(record.id, "req-7");
  EXPECT_FALSE(record.timestampMs.has_value());
  EXPECT_EQ(promptOf(record), record.tokens);
  EXPECT_EQ(
      parseTraceLine(R"({"id": 42, "prompt": [1], "max_new_tokens": 1})", TraceFormat::kTokens).id,
      "42");
}

TEST(TraceTest, MooncakeOutputLengthZeroSamplesOneToken) {
  EXPECT_EQ(parseTraceLine(R"({"input_length": 3, "output_length": 0, "hash_ids": [1]})",
                           TraceFormat::kAuto)
                .maxNewTokens,
            1);
}

TEST(TraceTest, MooncakeInputMayLeaveTrailingBlocksUnused) {
  TraceRecord const record =
      parseTraceLine(R"({"input_length": 100, "output_length": 1, "hash_ids": [1, 2, 3]})",
                     TraceFormat::kMooncake);
  EXPECT_EQ(promptOf(record).size(), 100u);
}

TEST(TraceTest, RejectsEveryMalformedRecord) {
  struct Case {
    char const* line;
    TraceFormat format;
    char const* message;
  };
  Case const cases[] = {
      {R"({"input_length": 1025, "output_length": 1, "hash_ids": [1, 2]})", TraceFormat::kAuto,
       "\"input_length\" 1025 is longer than the 1024 tokens of its 2 \"hash_ids\" blocks"},
      {R"({"input_length": 0, "output_length": 1, "hash_ids": [1]})", TraceFormat::kAuto,
       "\"input_length\" is 0, outside [1, "},
      {R"({"input_length": 10, "output_length": -1, "hash_ids": [1]})", TraceFormat::kAuto,
       "\"output_length\" is -1"},
      {R"({"input_length": 10.5, "output_length": 1, "hash_ids": [1]})", TraceFormat::kAuto,
       "\"input_length\" must be an integer, got 10.5"},
      {R"({"input_length": "10", "output_length": 1, "hash_ids": [1]})", TraceFormat::kAuto,
       "\"input_length\" must be an integer, got a string"},
      {R"({"input_length": 10, "hash_ids": [1]})", TraceFormat::kAuto,
       "missing \"output_length\" (required in the mooncake format)"},
      {R"({"input_length": 10, "output_length": 1})", TraceFormat::kAuto, "missing \"hash_ids\""},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": []})", TraceFormat::kAuto,
       "\"hash_ids\" is empty"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1, -2]})", TraceFormat::kAuto,
       "\"hash_ids\"[1] is -2"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1, 2.5]})", TraceFormat::kAuto,
       "\"hash_ids\"[1] must be an integer"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1, "2"]})", TraceFormat::kAuto,
       "\"hash_ids\"[1] must be an integer, got a string"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": {"0": 1}})", TraceFormat::kAuto,
       "\"hash_ids\" must be an array of integers, got an object"},
      {R"({"input_length": 9223372036854775808, "output_length": 1, "hash_ids": [1]})",
       TraceFormat::kAuto, "\"input_length\" is 9223372036854775808, outside [1, "},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": 5})", TraceFormat::kAuto,
       "\"hash_ids\" must be an array of integers, got a number"},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1], "timestamp": "x"})",
       TraceFormat::kAuto, "\"timestamp\" must be a number"},
      {R"({"prompt": [], "max_new_tokens": 1})", TraceFormat::kAuto, "\"prompt\" is empty"},
      {R"({"prompt": [1, -5], "max_new_tokens": 1})", TraceFormat::kAuto, "\"prompt\"[1] is -5"},
      {R"({"prompt": [1, 2147483648], "max_new_tokens": 1})", TraceFormat::kAuto,
       "\"prompt\"[1] is 2147483648"},
      {R"({"prompt": [1]})", TraceFormat::kAuto,
       "missing \"max_new_tokens\" (required in the tokens format)"},
      {R"({"prompt": [1], "max_new_tokens": 0})", TraceFormat::kAuto,
       "\"max_new_tokens\" is 0, outside [1, "},
      {R"({"prompt": [1], "max_new_tokens": 1, "salt": 3})", TraceFormat::kAuto,
       "\"salt\" must be a string, got a number"},
      {R"({"prompt": [1], "max_new_tokens": 1, "lora": null})", TraceFormat::kAuto,
       "\"lora\" must be a string, got null"},
      {R"({"prompt": [1], "max_new_tokens": 1, "id": 1.5})", TraceFormat::kAuto,
       "\"id\" must be a string or an integer"},
      {R"({"prompt": [1], "max_new_tokens": 1, "hash_ids": [1]})", TraceFormat::kAuto,
       "both \"prompt\""},
      {R"({"timestamp": 1})", TraceFormat::kAuto, "neither a Mooncake record"},
      {R"({"prompt": [1], "max_new_tokens": 1})", TraceFormat::kMooncake,
       "missing \"input_length\""},
      {R"({"input_length": 10, "output_length": 1, "hash_ids": [1]})", TraceFormat::kTokens,
       "missing \"prompt\""},
      {R"({"prompt": [1], "max_new_tokens": 1)", TraceFormat::kAuto,
       "column 36: JSON document ended early in the middle of an object or array"},
      {R"({"prompt": [1], "max_new_tokens": 1, "id": true})", TraceFormat::kAuto,
       "\"id\" must be a string or an integer, got a boolean"},
  };
  for (Case const& c : cases) {
    EXPECT_NE(errorOf(c.line, c.format).find(c.message), std::string::npos)
        << c.line << "\n  -> " << errorOf(c.line, c.format);
  }
}

TEST(TraceTest, DecodesEveryStringEscapeAsUtf8) {
  TraceRecord const record = parseTraceLine(
      R"({"prompt": [1], "max_new_tokens": 1, "salt": "q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20ac )"
      R"(\ud83d\ude00", "id": "\u0041"})",
      TraceFormat::kAuto);
  EXPECT_EQ(record.salt, "q\" b\\ s/ \b\f\n\r\t \xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(record.id, "A");
}

TEST(TraceTest, ChecksAndIgnoresUnknownKeysOfEveryKind) {
  TraceRecord const record = parseTraceLine(
      R"( {"meta": {"x": [1, {"y": "z"}], "w": null}, "mixed": [1, "two", true, false, -2.5e3],)"
      R"( "nested": [[1], []], "prompt": [7], "max_new_tokens": 2, "e": {},)"
      R"( "id": 18446744073709551615})"
      "\r",
      TraceFormat::kAuto);
  EXPECT_EQ(record.tokens, (std::vector<int32_t>{7}));
  EXPECT_EQ(record.maxNewTokens, 2);
  EXPECT_EQ(record.id, "18446744073709551615");
  // A forced format ignores the other format's keys, whatever their values.
  EXPECT_EQ(parseTraceLine(R"({"input_length": 1, "output_length": 1, "hash_ids": [1],)"
                           R"( "prompt": "text", "max_new_tokens": []})",
                           TraceFormat::kMooncake)
                .inputLength,
            1);
}

struct MalformedLine {
  char const* text;
  char const* message;  ///< the start of TraceLineError::what()
};

class TraceSyntaxTest : public ::testing::TestWithParam<MalformedLine> {};

// Strict JSON everywhere in the line, unknown keys included, whatever the format.
TEST_P(TraceSyntaxTest, NamesTheColumnWhenSimdjsonHasOne) {
  MalformedLine const& c = GetParam();
  for (TraceFormat format : {TraceFormat::kAuto, TraceFormat::kMooncake}) {
    std::string const error = errorOf(c.text, format);
    EXPECT_EQ(error.rfind(c.message, 0), 0u)
        << c.text << " (" << toString(format) << ")\n  -> " << error;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TraceSyntaxTest,
    ::testing::Values(
        MalformedLine{"", "Empty: no JSON found"},
        MalformedLine{"[1, 2]", "column 1: a line holds one JSON object, found an array"},
        MalformedLine{"{\"a\": 1", "column 8: JSON document ended early"},
        MalformedLine{"{\"a\": 1,}", "column 9: The JSON document has an improper structure"},
        MalformedLine{"{\"a\" 1}", "column 6: The JSON document has an improper structure"},
        MalformedLine{"{a: 1}", "column 2: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": 1}{}", "column 9: Unexpected trailing content"},
        MalformedLine{"{\"a\": \"x}", "A string is opened, but never closed"},
        MalformedLine{"{\"a\": \"x\ty\"}", "Within strings, some characters must be escaped"},
        MalformedLine{"{\"a\": \"\\x\"}", "column 11: Problem while parsing a string"},
        MalformedLine{"{\"a\": \"\\u12g4\"}", "column 15: Problem while parsing a string"},
        MalformedLine{"{\"a\": \"\\udc00\"}", "column 15: Problem while parsing a string"},
        MalformedLine{"{\"a\": \"\\ud800x\"}", "column 16: Problem while parsing a string"},
        MalformedLine{"{\"a\": \"\xC3\x28\"}", "The input is not valid UTF-8"},
        MalformedLine{"{\"a\": 01}", "column 7: Problem while parsing a number"},
        MalformedLine{"{\"a\": -}", "column 7: Problem while parsing a number"},
        MalformedLine{"{\"a\": 1.}", "column 7: Problem while parsing a number"},
        MalformedLine{"{\"a\": 1e}", "column 7: Problem while parsing a number"},
        MalformedLine{"{\"a\": +1}", "column 7: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": tru}", "column 7: Problem while parsing an atom starting with"},
        MalformedLine{"{\"a\": nul}", "column 7: Problem while parsing an atom starting with"},
        MalformedLine{"{\"a\": [1, 2}", "column 12: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": [1 2]}", "column 10: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": {\"b\": }}",
                      "column 13: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": NaN}", "column 7: The JSON document has an improper structure"},
        MalformedLine{"{\"a\": 1, \"a\": 2, \"input_length\": 1}",
                      "column 10: duplicate key \"a\""}));

TEST(TraceTest, NestingBeyondTheDepthLimitIsAnErrorNotACrash) {
  auto nested = [](std::size_t depth) {
    return R"({"prompt": [1], "max_new_tokens": 1, "a": )" + std::string(depth, '[') +
           std::string(depth, ']') + "}";
  };
  EXPECT_EQ(errorOf(nested(128)), "accepted");
  // The 129th bracket opens at column 43 + 128.
  EXPECT_EQ(errorOf(nested(100000)), "column 171: values nested deeper than 128 levels");
}

TEST(TraceTest, LoaderNamesTheFileAndLineAndSkipsBlankLines) {
  std::istringstream input(
      "{\"prompt\": [1, 2], \"max_new_tokens\": 1}\n"
      "\n"
      "   \r\n"
      "{\"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4]}\n"
      "{\"input_length\": 3, \"output_length\": 1 \"hash_ids\": [4]}\n");
  try {
    parseTrace(input, "t.jsonl", TraceFormat::kAuto);
    FAIL() << "accepted";
  } catch (TraceError const& error) {
    EXPECT_EQ(std::string(error.what())
                  .rfind("t.jsonl:5: column 40: The JSON document has an improper structure", 0),
              0u)
        << error.what();
  }
  std::istringstream again(
      "{\"prompt\": [1, 2], \"max_new_tokens\": 1}\n\n"
      "{\"input_length\": 3, \"output_length\": 1, \"hash_ids\": [4]}");
  std::vector<TraceRecord> const records = parseTrace(again, "t.jsonl", TraceFormat::kAuto);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].line, 1);
  EXPECT_EQ(records[1].line, 3);
  EXPECT_EQ(records[1].format, TraceFormat::kMooncake);
}

TEST(TraceTest, LimitStopsBeforeLaterLines) {
  std::istringstream input(
      "{\"prompt\": [1], \"max_new_tokens\": 1}\n"
      "{\"prompt\": [2], \"max_new_tokens\": 1}\n"
      "not json\n");
  EXPECT_EQ(parseTrace(input, "t", TraceFormat::kAuto, 2).size(), 2u);
}

TEST(TraceTest, MissingFileIsATraceError) {
  try {
    loadTrace("/nonexistent/trace.jsonl", TraceFormat::kAuto);
    FAIL();
  } catch (TraceError const& error) {
    EXPECT_EQ(std::string(error.what()),
              "cannot open trace /nonexistent/trace.jsonl: No such file or directory");
  }
}

TEST(TraceTest, FormatNames) {
  EXPECT_EQ(parseTraceFormat("mooncake"), TraceFormat::kMooncake);
  EXPECT_EQ(parseTraceFormat("tokens"), TraceFormat::kTokens);
  EXPECT_EQ(parseTraceFormat("auto"), TraceFormat::kAuto);
  EXPECT_FALSE(parseTraceFormat("csv").has_value());
}

TEST(MooncakeExpansionTest, TokensAreTheDocumentedFunctionOfBlockAndOffset) {
  // Golden values of 1000 + splitmix64(block * 1000003 + offset) % 30000, computed outside C++.
  EXPECT_EQ(mooncakeToken(0, 0), 28535);
  EXPECT_EQ(mooncakeToken(0, 1), 3465);
  EXPECT_EQ(mooncakeToken(1, 0), 22604);
  EXPECT_EQ(mooncakeToken(12345, 511), 6775);
  EXPECT_EQ(mooncakeToken(43923, 100), 5833);
}

TEST(MooncakeExpansionTest, ExactLengthLastBlockTruncatedAndDeterministic) {
  std::vector<int64_t> const blocks = {7, 8, 9};
  for (int32_t length : {1, 511, 512, 513, 1024, 1100, 1536}) {
    std::vector<int32_t> const prompt = expandMooncakePrompt(blocks, length);
    ASSERT_EQ(prompt.size(), static_cast<std::size_t>(length));
    EXPECT_EQ(prompt, expandMooncakePrompt(blocks, length));
    for (int32_t i = 0; i < length; ++i) {
      ASSERT_EQ(prompt[static_cast<std::size_t>(i)],
                mooncakeToken(blocks[static_cast<std::size_t>(i / 512)], i % 512));
      ASSERT_GE(prompt[static_cast<std::size_t>(i)], 1000);
      ASSERT_LT(prompt[static_cast<std::size_t>(i)], 31000);
    }
  }
  EXPECT_THROW(expandMooncakePrompt(blocks, 1537), std::invalid_argument);
}

TEST(MooncakeExpansionTest, EqualIdsShareTokensAndDifferentIdsDiffer) {
  std::vector<int32_t> const a = expandMooncakePrompt(std::vector<int64_t>{1, 2}, 1024);
  std::vector<int32_t> const b = expandMooncakePrompt(std::vector<int64_t>{1, 3}, 1024);
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 512, b.begin()));
  EXPECT_FALSE(std::equal(a.begin() + 512, a.end(), b.begin() + 512));
  // Within one block the tokens are not constant.
  std::set<int32_t> const distinct(a.begin(), a.begin() + 512);
  EXPECT_GT(distinct.size(), 400u);
}

TEST(TraceSourceTest, BoundsAndMaterialisation) {
  std::vector<TraceRecord> records;
  records.push_back(parseTraceLine(
      R"({"input_length": 1024, "output_length": 4, "hash_ids": [1, 2]})", TraceFormat::kAuto));
  records.push_back(
      parseTraceLine(R"({"input_length": 1500, "output_length": 300, "hash_ids": [1, 2, 3]})",
                     TraceFormat::kAuto));
  records.push_back(parseTraceLine(R"({"prompt": [1, 2, 3], "max_new_tokens": 9, "salt": "s"})",
                                   TraceFormat::kAuto));
  TraceSource source(std::move(records), "test");
  EXPECT_EQ(source.size(), 3u);
  EXPECT_EQ(source.longestSequenceTokens(0), 1800);
  EXPECT_EQ(source.longestSequenceTokens(10), 1510);
  // Distinct prompt pages at 128 tokens: 8 shared + 3 more of the second prompt; generated
  // pages: ceil(4/128)+1 + ceil(300/128)+1 + ceil(9/128)+1 = 2 + 4 + 2.
  EXPECT_EQ(source.cachedPagesBound(128, 0), 11 + 8);
  ReplayRequest const request = source.materialize(2);
  EXPECT_EQ(request.prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(request.maxNewTokens, 9);
  EXPECT_EQ(request.salt, "s");
}

}  // namespace
}  // namespace mkv::replay
