#include "core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "core/units.h"

namespace strata {
namespace {

// Plain lines for each tenth of the work come at least this far apart.
constexpr double kMinPlainGapS = 1.0;

std::string amount_text(uint64_t amount, ProgressUnit unit) {
  return unit == ProgressUnit::kBytes ? format_bytes(amount) : std::to_string(amount);
}

std::string rate_text(double per_second, ProgressUnit unit, std::string_view item_name) {
  if (unit == ProgressUnit::kBytes) return format_bytes(static_cast<uint64_t>(std::max(per_second, 0.0))) + "/s";
  std::string count = per_second >= 1e9   ? fmt::format("{:.2f}G", per_second / 1e9)
                      : per_second >= 1e6 ? fmt::format("{:.2f}M", per_second / 1e6)
                      : per_second >= 1e3 ? fmt::format("{:.1f}k", per_second / 1e3)
                                          : fmt::format("{:.0f}", per_second);
  return fmt::format("{} {}/s", count, item_name);
}

}  // namespace

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(seconds, 0.0)));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
}

std::string Progress::format_line(std::string_view label, uint64_t done, uint64_t total, double seconds,
                                  ProgressUnit unit, std::string_view item_name) {
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  const std::string items = unit == ProgressUnit::kItems ? fmt::format(" {}", item_name) : "";
  if (total == 0) {
    return fmt::format("{}: {}{}, {}", label, amount_text(done, unit), items, rate_text(rate, unit, item_name));
  }
  const uint64_t shown = std::min(done, total);
  const int percent = static_cast<int>(static_cast<double>(shown) * 100.0 / static_cast<double>(total));
  std::string line = fmt::format("{}: {} / {}{} ({}%), {}", label, amount_text(shown, unit), amount_text(total, unit),
                                 items, percent, rate_text(rate, unit, item_name));
  if (rate > 0) line += ", eta " + format_duration(static_cast<double>(total - shown) / rate);
  return line;
}

std::string Progress::format_summary(std::string_view label, uint64_t done, double seconds, ProgressUnit unit,
                                     std::string_view item_name) {
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  const std::string items = unit == ProgressUnit::kItems ? fmt::format(" {}", item_name) : "";
  return fmt::format("{}: {}{} in {}, {}", label, amount_text(done, unit), items, format_duration(seconds),
                     rate_text(rate, unit, item_name));
}

Progress::Progress(std::string label, uint64_t total, ProgressOptions options)
    : label_(std::move(label)), total_(total), options_(std::move(options)) {
  if (!options_.clock) options_.clock = [] { return ProgressOptions::Clock::now(); };
  if (!options_.write) {
    options_.write = [](std::string_view text) {
      std::fwrite(text.data(), 1, text.size(), stderr);
      std::fflush(stderr);
    };
  }
  tty_ = options_.tty.value_or(::isatty(STDERR_FILENO) == 1);
  start_ = options_.clock();
  next_check_ns_ = static_cast<int64_t>(options_.quiet_s * 1e9);
}

Progress::~Progress() { finish(); }

double Progress::seconds_since_start() const {
  return std::chrono::duration<double>(options_.clock() - start_).count();
}

void Progress::add(uint64_t amount) {
  done_.fetch_add(amount, std::memory_order_relaxed);
  maybe_print();
}

void Progress::set(uint64_t done) {
  done_.store(done, std::memory_order_relaxed);
  maybe_print();
}

void Progress::maybe_print() {
  if (!options_.enabled) return;
  const double s = seconds_since_start();
  if (s * 1e9 < static_cast<double>(next_check_ns_.load(std::memory_order_relaxed))) return;
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || finished_) return;  // another thread is printing
  bool due = false;
  double next = 0;
  if (!printed_) {
    due = s >= options_.quiet_s;
    next = options_.quiet_s;
  } else if (tty_) {
    due = s - last_print_s_ >= options_.tty_interval_s;
    next = last_print_s_ + options_.tty_interval_s;
  } else {
    const int tenth = total_ > 0 ? static_cast<int>(std::min<uint64_t>(done_.load() * 10 / total_, 10)) : 0;
    due = s - last_print_s_ >= options_.plain_interval_s || (tenth > last_tenth_ && s - last_print_s_ >= kMinPlainGapS);
    next = last_print_s_ + kMinPlainGapS;
  }
  if (due) {
    print_locked(s, /*summary=*/false);
    next = tty_ ? s + options_.tty_interval_s : s + kMinPlainGapS;
  }
  next_check_ns_.store(static_cast<int64_t>(next * 1e9), std::memory_order_relaxed);
}

void Progress::print_locked(double seconds, bool summary) {
  const uint64_t done = done_.load();
  std::string line = summary ? format_summary(label_, done, seconds, options_.unit, options_.item_name)
                             : format_line(label_, done, total_, seconds, options_.unit, options_.item_name);
  if (options_.note) {
    if (std::string note = options_.note(); !note.empty()) line += ", " + note;
  }
  std::string out;
  if (tty_) {
    out.reserve(std::max(line.size(), last_width_) + 2);
    out += '\r';
    out += line;
    if (line.size() < last_width_) out.append(last_width_ - line.size(), ' ');  // blank the longer previous line
    if (summary) out += '\n';
    last_width_ = line.size();
  } else {
    out = line + "\n";
  }
  options_.write(out);
  printed_ = true;
  last_print_s_ = seconds;
  if (total_ > 0) last_tenth_ = static_cast<int>(std::min<uint64_t>(done * 10 / total_, 10));
}

void Progress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (!options_.enabled) return;
  const double s = seconds_since_start();
  if (printed_ || s >= options_.quiet_s) print_locked(s, /*summary=*/true);
}

}  // namespace strata
