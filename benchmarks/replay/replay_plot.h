#pragma once
/// \file replay_plot.h
/// The --plot PNG: pages in use and the cumulative hit rate over the replay, drawn by gnuplot.

#include <optional>
#include <string>
#include <string_view>

#include "replay_runner.h"

namespace mkv::replay {

enum class PlotStatus : uint8_t {
  kWritten,    ///< the PNG exists
  kNoGnuplot,  ///< gnuplot is not in PATH; nothing was written
  kFailed,     ///< gnuplot ran and failed (message says why)
};

struct PlotOutcome {
  PlotStatus status = PlotStatus::kFailed;
  std::string message;
};

/// The first executable `name` in $PATH, if any.
std::optional<std::string> findInPath(std::string_view name);

/// Writes the time line and a gnuplot script to a fresh temporary folder, runs gnuplot on it
/// (its output goes to a log there, quoted in the message on failure) and removes the folder.
PlotOutcome writePlot(ReplayResult const& result, std::string const& pngPath);

}  // namespace mkv::replay
