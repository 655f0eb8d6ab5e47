// strata profile [CONFIG.yaml] [key=value ...]: a few steps of the real training with tracing
// on, written out as a Perfetto trace, a report against the plan, and pictures.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "core/check.h"
#include "core/config.h"
#include "core/log.h"
#include "core/trace.h"
#include "parallel/launch.h"
#include "tools/strata/commands.h"
#include "tools/strata/profile_pictures.h"
#include "train/hardware_profile.h"
#include "train/machine_bench.h"
#include "train/profile_report.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

constexpr const char* kProfileUsage = R"(Usage: strata profile [CONFIG.yaml] [key=value ...] [--steps N] [--warmup N] [--out DIR]
                      [--hardware FILE]

Answers "where does my step go?": runs the training of CONFIG (the same file and keys as
`strata train`; without them the embedded demo) for --warmup steps (default 2: buffers,
caches and the first prefetches settle), then --steps more (default 3) with tracing on, and
writes into --out (default RUN_DIR/profile):

  trace.json    a Perfetto / Chrome trace (open it in https://ui.perfetto.dev): the training
                thread's forward, recompute and backward per layer, the optimizer per group,
                stalls, each copy stream's copies and the nvme requests with their bytes, the
                checkpoint writer, the communication stream's collectives, and counters of
                bytes in use per tier and kind of state
  report.txt    memory per tier and kind, planned against peak measured; bytes moved per step
                in each direction, planned against measured, with the share of transfer time
                hidden behind work; the collectives between the ranks and the share of their
                time the compute hid; the step's time by phase (its critical path); the plan's
                predicted step time and terms against the measured ones
  report.json   the same numbers for scripts
  timeline.svg  a typical traced step, one lane per thread, stream and the nvme queue
  memory.svg    memory per tier, and each tier by kind of state, over that step

With several ranks (torchrun's variables) each rank profiles itself: rank 0 writes into --out,
rank N into --out/rank-N.

The plan's prediction uses the hardware.* rates: this machine's when `strata bench machine
--save` kept a profile for the device, a file's with --hardware FILE (`strata bench machine --out
FILE`), else the defaults, which describe an H200 box (so a CPU run's prediction is far off). The report is also printed. The run itself is a normal run (its
metrics.jsonl in a new run.dir);
run.export is ignored and nothing is resumed. On the cuda backend the trace shows host time:
the GPU's own kernel and copy times are not traced yet.

Example:
  strata profile model.preset=tiny memory.device=8MiB memory.host=16MiB memory.nvme.size=64MiB
)";

int fail(const Status& st) {
  std::fprintf(stderr, "strata profile: error: %s\n", st.message().c_str());
  return 1;
}

bool parse_count(const std::string& flag, const std::string& text, int64_t min, int64_t* out) {
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size() && v >= min && v <= 100000) {
      *out = v;
      return true;
    }
  } catch (...) {
  }
  std::fprintf(stderr, "strata profile: error: %s needs a whole number >= %lld, not '%s'\n", flag.c_str(),
               static_cast<long long>(min), text.c_str());
  return false;
}

// Starts tracing at the first measured step, stops it after the last, and keeps what the
// report compares with: the plan the engine ran and the run's folder.
class Profiler final : public RunObserver {
 public:
  Profiler(int64_t first, int64_t last) : first_(first), last_(last) {}
  void on_start(const TrainConfig& t, const PagedEngine& engine) override {
    run_dir_ = t.run_dir;
    backend_ = engine.device_name() == "cpu" ? "cpu" : "cuda";
    plan_ = engine.plan();
    plan_input_ = engine.plan_input();
  }
  void on_step_begin(int64_t step) override {
    if (step == first_) trace::start();
  }
  // The last step's own span ends after this: the events are collected once the run is over.
  void on_step_end(const StepMetrics& m) override {
    if (m.step == last_) trace::stop();
  }
  const std::string& run_dir() const { return run_dir_; }
  const std::string& backend() const { return backend_; }
  const std::optional<Plan>& plan() const { return plan_; }
  const std::optional<PlanInput>& plan_input() const { return plan_input_; }

 private:
  int64_t first_, last_;
  std::string run_dir_;
  std::string backend_ = "cpu";
  std::optional<Plan> plan_;
  std::optional<PlanInput> plan_input_;
};

}  // namespace

int profile_command(const std::vector<std::string>& args) {
  std::string config_path, out_dir, hardware;
  std::vector<std::string> overrides;
  int64_t steps = 3, warmup = 2;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const char* flag, std::string* out) {
      const std::string prefix = std::string(flag) + "=";
      if (a == flag) {
        if (i + 1 >= args.size()) {
          std::fprintf(stderr, "strata profile: error: %s needs a value (see strata profile --help)\n", flag);
          return false;
        }
        *out = args[++i];
        return true;
      }
      *out = a.substr(prefix.size());
      return true;
    };
    auto is_flag = [&](const char* flag) { return a == flag || a.rfind(std::string(flag) + "=", 0) == 0; };
    std::string text;
    if (a == "--help" || a == "-h") {
      std::printf("%s", kProfileUsage);
      return 0;
    } else if (is_flag("--steps")) {
      if (!value("--steps", &text) || !parse_count("--steps", text, 1, &steps)) return 2;
    } else if (is_flag("--warmup")) {
      if (!value("--warmup", &text) || !parse_count("--warmup", text, 0, &warmup)) return 2;
    } else if (is_flag("--out")) {
      if (!value("--out", &out_dir)) return 2;
    } else if (is_flag("--hardware")) {
      if (!value("--hardware", &hardware)) return 2;
    } else if (a.find('=') != std::string::npos && a[0] != '-') {
      overrides.push_back(a);
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "strata profile: error: unknown option '%s' (see strata profile --help)\n", a.c_str());
      return 2;
    } else if (config_path.empty()) {
      config_path = a;
    } else {
      std::fprintf(stderr, "strata profile: error: more than one config file given ('%s' and '%s')\n", config_path.c_str(),
                   a.c_str());
      return 2;
    }
  }
  // The hardware profile's keys (--hardware's, else this machine's saved one) go first, so that
  // key=value on the command line still wins.
  {
    Result<std::vector<std::string>> keys = hardware_keys(hardware, config_path, overrides);
    if (!keys.ok()) return fail(keys.status());
    overrides.insert(overrides.begin(), keys->begin(), keys->end());
  }
  Result<Config> config = load_train_config(config_path, overrides);
  if (!config.ok()) return fail(config.status());
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) return fail(tc.status());
  tc->steps = warmup + steps;
  tc->run_export.clear();
  tc->resume.clear();
  // A profile is a new run: it never continues or lands on another run's folder.
  if (!tc->run_dir.empty() && fs::exists(fs::path(tc->run_dir) / "metrics.jsonl"))
    return fail(Status::InvalidArgument(
        fmt::format("run.dir '{}' holds a run already; profile into a new folder (another run.dir, or leave it unset "
                    "for runs/default/version_N)",
                    tc->run_dir)));
  LogOptions lo;
  CHECK(parse_log_level(tc->log_level, &lo.level));
  init_logging(lo);

  Profiler profiler(warmup + 1, warmup + steps);
  Result<TrainSummary> summary = run_training(*tc, config->to_yaml(), &profiler);
  if (!summary.ok()) return fail(summary.status());
  trace::stop();  // when the run stopped early
  std::vector<trace::ThreadEvents> threads = trace::collect();
  if (summary->interrupted || summary->steps_done < warmup + steps || threads.empty())
    return fail(Status::Internal("the run stopped before its traced steps ended; nothing was written"));

  fs::path out = out_dir.empty() ? fs::path(profiler.run_dir()) / "profile" : fs::path(out_dir);
  // Several ranks: each writes its own trace and report, rank 0's into the folder and the
  // others' into rank-N inside it (the run started, so the environment parsed).
  if (Result<parallel::LaunchInfo> launch = parallel::launch_from_env(); launch.ok() && launch->rank > 0)
    out /= "rank-" + std::to_string(launch->rank);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return fail(Status::IOError("cannot create --out '" + out.string() + "': " + ec.message()));

  ProfileInput in;
  in.threads = std::move(threads);
  if (profiler.plan()) {
    in.plan = &*profiler.plan();
    in.plan_input = &*profiler.plan_input();
  }
  in.rates_source = tc->hardware_profile.empty()
                        ? "the hardware.* defaults, an H200 box; measure this machine's with strata bench machine"
                        : tc->hardware_profile;
  in.backend = profiler.backend();
  const ProfileReport report = analyze_profile(in);
  if (report.steps != steps)
    return fail(Status::Internal(fmt::format("the trace holds {} of the {} traced steps; nothing was written",
                                             report.steps, steps)));
  const std::string text = format_profile_report(report);
  const std::vector<std::pair<std::string, std::string>> metadata = {
      {"command", "strata profile"}, {"run_dir", profiler.run_dir()}, {"steps", std::to_string(report.steps)}};
  if (Status st = write_file_atomic((out / "trace.json").string(), trace::to_json(in.threads, metadata)); !st.ok())
    return fail(st);
  if (Status st = write_file_atomic((out / "report.txt").string(), text); !st.ok()) return fail(st);
  if (Status st = write_file_atomic((out / "report.json").string(), profile_report_json(report).dump(2) + "\n"); !st.ok())
    return fail(st);
  int64_t start = 0, end = 0, step = 0;
  std::vector<std::string> written = {"trace.json", "report.txt", "report.json"};
  if (pick_step(in.threads, in.training_thread, &start, &end, &step)) {
    if (Status st = write_file_atomic((out / "timeline.svg").string(), timeline_svg(in.threads, in.training_thread, start, end, step));
        !st.ok())
      return fail(st);
    if (Status st = write_file_atomic((out / "memory.svg").string(), memory_svg(in.threads, start, end, step)); !st.ok())
      return fail(st);
    written.push_back("timeline.svg");
    written.push_back("memory.svg");
  }
  std::printf("%s\n", text.c_str());
  for (const std::string& f : written) std::printf("wrote %s\n", (out / f).string().c_str());
  return 0;
}

}  // namespace strata::tools
