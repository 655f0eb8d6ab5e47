#include "train/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/units.h"

namespace strata {

std::string format_step_line(const StepMetrics& m) {
  int width = static_cast<int>(std::to_string(m.total_steps).size());
  std::string tps = m.tokens_per_s >= 1e6   ? fmt::format("{:.2f}M", m.tokens_per_s / 1e6)
                    : m.tokens_per_s >= 1e3 ? fmt::format("{:.1f}k", m.tokens_per_s / 1e3)
                                            : fmt::format("{:.0f}", m.tokens_per_s);
  const std::string eta = m.eta_s >= 0 ? " | eta " + format_duration(m.eta_s) : "";
  const std::string skipped = m.skipped             ? fmt::format(" | SKIPPED ({})", m.skipped_steps)
                              : m.skipped_steps > 0 ? fmt::format(" | skipped {}", m.skipped_steps)
                                                    : std::string();
  const std::string eval = m.evaluated
                               ? fmt::format(" | eval {:.4f} ppl {:.2f}", m.eval_loss, std::exp(m.eval_loss))
                               : std::string();
  return fmt::format(
      "step {:>{}}/{} | loss {:.4f}{} | lr {:.2e} | gnorm {:.3f} | {} tok/s | {:.0f} ms{} | dev {} host {} nvme {} | "
      "moved {} stall {:.0f} ms | rss {}{}{}{}{}",
      m.step, width, m.total_steps, m.loss, eval, m.lr, m.grad_norm, tps, m.ms, eta, format_bytes(m.tier_bytes[0]),
      format_bytes(m.tier_bytes[1]), format_bytes(m.tier_bytes[2]), format_bytes(m.moved_bytes), m.stall_ms,
      format_bytes(m.rss_bytes),
      m.rss_planned_bytes > 0 ? " / " + format_bytes(m.rss_planned_bytes) + " planned" : std::string(),
      m.recipe.empty() ? std::string() : " | " + m.recipe,
      m.world > 1 ? fmt::format(" | {} ranks, sent {}", m.world, format_bytes(static_cast<uint64_t>(m.comm_bytes)))
                  : std::string(),
      skipped);
}

Result<MetricsWriter> MetricsWriter::open(const std::string& path, bool append) {
  std::FILE* f = std::fopen(path.c_str(), append ? "a" : "w");
  if (f == nullptr)
    return Status::IOError("cannot create metrics file '" + path + "': " + std::strerror(errno) +
                           "; check that run.dir is writable");
  return MetricsWriter(f, path);
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status MetricsWriter::write(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step},
                      {"loss", m.loss},
                      {"lr", m.lr},
                      {"grad_norm", m.grad_norm},
                      {"tokens_per_s", m.tokens_per_s},
                      {"model_tflops", m.model_tflops},
                      {"ms", m.ms},
                      {"tokens", m.tokens},
                      {"device_bytes", m.tier_bytes[0]},
                      {"host_bytes", m.tier_bytes[1]},
                      {"nvme_bytes", m.tier_bytes[2]},
                      {"state_bytes", m.state_bytes},
                      {"moved_bytes", m.moved_bytes},
                      {"stall_ms", m.stall_ms},
                      {"elapsed_s", m.elapsed_s},
                      {"eta_s", m.eta_s},
                      {"ckpt_in_flight", m.ckpt_in_flight},
                      {"skipped", m.skipped},
                      {"skipped_steps", m.skipped_steps},
                      {"rss_bytes", m.rss_bytes},
                      {"rss_peak_bytes", m.rss_peak_bytes},
                      {"rss_planned_bytes", m.rss_planned_bytes}};
  if (m.evaluated) {
    // JSON has no NaN or Inf: nlohmann writes them as null, which readers take as not a number.
    j["eval_loss"] = m.eval_loss;
    j["eval_ppl"] = std::exp(m.eval_loss);
  }
  if (!m.experts_reached_by_layer.empty()) {
    j["experts_reached"] = m.experts_reached;
    j["experts_reached_by_layer"] = m.experts_reached_by_layer;
  }
  if (m.world > 1) {
    j["world"] = m.world;
    j["comm_bytes"] = m.comm_bytes;
  }
  // Losses are printed with 17 significant digits so that runs can be compared bitwise.
  return append(j.dump());
}

Status MetricsWriter::append(const std::string& json_object) {
  const std::string line = json_object + "\n";
  if (std::fputs(line.c_str(), file_) < 0 || std::fflush(file_) != 0)
    return Status::IOError("cannot write metrics file '" + path_ + "': " + std::strerror(errno));
  return Status::OK();
}

uint64_t peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) != 0) continue;
    try {
      return static_cast<uint64_t>(std::stoull(line.substr(6))) * 1024;  // kB
    } catch (...) {
      return 0;
    }
  }
  return 0;
}

uint64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  if (!(in >> pages >> resident)) return 0;
  return resident * 4096;
}

}  // namespace strata
