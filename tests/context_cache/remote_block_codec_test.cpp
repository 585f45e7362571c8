// The remote tier's value format (remote_block_codec.h): a value round-trips, and every field a
// load checks refuses a value that differs in it: another deployment, key, parent, extras, token
// ids or payload size, a damaged payload, a cut or padded value, another format.

#include "context_cache/remote_block_codec.h"

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "mkv/error.h"

namespace mkv {
namespace {

class RemoteBlockCodecTest : public ::testing::Test {
 protected:
  RemoteBlockCodecTest() {
    for (std::size_t i = 0; i < mBytes.size(); ++i) {
      mBytes[i] = static_cast<std::byte>(i * 37 + 1);
    }
    mHeader = RemoteBlockHeader{Hash128{1, 2}, Hash128{3, 4}, Hash128{5, 6},
                                Hash128{},     mTokens,       static_cast<int64_t>(mBytes.size())};
  }
  std::string encoded() const {
    std::array<std::span<std::byte const>, 2> const chunks{std::span(mBytes).first(100),
                                                           std::span(mBytes).subspan(100)};
    return encodeRemoteBlock(mHeader, chunks);
  }
  RemoteBlockCheck check(std::string const& value, RemoteBlockHeader const& expected) const {
    std::span<std::byte const> payload;
    RemoteBlockCheck const result = checkRemoteBlock(value, expected, payload);
    EXPECT_EQ(payload.empty(), result != RemoteBlockCheck::kValid);
    return result;
  }

  std::vector<int32_t> mTokens{10, 11, 12, 13};
  std::array<std::byte, 256> mBytes{};
  RemoteBlockHeader mHeader;
};

TEST_F(RemoteBlockCodecTest, AValueRoundTripsItsPayload) {
  std::string const value = encoded();
  std::span<std::byte const> payload;
  ASSERT_EQ(checkRemoteBlock(value, mHeader, payload), RemoteBlockCheck::kValid);
  ASSERT_EQ(payload.size(), mBytes.size());
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(), mBytes.begin()));
}

TEST_F(RemoteBlockCodecTest, EveryCheckedFieldRefusesAValueThatDiffers) {
  std::string const value = encoded();
  RemoteBlockHeader expected = mHeader;
  expected.deployment = Hash128{1, 3};
  EXPECT_EQ(check(value, expected), RemoteBlockCheck::kOtherDeployment);
  for (Hash128 RemoteBlockHeader::*field :
       {&RemoteBlockHeader::key, &RemoteBlockHeader::parent, &RemoteBlockHeader::extras}) {
    expected = mHeader;
    expected.*field = Hash128{9, 9};
    EXPECT_EQ(check(value, expected), RemoteBlockCheck::kOtherBlock);
  }
  std::vector<int32_t> otherTokens = mTokens;
  otherTokens[2] = 99;
  expected = mHeader;
  expected.tokens = otherTokens;
  EXPECT_EQ(check(value, expected), RemoteBlockCheck::kOtherBlock);
  expected = mHeader;
  expected.payloadBytes += 1;
  EXPECT_EQ(check(value, expected), RemoteBlockCheck::kOtherBlock);
}

TEST_F(RemoteBlockCodecTest, DamagedCutPaddedOrForeignValuesAreRefused) {
  std::string damaged = encoded();
  damaged.back() = static_cast<char>(damaged.back() ^ 1);
  EXPECT_EQ(check(damaged, mHeader), RemoteBlockCheck::kBadChecksum);
  std::string cut = encoded();
  cut.pop_back();
  EXPECT_EQ(check(cut, mHeader), RemoteBlockCheck::kTruncated);
  EXPECT_EQ(check(encoded().substr(0, 10), mHeader), RemoteBlockCheck::kTruncated);
  EXPECT_EQ(check(encoded() + "x", mHeader), RemoteBlockCheck::kTruncated);
  std::string foreign = encoded();
  foreign[0] = 'X';
  EXPECT_EQ(check(foreign, mHeader), RemoteBlockCheck::kBadFormat);
  EXPECT_EQ(check(std::string(200, '\0'), mHeader), RemoteBlockCheck::kBadFormat);
}

TEST_F(RemoteBlockCodecTest, APayloadOfAnotherSizeThanTheHeaderSaysIsAContractViolation) {
  RemoteBlockHeader wrong = mHeader;
  wrong.payloadBytes = 10;
  std::array<std::span<std::byte const>, 1> const chunks{std::span(mBytes)};
  EXPECT_THROW((void)encodeRemoteBlock(wrong, chunks), Error);
}

TEST(RemoteDeploymentTest, TheIdentityCoversTheModelAndEveryGeometryField) {
  RemoteDeployment const base{"llama", 32, 16, 8, 128, DataType::kFloat16};
  Hash128 const identity = remoteDeploymentIdentity(base);
  EXPECT_EQ(remoteDeploymentIdentity(base), identity);
  std::vector<RemoteDeployment> others(6, base);
  others[0].model = "llama-q4";
  others[1].numLayers = 31;
  others[2].tokensPerPage = 32;
  others[3].numKVHeads = 4;
  others[4].headDim = 64;
  others[5].dtype = DataType::kBFloat16;
  for (RemoteDeployment const& other : others) {
    EXPECT_NE(remoteDeploymentIdentity(other), identity);
  }
  EXPECT_EQ(remoteBlockKey(Hash128{0, 1}, Hash128{2, 3}),
            "mkv1:00000000000000000000000000000001:"
            "00000000000000020000000000000003")
      << "hi first, 32 hex digits each";
}

}  // namespace
}  // namespace mkv
