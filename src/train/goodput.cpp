#include "train/goodput.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/check.h"

namespace strata {
namespace {

constexpr const char* kKeys[kNumGoodputParts] = {"compute", "memory_stall", "checkpoint", "startup",
                                                 "restart", "data",         "export",     "eval", "idle"};
// The words of the goodput line, in the same order.
constexpr const char* kWords[kNumGoodputParts] = {"compute", "memory stalls", "checkpoints", "start-up",
                                                  "restart", "data",          "export",      "evaluation", "idle"};

// "41.2 s", "0 s": one decimal, and a plain 0 for nothing at all.
std::string seconds_text(double s) { return s == 0 ? std::string("0 s") : fmt::format("{:.1f} s", s); }

}  // namespace

const char* goodput_part_key(GoodputPart part) { return kKeys[static_cast<int>(part)]; }

double GoodputReport::goodput() const {
  return wall_s > 0 ? std::clamp((*this)[GoodputPart::kCompute] / wall_s, 0.0, 1.0) : 0.0;
}

void GoodputAccountant::add(GoodputPart part, double seconds) {
  CHECK_MSG(part != GoodputPart::kIdle, "idle time is what the other parts leave; it is not added");
  CHECK_MSG(seconds >= 0, "goodput: a negative or NaN duration");
  ns_[static_cast<size_t>(part)].fetch_add(static_cast<int64_t>(std::llround(seconds * 1e9)),
                                           std::memory_order_relaxed);
}

double GoodputAccountant::Timer::stop() {
  if (accountant_ == nullptr) return 0;
  const double s = std::chrono::duration<double>(Clock::now() - start_).count();
  accountant_->add(part_, s);
  accountant_ = nullptr;
  return s;
}

GoodputReport GoodputAccountant::report() const {
  GoodputReport r;
  const int64_t wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count();
  int64_t timed_ns = 0;
  for (int i = 0; i < kNumGoodputParts; ++i) {
    const int64_t ns = ns_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
    r.seconds[static_cast<size_t>(i)] = static_cast<double>(ns) / 1e9;
    timed_ns += ns;
  }
  const int64_t idle_ns = std::max<int64_t>(wall_ns - timed_ns, 0);
  r.seconds[static_cast<size_t>(GoodputPart::kIdle)] = static_cast<double>(idle_ns) / 1e9;
  r.wall_s = static_cast<double>(timed_ns + idle_ns) / 1e9;
  return r;
}

std::string format_goodput_line(const GoodputReport& r) {
  std::string line = fmt::format("goodput {:.1f}%:", 100 * r.goodput());
  for (int i = 0; i < kNumGoodputParts; ++i)
    line += fmt::format("{} {} {}", i == 0 ? "" : ",", kWords[i], seconds_text(r.seconds[static_cast<size_t>(i)]));
  return line + " of " + seconds_text(r.wall_s);
}

nlohmann::json goodput_json(const GoodputReport& r) {
  nlohmann::json j = {{"event", "goodput"}, {"wall_s", r.wall_s}, {"goodput", r.goodput()}};
  for (int i = 0; i < kNumGoodputParts; ++i) j[std::string(kKeys[i]) + "_s"] = r.seconds[static_cast<size_t>(i)];
  return j;
}

int64_t highest_recorded_step(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  int64_t highest = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || j.contains("event")) continue;
    const auto step = j.find("step");
    if (step != j.end() && step->is_number_integer()) highest = std::max(highest, step->get<int64_t>());
  }
  return highest;
}

}  // namespace strata
