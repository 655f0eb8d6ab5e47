#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/check.h"

namespace strata {

void init_logging(const LogOptions& options) {
  const ProcessIdentity& id = process_identity();
  auto logger = spdlog::get("strata");
  if (!logger) logger = spdlog::stderr_color_mt("strata");
  std::string prefix = id.world_size > 1 ? "[rank " + std::to_string(id.rank) + "] " : "";
  logger->set_pattern("%H:%M:%S %^%L%$ " + prefix + "%v");
  spdlog::level::level_enum level = spdlog::level::info;
  switch (options.level) {
    case LogLevel::kDebug: level = spdlog::level::debug; break;
    case LogLevel::kInfo: level = spdlog::level::info; break;
    case LogLevel::kWarn: level = spdlog::level::warn; break;
    case LogLevel::kError: level = spdlog::level::err; break;
  }
  if (id.rank != 0 && !options.all_ranks && level < spdlog::level::warn) level = spdlog::level::warn;
  logger->set_level(level);
  spdlog::set_default_logger(logger);
  spdlog::set_level(level);
}

bool parse_log_level(const std::string& name, LogLevel* out) {
  if (name == "debug") *out = LogLevel::kDebug;
  else if (name == "info") *out = LogLevel::kInfo;
  else if (name == "warn") *out = LogLevel::kWarn;
  else if (name == "error") *out = LogLevel::kError;
  else return false;
  return true;
}

}  // namespace strata
