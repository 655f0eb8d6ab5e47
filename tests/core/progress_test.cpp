// The progress reporter: its lines, the quiet period, rate limiting on a terminal and in a
// log, and concurrent updates, all under an injected clock.
#include "core/progress.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "core/units.h"

namespace strata {
namespace {

using Clock = ProgressOptions::Clock;

// A clock the test moves by hand, and the lines the reporter wrote.
struct Harness {
  Clock::time_point now{};
  std::vector<std::string> writes;

  void advance(double seconds) {
    now += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  ProgressOptions options(bool tty) {
    ProgressOptions o;
    o.tty = tty;
    o.clock = [this] { return now; };
    o.write = [this](std::string_view text) { writes.emplace_back(text); };
    return o;
  }
};

TEST(ProgressTest, LinesShowAmountPercentRateAndEta) {
  EXPECT_EQ(Progress::format_line("loading weights", 256 * kMiB, 1024 * kMiB, 2.0, ProgressUnit::kBytes, ""),
            "loading weights: 256.00 MiB / 1.00 GiB (25%), 128.00 MiB/s, eta 6s");
  EXPECT_EQ(Progress::format_line("tensors", 30, 120, 10.0, ProgressUnit::kItems, "tensors"),
            "tensors: 30 / 120 tensors (25%), 3 tensors/s, eta 30s");
  EXPECT_EQ(Progress::format_line("tokens", 2'500'000, 0, 2.0, ProgressUnit::kItems, "tokens"),
            "tokens: 2500000 tokens, 1.25M tokens/s");
  // Nothing done yet: no rate to predict from, so no eta.
  EXPECT_EQ(Progress::format_line("saving", 0, kMiB, 3.0, ProgressUnit::kBytes, ""),
            "saving: 0 B / 1.00 MiB (0%), 0 B/s");
  EXPECT_EQ(Progress::format_summary("verifying", 3 * kMiB, 128.0, ProgressUnit::kBytes, ""),
            "verifying: 3.00 MiB in 2m08s, 24.00 KiB/s");
}

TEST(ProgressTest, FastOperationPrintsNothing) {
  for (bool tty : {false, true}) {
    Harness h;
    {
      Progress p("fast", 100, h.options(tty));
      for (int i = 0; i < 100; ++i) {
        h.advance(0.019);
        p.add(1);
      }
    }  // 1.9 s in all
    EXPECT_TRUE(h.writes.empty()) << (tty ? "tty: " : "plain: ") << h.writes[0];
  }
}

TEST(ProgressTest, TerminalRewritesOneLineAtMostFourTimesASecond) {
  Harness h;
  Progress p("load", 1000, h.options(/*tty=*/true));
  for (int i = 0; i < 1000; ++i) {  // 10 s, an update every 10 ms
    h.advance(0.01);
    p.add(1);
  }
  // Lines from 2 s on, a quarter of a second apart: 33 of them, not 800.
  ASSERT_GE(h.writes.size(), 30u);
  EXPECT_LE(h.writes.size(), 33u);
  for (const std::string& w : h.writes) {
    EXPECT_EQ(w.front(), '\r') << w;
    EXPECT_EQ(w.find('\n'), std::string::npos) << w;
  }
  EXPECT_NE(h.writes.front().find("load: 200 B / 1000 B (20%)"), std::string::npos) << h.writes.front();
  const size_t lines = h.writes.size();
  p.finish();
  ASSERT_EQ(h.writes.size(), lines + 1);
  // The summary ends the line, blanking what is left of the longer progress line.
  EXPECT_EQ(h.writes.back().rfind("\rload: 1000 B in 10s, 100 B/s ", 0), 0u) << h.writes.back();
  EXPECT_EQ(h.writes.back().back(), '\n');
  p.finish();  // once
  EXPECT_EQ(h.writes.size(), lines + 1);
}

TEST(ProgressTest, TerminalLinePadsOverALongerPreviousOne) {
  Harness h;
  ProgressOptions o = h.options(/*tty=*/true);
  std::string note = "a long note that makes the line long";
  o.note = [&note] { return note; };
  Progress p("x", 10, o);
  h.advance(3);
  p.set(5);
  note = "";
  h.advance(1);
  p.set(6);
  ASSERT_EQ(h.writes.size(), 2u);
  EXPECT_EQ(h.writes[0], "\rx: 5 B / 10 B (50%), 1 B/s, eta 3s, a long note that makes the line long");
  EXPECT_EQ(h.writes[1].size(), h.writes[0].size()) << "the shorter line must blank the rest of the longer one";
  EXPECT_EQ(h.writes[1].rfind("\rx: 6 B / 10 B (60%)", 0), 0u) << h.writes[1];
}

TEST(ProgressTest, PlainLinesComeEachTenthOrEveryTenSecondsAndAtMostOneASecond) {
  {  // Steady work over 100 s: a line per tenth (every 10 s), not one per update.
    Harness h;
    Progress p("tokenize", 1000, h.options(/*tty=*/false));
    for (int i = 0; i < 1000; ++i) {
      h.advance(0.1);
      p.add(1);
    }
    p.finish();
    ASSERT_GE(h.writes.size(), 10u);
    EXPECT_LE(h.writes.size(), 12u);
    for (const std::string& w : h.writes) {
      EXPECT_EQ(w.find('\r'), std::string::npos) << w;
      EXPECT_EQ(w.back(), '\n') << w;
    }
    EXPECT_EQ(h.writes.back(), "tokenize: 1000 B in 1m40s, 10 B/s\n");
  }
  {  // The whole job in 3 s: tenths pass every 0.3 s but lines stay a second apart.
    Harness h;
    Progress p("quick", 100, h.options(/*tty=*/false));
    for (int i = 0; i < 100; ++i) {
      h.advance(0.03);
      p.add(1);
    }
    EXPECT_LE(h.writes.size(), 2u);  // at 2 s, maybe 3 s
    EXPECT_GE(h.writes.size(), 1u);
  }
  {  // Stalled work: a line every 10 s even though no tenth passes.
    Harness h;
    Progress p("stalled", 1000, h.options(/*tty=*/false));
    for (int i = 0; i < 60; ++i) {
      h.advance(1);
      p.add(0);
    }
    EXPECT_EQ(h.writes.size(), 6u);  // at 2, 12, 22, 32, 42, 52 s
  }
}

TEST(ProgressTest, LongOperationWithoutUpdatesStillEndsWithASummary) {
  Harness h;
  {
    Progress p("save", 0, h.options(/*tty=*/false));
    h.advance(5);
    p.add(10 * kMiB);  // the first update already past the quiet period prints a line
  }
  ASSERT_EQ(h.writes.size(), 2u);
  EXPECT_EQ(h.writes[0], "save: 10.00 MiB, 2.00 MiB/s\n");
  EXPECT_EQ(h.writes[1], "save: 10.00 MiB in 5s, 2.00 MiB/s\n");
}

TEST(ProgressTest, DisabledPrintsNothing) {
  Harness h;
  ProgressOptions o = h.options(/*tty=*/false);
  o.enabled = false;
  {
    Progress p("quiet", 10, o);
    h.advance(100);
    p.add(10);
  }
  EXPECT_TRUE(h.writes.empty());
}

TEST(ProgressTest, ConcurrentUpdatesAreAllCounted) {
  std::atomic<int64_t> fake_ns{0};
  std::vector<std::string> writes;  // the reporter serialises its writes
  ProgressOptions o;
  o.tty = false;
  o.clock = [&fake_ns] { return Clock::time_point(std::chrono::nanoseconds(fake_ns.fetch_add(1000))); };
  o.write = [&writes](std::string_view text) { writes.emplace_back(text); };
  constexpr int kThreads = 4, kAdds = 25000;
  {
    Progress p("parallel", kThreads * kAdds, o);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&p] {
        for (int i = 0; i < kAdds; ++i) p.add(1);
      });
    }
    for (auto& t : threads) t.join();
  }
  // 100k updates over ~0.1 s of the fake clock: a fast operation, silent.
  EXPECT_TRUE(writes.empty());

  fake_ns = 0;
  writes.clear();
  o.clock = [&fake_ns] { return Clock::time_point(std::chrono::nanoseconds(fake_ns.fetch_add(100'000))); };
  {
    Progress p("parallel", kThreads * kAdds, o);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&p] {
        for (int i = 0; i < kAdds; ++i) p.add(1);
      });
    }
    for (auto& t : threads) t.join();
  }
  ASSERT_FALSE(writes.empty());
  EXPECT_LE(writes.size(), 15u);  // ~10 s of the fake clock: tenths, at least a second apart
  EXPECT_EQ(writes.back().rfind("parallel: 97.66 KiB in", 0), 0u) << writes.back();
}

TEST(ProgressTest, DurationsRoundToWholeSeconds) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(44.6), "45s");
  EXPECT_EQ(format_duration(725), "12m05s");
  EXPECT_EQ(format_duration(3 * 3600 + 7 * 60), "3h07m");
}

}  // namespace
}  // namespace strata
