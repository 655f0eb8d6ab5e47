#include "core/trace.h"

#include <algorithm>
#include <limits>
#include <thread>

#include <gtest/gtest.h>

#include <optional>
#include <nlohmann/json.hpp>

#include "trace_check.h"

namespace strata {
namespace {

const trace::ThreadEvents* find_thread(const std::vector<trace::ThreadEvents>& threads, const std::string& name) {
  for (const auto& t : threads)
    if (t.name == name) return &t;
  return nullptr;
}

TEST(TraceTest, NothingIsRecordedWhileOff) {
  trace::start();
  trace::stop();
  { trace::Span span("compute", "forward", 1); }
  trace::counter("device bytes", {{"param", 1}});
  trace::complete("copy", "copy", trace::kNoIndex, 0, 10);
  EXPECT_TRUE(trace::collect().empty());
}

TEST(TraceTest, SpansCountersAndAsyncSpansFromSeveralThreadsMakeAValidTrace) {
  trace::start();
  trace::name_thread("main");
  {
    trace::Span outer("compute", "forward", 3);
    outer.arg("tokens", 128);
    { trace::Span inner("stall", "wait"); }
    trace::counter("device bytes", {{"param", 4096}, {"grad", 8192}});
  }
  std::thread worker([] {
    trace::name_thread("copy host->device");
    const int64_t t0 = trace::now_ns();
    trace::complete("copy", "host->device", trace::kNoIndex, t0, t0 + 1000, {{"bytes", 1 << 20}});
    trace::async_span("nvme", "nvme read", 7, t0, t0 + 5000, {{"bytes", 4096}});
    trace::async_span("nvme", "nvme read", 8, t0 + 100, t0 + 3000, {{"bytes", 4096}});
  });
  worker.join();
  trace::stop();
  const std::vector<trace::ThreadEvents> threads = trace::collect();
  const trace::ThreadEvents* main = find_thread(threads, "main");
  const trace::ThreadEvents* copy = find_thread(threads, "copy host->device");
  ASSERT_NE(main, nullptr);
  ASSERT_NE(copy, nullptr);
  ASSERT_EQ(main->events.size(), 3u);  // inner ends first, then the counter, then outer
  EXPECT_EQ(trace::display_name(main->events[2]), "forward 3");
  EXPECT_EQ(main->events[2].num_args, 1);
  EXPECT_EQ(copy->events.size(), 5u);  // one span, two async begin/end pairs

  const nlohmann::json doc = nlohmann::json::parse(trace::to_json(threads, {{"config", "demo"}}));
  EXPECT_EQ(testing::check_trace_json(doc), "");
  EXPECT_EQ(doc["otherData"]["config"], "demo");
  bool saw_counter = false;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "C") saw_counter = e["args"]["grad"] == 8192;
  EXPECT_TRUE(saw_counter);
}

TEST(TraceTest, StartDropsEarlierEvents) {
  trace::start();
  { trace::Span span("compute", "old"); }
  trace::start();
  { trace::Span span("compute", "new"); }
  trace::stop();
  int count = 0;
  for (const auto& t : trace::collect())
    for (const auto& e : t.events) count += std::string(e.name) == "old" ? 100 : 1;
  EXPECT_EQ(count, 1);
}

TEST(TraceTest, TheCheckerCatchesOverlappingSpansAndUnpairedAsyncEvents) {
  const auto doc = [](const std::string& events) {
    return nlohmann::json::parse(
        R"({"traceEvents":[{"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"t"}},)" + events + "]}");
  };
  EXPECT_EQ(testing::check_trace_json(doc(R"({"ph":"X","name":"a","pid":1,"tid":1,"ts":0,"dur":10},
      {"ph":"X","name":"b","pid":1,"tid":1,"ts":2,"dur":3})")), "");
  EXPECT_NE(testing::check_trace_json(doc(R"({"ph":"X","name":"a","pid":1,"tid":1,"ts":0,"dur":10},
      {"ph":"X","name":"b","pid":1,"tid":1,"ts":5,"dur":10})")), "");
  EXPECT_NE(testing::check_trace_json(doc(R"({"ph":"b","cat":"n","id":"0x1","name":"a","pid":1,"tid":1,"ts":0})")), "");
  EXPECT_NE(testing::check_trace_json(doc(R"({"ph":"C","name":"c","pid":1,"tid":1,"ts":0,"args":{}})")), "");
  EXPECT_NE(testing::check_trace_json(doc(R"({"ph":"X","name":"a","pid":1,"tid":2,"ts":0,"dur":1})")), "");
}

TEST(TraceTest, TheJsonStaysValidForAnyNameArgumentOrTime) {
  trace::ThreadEvents t{1, "thread \"quoted\" \xff", {}};
  trace::Event e;
  e.phase = 'X';
  e.category = "compute";
  e.name = "forward";
  e.ts_ns = -1500;  // a clock read that raced start()
  e.dur_ns = 10;
  e.args[0] = {"bytes", std::numeric_limits<double>::quiet_NaN()};
  e.args[1] = {"tier", 1};
  e.args[2] = {nullptr, 2};
  e.num_args = 3;
  t.events.push_back(e);
  const nlohmann::json doc = nlohmann::json::parse(trace::to_json({t}, {{"run_dir", "/tmp/bad\xff"}}));
  EXPECT_EQ(testing::check_trace_json(doc), "");
  for (const auto& ev : doc["traceEvents"]) {
    if (ev["ph"] != "X") continue;
    EXPECT_EQ(ev["ts"].get<double>(), 0.0);
    EXPECT_EQ(ev["args"].size(), 1u);  // the NaN and the keyless argument are left out
    EXPECT_EQ(ev["args"]["tier"], 1);
  }
}

TEST(TraceTest, NamingAThreadCostsNoBufferUntilItRecords) {
  trace::start();
  std::thread quiet([] { trace::name_thread("quiet"); });
  quiet.join();
  std::thread busy([] {
    trace::name_thread("busy");
    trace::Span span("compute", "forward");
  });
  busy.join();
  trace::stop();
  std::vector<std::string> names;
  for (const auto& t : trace::collect()) names.push_back(t.name);
  EXPECT_EQ(std::count(names.begin(), names.end(), "quiet"), 0);
  EXPECT_EQ(std::count(names.begin(), names.end(), "busy"), 1);
}

// A Track is a track of its own, written from any thread (what a device ran, timed there): its
// spans appear under its name, not the recording thread's, only while tracing is on, and stay
// after the Track is gone until the next start().
TEST(TraceTest, ATrackCollectsSpansFromAnyThreadUnderItsName) {
  trace::start();
  std::optional<trace::Track> track(std::in_place, "device lane");
  track->complete("compute", "forward", 3, 100, 250);
  std::thread other([&] { track->complete("copy", "up", trace::kNoIndex, 300, 200); });
  other.join();
  trace::stop();
  track->complete("compute", "late", trace::kNoIndex, 400, 500);  // tracing is off
  track.reset();
  std::vector<trace::Event> spans;
  for (const trace::ThreadEvents& t : trace::collect())
    if (t.name == "device lane") spans = t.events;
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_STREQ(spans[0].name, "forward");
  EXPECT_EQ(spans[0].index, 3);
  EXPECT_EQ(spans[0].ts_ns, 100);
  EXPECT_EQ(spans[0].dur_ns, 150);
  EXPECT_STREQ(spans[1].name, "up");
  EXPECT_EQ(spans[1].dur_ns, 0) << "an end before the start is an empty span";
}

}  // namespace
}  // namespace strata
