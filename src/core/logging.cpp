#include "mkv/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <mutex>

namespace mkv {
namespace {

std::mutex gLoggerMutex;
std::shared_ptr<spdlog::logger> gLogger;

std::shared_ptr<spdlog::logger> makeDefaultLogger() {
  if (auto existing = spdlog::get(kLoggerName)) {
    return existing;
  }
  auto created = spdlog::stderr_color_mt(kLoggerName);
  created->set_level(spdlog::level::warn);
  return created;
}

}  // namespace

std::shared_ptr<spdlog::logger> logger() {
  std::lock_guard<std::mutex> lock(gLoggerMutex);
  if (!gLogger) {
    gLogger = makeDefaultLogger();
  }
  return gLogger;
}

void setLogger(std::shared_ptr<spdlog::logger> replacement) {
  std::lock_guard<std::mutex> lock(gLoggerMutex);
  gLogger = replacement ? std::move(replacement) : makeDefaultLogger();
}

}  // namespace mkv
