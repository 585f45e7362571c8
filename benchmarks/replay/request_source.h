#pragma once
/// \file request_source.h
/// What the replay runner consumes: requests in replay order, materialised one at a time.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace mkv::replay {

/// One request as the engine runs it.
struct ReplayRequest {
  std::vector<int32_t> prompt;  ///< token ids, never empty
  int32_t maxNewTokens = 1;     ///< sampled tokens, >= 1 (before the runner's --max-output cap)
  std::string salt;             ///< cache salt (tenant); requests with different salts never share
  std::string lora;             ///< LoRA adapter name; part of every block key
  std::string id;               ///< caller's id, may be empty
  std::optional<double> timestampMs;  ///< arrival time in the trace, when it has one
};

/// A replayable workload. Requests are materialised in index order; a source may make request i
/// depend on the outcome of an earlier one (a chat turn continues the previous turn's reply),
/// in which case ready(i) stays false until finished() was called for that earlier request.
/// Single-threaded.
class RequestSource {
 public:
  virtual ~RequestSource() = default;

  virtual std::size_t size() const = 0;
  /// One line for the summary, e.g. "trace t.jsonl (mooncake)".
  virtual std::string describe() const = 0;
  /// Whether request `index` can be materialised now. Always true once every request before it
  /// has finished.
  virtual bool ready(std::size_t index) const = 0;
  /// Builds request `index` (called once per index, in increasing order).
  virtual ReplayRequest materialize(std::size_t index) = 0;
  /// The final outcome of request `index`: every sampled token (empty when it failed).
  virtual void finished(std::size_t index, std::span<int32_t const> generated) = 0;

  /// Upper bound of prompt + sampled tokens of any request, with generation capped at
  /// `maxOutputCap` tokens (0 = no cap).
  virtual int64_t longestSequenceTokens(int32_t maxOutputCap) const = 0;
  /// Upper bound of the pages that published (cached) blocks can ever hold at page size
  /// `pageSize`: distinct page-aligned prompt prefixes plus the pages generated tokens can fill.
  /// Sizes the "unbounded" pool of reuse mode (nothing is ever evicted).
  virtual int64_t cachedPagesBound(int32_t pageSize, int32_t maxOutputCap) const = 0;
};

/// min(requested, cap) with cap 0 meaning no cap.
inline int32_t cappedOutput(int32_t requested, int32_t cap) noexcept {
  return cap > 0 && cap < requested ? cap : requested;
}

}  // namespace mkv::replay
