#pragma once
/// \file replay_report.h
/// The outputs of a replay: the summary table (stdout), the JSON summary and the per-request CSV.
/// Every figure is described in docs/replay.md.

#include <ostream>
#include <string>

#include "replay_runner.h"

namespace mkv::replay {

/// The human-readable summary table.
std::string formatSummary(ReplayResult const& result);
/// One JSON object with every summary figure (keys in docs/replay.md), newline-terminated.
std::string formatJson(ReplayResult const& result);
/// Header plus one row per request in index order.
std::string formatCsv(ReplayResult const& result);

/// The first figure in which `other` differs from `reference` (two ranks of one tensor-parallel
/// replay), timings and the tensor_parallel block aside: a JSON key, or a request's CSV row; empty
/// when they agree.
std::string firstDifference(ReplayResult const& reference, ReplayResult const& other);

}  // namespace mkv::replay
