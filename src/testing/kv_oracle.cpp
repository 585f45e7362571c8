#include "mkv/testing/kv_oracle.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "context_cache/block_hash.h"
#include "core/check.h"
#include "core/device.h"
#include "testing/oracle_bytes.h"

namespace mkv::testing {
namespace {

using oracle::mix64;

constexpr uint64_t kChainRoot = 0x6A09E667F3BCC908ULL;

}  // namespace

uint64_t identitySeed(std::string_view loraWeightsName, std::string_view cacheSalt) noexcept {
  using oracle::seedMix;
  Hash128 const salt = digestIdentity(cacheSalt);
  Hash128 const lora = digestIdentity(loraWeightsName);
  return seedMix(salt.hi ^ seedMix(salt.lo ^ seedMix(lora.hi ^ seedMix(lora.lo))));
}

void PrefixDigests::extend(std::span<uint64_t const> positionKeys) {
  uint64_t previous = mDigests.empty() ? mix64(kChainRoot ^ mSeed) : mDigests.back();
  for (uint64_t key : positionKeys) {
    previous = mix64(previous ^ mix64(key + 0x9E3779B97F4A7C15ULL));
    mDigests.push_back(previous);
  }
}

void PrefixDigests::extendTokens(std::span<int32_t const> tokens) {
  std::vector<uint64_t> keys(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    keys[i] = static_cast<uint32_t>(tokens[i]);
  }
  extend(keys);
}

void PrefixDigests::truncate(int64_t length) {
  if (length >= 0 && length < size()) {
    mDigests.resize(static_cast<std::size_t>(length));
  }
}

void KvOracle::expectedRow(uint64_t digest, int32_t layer, int32_t half, std::span<uint8_t> out) {
  uint64_t const seed = oracle::rowSeed(digest, layer, half);
  std::size_t i = 0;
  for (int64_t w = 0; i < out.size(); ++w) {
    uint64_t const word = oracle::rowWord(seed, w);
    for (int b = 0; b < 8 && i < out.size(); ++b, ++i) {
      out[i] = static_cast<uint8_t>(word >> (8 * b));
    }
  }
}

KvOracle::KvOracle(KVCachePool& pool, KVPageTable const& table) : mPool(pool), mTable(table) {
  MKV_REQUIRE(pool.numPages() == table.numPages(), "KvOracle",
              "pool has {} pages but the page table addresses {}", pool.numPages(),
              table.numPages());
  MKV_REQUIRE(pool.deviceType() == table.deviceType(), "KvOracle",
              "pool on {} but page table on {}", toString(pool.deviceType()),
              toString(table.deviceType()));
}

std::vector<int32_t> KvOracle::deviceRow(CacheSlot slot) const {
  MKV_REQUIRE(slot >= 0 && slot < mTable.maxBatch(), "KvOracle", "slot {} outside [0, {})", slot,
              mTable.maxBatch());
  auto const width = 2 * static_cast<std::size_t>(mTable.maxPagesPerSeq());
  std::vector<int32_t> row(width);
  auto const* base =
      mTable.deviceTable().dataPointer<int32_t>() + width * static_cast<std::size_t>(slot);
  detail::copyBytes(row.data(), DeviceType::kCPU, base, mTable.deviceType(),
                    width * sizeof(int32_t), nullptr);
  if (mTable.deviceType() == DeviceType::kGPU) {
    detail::synchronizeDevice();
  }
  return row;
}

PageId KvOracle::resolve(CacheSlot, int64_t position, std::vector<int32_t> const& row) const {
  int64_t const logical = position / mPool.tokensPerPage();
  if (logical >= mTable.maxPagesPerSeq()) {
    return kNoPage;
  }
  return row[static_cast<std::size_t>(logical)];
}

void KvOracle::write(CacheSlot slot, PrefixDigests const& digests, int64_t begin, int64_t end) {
  MKV_REQUIRE(begin >= 0 && begin <= end && end <= digests.size(), "KvOracle::write",
              "range [{}, {}) outside the {} known positions", begin, end, digests.size());
  std::vector<int32_t> const row = deviceRow(slot);
  auto const tokenBytes = static_cast<std::size_t>(mPool.tokenBytes());
  auto const pageBytes = static_cast<std::size_t>(mPool.pageBytes());
  auto const halfBytes = pageBytes * static_cast<std::size_t>(mPool.numPages());
  std::vector<uint8_t> bytes(tokenBytes);
  for (int64_t p = begin; p < end; ++p) {
    PageId const page = resolve(slot, p, row);
    MKV_REQUIRE(page >= 0 && page < mPool.numPages(), "KvOracle::write",
                "position {} of slot {} maps to no page (entry {})", p, slot, page);
    auto const rowInPage = static_cast<std::size_t>(p % mPool.tokensPerPage());
    for (int32_t layer = 0; layer < mPool.numLayers(); ++layer) {
      auto* base = static_cast<uint8_t*>(mPool.layer(layer).rawPointer());
      for (int32_t half = 0; half < 2; ++half) {
        expectedRow(digests.at(p), layer, half, bytes);
        uint8_t* target = base + static_cast<std::size_t>(half) * halfBytes +
                          static_cast<std::size_t>(page) * pageBytes + rowInPage * tokenBytes;
        detail::copyBytes(target, mPool.deviceType(), bytes.data(), DeviceType::kCPU, tokenBytes,
                          nullptr);
        if (mPool.deviceType() == DeviceType::kGPU) {
          detail::synchronizeDevice();
        }
      }
    }
  }
}

OracleReport KvOracle::verify(CacheSlot slot, PrefixDigests const& digests, int64_t begin,
                              int64_t end) const {
  MKV_REQUIRE(begin >= 0 && begin <= end && end <= digests.size(), "KvOracle::verify",
              "range [{}, {}) outside the {} known positions", begin, end, digests.size());
  OracleReport report;
  std::vector<int32_t> const row = deviceRow(slot);
  auto const tokenBytes = static_cast<std::size_t>(mPool.tokenBytes());
  auto const pageBytes = static_cast<std::size_t>(mPool.pageBytes());
  auto const halfBytes = pageBytes * static_cast<std::size_t>(mPool.numPages());
  std::vector<uint8_t> expected(tokenBytes);
  std::vector<uint8_t> found(tokenBytes);
  for (int64_t p = begin; p < end; ++p) {
    ++report.positionsChecked;
    PageId const page = resolve(slot, p, row);
    if (page < 0 || page >= mPool.numPages()) {
      if (report.mismatches++ == 0) {
        report.firstMismatch =
            fmt::format("slot {} position {}: no page mapped (entry {})", slot, p, page);
      }
      continue;
    }
    auto const rowInPage = static_cast<std::size_t>(p % mPool.tokensPerPage());
    bool positionOk = true;
    for (int32_t layer = 0; layer < mPool.numLayers() && positionOk; ++layer) {
      auto const* base = static_cast<uint8_t const*>(mPool.layer(layer).rawPointer());
      for (int32_t half = 0; half < 2 && positionOk; ++half) {
        expectedRow(digests.at(p), layer, half, expected);
        uint8_t const* source = base + static_cast<std::size_t>(half) * halfBytes +
                                static_cast<std::size_t>(page) * pageBytes + rowInPage * tokenBytes;
        detail::copyBytes(found.data(), DeviceType::kCPU, source, mPool.deviceType(), tokenBytes,
                          nullptr);
        if (mPool.deviceType() == DeviceType::kGPU) {
          detail::synchronizeDevice();
        }
        if (std::memcmp(found.data(), expected.data(), tokenBytes) != 0) {
          positionOk = false;
          if (report.mismatches == 0) {
            std::size_t byte = 0;
            while (found[byte] == expected[byte]) {
              ++byte;
            }
            report.firstMismatch = fmt::format(
                "slot {} position {} (page {}, row {}) layer {} {}: byte {} is {:#04x}, expected "
                "{:#04x}",
                slot, p, page, rowInPage, layer, half == 0 ? "K" : "V", byte, found[byte],
                expected[byte]);
          }
        }
      }
    }
    if (!positionOk) {
      ++report.mismatches;
    }
  }
  return report;
}

// ---------------------------------------------------------------- RecurrentOracle

void RecurrentOracle::expectedRow(uint64_t digest, int32_t layer, bool conv,
                                  std::span<uint8_t> out) {
  // Row kinds 2 and 3 continue KvOracle's halves 0 (K) and 1 (V): no stream is shared.
  KvOracle::expectedRow(digest, layer, conv ? 3 : 2, out);
}

void RecurrentOracle::expected(PrefixDigests const& digests, int64_t length, int32_t layer,
                               bool conv, std::span<uint8_t> out) const {
  if (length == 0) {
    std::fill(out.begin(), out.end(), uint8_t{0});
  } else {
    expectedRow(digests.at(length - 1), layer, conv, out);
  }
}

template <typename StateOf, typename ConvOf>
void RecurrentOracle::writeRows(char const* call, int64_t row, PrefixDigests const& digests,
                                int64_t length, StateOf&& stateOf, ConvOf&& convOf) {
  MKV_REQUIRE(length >= 0 && length <= digests.size(), call,
              "length {} outside the {} known positions", length, digests.size());
  for (int32_t layer = 0; layer < mPool.numLayers(); ++layer) {
    for (bool conv : {false, true}) {
      Tensor& rows = conv ? convOf(layer) : stateOf(layer);
      auto const bytes = static_cast<std::size_t>(rows.dim(1));
      MKV_REQUIRE(rows.dim(1) == (conv ? mPool.conv(layer) : mPool.state(layer)).dim(1), call,
                  "layer {} {} rows of {} bytes, the pool's have {}", layer,
                  conv ? "conv" : "state", rows.dim(1),
                  (conv ? mPool.conv(layer) : mPool.state(layer)).dim(1));
      std::vector<uint8_t> values(bytes);
      expected(digests, length, layer, conv, values);
      detail::copyBytes(
          static_cast<uint8_t*>(rows.rawPointer()) + bytes * static_cast<std::size_t>(row),
          rows.deviceType(), values.data(), DeviceType::kCPU, bytes, nullptr);
      if (rows.deviceType() == DeviceType::kGPU) {
        detail::synchronizeDevice();
      }
    }
  }
}

void RecurrentOracle::write(CacheSlot slot, PrefixDigests const& digests, int64_t length) {
  MKV_REQUIRE(slot >= 0 && slot < mPool.numSlots(), "RecurrentOracle::write",
              "slot {} outside [0, {})", slot, mPool.numSlots());
  writeRows(
      "RecurrentOracle::write", slot, digests, length,
      [&](int32_t l) -> Tensor& { return mPool.state(l); },
      [&](int32_t l) -> Tensor& { return mPool.conv(l); });
}

void RecurrentOracle::writeSnapshot(SnapshotStorage& snapshots, int32_t snapshotSlot,
                                    PrefixDigests const& digests, int64_t length) {
  MKV_REQUIRE(snapshotSlot >= 0 && snapshotSlot < snapshots.config().recurrentSlots,
              "RecurrentOracle::writeSnapshot", "snapshot slot {} outside [0, {})", snapshotSlot,
              snapshots.config().recurrentSlots);
  writeRows(
      "RecurrentOracle::writeSnapshot", snapshotSlot, digests, length,
      [&](int32_t l) -> Tensor& { return snapshots.recurrentStateSlab(l); },
      [&](int32_t l) -> Tensor& { return snapshots.recurrentConvSlab(l); });
}

OracleReport RecurrentOracle::verify(CacheSlot slot, PrefixDigests const& digests,
                                     int64_t length) const {
  MKV_REQUIRE(slot >= 0 && slot < mPool.numSlots(), "RecurrentOracle::verify",
              "slot {} outside [0, {})", slot, mPool.numSlots());
  MKV_REQUIRE(length >= 0 && length <= digests.size(), "RecurrentOracle::verify",
              "length {} outside the {} known positions", length, digests.size());
  OracleReport report;
  report.positionsChecked = 1;
  for (int32_t layer = 0; layer < mPool.numLayers(); ++layer) {
    for (bool conv : {false, true}) {
      Tensor const& rows = conv ? mPool.conv(layer) : mPool.state(layer);
      auto const bytes = static_cast<std::size_t>(rows.dim(1));
      std::vector<uint8_t> want(bytes);
      std::vector<uint8_t> found(bytes);
      expected(digests, length, layer, conv, want);
      detail::copyBytes(
          found.data(), DeviceType::kCPU,
          static_cast<uint8_t const*>(rows.rawPointer()) + bytes * static_cast<std::size_t>(slot),
          mPool.deviceType(), bytes, nullptr);
      if (mPool.deviceType() == DeviceType::kGPU) {
        detail::synchronizeDevice();
      }
      auto const differs = std::mismatch(found.begin(), found.end(), want.begin());
      if (differs.first != found.end()) {
        report.mismatches = 1;
        report.firstMismatch = fmt::format(
            "slot {} recurrent state after {} tokens, layer {} {} row: byte {} is {:#04x}, "
            "expected {:#04x}",
            slot, length, layer, conv ? "conv" : "state", differs.first - found.begin(),
            *differs.first, *differs.second);
        return report;
      }
    }
  }
  return report;
}

}  // namespace mkv::testing
