#include "core/trace.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata::trace {
// One track's events (a thread's or a Track's). The recorder takes `mu` for each event; only
// collect() and start() contend for it.
struct detail::Buffer {
  std::mutex mu;
  int tid = 0;
  std::string name;
  std::vector<Event> events;
  uint64_t dropped = 0;
  bool alive = true;  // the thread still runs or the Track exists (else its events are kept until start())
};
using detail::Buffer;

namespace {

using Clock = std::chrono::steady_clock;


struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<Buffer>> buffers;
  int next_tid = 1;
  std::atomic<int64_t> epoch_ns{0};  // Clock time of start()
  std::atomic<uint64_t> next_id{1};
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: threads may record during exit
  return *r;
}

int64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The calling thread's buffer, registered on first use, and the name it was given before.
struct Handle {
  std::shared_ptr<Buffer> buffer;
  const char* name = nullptr;
  ~Handle() {
    if (buffer) {
      std::lock_guard<std::mutex> lock(buffer->mu);
      buffer->alive = false;
    }
  }
};

Handle& my_handle() {
  thread_local Handle handle;
  return handle;
}

// A new track's buffer, registered for collect(): a thread's or a Track's.
std::shared_ptr<Buffer> register_buffer(const char* name) {
  auto b = std::make_shared<Buffer>();
  if (name != nullptr) b->name = name;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  b->tid = r.next_tid++;
  r.buffers.push_back(b);
  return b;
}

Buffer& my_buffer() {
  Handle& handle = my_handle();
  if (!handle.buffer) handle.buffer = register_buffer(handle.name);
  return *handle.buffer;
}

// A complete span ('X') from start_ns to end_ns, no arguments.
Event span_event(const char* category, const char* name, int64_t index, int64_t start_ns, int64_t end_ns) {
  Event e;
  e.phase = 'X';
  e.category = category;
  e.name = name;
  e.index = index;
  e.ts_ns = start_ns;
  e.dur_ns = std::max<int64_t>(0, end_ns - start_ns);
  return e;
}

// Appends under the buffer's lock (only collect() and start() contend for it).
void append_locked(Buffer& b, const Event& e) {
  if (b.events.size() >= kMaxEventsPerThread) {
    ++b.dropped;
    return;
  }
  b.events.push_back(e);
}

void record(const Event& e) {
  Buffer& b = my_buffer();
  std::lock_guard<std::mutex> lock(b.mu);
  append_locked(b, e);
}

void set_args(Event& e, std::initializer_list<Arg> args) {
  for (const Arg& a : args) {
    if (e.num_args == kMaxArgs) break;
    e.args[e.num_args++] = a;
  }
}

// Microseconds with nanosecond precision, the unit trace-event JSON uses. Times before start()
// (a clock read racing it) are written as 0.
void append_us(fmt::memory_buffer& out, int64_t ns) {
  ns = std::max<int64_t>(ns, 0);
  fmt::format_to(std::back_inserter(out), "{}.{:03d}", ns / 1000, static_cast<int>(ns % 1000));
}

// A JSON string; bytes that are not UTF-8 (a path from the command line) become U+FFFD.
void append_string(fmt::memory_buffer& out, const std::string& s) {
  const std::string quoted = nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  out.append(quoted.data(), quoted.data() + quoted.size());
}

// JSON has no NaN or Inf: an argument that is not finite (or has no key) is left out.
void append_args(fmt::memory_buffer& out, const Event& e) {
  out.append(std::string_view(",\"args\":{"));
  bool first = true;
  for (int i = 0; i < e.num_args; ++i) {
    const double v = e.args[i].value;
    if (e.args[i].key == nullptr || !std::isfinite(v)) continue;
    if (!first) out.push_back(',');
    first = false;
    append_string(out, e.args[i].key);
    fmt::format_to(std::back_inserter(out), ":{}", v);
  }
  out.push_back('}');
}

}  // namespace

void start() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::g_enabled.store(false, std::memory_order_relaxed);
  std::vector<std::shared_ptr<Buffer>> kept;
  for (auto& b : r.buffers) {
    std::lock_guard<std::mutex> block(b->mu);
    b->events.clear();
    b->dropped = 0;
    if (b->alive) kept.push_back(b);
  }
  r.buffers = std::move(kept);
  r.epoch_ns.store(clock_ns(), std::memory_order_relaxed);
  detail::g_enabled.store(true, std::memory_order_release);
}

void stop() { detail::g_enabled.store(false, std::memory_order_release); }

int64_t now_ns() { return clock_ns() - registry().epoch_ns.load(std::memory_order_relaxed); }

void name_thread(const char* name) {
  Handle& h = my_handle();
  h.name = name;
  if (!h.buffer) return;  // the buffer takes the name when it is made
  std::lock_guard<std::mutex> lock(h.buffer->mu);
  h.buffer->name = name;
}

uint64_t next_id() { return registry().next_id.fetch_add(1, std::memory_order_relaxed); }

void complete(const char* category, const char* name, int64_t index, int64_t start_ns, int64_t end_ns,
              std::initializer_list<Arg> args) {
  if (!enabled()) return;
  Event e = span_event(category, name, index, start_ns, end_ns);
  set_args(e, args);
  record(e);
}

void counter(const char* name, std::initializer_list<Arg> series) {
  if (!enabled()) return;
  Event e;
  e.phase = 'C';
  e.category = "memory";
  e.name = name;
  e.ts_ns = now_ns();
  set_args(e, series);
  record(e);
}

void async_span(const char* category, const char* name, uint64_t id, int64_t start_ns, int64_t end_ns,
                std::initializer_list<Arg> args) {
  if (!enabled()) return;
  Event b;
  b.phase = 'b';
  b.category = category;
  b.name = name;
  b.id = id;
  b.ts_ns = start_ns;
  set_args(b, args);
  Event e = b;
  e.phase = 'e';
  e.ts_ns = std::max(start_ns, end_ns);
  e.num_args = 0;
  Buffer& buf = my_buffer();
  std::lock_guard<std::mutex> lock(buf.mu);
  if (buf.events.size() + 2 > kMaxEventsPerThread) {
    buf.dropped += 2;
    return;
  }
  buf.events.push_back(b);
  buf.events.push_back(e);
}

Track::Track(const char* name) : buffer_(register_buffer(name)) {}

Track::~Track() {
  if (!buffer_) return;  // moved from
  std::lock_guard<std::mutex> lock(buffer_->mu);
  buffer_->alive = false;
}

void Track::complete(const char* category, const char* name, int64_t index, int64_t start_ns, int64_t end_ns) {
  if (!enabled() || !buffer_) return;
  const Event e = span_event(category, name, index, start_ns, end_ns);
  std::lock_guard<std::mutex> lock(buffer_->mu);
  append_locked(*buffer_, e);
}

void Span::end() {
  if (start_ns_ < 0) return;
  Event e;
  e.phase = 'X';
  e.category = category_;
  e.name = name_;
  e.index = index_;
  e.ts_ns = start_ns_;
  e.dur_ns = std::max<int64_t>(0, now_ns() - start_ns_);
  e.num_args = num_args_;
  std::copy(args_, args_ + num_args_, e.args);
  start_ns_ = -1;
  // A span begun while tracing was on is kept even if tracing stopped meanwhile: the events
  // of a step end together.
  record(e);
}

std::vector<ThreadEvents> collect() {
  std::vector<std::shared_ptr<Buffer>> buffers;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    buffers = r.buffers;
  }
  std::vector<ThreadEvents> out;
  for (auto& b : buffers) {
    std::lock_guard<std::mutex> lock(b->mu);
    if (b->events.empty() && b->dropped == 0) continue;
    out.push_back(ThreadEvents{b->tid, b->name.empty() ? "thread " + std::to_string(b->tid) : b->name, b->events,
                               b->dropped});
  }
  return out;
}

std::string display_name(const Event& e) {
  return e.index == kNoIndex ? std::string(e.name) : fmt::format("{} {}", e.name, e.index);
}

std::string to_json(const std::vector<ThreadEvents>& threads,
                    const std::vector<std::pair<std::string, std::string>>& metadata) {
  constexpr int kPid = 1;
  fmt::memory_buffer out;
  out.append(std::string_view("{\"displayTimeUnit\":\"ms\",\"otherData\":{"));
  uint64_t dropped = 0;
  for (const ThreadEvents& t : threads) dropped += t.dropped;
  fmt::format_to(std::back_inserter(out), "\"dropped_events\":\"{}\"", dropped);
  for (const auto& [key, value] : metadata) {
    out.push_back(',');
    append_string(out, key);
    out.push_back(':');
    append_string(out, value);
  }
  out.append(std::string_view("},\"traceEvents\":[\n"));
  fmt::format_to(std::back_inserter(out),
                 "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"tid\":0,\"args\":{{\"name\":\"strata\"}}}}",
                 kPid);
  for (const ThreadEvents& t : threads) {
    fmt::format_to(std::back_inserter(out), ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":",
                   kPid, t.tid);
    append_string(out, t.name);
    out.append(std::string_view("}}"));
    fmt::format_to(std::back_inserter(out),
                   ",\n{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},\"args\":{{\"sort_index\":{}}}}}",
                   kPid, t.tid, t.tid);
    for (const Event& e : t.events) {
      out.append(std::string_view(",\n{\"ph\":\""));
      out.push_back(e.phase);
      out.append(std::string_view("\",\"cat\":"));
      append_string(out, e.category);
      out.append(std::string_view(",\"name\":"));
      append_string(out, display_name(e));
      fmt::format_to(std::back_inserter(out), ",\"pid\":{},\"tid\":{},\"ts\":", kPid, t.tid);
      append_us(out, e.ts_ns);
      if (e.phase == 'X') {
        out.append(std::string_view(",\"dur\":"));
        append_us(out, e.dur_ns);
      }
      if (e.phase == 'b' || e.phase == 'e') fmt::format_to(std::back_inserter(out), ",\"id\":\"0x{:x}\"", e.id);
      if (e.phase == 'i') out.append(std::string_view(",\"s\":\"t\""));
      if (e.num_args > 0 || e.phase == 'C') append_args(out, e);
      out.push_back('}');
    }
  }
  out.append(std::string_view("\n]}\n"));
  return fmt::to_string(out);
}

}  // namespace strata::trace
