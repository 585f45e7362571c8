#pragma once
/// \file remote_tier_worker.h
/// The remote tier's thread (docs/context_cache.md, "Remote tier"): every store call of a load or
/// a save, and the copy of loaded bytes into host pages, runs here, off the engine thread and off
/// every CUDA stream. Placements run first (a request waits on them and they touch no network),
/// then loads (a request waits on a load; a save only frees a host page), then saves, each kind in
/// submission order. A load checks every value against the block the prompt expects
/// (remote_block_codec.h) and keeps the run of valid blocks from the first one; a placement copies
/// loaded payloads into host pages the engine reserved for them; a save encodes a block from host
/// memory the engine keeps pinned until the save is reported finished.
///
/// Thread-safety: submit and takeFinished from the engine thread; the store only from the worker.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "context_cache/remote_block_codec.h"
#include "mkv/remote_kv_store.h"
#include "mkv/types.h"

namespace mkv::detail {

class RemoteTierWorker {
 public:
  /// One block a load expects: its store key and the header its value must carry (the tokens
  /// are a view the submitter keeps alive until the load is taken back).
  struct ExpectedBlock {
    std::string key;
    RemoteBlockHeader header;
  };
  struct LoadJob {
    uint64_t ticket = 0;
    std::vector<ExpectedBlock> blocks;
  };
  /// A loaded block: its value and where the payload starts in it.
  struct LoadedBlock {
    std::string value;
    std::size_t payloadOffset = 0;
    std::span<std::byte const> payload() const noexcept;
  };
  struct LoadDone {
    uint64_t ticket = 0;
    RemoteStoreStatus status = RemoteStoreStatus::kOk;
    std::vector<LoadedBlock> blocks;  ///< the valid run, from the first expected block
    int32_t missing = 0;              ///< 1 when the run ended at a block the store lacks
    int32_t rejected = 0;             ///< 1 when it ended at a value the check refused
  };
  /// One block to save: its header fields (tokens owned) and its payload, views of pinned host
  /// memory (every layer, K then V) that stay valid until the save is taken back.
  struct SaveJob {
    uint64_t id = 0;
    PageId hostPage = kNoPage;
    std::string key;
    Hash128 deployment;
    Hash128 blockKey;
    Hash128 parent;
    Hash128 extras;
    std::vector<int32_t> tokens;
    std::vector<std::span<std::byte const>> payload;
  };
  /// One contiguous copy of a placement: `bytes` from `from` (a loaded value the engine keeps
  /// alive) to `to` (a reserved host page that nothing else reads or writes until the placement
  /// is taken back).
  struct ByteCopy {
    std::byte const* from = nullptr;
    std::byte* to = nullptr;
    std::size_t bytes = 0;
  };
  /// The copies that put a finished load's blocks into their host pages.
  struct PlaceJob {
    uint64_t ticket = 0;
    std::vector<ByteCopy> copies;
  };
  struct SaveDone {
    uint64_t id = 0;
    PageId hostPage = kNoPage;
    RemoteStoreStatus status = RemoteStoreStatus::kOk;
    int64_t valueBytes = 0;
  };

  /// Starts the thread; `store` is used only there. Throws mkv::Error for a null store.
  explicit RemoteTierWorker(std::unique_ptr<RemoteKvStore> store);
  /// Finishes the store call in progress and stops; jobs not started are dropped.
  ~RemoteTierWorker();
  RemoteTierWorker(RemoteTierWorker const&) = delete;
  RemoteTierWorker& operator=(RemoteTierWorker const&) = delete;

  void submit(LoadJob job);
  void submit(SaveJob job);
  void submit(PlaceJob job);
  /// Appends the jobs finished since the last call (never waits); `placed` gets the tickets of
  /// finished placements.
  void takeFinished(std::vector<LoadDone>& loads, std::vector<SaveDone>& saves,
                    std::vector<uint64_t>& placed);
  /// Waits until every submitted job has finished (shutdown, a cache reset, tests).
  void waitIdle();

 private:
  void run();
  LoadDone load(LoadJob const& job);
  SaveDone save(SaveJob const& job);

  std::unique_ptr<RemoteKvStore> mStore;
  std::mutex mMutex;
  std::condition_variable mWake;  ///< a job was submitted, or stop
  std::condition_variable mIdle;  ///< a job finished
  std::deque<LoadJob> mLoads;
  std::deque<SaveJob> mSaves;
  std::deque<PlaceJob> mPlacements;
  std::vector<LoadDone> mLoadsDone;
  std::vector<SaveDone> mSavesDone;
  std::vector<uint64_t> mPlaced;
  int32_t mRunning = 0;  ///< jobs taken from the queues and not finished
  bool mStop = false;
  std::thread mThread;  ///< last: started after every other member exists
};

}  // namespace mkv::detail
