#include "mkv/events/kv_event_publisher.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "core/check.h"
#include "core/prometheus_text.h"
#include "events/batch_queue.h"
#include "events/kv_event_wire.h"
#include "mkv/logging.h"

namespace mkv {

namespace {

constexpr char const* kCreate = "KvEventPublisher::create";
/// What closing the PUB socket waits for messages still in ZeroMQ's buffers, in milliseconds.
constexpr int kLingerMilliseconds = 1000;

std::array<char, 8> bigEndian(uint64_t value) noexcept {
  std::array<char, 8> bytes{};
  for (int i = 7; i >= 0; --i) {
    bytes[static_cast<std::size_t>(i)] = static_cast<char>(value & 0xFFU);
    value >>= 8U;
  }
  return bytes;
}

uint64_t fromBigEndian(std::string const& bytes) noexcept {
  uint64_t value = 0;
  for (char c : bytes) {
    value = (value << 8U) | static_cast<uint8_t>(c);
  }
  return value;
}

/// vLLM's rule: bind stable (wildcard or local transport) addresses, connect the others.
bool bindsEndpoint(std::string_view endpoint) noexcept {
  return endpoint.find('*') != std::string_view::npos ||
         endpoint.find("::") != std::string_view::npos || endpoint.starts_with("ipc://") ||
         endpoint.starts_with("inproc://");
}

std::string lastEndpoint(void* socket) {
  std::array<char, 1024> buffer{};
  std::size_t size = buffer.size();
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buffer.data(), &size) != 0 || size == 0) {
    return {};
  }
  return std::string(buffer.data());
}

void setInt(void* socket, int option, int value) {
  MKV_ASSERT(zmq_setsockopt(socket, option, &value, sizeof value) == 0, "zmq_setsockopt {}: {}",
             option, zmq_strerror(zmq_errno()));
}

/// Sends `frames` as one multipart message; false when ZeroMQ refused a frame.
bool sendFrames(void* socket, std::initializer_list<std::string_view> frames) noexcept {
  std::size_t left = frames.size();
  for (std::string_view frame : frames) {
    int const flags = ZMQ_DONTWAIT | (--left > 0 ? ZMQ_SNDMORE : 0);
    if (zmq_send(socket, frame.data(), frame.size(), flags) < 0) {
      return false;
    }
  }
  return true;
}

/// Every frame of the next message, or nothing when none is waiting.
std::vector<std::string> receiveFrames(void* socket) {
  std::vector<std::string> frames;
  while (true) {
    zmq_msg_t message;
    zmq_msg_init(&message);
    if (zmq_msg_recv(&message, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&message);
      return frames;
    }
    frames.emplace_back(static_cast<char const*>(zmq_msg_data(&message)), zmq_msg_size(&message));
    bool const more = zmq_msg_more(&message) != 0;
    zmq_msg_close(&message);
    if (!more) {
      return frames;
    }
  }
}

}  // namespace

struct KvEventPublisher::Impl {
  KvEventPublisherConfig config;
  void* context = nullptr;
  void* pub = nullptr;
  void* replay = nullptr;
  int wakeFd = -1;  ///< eventfd: publish() and the destructor wake the worker through it
  std::string endpoint;
  std::string replayEndpoint;

  std::unique_ptr<events::BatchQueue> queue;
  std::atomic<bool> stopping{false};

  std::deque<std::pair<uint64_t, std::string>> replayBuffer;  ///< worker thread only
  std::thread worker;

  Impl() = default;
  Impl(Impl const&) = delete;
  Impl& operator=(Impl const&) = delete;
  ~Impl() {
    if (pub != nullptr) {
      zmq_close(pub);
    }
    if (replay != nullptr) {
      zmq_close(replay);
    }
    if (context != nullptr) {
      zmq_ctx_term(context);
    }
    if (wakeFd >= 0) {
      close(wakeFd);
    }
  }

  void open() {
    context = zmq_ctx_new();
    MKV_REQUIRE(context != nullptr, kCreate, "zmq_ctx_new failed: {}", zmq_strerror(zmq_errno()));
    wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    MKV_REQUIRE(wakeFd >= 0, kCreate, "eventfd failed: {}", std::strerror(errno));

    pub = zmq_socket(context, ZMQ_PUB);
    MKV_REQUIRE(pub != nullptr, kCreate, "zmq_socket failed: {}", zmq_strerror(zmq_errno()));
    setInt(pub, ZMQ_SNDHWM, config.sendHighWaterMark);
    setInt(pub, ZMQ_LINGER, kLingerMilliseconds);
    bool const bind = bindsEndpoint(config.endpoint);
    int const rc =
        bind ? zmq_bind(pub, config.endpoint.c_str()) : zmq_connect(pub, config.endpoint.c_str());
    MKV_REQUIRE(rc == 0, kCreate, "cannot {} the PUB socket to endpoint '{}': {}",
                bind ? "bind" : "connect", config.endpoint, zmq_strerror(zmq_errno()));
    endpoint = bind ? lastEndpoint(pub) : config.endpoint;

    if (!config.replayEndpoint.empty()) {
      replay = zmq_socket(context, ZMQ_ROUTER);
      MKV_REQUIRE(replay != nullptr, kCreate, "zmq_socket failed: {}", zmq_strerror(zmq_errno()));
      // A replay answer is bounded by the replay buffer; let ZeroMQ queue all of it.
      setInt(replay, ZMQ_SNDHWM, 0);
      setInt(replay, ZMQ_LINGER, 0);
      MKV_REQUIRE(zmq_bind(replay, config.replayEndpoint.c_str()) == 0, kCreate,
                  "cannot bind the replay socket to replayEndpoint '{}': {}", config.replayEndpoint,
                  zmq_strerror(zmq_errno()));
      replayEndpoint = lastEndpoint(replay);
    }
  }

  void wake() const noexcept {
    uint64_t const one = 1;
    // EAGAIN only when the counter is saturated, and then the worker is woken anyway.
    [[maybe_unused]] ssize_t const written = write(wakeFd, &one, sizeof one);
  }

  void send(events::PendingBatch const& batch) {
    std::string payload = events::encodeBatch(batch.timestamp, batch.events, config);
    std::array<char, 8> const sequence = bigEndian(batch.sequence);
    if (!sendFrames(pub, {config.topic, {sequence.data(), sequence.size()}, payload})) {
      logger()->warn("KvEventPublisher: sending batch {} failed: {}", batch.sequence,
                     zmq_strerror(zmq_errno()));
    }
    if (replay != nullptr) {
      if (replayBuffer.size() == static_cast<std::size_t>(config.replayBufferBatches)) {
        replayBuffer.pop_front();
      }
      replayBuffer.emplace_back(batch.sequence, std::move(payload));
    }
  }

  /// Answers one replay request: [identity, "", start sequence (8 bytes, big-endian)] gets every
  /// buffered batch from that sequence on, then the end marker (sequence -1, empty payload).
  void serviceReplay() {
    std::vector<std::string> const request = receiveFrames(replay);
    if (request.size() != 3 || !request[1].empty() || request[2].size() != 8) {
      if (!request.empty()) {
        logger()->warn("KvEventPublisher: ignored a malformed replay request of {} frames",
                       request.size());
      }
      return;
    }
    uint64_t const start = fromBigEndian(request[2]);
    for (auto const& [sequence, payload] : replayBuffer) {
      if (sequence >= start) {
        std::array<char, 8> const bytes = bigEndian(sequence);
        sendFrames(replay, {request[0], {}, {bytes.data(), bytes.size()}, payload});
      }
    }
    std::array<char, 8> const end = bigEndian(~uint64_t{0});
    sendFrames(replay, {request[0], {}, {end.data(), end.size()}, {}});
  }

  void run() {
    std::array<zmq_pollitem_t, 2> items{};
    items[0].fd = wakeFd;
    items[0].events = ZMQ_POLLIN;
    items[1].socket = replay;
    items[1].events = ZMQ_POLLIN;
    int const count = replay != nullptr ? 2 : 1;
    while (true) {
      if (zmq_poll(items.data(), count, -1) < 0 && zmq_errno() != EINTR) {
        logger()->warn("KvEventPublisher: zmq_poll failed: {}", zmq_strerror(zmq_errno()));
      }
      if ((items[0].revents & ZMQ_POLLIN) != 0) {
        uint64_t counter = 0;
        [[maybe_unused]] ssize_t const got = read(wakeFd, &counter, sizeof counter);
      }
      if (count == 2 && (items[1].revents & ZMQ_POLLIN) != 0) {
        serviceReplay();
      }
      // Read before draining: a stop requested after this point is seen on the next wake-up.
      bool const stop = stopping.load(std::memory_order_acquire);
      while (std::optional<events::PendingBatch> const batch = queue->pop()) {
        send(*batch);
        queue->markSent();
      }
      if (stop) {
        return;
      }
    }
  }
};

std::unique_ptr<KvEventPublisher> KvEventPublisher::create(KvEventPublisherConfig config) {
  MKV_REQUIRE(!config.endpoint.empty(), kCreate, "endpoint is empty");
  MKV_REQUIRE(config.dataParallelRank >= 0, kCreate, "dataParallelRank must be >= 0, got {}",
              config.dataParallelRank);
  MKV_REQUIRE(config.queueCapacity > 0, kCreate, "queueCapacity must be > 0, got {}",
              config.queueCapacity);
  MKV_REQUIRE(config.replayEndpoint.empty() || config.replayBufferBatches > 0, kCreate,
              "replayBufferBatches must be > 0 with a replay endpoint, got {}",
              config.replayBufferBatches);
  MKV_REQUIRE(config.sendHighWaterMark >= 0, kCreate, "sendHighWaterMark must be >= 0, got {}",
              config.sendHighWaterMark);
  auto impl = std::make_unique<Impl>();
  impl->queue = std::make_unique<events::BatchQueue>(config.queueCapacity);
  impl->config = std::move(config);
  impl->open();
  impl->worker = std::thread([raw = impl.get()] { raw->run(); });
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : mImpl(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  mImpl->stopping.store(true, std::memory_order_release);
  mImpl->wake();
  mImpl->worker.join();
}

bool KvEventPublisher::publish(std::vector<KvEvent> events) {
  if (events.empty()) {
    return true;
  }
  double const timestamp =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (!mImpl->queue->push(timestamp, std::move(events))) {
    return false;
  }
  mImpl->wake();
  return true;
}

void KvEventPublisher::flush() { mImpl->queue->waitUntilSent(); }

std::string const& KvEventPublisher::endpoint() const noexcept { return mImpl->endpoint; }
std::string const& KvEventPublisher::replayEndpoint() const noexcept {
  return mImpl->replayEndpoint;
}
uint64_t KvEventPublisher::batchesPublished() const { return mImpl->queue->accepted(); }
uint64_t KvEventPublisher::batchesDropped() const { return mImpl->queue->dropped(); }
uint64_t KvEventPublisher::eventsDropped() const { return mImpl->queue->droppedEvents(); }

std::string KvEventPublisher::toPrometheus(std::string_view prefix) const {
  detail::PrometheusWriter w("KvEventPublisher::toPrometheus", prefix);
  w.counter("kv_event_batches_published_total",
            "KV event batches handed to the wire publisher and queued for sending.",
            batchesPublished());
  w.counter("kv_event_batches_dropped_total",
            "KV event batches dropped because the publisher's queue was full.", batchesDropped());
  w.counter("kv_events_publisher_dropped_total",
            "KV events in the batches the publisher's full queue dropped.", eventsDropped());
  return w.take();
}

}  // namespace mkv
