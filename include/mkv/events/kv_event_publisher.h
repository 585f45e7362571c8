#pragma once
/// \file kv_event_publisher.h
/// Publishes the cache's KV events on ZeroMQ in vLLM's wire format (vllm/distributed/kv_events.py),
/// so that KV-aware routers built for vLLM (NVIDIA Dynamo's KV router, llm-d's KV-cache manager)
/// can follow a managedkv engine. Wire format, options and limits: docs/context_cache.md, "KV
/// events on the wire".
///
/// The engine thread hands one batch per engine step to publish(); a worker thread owned by the
/// publisher encodes it (msgpack) and sends it. publish() never blocks on the network: when the
/// bounded queue of batches waiting for the worker is full, the batch is dropped and counted (its
/// sequence number is still used, so subscribers see the gap).
///
/// Thread-safety: publish(), flush() and the observers may be called from any one thread at a
/// time (the engine thread); the worker thread is internal.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/context_cache/kv_events.h"

namespace mkv {

/// How each event of a batch is encoded. The batch itself is always the array
/// `[timestamp, [events], data_parallel_rank]`.
enum class KvEventEncoding : uint8_t {
  kTaggedMap,        ///< a map with a "type" key and field names (vLLM's current encoding;
                     ///< Dynamo decodes it, llm-d does not)
  kPositionalArray,  ///< an array led by the event's class name (older vLLM; Dynamo and llm-d
                     ///< decode it)
};

struct KvEventPublisherConfig {
  /// PUB socket address. Bound when it holds a wildcard (`tcp://*:5557`, `tcp://127.0.0.1:*`,
  /// `::`) or is an ipc:// or inproc:// address, connected otherwise (vLLM's rule).
  std::string endpoint;
  /// ROUTER socket for replay requests, always bound; empty: no replay socket.
  std::string replayEndpoint;
  std::string topic;  ///< first frame of every message (may be empty)
  KvEventEncoding encoding = KvEventEncoding::kTaggedMap;
  int32_t dataParallelRank = 0;  ///< third element of every batch, >= 0
  std::string medium = "GPU";  ///< `medium` of the GPU cache's events (KvMedium::kGpu); empty: nil
  /// `medium` of the host tier's events (KvMedium::kCpu); empty: nil.
  std::string hostMedium = "CPU";
  /// `medium` of the remote tier's events (KvMedium::kRemote); empty: nil.
  std::string remoteMedium = "REMOTE";
  int32_t queueCapacity = 1024;  ///< batches waiting for the worker, > 0
  /// Last batches kept for replay requests, > 0 when there is a replay socket.
  int32_t replayBufferBatches = 10000;
  int32_t sendHighWaterMark = 100000;  ///< ZMQ_SNDHWM of the PUB socket, >= 0 (0: unlimited)
};

class KvEventPublisher {
 public:
  /// Opens the sockets and starts the worker. Throws mkv::Error naming
  /// "KvEventPublisher::create" and the offending value for an invalid setting or an endpoint
  /// ZeroMQ cannot bind or connect.
  static std::unique_ptr<KvEventPublisher> create(KvEventPublisherConfig config);
  /// Sends what is queued, then closes the sockets (waiting at most one second for messages
  /// still in ZeroMQ's buffers to leave).
  ~KvEventPublisher();
  KvEventPublisher(KvEventPublisher const&) = delete;
  KvEventPublisher& operator=(KvEventPublisher const&) = delete;

  /// Hands one engine step's events (ContextCacheCoordinator::drainEvents()) to the worker, with
  /// the current time as the batch's timestamp. An empty step publishes nothing and returns true.
  /// Returns false when the batch was dropped because the queue was full. Never blocks on I/O;
  /// holds an internal mutex only to append to the queue.
  bool publish(std::vector<KvEvent> events);
  /// Waits until the worker has sent every batch handed so far.
  void flush();

  /// The PUB address actually in use (a bound wildcard port resolved), and the replay one (empty
  /// without a replay socket).
  std::string const& endpoint() const noexcept;
  std::string const& replayEndpoint() const noexcept;
  /// Batches accepted by publish() (sent or queued), and dropped for a full queue; their sum is
  /// the number of sequence numbers used so far.
  uint64_t batchesPublished() const;
  uint64_t batchesDropped() const;
  uint64_t eventsDropped() const;  ///< events of the dropped batches

  /// The publisher's counters in the Prometheus text format, with HELP and TYPE lines. Throws
  /// mkv::Error for an invalid metric-name prefix.
  std::string toPrometheus(std::string_view prefix = "managedkv_") const;

 private:
  struct Impl;
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> mImpl;
};

}  // namespace mkv
