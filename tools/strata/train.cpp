// strata train [CONFIG.yaml] [key=value ...]
#include <cstdio>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/config.h"
#include "core/log.h"
#include "tools/strata/commands.h"
#include "train/hardware_profile.h"
#include "train/machine_bench.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

constexpr const char* kTrainUsage = R"(Usage: strata train [CONFIG.yaml] [key=value ...] [--resume DIR|auto] [--hardware FILE]
                    [--print-config]

Trains a model. CONFIG.yaml holds nested settings (e.g. `optim: {lr: 3e-4}`); key=value
arguments override them (e.g. optim.lr=3e-4 train.steps=50). Without CONFIG.yaml and without a
model (model.from, model.config, model.init or model.preset) the embedded demo runs: a
0.85M-parameter Llama learning Debian's license texts byte by byte, its state paged through
tiny budgets (24 MiB device, 10 MiB host, 64 MiB nvme). Naming a model leaves the settings
below at their defaults: the whole free GPU, 80% of the available host memory, no nvme tier.
--print-config prints the effective configuration and exits without training. The plan
predicts with this machine's hardware.* rates when `strata bench machine --save` kept a profile
for the device; --hardware FILE reads a `strata bench machine --out FILE` profile instead,
--hardware builtin the built-in defaults (key=value on the command line still wins).

Each step prints one line (step, loss, lr, gradient norm, tokens/s, ms/step, memory, RSS
against the planned peak of host memory) and appends the same to RUN_DIR/metrics.jsonl; at
the end the run's goodput (the share of its wall time spent on new steps, and where the rest
went) is printed and appended as {"event": "goodput", ...}. A run whose peak host memory
exceeds what the machine has available is refused before it loads weights. Without run.dir each run gets a new
runs/default/version_N. SIGINT/SIGTERM stop after the current step, write a final checkpoint
and exit 0 (a second signal exits at once). --resume DIR continues from a checkpoint (DIR,
DIR/latest or DIR/step-N) with the data position, optimizer state and schedule restored;
memory budgets may differ from the saved run. --resume auto continues the run in ckpt.dir (the
newest version_N when run.dir is unset), or starts it from step 1 when it left no checkpoint
(a requeued job), keeping the old metrics beside the new.

Exit codes: 0 trained (or stopped by a signal, state saved); 1 an error (the message says
what; a final checkpoint is written first when the state is sound); 2 a bad command line.

Settings:)";

int fail(const Status& st) {
  std::fprintf(stderr, "strata train: error: %s\n", st.message().c_str());
  return 1;
}

}  // namespace

int train_command(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_config = false;
  std::string resume, hardware;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s\n%s", kTrainUsage, train_schema().help_text().c_str());
      return 0;
    } else if (a == "--hardware") {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "strata train: error: --hardware needs a profile file (strata bench machine --out FILE)\n");
        return 2;
      }
      hardware = args[++i];
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--resume" || a.rfind("--resume=", 0) == 0) {
      if (a == "--resume") {
        if (i + 1 >= args.size()) {
          std::fprintf(stderr, "strata train: error: --resume needs a checkpoint directory or 'auto'\n");
          return 2;
        }
        resume = args[++i];
      } else {
        resume = a.substr(9);
      }
    } else if (a.find('=') != std::string::npos) {
      overrides.push_back(a);
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "strata train: error: unknown option '%s' (see strata train --help)\n", a.c_str());
      return 2;
    } else if (config_path.empty()) {
      config_path = a;
    } else {
      std::fprintf(stderr, "strata train: error: more than one config file given ('%s' and '%s')\n",
                   config_path.c_str(), a.c_str());
      return 2;
    }
  }
  // The hardware profile's keys (--hardware's, else this machine's saved one) go first, so that
  // key=value on the command line still wins.
  {
    Result<std::vector<std::string>> keys = hardware_keys(hardware, config_path, overrides);
    if (!keys.ok()) {
      std::fprintf(stderr, "strata %s: error: %s\n", "train", keys.status().message().c_str());
      return 1;
    }
    overrides.insert(overrides.begin(), keys->begin(), keys->end());
  }
  Result<Config> config = load_train_config(config_path, overrides);
  if (!config.ok()) return fail(config.status());
  if (print_config) {
    std::printf("%s\n", config->to_yaml().c_str());
    return 0;
  }
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) return fail(tc.status());
  tc->resume = resume;
  LogOptions lo;
  CHECK(parse_log_level(tc->log_level, &lo.level));
  init_logging(lo);
  Result<TrainSummary> summary = run_training(*tc, config->to_yaml());
  if (!summary.ok()) return fail(summary.status());
  return 0;
}

}  // namespace strata::tools
