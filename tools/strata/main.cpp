// strata: the command-line entry point. Each command lives in its own file (train.cpp, ...).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/cpu_device.h"
#include "core/log.h"
#include "kernels/linear.h"
#include "tools/strata/ckpt_command.h"
#include "tools/strata/commands.h"

namespace {

constexpr const char* kUsage = R"(strata — train large language models on GPUs with little memory

Usage: strata <command> [options]

Commands:
  train [CONFIG.yaml] [key=value ...]   train a model; without CONFIG, the embedded default run
  plan [CONFIG.yaml] [key=value ...]    memory per tier, traffic and predicted step time, no training
  profile [CONFIG.yaml] [key=value ...] a few traced steps: Perfetto trace, report against the plan, SVGs
  plot RUN_DIR [--out DIR]              SVG charts of a run's metrics (loss, throughput, memory, stalls)
  convert --from SRC --to DST           Hugging Face model or strata checkpoint -> Hugging Face directory
  generate --from SRC --prompt TEXT     sample text from a run, checkpoint or Hugging Face model (KV cache)
  data tokenize --tokenizer DIR ...     text, JSONL or chat JSONL -> llm.c token shards
  ckpt inspect|verify DIR               summarise a checkpoint, or recompute its checksums
  bench machine|io|adam|train-gpu|...   the planner's rates, the disk, the CPU AdamW, GPU training, tracing, queueing
  version                               print the version

Run 'strata <command> --help' for a command's options.
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  strata::init_logging({});  // one log format for every command; train sets its own level
  if (auto gemm = strata::kernels::parse_deterministic_gemm(std::getenv("STRATA_DETERMINISTIC_GEMM")); !gemm.ok()) {
    std::fprintf(stderr, "strata: error: %s\n", gemm.status().message().c_str());
    return 2;
  }
  if (auto chaos = strata::stream_chaos_from_env(); !chaos.ok()) {
    std::fprintf(stderr, "strata: error: %s\n", chaos.status().message().c_str());
    return 2;
  } else if (*chaos != 0) {
    LOG_WARN("chaos mode (STRATA_STREAM_CHAOS={}): the CPU backend delays every stream task at random and "
             "poisons released device slots; a test setting, slow",
             *chaos);
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "train") return strata::tools::train_command(args);
  if (command == "bench") return strata::tools::bench_command(args);
  if (command == "convert") return strata::tools::convert_command(args);
  if (command == "plan") return strata::tools::plan_command(args);
  if (command == "profile") return strata::tools::profile_command(args);
  if (command == "plot") return strata::tools::plot_command(args);
  if (command == "data") return strata::tools::data_command(args);
  if (command == "generate") return strata::tools::generate_command(args);
  if (command == "ckpt") return strata::tools::ckpt_command(args);
  if (command == "version" || command == "--version") {
    std::printf("strata %s\n", strata::tools::kVersion);
    return 0;
  }
  std::fprintf(stderr, "strata: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}
