/// Host twins of the step kernels (oracle_step.cu): the same units, one thread, in unit order.
#include "testing/oracle_step.h"

#include "testing/oracle_step_units.h"

namespace mkv::testing::oracle {

void oracleWriteHost(OracleGeometry const& geometry, uint8_t* plan) {
  auto& header = *reinterpret_cast<OracleStepHeader*>(plan);
  OracleResult& result = header.result;
  for (int64_t flat = 0; flat < header.writePositions; ++flat) {
    result.writeFaultKey =
        minKey(result.writeFaultKey, writeUnitShare(geometry, plan, header, flat, 0, 1));
  }
  int64_t const chunks = (header.storePositions + kOracleStoreChunk - 1) / kOracleStoreChunk;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    storeUnitShare(geometry, plan, header, chunk, 0, 1);
  }
  for (int64_t item = 0; item < header.numRecurrent; ++item) {
    uint64_t const key = recurrentUnitShare(geometry, plan, header, item, 0, 1);
    if (key == kNoKey) {
      continue;
    }
    if (isHiddenItem(plan, header, item)) {
      ++result.hiddenMismatches;
      result.hiddenKey = minKey(result.hiddenKey, key);
    } else {
      ++result.recurrentMismatches;
      result.recurrentKey = minKey(result.recurrentKey, key);
    }
  }
}

void oracleVerifyHost(OracleGeometry const& geometry, uint8_t* plan) {
  auto& header = *reinterpret_cast<OracleStepHeader*>(plan);
  OracleResult& result = header.result;
  for (int64_t flat = 0; flat < header.verifyPositions; ++flat) {
    uint64_t pageKey = kNoKey;
    uint64_t const key = verifyUnitShare(geometry, plan, header, flat, 0, 1, &pageKey);
    if (key != kNoKey) {
      ++result.kvMismatches;
      result.draftMismatches += isDraftPosition(plan, header, flat) ? 1U : 0U;
      result.kvKey = minKey(result.kvKey, key);
      result.kvPageKey = minKey(result.kvPageKey, pageKey);
    }
  }
}

void oracleLengthsHost(OracleGeometry const& geometry, uint8_t* plan,
                       int32_t const rows[kOraclePools]) {
  auto const& header = *reinterpret_cast<OracleStepHeader const*>(plan);
  auto* snapshot = reinterpret_cast<int32_t*>(plan + header.lengthsOffset);
  for (int32_t pool = 0; pool < kOraclePools; ++pool) {
    for (int32_t row = 0; row < rows[pool]; ++row) {
      snapshot[pool * geometry.storeRows + row] = geometry.pools[pool].kvLengths[row];
    }
  }
}

}  // namespace mkv::testing::oracle
