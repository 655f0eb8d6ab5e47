// Logging over spdlog. Lines carry a rank prefix; INFO is printed by rank 0 only unless
// all_ranks is set. Never include this from .cu files (nvcc 13 + fmt 9 + C++20 do not mix).
#pragma once

#ifndef SPDLOG_ACTIVE_LEVEL
#define SPDLOG_ACTIVE_LEVEL SPDLOG_LEVEL_DEBUG
#endif
#include <spdlog/spdlog.h>

namespace strata {

enum class LogLevel { kDebug, kInfo, kWarn, kError };

struct LogOptions {
  LogLevel level = LogLevel::kInfo;
  bool all_ranks = false;  // INFO/DEBUG from every rank, not only rank 0
};

// Uses process_identity() for the prefix. Safe to call again (e.g. after the rank is known).
void init_logging(const LogOptions& options);
// Parses "debug", "info", "warn", "error".
bool parse_log_level(const std::string& name, LogLevel* out);

}  // namespace strata

#define LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define LOG_INFO(...) SPDLOG_INFO(__VA_ARGS__)
#define LOG_WARN(...) SPDLOG_WARN(__VA_ARGS__)
#define LOG_ERROR(...) SPDLOG_ERROR(__VA_ARGS__)
