#pragma once
/// \file multi_turn_workload.h
/// The workload mkv-replay replays without arguments: interleaved multi-turn chats.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "request_source.h"

namespace mkv::replay {

struct MultiTurnWorkloadConfig {
  int32_t conversations = 24;
  int32_t turns = 5;
  /// Every other conversation (the even ones) starts with the same system prompt of this many
  /// tokens; the odd ones have none.
  int32_t systemPromptTokens = 320;
  int32_t minUserTokens = 40;  ///< each turn's new user message: [min, max] tokens
  int32_t maxUserTokens = 160;
  int32_t minReplyTokens = 16;  ///< each turn's max_new_tokens: [min, max]
  int32_t maxReplyTokens = 112;
  uint64_t seed = 1;
};

/// Request i is turn i / conversations of conversation i % conversations, so the conversations
/// interleave turn by turn. A turn's prompt is the previous turn's prompt, that turn's sampled
/// tokens (the assistant's reply, as the engine produced it) and a new user message: the workload
/// is closed-loop, and turn t of a conversation is ready only once turn t - 1 finished. Message
/// lengths, reply budgets and token ids are deterministic functions of the seed.
class MultiTurnWorkload final : public RequestSource {
 public:
  explicit MultiTurnWorkload(MultiTurnWorkloadConfig const& config = {});

  std::size_t size() const override;
  std::string describe() const override;
  bool ready(std::size_t index) const override;
  ReplayRequest materialize(std::size_t index) override;
  void finished(std::size_t index, std::span<int32_t const> generated) override;
  int64_t longestSequenceTokens(int32_t maxOutputCap) const override;
  int64_t cachedPagesBound(int32_t pageSize, int32_t maxOutputCap) const override;

 private:
  struct Turn {
    std::vector<int32_t> userMessage;
    int32_t maxNewTokens = 0;
  };
  Turn const& turn(std::size_t index) const;

  MultiTurnWorkloadConfig mConfig;
  std::vector<int32_t> mSystemPrompt;
  std::vector<Turn> mTurns;                    ///< by request index
  std::vector<std::vector<int32_t>> mHistory;  ///< per conversation: last prompt + its reply
  std::vector<int32_t> mFinishedTurns;         ///< per conversation
};

}  // namespace mkv::replay
