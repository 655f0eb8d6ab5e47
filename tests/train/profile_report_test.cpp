// The profile report from a hand-made trace: the phases partition the step, stalls hide the
// transfers they overlap, counters give the peaks, and the text and JSON keep their shape.
#include "train/profile_report.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

trace::Event span(const char* cat, const char* name, int64_t index, int64_t ts_us, int64_t dur_us,
                  std::initializer_list<trace::Arg> args = {}) {
  trace::Event e;
  e.phase = 'X';
  e.category = cat;
  e.name = name;
  e.index = index;
  e.ts_ns = ts_us * 1000;
  e.dur_ns = dur_us * 1000;
  for (const trace::Arg& a : args) e.args[e.num_args++] = a;
  return e;
}

trace::Event counter(const char* name, int64_t ts_us, std::initializer_list<trace::Arg> args) {
  trace::Event e;
  e.phase = 'C';
  e.category = "memory";
  e.name = name;
  e.ts_ns = ts_us * 1000;
  for (const trace::Arg& a : args) e.args[e.num_args++] = a;
  return e;
}

// Two steps of 1000 us each. Step 1: data 50, forward 300 (a 100 us stall for a copy inside),
// backward 400, optimizer 200, the rest (50) the loop's own. Step 2 the same, without the stall.
ProfileInput two_steps(Plan* plan) {
  trace::ThreadEvents training{1, "training", {}};
  for (int s = 0; s < 2; ++s) {
    const int64_t t = s * 1000;
    training.events.push_back(span("step", "step", s + 1, t, 1000));
    training.events.push_back(span("data", "data", trace::kNoIndex, t, 50));
    training.events.push_back(span("step", "micro-batch", 0, t + 50, 700));
    training.events.push_back(span("compute", "forward", 0, t + 50, 300));
    if (s == 0) training.events.push_back(span("stall", "wait for copy", trace::kNoIndex, t + 60, 100));
    training.events.push_back(span("compute", "backward", 0, t + 350, 400));
    training.events.push_back(span("optimizer", "adamw group", 0, t + 750, 200, {{"tier", 1}}));
  }
  trace::ThreadEvents copies{2, "copy host->device", {}};
  // 200 us of copying: half of it while the training thread stalled.
  copies.events.push_back(span("copy", "copy", trace::kNoIndex, 10, 200, {{"bytes", 4096}}));
  copies.events.push_back(span("copy", "copy", trace::kNoIndex, 1100, 50, {{"bytes", 4096}}));
  trace::ThreadEvents memory{3, "thread 3", {}};
  memory.events.push_back(counter("device bytes", 0, {{"param", 100}, {"grad", 50}}));
  memory.events.push_back(counter("device bytes", 500, {{"param", 300}, {"grad", 50}}));
  memory.events.push_back(counter("device bytes", 900, {{"param", 100}, {"grad", 250}}));
  ProfileInput in;
  in.threads = {training, copies, memory};
  plan->fits = true;
  plan->device.param = 300;
  plan->h2d_bytes = 4096;
  plan->compute_s = 700e-6;
  plan->step_s = 800e-6;
  plan->bottleneck = "compute";
  in.plan = plan;
  return in;
}

double phase(const ProfileReport& r, const std::string& name) {
  for (const auto& [p, s] : r.phases)
    if (p == name) return s;
  return -1;
}

TEST(ProfileReportTest, PhasesPartitionTheStepAndStallsAreTakenOutOfCompute) {
  Plan plan;
  const ProfileReport r = analyze_profile(two_steps(&plan));
  EXPECT_EQ(r.steps, 2);
  EXPECT_NEAR(r.step_s, 1000e-6, 1e-12);
  double sum = 0;
  for (const auto& [p, s] : r.phases) sum += s;
  EXPECT_NEAR(sum, r.step_s, 1e-12);
  EXPECT_NEAR(phase(r, "forward"), 250e-6, 1e-12);  // (200 + 300) / 2
  EXPECT_NEAR(phase(r, "memory stalls"), 50e-6, 1e-12);
  EXPECT_NEAR(phase(r, "backward"), 400e-6, 1e-12);
  EXPECT_NEAR(phase(r, "optimizer"), 200e-6, 1e-12);
  EXPECT_NEAR(phase(r, "data"), 50e-6, 1e-12);
  EXPECT_NEAR(phase(r, "other"), 50e-6, 1e-12);
  ASSERT_EQ(r.stalls.size(), 1u);
  EXPECT_EQ(r.stalls[0].first, "wait for copy");
}

// Ops queued on a compute stream: the host launches in a few us and waits for the stream at the
// loss and in the optimizer step. The waits are split by the phases the stream's track shows.
TEST(ProfileReportTest, WaitsForTheComputeStreamAreTheComputeItRan) {
  trace::ThreadEvents training{1, "training", {}};
  training.events.push_back(span("step", "step", 1, 0, 1000));
  training.events.push_back(span("compute", "forward", 0, 0, 10));
  training.events.push_back(span("compute", "head", trace::kNoIndex, 10, 390));
  training.events.push_back(span("wait", "compute stream", trace::kNoIndex, 20, 370));  // the loss read-back
  training.events.push_back(span("compute", "backward", 0, 400, 10));
  training.events.push_back(span("step", "optimizer step", trace::kNoIndex, 410, 590));
  training.events.push_back(span("wait", "compute stream", trace::kNoIndex, 410, 400));  // drain before AdamW
  trace::ThreadEvents stream{2, "compute stream", {}};
  stream.events.push_back(span("compute", "forward", 0, 5, 300));
  stream.events.push_back(span("compute", "head", trace::kNoIndex, 305, 85));
  stream.events.push_back(span("compute", "backward", 0, 390, 420));
  ProfileInput in;
  in.threads = {training, stream};
  Plan plan;
  plan.fits = true;
  plan.phases.micro_batches = 1;
  in.plan = &plan;
  const ProfileReport r = analyze_profile(in);
  double sum = 0;
  for (const auto& [p, s] : r.phases) sum += s;
  EXPECT_NEAR(sum, r.step_s, 1e-12);
  // forward: 10 launching + the first wait's [20, 305); head: its own 20 outside the wait +
  // [305, 390); backward: 10 launching + the second wait's [410, 810).
  EXPECT_NEAR(phase(r, "forward"), 295e-6, 1e-12);
  EXPECT_NEAR(phase(r, "head (LM head + loss)"), 105e-6, 1e-12);
  EXPECT_NEAR(phase(r, "backward"), 410e-6, 1e-12);
  EXPECT_NEAR(phase(r, "optimizer"), 190e-6, 1e-12);
  ASSERT_GE(r.phase_terms.size(), 4u);
  EXPECT_EQ(r.phase_terms[0].name, "forward (with the head)");
  EXPECT_NEAR(r.phase_terms[0].measured_s, 385e-6, 1e-12);  // the stream's forward and head
  EXPECT_NEAR(r.phase_terms[1].measured_s, 420e-6, 1e-12);  // its backward
  EXPECT_NEAR(r.phase_terms[3].measured_s, 190e-6, 1e-12);  // the optimizer step less its wait
}

TEST(ProfileReportTest, TransfersOverlappingStallsAreNotHidden) {
  Plan plan;
  const ProfileReport r = analyze_profile(two_steps(&plan));
  ASSERT_EQ(r.traffic.size(), 4u);
  const auto& h2d = r.traffic[0];
  EXPECT_EQ(h2d.name, "host->device");
  EXPECT_EQ(h2d.bytes, 4096u);  // 8192 over two steps
  EXPECT_EQ(h2d.planned_bytes, 4096u);
  EXPECT_NEAR(h2d.busy_s, 125e-6, 1e-12);
  // Of 250 us of copying, the 100 us of the stall [60, 160) were waited through.
  EXPECT_NEAR(h2d.hidden_share, 1.0 - 100.0 / 250.0, 1e-9);
}

// ZeRO-1 and 2's updated-weight gathers run on the communication stream beside the optimizer's
// group updates: hidden while the training thread updates a group (as while the compute stream
// runs an op) but not while it stalls there, and exposed after the last update, when the step
// waits for them.
TEST(ProfileReportTest, UpdatedWeightGathersBesideTheOptimizerAreHidden) {
  Plan plan;
  ProfileInput in = two_steps(&plan);
  in.compute_stream = "compute stream";
  trace::ThreadEvents stream{5, "compute stream", {}};
  stream.events.push_back(span("compute", "forward", 0, 50, 300));
  stream.events.push_back(span("compute", "backward", 0, 350, 400));
  trace::ThreadEvents comm{6, "communication", {}};
  // Step 1's AdamW runs over [750, 950), stalled over [780, 820) for a chunk a gather still
  // holds: of 100 us of gather from 800, the 20 us in the stall are exposed, and the 30 us
  // after the updates.
  in.threads[0].events.push_back(span("stall", "wait for copy", trace::kNoIndex, 780, 40));
  comm.events.push_back(span("communication", "gathering the updated weights", 0, 800, 100));
  comm.events.push_back(span("communication", "gathering the updated weights", 1, 960, 30));
  in.threads.push_back(stream);
  in.threads.push_back(comm);
  const ProfileReport r = analyze_profile(in);
  ASSERT_TRUE(r.communication.traced);
  EXPECT_NEAR(r.communication.busy_s, 130.0 / 2 * 1e-6, 1e-12);
  EXPECT_NEAR(r.communication.hidden_share, 1.0 - (20.0 + 30.0) / 130.0, 1e-9);
}

// Collectives: the sums at handover on a thread of their own (120 us a step) are hidden but for
// the 40 us the training thread waited for them after AdamW in step 1; the training thread's own
// (30 us in step 2) are not hidden at all, and are a phase of the step of their own. Spans
// outside the traced steps are left out.
TEST(ProfileReportTest, CollectivesTheTrainingThreadWaitsForAreNotHidden) {
  Plan plan;
  ProfileInput in = two_steps(&plan);
  plan.comm_s = 150e-6;
  plan.comm_hidden_s = 100e-6;
  in.threads[0].events.push_back(span("optimizer", "wait for gradient sums", trace::kNoIndex, 950, 40));
  in.threads[0].events.push_back(span("communication", "updated weight gather", 0, 1960, 30));
  trace::ThreadEvents sums{4, "thread 4", {}};
  sums.events.push_back(span("communication", "gradient all-reduce", 1, 870, 120));
  sums.events.push_back(span("communication", "gradient all-reduce", 1, 1620, 120));
  sums.events.push_back(span("communication", "gradient all-reduce", 1, 2500, 120));  // after the steps
  in.threads.push_back(sums);
  const ProfileReport r = analyze_profile(in);
  ASSERT_TRUE(r.communication.traced);
  EXPECT_NEAR(r.communication.busy_s, (120.0 + 120.0 + 30.0) / 2 * 1e-6, 1e-12);
  EXPECT_NEAR(r.communication.hidden_share, 1.0 - (40.0 + 30.0) / 270.0, 1e-9);
  EXPECT_NEAR(r.communication.planned_s, 150e-6, 1e-12);
  EXPECT_NEAR(r.communication.planned_hidden_share, 100.0 / 150.0, 1e-9);
  EXPECT_NEAR(phase(r, "communication"), 15e-6, 1e-12);  // 30 us over two steps
  EXPECT_NE(format_profile_report(r).find("hidden behind compute: planned 67%, measured 74%"), std::string::npos)
      << format_profile_report(r);
  EXPECT_NEAR(profile_report_json(r)["communication"]["hidden_share"].get<double>(), r.communication.hidden_share, 1e-12);
  // One process: no collective traced, no line.
  Plan alone;
  const ProfileReport one = analyze_profile(two_steps(&alone));
  EXPECT_FALSE(one.communication.traced);
  EXPECT_EQ(format_profile_report(one).find("collectives between the ranks"), std::string::npos);
}

TEST(ProfileReportTest, CountersGivePeaksPerKindAndOfTheTotal) {
  Plan plan;
  const ProfileReport r = analyze_profile(two_steps(&plan));
  ASSERT_FALSE(r.memory.empty());
  EXPECT_EQ(r.memory[0].tier, "device");
  EXPECT_EQ(r.memory[0].peak.param, 300u);
  EXPECT_EQ(r.memory[0].peak.grad, 250u);
  EXPECT_EQ(r.memory[0].peak_total, 350u);  // never 300 + 250 at once
  EXPECT_EQ(r.memory[0].planned.param, 300u);
}

TEST(ProfileReportTest, TextAndJsonKeepTheirShape) {
  Plan plan;
  const ProfileReport r = analyze_profile(two_steps(&plan));
  const std::string text = format_profile_report(r);
  size_t at = 0;
  for (const char* heading : {"profile of 2 steps", "memory per tier", "traffic per step", "critical path",
                              "predicted -> measured", "notes:"}) {
    const size_t found = text.find(heading, at);
    ASSERT_NE(found, std::string::npos) << "'" << heading << "' missing or out of order in:\n" << text;
    at = found;
  }
  const nlohmann::json j = profile_report_json(r);
  for (const char* key : {"steps", "step_s", "median_step_s", "memory", "traffic", "phases", "stalls", "tracks",
                          "predicted", "predicted_bound", "notes"})
    EXPECT_TRUE(j.contains(key)) << key;
  ASSERT_EQ(j["predicted"].size(), 6u);
  EXPECT_EQ(j["predicted"][5]["term"], "step");
  EXPECT_NEAR(j["predicted"][5]["measured_s"].get<double>(), 1000e-6, 1e-12);
  EXPECT_NEAR(j["predicted"][3]["measured_s"].get<double>(), 200e-6, 1e-12);  // host-tier AdamW
}

}  // namespace
}  // namespace strata
