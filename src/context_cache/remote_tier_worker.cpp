// RemoteTierWorker: the remote tier's store calls on a thread of their own.

#include "context_cache/remote_tier_worker.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <optional>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv::detail {

std::span<std::byte const> RemoteTierWorker::LoadedBlock::payload() const noexcept {
  return std::as_bytes(std::span(value)).subspan(payloadOffset);
}

RemoteTierWorker::RemoteTierWorker(std::unique_ptr<RemoteKvStore> store)
    : mStore(std::move(store)) {
  MKV_REQUIRE(mStore != nullptr, "RemoteTierWorker", "openStore returned no store");
  mThread = std::thread([this] { run(); });
}

RemoteTierWorker::~RemoteTierWorker() {
  {
    std::lock_guard const lock(mMutex);
    mStop = true;
  }
  mWake.notify_all();
  mThread.join();
}

void RemoteTierWorker::submit(LoadJob job) {
  {
    std::lock_guard const lock(mMutex);
    mLoads.push_back(std::move(job));
  }
  mWake.notify_one();
}

void RemoteTierWorker::submit(SaveJob job) {
  {
    std::lock_guard const lock(mMutex);
    mSaves.push_back(std::move(job));
  }
  mWake.notify_one();
}

void RemoteTierWorker::submit(PlaceJob job) {
  {
    std::lock_guard const lock(mMutex);
    mPlacements.push_back(std::move(job));
  }
  mWake.notify_one();
}

void RemoteTierWorker::takeFinished(std::vector<LoadDone>& loads, std::vector<SaveDone>& saves,
                                    std::vector<uint64_t>& placed) {
  std::lock_guard const lock(mMutex);
  for (LoadDone& done : mLoadsDone) {
    loads.push_back(std::move(done));
  }
  saves.insert(saves.end(), mSavesDone.begin(), mSavesDone.end());
  placed.insert(placed.end(), mPlaced.begin(), mPlaced.end());
  mLoadsDone.clear();
  mSavesDone.clear();
  mPlaced.clear();
}

void RemoteTierWorker::waitIdle() {
  std::unique_lock lock(mMutex);
  mIdle.wait(lock, [this] {
    return mLoads.empty() && mSaves.empty() && mPlacements.empty() && mRunning == 0;
  });
}

void RemoteTierWorker::run() {
  std::unique_lock lock(mMutex);
  while (true) {
    mWake.wait(lock, [this] {
      return mStop || !mLoads.empty() || !mSaves.empty() || !mPlacements.empty();
    });
    if (mStop) {
      return;
    }
    ++mRunning;
    if (!mPlacements.empty()) {
      PlaceJob const job = std::move(mPlacements.front());
      mPlacements.pop_front();
      lock.unlock();
      for (ByteCopy const& copy : job.copies) {
        std::memcpy(copy.to, copy.from, copy.bytes);
      }
      lock.lock();
      mPlaced.push_back(job.ticket);
    } else if (!mLoads.empty()) {
      LoadJob const job = std::move(mLoads.front());
      mLoads.pop_front();
      lock.unlock();
      LoadDone done = load(job);
      lock.lock();
      mLoadsDone.push_back(std::move(done));
    } else {
      SaveJob const job = std::move(mSaves.front());
      mSaves.pop_front();
      lock.unlock();
      SaveDone const done = save(job);
      lock.lock();
      mSavesDone.push_back(done);
    }
    --mRunning;
    mIdle.notify_all();
  }
}

RemoteTierWorker::LoadDone RemoteTierWorker::load(LoadJob const& job) {
  LoadDone done;
  done.ticket = job.ticket;
  try {
    std::vector<std::string> keys;
    keys.reserve(job.blocks.size());
    for (ExpectedBlock const& block : job.blocks) {
      keys.push_back(block.key);
    }
    std::vector<std::optional<std::string>> values;
    done.status = mStore->get(keys, values);
    if (done.status != RemoteStoreStatus::kOk) {
      return done;
    }
    for (std::size_t i = 0; i < job.blocks.size(); ++i) {
      if (!values[i]) {
        done.missing = 1;
        break;
      }
      std::span<std::byte const> payload;
      RemoteBlockCheck const check = checkRemoteBlock(*values[i], job.blocks[i].header, payload);
      if (check != RemoteBlockCheck::kValid) {
        logger()->warn("remote tier: {} refused ({}); the load ends there", job.blocks[i].key,
                       toString(check));
        done.rejected = 1;
        break;
      }
      auto const offset =
          static_cast<std::size_t>(payload.data() - std::as_bytes(std::span(*values[i])).data());
      done.blocks.push_back(LoadedBlock{std::move(*values[i]), offset});
    }
  } catch (std::exception const& error) {  // an allocation: the load fails as a whole
    logger()->error("remote tier: load {} failed: {}", job.ticket, error.what());
    done.blocks.clear();
    done.status = RemoteStoreStatus::kUnavailable;
  }
  return done;
}

RemoteTierWorker::SaveDone RemoteTierWorker::save(SaveJob const& job) {
  SaveDone done{job.id, job.hostPage, RemoteStoreStatus::kOk, 0};
  try {
    int64_t payloadBytes = 0;
    for (std::span<std::byte const> chunk : job.payload) {
      payloadBytes += static_cast<int64_t>(chunk.size());
    }
    RemoteBlockHeader const header{job.deployment, job.blockKey, job.parent,
                                   job.extras,     job.tokens,   payloadBytes};
    std::string const value = encodeRemoteBlock(header, job.payload);
    done.valueBytes = static_cast<int64_t>(value.size());
    done.status = mStore->put(job.key, value);
  } catch (std::exception const& error) {
    logger()->error("remote tier: save of {} failed: {}", job.key, error.what());
    done.status = RemoteStoreStatus::kRejected;
  }
  return done;
}

}  // namespace mkv::detail
