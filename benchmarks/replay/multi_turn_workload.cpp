#include "multi_turn_workload.h"

#include <fmt/format.h>

#include <stdexcept>

namespace mkv::replay {
namespace {

class Random {
 public:
  explicit Random(uint64_t seed) : mState(seed) {}
  uint64_t next() noexcept {
    mState += 0x9E3779B97F4A7C15ULL;
    uint64_t z = mState;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  int32_t uniform(int32_t low, int32_t high) noexcept {  // [low, high]
    return low + static_cast<int32_t>(next() % static_cast<uint64_t>(high - low + 1));
  }
  std::vector<int32_t> tokens(int32_t count) {
    std::vector<int32_t> out(static_cast<std::size_t>(count));
    for (int32_t& token : out) {
      token = uniform(1000, 30999);
    }
    return out;
  }

 private:
  uint64_t mState;
};

}  // namespace

MultiTurnWorkload::MultiTurnWorkload(MultiTurnWorkloadConfig const& config) : mConfig(config) {
  if (config.conversations < 1 || config.turns < 1 || config.systemPromptTokens < 0 ||
      config.minUserTokens < 1 || config.maxUserTokens < config.minUserTokens ||
      config.minReplyTokens < 1 || config.maxReplyTokens < config.minReplyTokens) {
    throw std::invalid_argument("MultiTurnWorkload: inconsistent configuration");
  }
  Random random(config.seed ^ 0xC0FFEE5EEDULL);
  mSystemPrompt = random.tokens(config.systemPromptTokens);
  auto const count =
      static_cast<std::size_t>(config.conversations) * static_cast<std::size_t>(config.turns);
  mTurns.resize(count);
  for (Turn& t : mTurns) {
    t.userMessage = random.tokens(random.uniform(config.minUserTokens, config.maxUserTokens));
    t.maxNewTokens = random.uniform(config.minReplyTokens, config.maxReplyTokens);
  }
  mHistory.resize(static_cast<std::size_t>(config.conversations));
  mFinishedTurns.assign(static_cast<std::size_t>(config.conversations), 0);
}

std::size_t MultiTurnWorkload::size() const { return mTurns.size(); }

std::string MultiTurnWorkload::describe() const {
  return fmt::format(
      "embedded multi-turn workload ({} conversations x {} turns, shared {}-token system prompt "
      "in half of them)",
      mConfig.conversations, mConfig.turns, mConfig.systemPromptTokens);
}

MultiTurnWorkload::Turn const& MultiTurnWorkload::turn(std::size_t index) const {
  return mTurns.at(index);
}

bool MultiTurnWorkload::ready(std::size_t index) const {
  auto const conversations = static_cast<std::size_t>(mConfig.conversations);
  auto const t = static_cast<int32_t>(index / conversations);
  return t == 0 || mFinishedTurns[index % conversations] >= t;
}

ReplayRequest MultiTurnWorkload::materialize(std::size_t index) {
  if (!ready(index)) {
    throw std::logic_error(fmt::format("MultiTurnWorkload: request {} is not ready", index));
  }
  auto const conversations = static_cast<std::size_t>(mConfig.conversations);
  std::size_t const conversation = index % conversations;
  std::vector<int32_t>& history = mHistory[conversation];
  if (index < conversations && conversation % 2 == 0) {
    history = mSystemPrompt;
  }
  Turn const& t = turn(index);
  history.insert(history.end(), t.userMessage.begin(), t.userMessage.end());
  ReplayRequest request;
  request.prompt = history;
  request.maxNewTokens = t.maxNewTokens;
  request.id = fmt::format("c{}t{}", conversation, index / conversations);
  return request;
}

void MultiTurnWorkload::finished(std::size_t index, std::span<int32_t const> generated) {
  auto const conversations = static_cast<std::size_t>(mConfig.conversations);
  std::size_t const conversation = index % conversations;
  std::vector<int32_t>& history = mHistory[conversation];
  history.insert(history.end(), generated.begin(), generated.end());
  ++mFinishedTurns[conversation];
}

int64_t MultiTurnWorkload::longestSequenceTokens(int32_t maxOutputCap) const {
  int64_t longest = 0;
  auto const conversations = static_cast<std::size_t>(mConfig.conversations);
  for (std::size_t c = 0; c < conversations; ++c) {
    int64_t length = c % 2 == 0 ? mConfig.systemPromptTokens : 0;
    for (std::size_t i = c; i < mTurns.size(); i += conversations) {
      length += static_cast<int64_t>(mTurns[i].userMessage.size()) +
                cappedOutput(mTurns[i].maxNewTokens, maxOutputCap);
    }
    longest = std::max(longest, length);
  }
  return longest;
}

int64_t MultiTurnWorkload::cachedPagesBound(int32_t pageSize, int32_t maxOutputCap) const {
  // Every request publishes at most the pages of its own prompt and reply.
  int64_t pages = 0;
  auto const conversations = static_cast<std::size_t>(mConfig.conversations);
  for (std::size_t c = 0; c < conversations; ++c) {
    int64_t length = c % 2 == 0 ? mConfig.systemPromptTokens : 0;
    for (std::size_t i = c; i < mTurns.size(); i += conversations) {
      length += static_cast<int64_t>(mTurns[i].userMessage.size()) +
                cappedOutput(mTurns[i].maxNewTokens, maxOutputCap);
      pages += (length + pageSize - 1) / pageSize;
    }
  }
  return pages;
}

}  // namespace mkv::replay
