#pragma once
/// \file progress_bar.h
/// A one-line progress bar with rate and ETA, redrawn in place on a terminal.

#include <chrono>
#include <cstddef>
#include <cstdio>

namespace mkv::replay {

/// Draws `[=====>    ] done/total  rate req/s  ETA m:ss` on `out`, at most ten times a second.
/// Disabled bars draw nothing (use isatty() to decide). Single-threaded.
class ProgressBar {
 public:
  ProgressBar(std::FILE* out, bool enabled);
  ~ProgressBar();
  ProgressBar(ProgressBar const&) = delete;
  ProgressBar& operator=(ProgressBar const&) = delete;

  /// Records progress; redraws when 100 ms passed since the last drawing.
  void update(std::size_t done, std::size_t total);
  /// Erases the bar (before other output goes to the same terminal). Idempotent.
  void clear();
  bool enabled() const noexcept { return mEnabled; }

 private:
  void draw(std::size_t done, std::size_t total);

  std::FILE* mOut;
  bool mEnabled;
  bool mDrawn = false;
  std::chrono::steady_clock::time_point mStart;
  std::chrono::steady_clock::time_point mLastDraw;
};

}  // namespace mkv::replay
