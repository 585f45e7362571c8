#include "mkv/events/kv_event_publisher.h"

#include <gtest/gtest.h>
#include <zmq.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#define MSGPACK_NO_BOOST
#include <msgpack.hpp>

#include "support/prometheus_text_parser.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

constexpr int32_t kBlock = 4;

// ------------------------------------------------------------------ a ZeroMQ client of our own

struct Context {
  void* raw = zmq_ctx_new();
  ~Context() { zmq_ctx_term(raw); }
};

struct Socket {
  Socket(Context& context, int type) : raw(zmq_socket(context.raw, type)) {
    int const linger = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &linger, sizeof linger);
  }
  ~Socket() { zmq_close(raw); }
  void send(std::vector<std::string> const& frames) const {
    for (std::size_t i = 0; i < frames.size(); ++i) {
      int const more = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
      ASSERT_GE(zmq_send(raw, frames[i].data(), frames[i].size(), more), 0);
    }
  }
  /// The next message's frames, or nothing after `timeoutMs`.
  std::optional<std::vector<std::string>> receive(int timeoutMs) const {
    zmq_pollitem_t item{raw, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, timeoutMs) <= 0) {
      return std::nullopt;
    }
    std::vector<std::string> frames;
    while (true) {
      zmq_msg_t message;
      zmq_msg_init(&message);
      EXPECT_GE(zmq_msg_recv(&message, raw, 0), 0);
      frames.emplace_back(static_cast<char const*>(zmq_msg_data(&message)), zmq_msg_size(&message));
      bool const more = zmq_msg_more(&message) != 0;
      zmq_msg_close(&message);
      if (!more) {
        return frames;
      }
    }
  }
  void* raw;
};

int64_t sequenceOf(std::string const& frame) {
  EXPECT_EQ(frame.size(), 8U);
  uint64_t value = 0;
  for (char c : frame) {
    value = (value << 8U) | static_cast<uint8_t>(c);
  }
  return static_cast<int64_t>(value);
}

std::string bigEndian(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 7; i >= 0; --i) {
    bytes[static_cast<std::size_t>(i)] = static_cast<char>(value & 0xFFU);
    value >>= 8U;
  }
  return bytes;
}

/// Every (sequence, payload) a replay request from `start` returns, up to the end marker.
std::vector<std::pair<int64_t, std::string>> replayFrom(Context& context,
                                                        std::string const& endpoint,
                                                        uint64_t start) {
  Socket dealer(context, ZMQ_DEALER);
  EXPECT_EQ(zmq_connect(dealer.raw, endpoint.c_str()), 0);
  dealer.send({"", bigEndian(start)});
  std::vector<std::pair<int64_t, std::string>> batches;
  while (true) {
    std::optional<std::vector<std::string>> const frames = dealer.receive(5000);
    if (!frames) {
      ADD_FAILURE() << "no answer to a replay request from " << start;
      return batches;
    }
    EXPECT_EQ(frames->size(), 3U);
    EXPECT_TRUE(frames->at(0).empty()) << "the delimiter frame";
    int64_t const sequence = sequenceOf(frames->at(1));
    if (sequence == -1) {
      EXPECT_TRUE(frames->at(2).empty()) << "the end marker has an empty payload";
      return batches;
    }
    batches.emplace_back(sequence, frames->at(2));
  }
}

// ------------------------------------------------------------------ an independent decoder

/// One wire event as a router reads it, from either encoding.
struct WireEvent {
  std::string type;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;
  std::vector<uint64_t> tokens;
  int64_t blockSize = 0;
  std::optional<std::string> medium;
  bool loraNil = true;
  std::optional<std::vector<std::optional<std::string>>> extraKeys;  ///< first key of each block
  bool extraKeysNil = false;  ///< the extra_keys field is present and nil
  std::optional<int64_t> groupIdx;
  std::optional<std::string> specKind;
  std::optional<int64_t> slidingWindow;  ///< unset when absent or nil
  std::size_t fieldCount = 0;            ///< fields besides the type (the tag or the class name)
};

std::string text(msgpack::object const& o) {
  EXPECT_EQ(o.type, msgpack::type::STR);
  return {o.via.str.ptr, o.via.str.size};
}

std::vector<uint64_t> integers(msgpack::object const& o) {
  EXPECT_EQ(o.type, msgpack::type::ARRAY);
  std::vector<uint64_t> out;
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    EXPECT_EQ(o.via.array.ptr[i].type, msgpack::type::POSITIVE_INTEGER);
    out.push_back(o.via.array.ptr[i].via.u64);
  }
  return out;
}

WireEvent decodeEvent(msgpack::object const& o, KvEventEncoding encoding) {
  std::map<std::string, msgpack::object> fields;
  WireEvent e;
  if (encoding == KvEventEncoding::kTaggedMap) {
    EXPECT_EQ(o.type, msgpack::type::MAP);
    for (uint32_t i = 0; i < o.via.map.size; ++i) {
      fields[text(o.via.map.ptr[i].key)] = o.via.map.ptr[i].val;
    }
    e.type = text(fields.at("type"));
    e.fieldCount = fields.size() - 1;
  } else {
    EXPECT_EQ(o.type, msgpack::type::ARRAY);
    e.type = text(o.via.array.ptr[0]);
    e.fieldCount = o.via.array.size - 1;
    std::vector<std::string> const names =
        e.type == "BlockStored" ? std::vector<std::string>{"block_hashes",
                                                           "parent_block_hash",
                                                           "token_ids",
                                                           "block_size",
                                                           "lora_id",
                                                           "medium",
                                                           "lora_name",
                                                           "extra_keys",
                                                           "group_idx",
                                                           "kv_cache_spec_kind",
                                                           "kv_cache_spec_sliding_window"}
                                : std::vector<std::string>{"block_hashes", "medium", "group_idx"};
    EXPECT_LE(o.via.array.size - 1, names.size());
    for (uint32_t i = 1; i < o.via.array.size; ++i) {
      fields[names[i - 1]] = o.via.array.ptr[i];
    }
  }
  if (e.type == "AllBlocksCleared") {
    return e;
  }
  e.hashes = integers(fields.at("block_hashes"));
  e.medium = fields.at("medium").is_nil() ? std::nullopt : std::optional(text(fields.at("medium")));
  if (auto const it = fields.find("group_idx"); it != fields.end()) {
    e.groupIdx = it->second.as<int64_t>();
  }
  if (e.type != "BlockStored") {
    return e;
  }
  if (auto const it = fields.find("kv_cache_spec_kind"); it != fields.end()) {
    e.specKind = text(it->second);
  }
  if (auto const it = fields.find("kv_cache_spec_sliding_window");
      it != fields.end() && !it->second.is_nil()) {
    e.slidingWindow = it->second.as<int64_t>();
  }
  msgpack::object const& parent = fields.at("parent_block_hash");
  if (!parent.is_nil()) {
    e.parent = parent.via.u64;
  }
  e.tokens = integers(fields.at("token_ids"));
  e.blockSize = fields.at("block_size").as<int64_t>();
  e.loraNil = fields.at("lora_id").is_nil() && fields.at("lora_name").is_nil();
  if (auto const it = fields.find("extra_keys"); it != fields.end() && it->second.is_nil()) {
    e.extraKeysNil = true;
  } else if (it != fields.end()) {
    e.extraKeys.emplace();
    for (uint32_t i = 0; i < it->second.via.array.size; ++i) {
      msgpack::object const& keys = it->second.via.array.ptr[i];
      e.extraKeys->push_back(keys.is_nil() ? std::nullopt
                                           : std::optional(text(keys.via.array.ptr[0])));
    }
  }
  return e;
}

struct WireBatch {
  double timestamp = 0.0;
  std::vector<WireEvent> events;
  int64_t rank = -1;
};

WireBatch decodeBatch(std::string const& payload, KvEventEncoding encoding) {
  msgpack::object_handle const handle = msgpack::unpack(payload.data(), payload.size());
  msgpack::object const& o = handle.get();
  WireBatch batch;
  EXPECT_EQ(o.type, msgpack::type::ARRAY);
  EXPECT_EQ(o.via.array.size, 3U) << "[timestamp, [events], data_parallel_rank]";
  EXPECT_EQ(o.via.array.ptr[0].type, msgpack::type::FLOAT64);
  batch.timestamp = o.via.array.ptr[0].via.f64;
  msgpack::object const& events = o.via.array.ptr[1];
  for (uint32_t i = 0; i < events.via.array.size; ++i) {
    batch.events.push_back(decodeEvent(events.via.array.ptr[i], encoding));
  }
  batch.rank = o.via.array.ptr[2].as<int64_t>();
  return batch;
}

/// Waits until `publisher` has sent every accepted batch, then returns those its replay socket
/// holds from sequence `start` on, decoded: (sequence number, batch).
std::vector<std::pair<int64_t, WireBatch>> sentBatches(KvEventPublisher& publisher,
                                                       KvEventEncoding encoding,
                                                       uint64_t start = 0) {
  publisher.flush();
  Context context;
  std::vector<std::pair<int64_t, WireBatch>> batches;
  for (auto const& [sequence, payload] : replayFrom(context, publisher.replayEndpoint(), start)) {
    batches.emplace_back(sequence, decodeBatch(payload, encoding));
  }
  return batches;
}

// ------------------------------------------------------------------ the tests

BlockStored stored(Hash128 digest, Hash128 parent, int32_t firstToken, Hash128 extras = {}) {
  std::vector<int32_t> tokens(kBlock);
  for (int32_t i = 0; i < kBlock; ++i) {
    tokens[static_cast<std::size_t>(i)] = firstToken + i;
  }
  return BlockStored{digest, parent, 0, kBlock, tokens, extras};
}

KvEventPublisherConfig loopbackConfig(KvEventEncoding encoding) {
  KvEventPublisherConfig config;
  config.endpoint = "tcp://127.0.0.1:*";
  config.replayEndpoint = "tcp://127.0.0.1:*";
  config.encoding = encoding;
  config.dataParallelRank = 3;
  return config;
}

TEST(KvEventPublisherTest, CreateRejectsInvalidSettingsNamingTheValue) {
  auto const create = [](auto&& change) {
    return [change] {
      KvEventPublisherConfig config = loopbackConfig(KvEventEncoding::kTaggedMap);
      change(config);
      (void)KvEventPublisher::create(config);
    };
  };
  char const* kCall = "KvEventPublisher::create";
  EXPECT_TRUE(throwsError(create([](auto& c) { c.endpoint.clear(); }), {kCall, "endpoint"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.dataParallelRank = -1; }),
                          {kCall, "dataParallelRank", "-1"}));
  EXPECT_TRUE(
      throwsError(create([](auto& c) { c.queueCapacity = 0; }), {kCall, "queueCapacity", "0"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.replayBufferBatches = 0; }),
                          {kCall, "replayBufferBatches", "0"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.sendHighWaterMark = -5; }),
                          {kCall, "sendHighWaterMark", "-5"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.endpoint = "tcp://127.0.0.1:*:bad"; }),
                          {kCall, "bind", "tcp://127.0.0.1:*:bad"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.endpoint = "nonsense://x"; }),
                          {kCall, "connect", "nonsense://x"}));
  EXPECT_TRUE(throwsError(create([](auto& c) { c.replayEndpoint = "nonsense://x"; }),
                          {kCall, "replayEndpoint", "nonsense://x"}));
}

TEST(KvEventPublisherTest, BindsWildcardEndpointsAndConnectsTheOthers) {
  auto bound = KvEventPublisher::create(loopbackConfig(KvEventEncoding::kTaggedMap));
  EXPECT_EQ(bound->endpoint().rfind("tcp://127.0.0.1:", 0), 0U) << bound->endpoint();
  EXPECT_EQ(bound->endpoint().find('*'), std::string::npos) << "the bound port is resolved";
  EXPECT_EQ(bound->replayEndpoint().find('*'), std::string::npos);
  KvEventPublisherConfig config;
  config.endpoint = bound->endpoint();  // no wildcard: connected, as given
  auto connected = KvEventPublisher::create(config);
  EXPECT_EQ(connected->endpoint(), bound->endpoint());
  EXPECT_TRUE(connected->replayEndpoint().empty());
}

class KvEventWireTest : public ::testing::TestWithParam<KvEventEncoding> {};

TEST_P(KvEventWireTest, ReplayReturnsBufferedBatchesInVllmsLayoutThenTheEndMarker) {
  KvEventPublisherConfig config = loopbackConfig(GetParam());
  config.replayBufferBatches = 2;
  auto publisher = KvEventPublisher::create(config);
  Hash128 const a{11, 101};
  Hash128 const b{12, 102};
  Hash128 const c{13, 103};
  Hash128 const d{14, 104};
  Hash128 const image{5, 6};
  ASSERT_TRUE(publisher->publish(
      {stored(a, kBlockChainRoot, 1), stored(b, a, 5), stored(c, kBlockChainRoot, 9)}));
  ASSERT_TRUE(publisher->publish({}));  // an empty step: no batch, no sequence number
  ASSERT_TRUE(
      publisher->publish({BlockRemoved{a, 0}, BlockRemoved{b, 0}, stored(d, c, 20, image)}));
  ASSERT_TRUE(publisher->publish({BlockRemoved{c, 0}}));
  publisher->flush();
  EXPECT_EQ(publisher->batchesPublished(), 3U);

  Context context;
  std::vector<std::pair<int64_t, std::string>> const all =
      replayFrom(context, publisher->replayEndpoint(), 0);
  ASSERT_EQ(all.size(), 2U) << "the buffer keeps the last 2 batches";
  EXPECT_EQ(all[0].first, 1);
  EXPECT_EQ(all[1].first, 2);
  std::vector<std::pair<int64_t, std::string>> const fromLast =
      replayFrom(context, publisher->replayEndpoint(), 2);
  ASSERT_EQ(fromLast.size(), 1U);
  EXPECT_EQ(fromLast[0], all[1]);
  EXPECT_TRUE(replayFrom(context, publisher->replayEndpoint(), 3).empty());

  WireBatch const second = decodeBatch(all[0].second, GetParam());
  EXPECT_GT(second.timestamp, 1.6e9) << "seconds since the epoch";
  EXPECT_EQ(second.rank, 3);
  ASSERT_EQ(second.events.size(), 2U) << "consecutive removals form one event";
  WireEvent const& removed = second.events[0];
  EXPECT_EQ(removed.type, "BlockRemoved");
  EXPECT_EQ(removed.hashes, (std::vector<uint64_t>{101, 102})) << "the low 64 bits";
  EXPECT_EQ(removed.medium, "GPU");
  WireEvent const& withImage = second.events[1];
  EXPECT_EQ(withImage.type, "BlockStored");
  EXPECT_EQ(withImage.hashes, (std::vector<uint64_t>{104}));
  EXPECT_EQ(withImage.parent, 103U);
  EXPECT_EQ(withImage.tokens, (std::vector<uint64_t>{20, 21, 22, 23}));
  EXPECT_EQ(withImage.blockSize, kBlock);
  EXPECT_TRUE(withImage.loraNil);
  ASSERT_TRUE(withImage.extraKeys.has_value());
  EXPECT_EQ(*withImage.extraKeys, (std::vector<std::optional<std::string>>{toString(image)}));
  EXPECT_EQ(decodeBatch(all[1].second, GetParam()).events.at(0).hashes,
            (std::vector<uint64_t>{103}));
}

TEST_P(KvEventWireTest, ChainedStoresShareOneEventAndOthersStartTheirOwn) {
  auto publisher = KvEventPublisher::create(loopbackConfig(GetParam()));
  Hash128 const a{1, 201};
  Hash128 const b{2, 202};
  Hash128 const c{3, 203};
  ASSERT_TRUE(publisher->publish(
      {stored(a, kBlockChainRoot, 1), stored(b, a, 5), stored(c, kBlockChainRoot, 9)}));
  auto const batches = sentBatches(*publisher, GetParam());
  ASSERT_EQ(batches.size(), 1U);
  EXPECT_EQ(batches[0].first, 0) << "sequence numbers start at 0";
  WireBatch const& batch = batches[0].second;
  ASSERT_EQ(batch.events.size(), 2U);
  EXPECT_EQ(batch.events[0].hashes, (std::vector<uint64_t>{201, 202}));
  EXPECT_FALSE(batch.events[0].parent.has_value()) << "a first block's parent is nil";
  EXPECT_EQ(batch.events[0].tokens, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_FALSE(batch.events[0].extraKeys.has_value()) << "token-only blocks carry no extra keys";
  EXPECT_EQ(batch.events[1].hashes, (std::vector<uint64_t>{203}));
  EXPECT_FALSE(batch.events[1].parent.has_value());
}

TEST_P(KvEventWireTest, AllBlocksClearedIsAFieldlessEventBetweenTheOthers) {
  auto publisher = KvEventPublisher::create(loopbackConfig(GetParam()));
  Hash128 const a{1, 301};
  Hash128 const b{2, 302};
  ASSERT_TRUE(publisher->publish({BlockRemoved{a, 0}, AllBlocksCleared{}, AllBlocksCleared{},
                                  stored(b, kBlockChainRoot, 1), BlockRemoved{b, 0}}));
  auto const batches = sentBatches(*publisher, GetParam());
  ASSERT_EQ(batches.size(), 1U);
  WireBatch const& batch = batches[0].second;
  std::vector<std::string> types;
  for (WireEvent const& event : batch.events) {
    types.push_back(event.type);
  }
  EXPECT_EQ(types, (std::vector<std::string>{"BlockRemoved", "AllBlocksCleared", "BlockStored",
                                             "BlockRemoved"}))
      << "consecutive clears are one event; the order of the others is kept";
  EXPECT_EQ(batch.events[1].fieldCount, 0U)
      << "vLLM's AllBlocksCleared has no fields: {\"type\": ...} or [\"AllBlocksCleared\"]";
  EXPECT_EQ(batch.events[2].hashes, (std::vector<uint64_t>{302}));
}

TEST_P(KvEventWireTest, TheHostTiersEventsCarryItsMediumAndStartTheirOwnEvents) {
  KvEventPublisherConfig config = loopbackConfig(GetParam());
  config.hostMedium = "cpu_tier";
  auto publisher = KvEventPublisher::create(config);
  Hash128 const a{1, 401};
  Hash128 const b{2, 402};
  BlockStored onHost = stored(b, a, 5);
  onHost.medium = KvMedium::kCpu;
  // An offload: removed from the GPU, then stored on the host; then the host drops block a.
  ASSERT_TRUE(publisher->publish({stored(a, kBlockChainRoot, 1), onHost, BlockRemoved{a, 0},
                                  BlockRemoved{b, 7, KvMedium::kCpu}}));
  auto const batches = sentBatches(*publisher, GetParam());
  ASSERT_EQ(batches.size(), 1U);
  WireBatch const& batch = batches[0].second;
  ASSERT_EQ(batch.events.size(), 4U) << "a chain or a removal run ends where the medium changes";
  EXPECT_EQ(batch.events[0].medium, "GPU");
  EXPECT_EQ(batch.events[1].type, "BlockStored");
  EXPECT_EQ(batch.events[1].medium, "cpu_tier");
  EXPECT_EQ(batch.events[1].parent, 401U);
  EXPECT_EQ(batch.events[2].medium, "GPU");
  EXPECT_EQ(batch.events[3].hashes, (std::vector<uint64_t>{402}));
  EXPECT_EQ(batch.events[3].medium, "cpu_tier");
}

TEST_P(KvEventWireTest, GroupedEventsCarryVllmsGroupFieldsAndStartTheirOwnEvents) {
  auto publisher = KvEventPublisher::create(loopbackConfig(GetParam()));
  KvCacheGroup const full{0, KvCacheSpecKind::kFullAttention, 0};
  KvCacheGroup const sliding{1, KvCacheSpecKind::kSlidingWindow, 4096};
  Hash128 const a{1, 501};
  Hash128 const b{2, 502};
  auto inGroup = [](BlockStored event, KvCacheGroup group) {
    event.group = group;
    return event;
  };
  // The composed backend publishes a prompt's blocks in both pools, then a window page is taken
  // back; a block with extras keeps its extra keys before the group fields.
  ASSERT_TRUE(publisher->publish(
      {inGroup(stored(a, kBlockChainRoot, 1), full), inGroup(stored(b, a, 5, {7, 8}), full),
       inGroup(stored(a, kBlockChainRoot, 1), sliding), inGroup(stored(b, a, 5), sliding),
       BlockRemoved{a, 3, KvMedium::kGpu, sliding}, BlockRemoved{b, 9, KvMedium::kGpu, full}}));
  auto const batches = sentBatches(*publisher, GetParam());
  ASSERT_EQ(batches.size(), 1U);
  WireBatch const& batch = batches[0].second;
  ASSERT_EQ(batch.events.size(), 4U) << "a chain or a removal run ends where the group changes";
  WireEvent const& fullChain = batch.events[0];
  EXPECT_EQ(fullChain.hashes, (std::vector<uint64_t>{501, 502}));
  EXPECT_EQ(fullChain.fieldCount, 11U) << "every field up to kv_cache_spec_sliding_window";
  EXPECT_EQ(fullChain.groupIdx, 0);
  EXPECT_EQ(fullChain.specKind, "full_attention");
  EXPECT_FALSE(fullChain.slidingWindow.has_value()) << "nil for full attention";
  ASSERT_TRUE(fullChain.extraKeys.has_value());
  EXPECT_EQ(*fullChain.extraKeys,
            (std::vector<std::optional<std::string>>{std::nullopt, toString(Hash128{7, 8})}));
  WireEvent const& slidingChain = batch.events[1];
  EXPECT_EQ(slidingChain.hashes, (std::vector<uint64_t>{501, 502}));
  EXPECT_EQ(slidingChain.tokens, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(slidingChain.groupIdx, 1);
  EXPECT_EQ(slidingChain.specKind, "sliding_window");
  EXPECT_EQ(slidingChain.slidingWindow, 4096);
  EXPECT_TRUE(slidingChain.extraKeysNil) << "no extras: extra_keys is nil before the group";
  EXPECT_EQ(batch.events[2].type, "BlockRemoved");
  EXPECT_EQ(batch.events[2].fieldCount, 3U);
  EXPECT_EQ(batch.events[2].groupIdx, 1);
  EXPECT_EQ(batch.events[3].hashes, (std::vector<uint64_t>{502}));
  EXPECT_EQ(batch.events[3].groupIdx, 0);

  // An ungrouped deployment's events keep the short layout.
  ASSERT_TRUE(publisher->publish({stored(a, kBlockChainRoot, 1), BlockRemoved{a, 0}}));
  auto const later = sentBatches(*publisher, GetParam(), 1);
  ASSERT_EQ(later.size(), 1U);
  WireBatch const& plain = later[0].second;
  ASSERT_EQ(plain.events.size(), 2U);
  EXPECT_EQ(plain.events[0].fieldCount, 7U);
  EXPECT_FALSE(plain.events[0].groupIdx.has_value());
  EXPECT_EQ(plain.events[1].fieldCount, 2U);
  EXPECT_FALSE(plain.events[1].groupIdx.has_value());
}

INSTANTIATE_TEST_SUITE_P(Encodings, KvEventWireTest,
                         ::testing::Values(KvEventEncoding::kTaggedMap,
                                           KvEventEncoding::kPositionalArray),
                         [](auto const& encoding) {
                           return encoding.param == KvEventEncoding::kTaggedMap ? "map" : "array";
                         });

TEST(KvEventPublisherTest, SubscribersGetThreeFramesWithBigEndianSequenceNumbers) {
  KvEventPublisherConfig config = loopbackConfig(KvEventEncoding::kTaggedMap);
  config.topic = "kv@engine0";
  auto publisher = KvEventPublisher::create(config);
  Context context;
  Socket sub(context, ZMQ_SUB);
  ASSERT_EQ(zmq_setsockopt(sub.raw, ZMQ_SUBSCRIBE, "kv@", 3), 0);
  ASSERT_EQ(zmq_connect(sub.raw, publisher->endpoint().c_str()), 0);
  // ZeroMQ's slow joiner: batches sent before the subscription reaches the publisher are lost to
  // this subscriber, so publish until the first one arrives (a bounded number of tries).
  std::optional<std::vector<std::string>> frames;
  for (int attempt = 0; attempt < 250 && !frames; ++attempt) {
    ASSERT_TRUE(publisher->publish({BlockRemoved{Hash128{0, 7}, 0}}));
    frames = sub.receive(20);
  }
  ASSERT_TRUE(frames.has_value()) << "no batch reached the subscriber";
  ASSERT_EQ(frames->size(), 3U);
  EXPECT_EQ(frames->at(0), "kv@engine0");
  int64_t const first = sequenceOf(frames->at(1));
  EXPECT_EQ(decodeBatch(frames->at(2), config.encoding).events.at(0).hashes,
            (std::vector<uint64_t>{7}));
  ASSERT_TRUE(publisher->publish({BlockRemoved{Hash128{0, 8}, 0}}));
  // Later batches follow without a gap (earlier tries may still be in flight).
  int64_t last = first;
  while (std::optional<std::vector<std::string>> next = sub.receive(5000)) {
    EXPECT_EQ(sequenceOf(next->at(1)), last + 1);
    last = sequenceOf(next->at(1));
    if (decodeBatch(next->at(2), config.encoding).events.at(0).hashes.at(0) == 8) {
      break;
    }
  }
  EXPECT_EQ(last + 1, static_cast<int64_t>(publisher->batchesPublished()));
}

TEST(KvEventPublisherTest, IgnoresMalformedReplayRequestsAndAnswersTheNext) {
  auto publisher = KvEventPublisher::create(loopbackConfig(KvEventEncoding::kTaggedMap));
  ASSERT_TRUE(publisher->publish({BlockRemoved{Hash128{0, 1}, 0}}));
  publisher->flush();
  Context context;
  Socket dealer(context, ZMQ_DEALER);
  ASSERT_EQ(zmq_connect(dealer.raw, publisher->replayEndpoint().c_str()), 0);
  dealer.send({"", "short"});  // not 8 bytes
  dealer.send({"only one frame"});
  dealer.send({"", bigEndian(0)});
  std::optional<std::vector<std::string>> const answer = dealer.receive(5000);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(sequenceOf(answer->at(1)), 0) << "the first answer is the valid request's";
}

TEST(KvEventPublisherTest, PrometheusExpositionFollowsTheGrammar) {
  auto publisher = KvEventPublisher::create(loopbackConfig(KvEventEncoding::kTaggedMap));
  ASSERT_TRUE(publisher->publish({BlockRemoved{}}));
  publisher->flush();
  test::PrometheusParse const parsed = test::parsePrometheusText(publisher->toPrometheus());
  ASSERT_TRUE(parsed.text.has_value()) << parsed.error;
  EXPECT_EQ(parsed.text->samples.at("managedkv_kv_event_batches_published_total"), 1);
  EXPECT_EQ(parsed.text->samples.at("managedkv_kv_event_batches_dropped_total"), 0);
  EXPECT_EQ(parsed.text->families.at("managedkv_kv_events_publisher_dropped_total").type,
            "counter");
  EXPECT_THROW((void)publisher->toPrometheus("bad prefix"), Error);
}

}  // namespace
}  // namespace mkv
