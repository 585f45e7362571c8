#include "progress_bar.h"

#include <fmt/format.h>

#include <string>

namespace mkv::replay {
namespace {

constexpr int kWidth = 30;
constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

std::string duration(double seconds) {
  auto const total = static_cast<long long>(seconds + 0.5);
  if (total >= 3600) {
    return fmt::format("{}:{:02}:{:02}", total / 3600, (total / 60) % 60, total % 60);
  }
  return fmt::format("{}:{:02}", total / 60, total % 60);
}

}  // namespace

ProgressBar::ProgressBar(std::FILE* out, bool enabled)
    : mOut(out), mEnabled(enabled), mStart(std::chrono::steady_clock::now()), mLastDraw(mStart) {}

ProgressBar::~ProgressBar() { clear(); }

void ProgressBar::update(std::size_t done, std::size_t total) {
  if (!mEnabled) {
    return;
  }
  auto const now = std::chrono::steady_clock::now();
  if (mDrawn && now - mLastDraw < kRedrawInterval && done < total) {
    return;
  }
  mLastDraw = now;
  draw(done, total);
}

void ProgressBar::draw(std::size_t done, std::size_t total) {
  double const elapsed = std::chrono::duration<double>(mLastDraw - mStart).count();
  double const fraction = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  auto const filled = static_cast<int>(fraction * kWidth);
  std::string bar(static_cast<std::size_t>(kWidth), ' ');
  for (int i = 0; i < filled && i < kWidth; ++i) {
    bar[static_cast<std::size_t>(i)] = '=';
  }
  if (filled < kWidth) {
    bar[static_cast<std::size_t>(filled)] = '>';
  }
  std::string tail;
  if (elapsed > 0.0 && done > 0) {
    double const rate = static_cast<double>(done) / elapsed;
    tail = fmt::format("  {:.1f} req/s  ETA {}", rate,
                       duration(static_cast<double>(total - done) / rate));
  }
  fmt::print(mOut, "\r[{}] {}/{}{}\x1b[K", bar, done, total, tail);
  std::fflush(mOut);
  mDrawn = true;
}

void ProgressBar::clear() {
  if (mEnabled && mDrawn) {
    fmt::print(mOut, "\r\x1b[K");
    std::fflush(mOut);
    mDrawn = false;
  }
}

}  // namespace mkv::replay
