#pragma once
/// \file logging.h
/// The library logs through one spdlog logger named "managedkv" (level warn by default).
/// A host application may replace it, for example with a logger that has its own sinks.

#include <memory>

namespace spdlog {
class logger;
}

namespace mkv {

inline constexpr char const* kLoggerName = "managedkv";

/// The current library logger (created on first use: stderr, level warn). Never null.
/// Thread-safe.
std::shared_ptr<spdlog::logger> logger();

/// Replaces the library logger. Passing nullptr restores the default. Thread-safe; calls that
/// are logging concurrently finish on the logger they started with.
void setLogger(std::shared_ptr<spdlog::logger> replacement);

}  // namespace mkv
