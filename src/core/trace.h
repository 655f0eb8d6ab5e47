// Tracing: spans, counters and asynchronous spans recorded per thread, written out as Chrome
// trace-event JSON (the format ui.perfetto.dev and chrome://tracing open).
//
// Off by default. Every recording call first reads one relaxed atomic flag and returns at
// once when tracing is off, so instrumented code costs a load and a branch (`strata bench
// trace` measures it). When on, an event is appended to the calling thread's own buffer under
// a mutex no other recorder takes: no formatting, no allocation beyond the vector's growth.
// Names are static strings plus an optional index ("forward" + 3 is shown as "forward 3"),
// formatted only when the trace is written.
//
// Tracks: each thread that records gets a track, named by name_thread() (copy streams,
// the optimizer worker, the checkpoint writer name themselves). Counters are per process.
// Asynchronous spans (NVMe requests, which overlap one another) get tracks of their own.
//
// Thread safety: every function is safe to call from any thread. collect() may run while
// others record; it sees what was recorded before it took each buffer's lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace strata::trace {

namespace detail {
inline std::atomic<bool> g_enabled{false};
struct Buffer;  // one track's events (trace.cpp)
}  // namespace detail

inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }

// Drops everything recorded so far, restarts the clock at 0 and turns recording on.
void start();
// Turns recording off; what was recorded stays until the next start().
void stop();
// Nanoseconds since start().
int64_t now_ns();

// Names the calling thread's track ("training", "copy host->device", ...): a static string.
// Kept across start(), so threads created before tracing starts may name themselves; costs no
// buffer until the thread records something.
void name_thread(const char* name);

// At most this many events are kept per thread (about 100 MiB); later ones are counted as
// dropped (collect() and the JSON's otherData say how many).
inline constexpr size_t kMaxEventsPerThread = 1 << 20;

// A numeric argument shown with the event ("bytes": 4194304).
// No member initialisers: a Span holds kMaxArgs of them and must cost nothing while tracing is
// off.
struct Arg {
  const char* key;  // a static string
  double value;
};
inline constexpr int kMaxArgs = 6;
inline constexpr int64_t kNoIndex = INT64_MIN;

// One recorded event, as trace-event JSON will show it.
struct Event {
  char phase = 'X';             // X complete span, C counter, b/e asynchronous begin/end, i instant
  const char* category = "";    // static strings
  const char* name = "";
  int64_t index = kNoIndex;     // appended to the name when set
  int64_t ts_ns = 0;            // since start()
  int64_t dur_ns = 0;           // X only
  uint64_t id = 0;              // b/e only: pairs them
  int num_args = 0;
  Arg args[kMaxArgs];
};

// A span from `start_ns` to `end_ns` (now_ns() values) on the calling thread's track.
void complete(const char* category, const char* name, int64_t index, int64_t start_ns, int64_t end_ns,
              std::initializer_list<Arg> args = {});
// A counter's value(s) now: one track per name, one series per argument.
void counter(const char* name, std::initializer_list<Arg> series);
// A new id for async_span, unique in this process.
uint64_t next_id();
// An asynchronous span (overlapping others of its category) with its own id.
void async_span(const char* category, const char* name, uint64_t id, int64_t start_ns, int64_t end_ns,
                std::initializer_list<Arg> args = {});

// A span for the lifetime of the object on the calling thread's track:
//   trace::Span span("compute", "forward", layer);
// Costs one flag read when tracing is off.
class Span {
 public:
  Span(const char* category, const char* name, int64_t index = kNoIndex)
      : category_(category), name_(name), index_(index), start_ns_(enabled() ? now_ns() : -1) {}
  ~Span() {
    if (start_ns_ >= 0) end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  // Attaches a numeric argument (at most kMaxArgs; extra ones are dropped).
  void arg(const char* key, double value) {
    if (start_ns_ >= 0 && num_args_ < kMaxArgs) args_[num_args_++] = Arg{key, value};
  }
  // Ends the span now instead of at destruction.
  void end();

 private:
  const char* category_;
  const char* name_;
  int64_t index_;
  int64_t start_ns_;  // -1: tracing was off when the span began
  int num_args_ = 0;
  Arg args_[kMaxArgs];  // the first num_args_ are set
};

// A track that belongs to no thread: what a device did, timed on the device and placed on this
// clock afterwards (a CUDA stream's kernels and copies, core/cuda/cuda_timeline.h), recorded
// from whichever thread learns of it. Shown like a thread's track, under its name. Safe for
// concurrent use; movable, not copyable.
class Track {
 public:
  explicit Track(const char* name);  // a static string
  ~Track();
  Track(Track&&) noexcept = default;
  Track& operator=(Track&&) noexcept = default;
  Track(const Track&) = delete;
  Track& operator=(const Track&) = delete;
  // A span from start_ns to end_ns (now_ns() values), as complete() records one.
  void complete(const char* category, const char* name, int64_t index, int64_t start_ns, int64_t end_ns);

 private:
  std::shared_ptr<detail::Buffer> buffer_;
};

// Everything recorded, per thread, in recording order.
struct ThreadEvents {
  int tid = 0;
  std::string name;
  std::vector<Event> events;
  uint64_t dropped = 0;  // events over kMaxEventsPerThread, not kept
};
std::vector<ThreadEvents> collect();

// The trace as Chrome trace-event JSON: {"traceEvents": [...], "displayTimeUnit": "ms",
// "otherData": metadata}. Timestamps are microseconds since start().
std::string to_json(const std::vector<ThreadEvents>& threads, const std::vector<std::pair<std::string, std::string>>& metadata = {});

// The name an event shows: its name, and its index when it has one ("forward 3").
std::string display_name(const Event& e);

}  // namespace strata::trace
