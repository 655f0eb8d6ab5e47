// A progress line for long operations (loading, converting and exporting weights, tokenizing,
// verifying and saving checkpoints):
//   loading weights: 1.20 GiB / 4.00 GiB (30%), 512.00 MiB/s, eta 6s
// On a terminal it is one line rewritten in place with \r (at most every tty_interval_s);
// elsewhere (a log file, a pipe) plain lines, every plain_interval_s or each tenth of the work,
// at least a second apart. An operation that ends within quiet_s prints nothing at all; one
// that printed ends with a summary line ("loading weights: 4.00 GiB in 8s, 512.00 MiB/s").
//
// Thread safety: add() and set() may be called from any threads at once (e.g. I/O workers);
// between prints they cost an atomic add and a clock read. finish() and the destructor from one
// thread, after the others are done.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace strata {

enum class ProgressUnit : uint8_t {
  kBytes,  // amounts as format_bytes, the rate per second
  kItems,  // plain counts named ProgressOptions::item_name
};

struct ProgressOptions {
  using Clock = std::chrono::steady_clock;
  ProgressUnit unit = ProgressUnit::kBytes;
  std::string item_name = "items";  // kItems: "tensors", "tokens", ...
  bool enabled = true;              // false: a no-op (e.g. --quiet)
  double quiet_s = 2.0;             // nothing is printed before this much time has passed
  double tty_interval_s = 0.25;
  double plain_interval_s = 10.0;
  // Extra text for the end of each line (e.g. "1.2M tokens"); called only when a line is
  // printed, under the reporter's lock.
  std::function<std::string()> note;
  // Injected for tests: where lines go (default: stderr), whether that is a terminal (default:
  // isatty(stderr)) and the clock (default: steady_clock).
  std::function<void(std::string_view)> write;
  std::optional<bool> tty;
  std::function<Clock::time_point()> clock;
};

class Progress {
 public:
  // `total` 0 means unknown: lines show the amount done and the rate, no percentage or eta.
  Progress(std::string label, uint64_t total, ProgressOptions options = {});
  ~Progress();  // finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add(uint64_t amount);
  void set(uint64_t done);
  // The summary line when a line was printed or the operation took at least quiet_s; once.
  void finish();

  // "LABEL: DONE / TOTAL (P%), RATE, eta T" (or "LABEL: DONE, RATE" when total is 0).
  static std::string format_line(std::string_view label, uint64_t done, uint64_t total, double seconds,
                                 ProgressUnit unit, std::string_view item_name);
  // "LABEL: DONE in Ts, RATE".
  static std::string format_summary(std::string_view label, uint64_t done, double seconds, ProgressUnit unit,
                                    std::string_view item_name);

 private:
  void maybe_print();
  void print_locked(double seconds, bool summary);  // REQUIRES: mu_ held
  double seconds_since_start() const;

  const std::string label_;
  const uint64_t total_;
  ProgressOptions options_;
  bool tty_ = false;
  ProgressOptions::Clock::time_point start_;
  std::atomic<uint64_t> done_{0};
  std::atomic<int64_t> next_check_ns_{0};  // since start_; add() skips the lock before it

  std::mutex mu_;
  double last_print_s_ = 0;   // GUARDED_BY(mu_)
  int last_tenth_ = 0;        // GUARDED_BY(mu_): tenths of the work done at the last plain line
  size_t last_width_ = 0;     // GUARDED_BY(mu_): characters of the line on a terminal
  bool printed_ = false;      // GUARDED_BY(mu_)
  bool finished_ = false;     // GUARDED_BY(mu_)
};

// "45s", "12m05s", "3h07m": durations in progress and step lines.
std::string format_duration(double seconds);

}  // namespace strata
