#pragma once
/// \file trace.h
/// Request traces: the Mooncake FAST'25 JSONL format and mkv-replay's own token format, their
/// strict line parser and loader, the deterministic expansion of Mooncake block ids into token
/// ids, and TraceSource (a trace as a RequestSource). Formats: docs/replay.md.

#include <cstdint>
#include <istream>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "request_source.h"

namespace mkv::replay {

enum class TraceFormat : uint8_t {
  kAuto,      ///< decide per line by its keys
  kMooncake,  ///< timestamp, input_length, output_length, hash_ids
  kTokens,    ///< prompt, max_new_tokens, salt, lora, id
};
std::string_view toString(TraceFormat format) noexcept;
/// "auto", "mooncake", "tokens"; nullopt otherwise.
std::optional<TraceFormat> parseTraceFormat(std::string_view name) noexcept;

/// Tokens of one Mooncake hash block.
inline constexpr int32_t kMooncakeBlockTokens = 512;
/// Largest prompt and largest generation a trace line may ask for (tokens).
inline constexpr int32_t kMaxTraceTokens = 1 << 24;

/// Token `offset` (in [0, 512)) of Mooncake block `blockId`:
/// 1000 + splitmix64(blockId * 1000003 + offset) % 30000, so equal block ids expand to equal
/// tokens and different ones (almost surely) differ at their first token.
int32_t mooncakeToken(int64_t blockId, int32_t offset) noexcept;
/// The prompt of a Mooncake record: the blocks' tokens in order, exactly `inputLength` of them
/// (the last block used is truncated; blocks beyond inputLength are not used). Throws
/// std::invalid_argument when the blocks hold fewer than inputLength tokens.
std::vector<int32_t> expandMooncakePrompt(std::span<int64_t const> hashIds, int32_t inputLength);

/// One parsed trace line.
struct TraceRecord {
  TraceFormat format = TraceFormat::kTokens;  ///< kMooncake or kTokens, never kAuto
  int64_t line = 0;                           ///< 1-based line number in the file
  int32_t inputLength = 0;                    ///< prompt tokens
  /// Tokens to sample. Mooncake output_length 0 becomes 1: the engine always samples one token
  /// at the end of prefill.
  int32_t maxNewTokens = 1;
  std::vector<int64_t> hashIds;  ///< kMooncake
  std::vector<int32_t> tokens;   ///< kTokens: the prompt
  std::string salt;
  std::string lora;
  std::string id;  ///< "id" as written (a string, or an integer's digits)
  std::optional<double> timestampMs;
};

/// A line that is not a valid record; the message has no location.
class TraceLineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A trace that cannot be loaded: "<file>:<line>: <what>" or "cannot open <file>: <why>".
class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Parses one non-blank line. Throws TraceLineError.
TraceRecord parseTraceLine(std::string_view text, TraceFormat format);
/// Reads records until the end or until `limit` records (0 = all); blank lines are skipped.
/// Throws TraceError naming `name` and the line number for the first malformed line.
std::vector<TraceRecord> parseTrace(std::istream& input, std::string const& name,
                                    TraceFormat format, std::size_t limit = 0);
/// parseTrace of a file; TraceError when it cannot be opened or read.
std::vector<TraceRecord> loadTrace(std::string const& path, TraceFormat format,
                                   std::size_t limit = 0);

/// The prompt tokens of a record (expanded for Mooncake).
std::vector<int32_t> promptOf(TraceRecord const& record);

/// A loaded trace replayed in file order; requests do not depend on each other.
class TraceSource final : public RequestSource {
 public:
  TraceSource(std::vector<TraceRecord> records, std::string description);

  std::size_t size() const override { return mRecords.size(); }
  std::string describe() const override { return mDescription; }
  bool ready(std::size_t) const override { return true; }
  ReplayRequest materialize(std::size_t index) override;
  void finished(std::size_t, std::span<int32_t const>) override {}
  int64_t longestSequenceTokens(int32_t maxOutputCap) const override;
  int64_t cachedPagesBound(int32_t pageSize, int32_t maxOutputCap) const override;

  std::vector<TraceRecord> const& records() const noexcept { return mRecords; }

 private:
  std::vector<TraceRecord> mRecords;
  std::string mDescription;
};

}  // namespace mkv::replay
