// The strict one-object-per-line JSON parser of mkv-replay: accepted syntax, values kept,
// values skipped, and every malformed case with the column it points at.
#include "json_object.h"

#include <gtest/gtest.h>

#include <string>

namespace mkv::replay {
namespace {

using Kind = JsonValue::Kind;

TEST(JsonObjectTest, KeepsNumbersStringsBooleansNullAndNumberArrays) {
  JsonObject const object = parseJsonObject(
      R"( {"a": 12, "b": -3, "c": 1.5, "d": 2e3, "s": "x", "t": true, "f": false, "n": null,)"
      R"( "arr": [1, -2, 3.25], "empty": []} )");
  ASSERT_EQ(object.members().size(), 10u);
  EXPECT_EQ(object.members()[0].first, "a");
  JsonValue const* a = object.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->kind, Kind::kNumber);
  EXPECT_TRUE(a->number.integral);
  EXPECT_EQ(a->number.integer, 12);
  EXPECT_EQ(object.find("b")->number.integer, -3);
  EXPECT_FALSE(object.find("c")->number.integral);
  EXPECT_DOUBLE_EQ(object.find("c")->number.value, 1.5);
  EXPECT_FALSE(object.find("d")->number.integral);  // an exponent is not an integer literal
  EXPECT_DOUBLE_EQ(object.find("d")->number.value, 2000.0);
  EXPECT_EQ(object.find("s")->string, "x");
  EXPECT_TRUE(object.find("t")->boolean);
  EXPECT_EQ(object.find("f")->kind, Kind::kBool);
  EXPECT_FALSE(object.find("f")->boolean);
  EXPECT_EQ(object.find("n")->kind, Kind::kNull);
  JsonValue const* arr = object.find("arr");
  ASSERT_EQ(arr->kind, Kind::kNumberArray);
  ASSERT_EQ(arr->numbers.size(), 3u);
  EXPECT_EQ(arr->numbers[1].integer, -2);
  EXPECT_FALSE(arr->numbers[2].integral);
  EXPECT_EQ(object.find("empty")->kind, Kind::kNumberArray);
  EXPECT_TRUE(object.find("empty")->numbers.empty());
  EXPECT_EQ(object.find("missing"), nullptr);
}

TEST(JsonObjectTest, DecodesEveryEscapeAsUtf8) {
  JsonObject const object =
      parseJsonObject(R"({"s": "q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20ac \ud83d\ude00"})");
  EXPECT_EQ(object.find("s")->string,
            "q\" b\\ s/ \b\f\n\r\t \xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
}

TEST(JsonObjectTest, EmptyObjectAndCrLfLineEnd) {
  EXPECT_TRUE(parseJsonObject("{}").members().empty());
  EXPECT_EQ(parseJsonObject("{\"a\": 1}\r").find("a")->number.integer, 1);
}

TEST(JsonObjectTest, SkipsNestedObjectsAndMixedArrays) {
  JsonObject const object = parseJsonObject(
      R"({"meta": {"x": [1, {"y": "z"}], "w": null}, "mixed": [1, "two"], "nested": [[1], [2]],)"
      R"( "k": 7})");
  EXPECT_EQ(object.find("meta")->kind, Kind::kOther);
  EXPECT_EQ(object.find("mixed")->kind, Kind::kOther);
  EXPECT_EQ(object.find("nested")->kind, Kind::kOther);
  EXPECT_EQ(object.find("k")->number.integer, 7);
}

TEST(JsonObjectTest, IntegersBeyondInt64AreNotIntegral) {
  JsonObject const object = parseJsonObject(
      R"({"max": 9223372036854775807, "min": -9223372036854775808, "big": 9223372036854775808})");
  EXPECT_TRUE(object.find("max")->number.integral);
  EXPECT_EQ(object.find("max")->number.integer, INT64_MAX);
  EXPECT_EQ(object.find("min")->number.integer, INT64_MIN);
  EXPECT_FALSE(object.find("big")->number.integral);
  EXPECT_GT(object.find("big")->number.value, 9.2e18);
}

struct Malformed {
  char const* text;
  std::size_t column;
  char const* message;  // a fragment of the message
};

class JsonObjectMalformedTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(JsonObjectMalformedTest, ThrowsWithTheColumn) {
  Malformed const& c = GetParam();
  try {
    parseJsonObject(c.text);
    FAIL() << "accepted: " << c.text;
  } catch (JsonSyntaxError const& error) {
    EXPECT_EQ(error.column(), c.column) << c.text << ": " << error.what();
    EXPECT_NE(std::string(error.what()).find(c.message), std::string::npos)
        << c.text << ": " << error.what();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, JsonObjectMalformedTest,
    ::testing::Values(
        Malformed{"", 1, "expected '{'"}, Malformed{"   ", 4, "found the end of the line"},
        Malformed{"[1, 2]", 1, "one JSON object"}, Malformed{"{\"a\": 1", 8, "',' or '}'"},
        Malformed{"{\"a\": 1,}", 9, "a string key"}, Malformed{"{\"a\" 1}", 6, "':' after the key"},
        Malformed{"{a: 1}", 2, "a string key"},
        Malformed{"{\"a\": 1} x", 10, "the end of the line"},
        Malformed{"{\"a\": 1}{}", 9, "the end of the line"},
        Malformed{"{\"a\": \"x}", 10, "closing '\"'"},
        Malformed{"{\"a\": \"x\ty\"}", 9, "control character"},
        Malformed{"{\"a\": \"\\x\"}", 9, "an escape"},
        Malformed{"{\"a\": \"\\u12g4\"}", 12, "hex digits"},
        Malformed{"{\"a\": \"\\udc00\"}", 8, "unpaired low surrogate"},
        Malformed{"{\"a\": \"\\ud800x\"}", 8, "unpaired high surrogate"},
        Malformed{"{\"a\": 01}", 8, "',' or '}'"}, Malformed{"{\"a\": -}", 8, "a digit"},
        Malformed{"{\"a\": 1.}", 9, "after the decimal point"},
        Malformed{"{\"a\": 1e}", 9, "exponent"}, Malformed{"{\"a\": +1}", 7, "a JSON value"},
        Malformed{"{\"a\": tru}", 7, "a JSON value"}, Malformed{"{\"a\": [1, 2}", 12, "',' or ']'"},
        Malformed{"{\"a\": [1 2]}", 10, "',' or ']'"},
        Malformed{"{\"a\": [1, \"x\"}", 14, "',' or ']'"},
        Malformed{"{\"a\": {\"b\": }}", 13, "a JSON value"},
        Malformed{"{\"a\": 1, \"a\": 2}", 10, "duplicate key \"a\""},
        Malformed{"{\"a\": NaN}", 7, "a JSON value"}));

TEST(JsonObjectTest, LimitsNestingOfSkippedValues) {
  std::string deep = "{\"a\": ";
  for (int i = 0; i < 200; ++i) {
    deep += "[";
  }
  for (int i = 0; i < 200; ++i) {
    deep += "]";
  }
  deep += "}";
  EXPECT_THROW(parseJsonObject(deep), JsonSyntaxError);
}

}  // namespace
}  // namespace mkv::replay
