// strata bench machine: measures what the planner needs on this machine and writes a hardware
// profile (the measuring lives in train/machine_bench.cpp, which the tests link too).
#include "tools/strata/bench_machine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tools/strata/commands.h"
#include "train/hardware_profile.h"
#include "train/machine_bench.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench machine [CONFIG.yaml] [key=value ...] [--out FILE] [--save]
                            [--device cpu|cuda] [--dir DIR] [--quick] [--widths W,W,...|none]

Measures on this machine the rates `strata plan` and `strata train` predict a step with, each
printed beside a reference measured in the same run:
  compute       (cpu only; on cuda the profile keeps hardware.gpu_tflops's default)
                FLOP/s the backend's ops reach on one micro-batch of the config's model
                (forward and backward with recompute, FLOPs as the planner counts them), and
                the share of a copy stream's work that hides behind that compute (copy_overlap:
                near 0 on the cpu backend, whose copies take the cores compute uses)
  compute@W     (cpu only) the same at each width W of --widths: one Llama-shaped decoder layer
                of hidden size W (heads of 64, MLP 3.5 W wide) and a head over 8192 tokens,
                2 x 256 tokens. A CPU's GEMMs speed up with their matrices, so plans of other
                models take the rate at their own hidden size from this table
                (hardware.cpu_tflops_by_width), interpolated between the widths around it.
                Default widths: 128,512,2048 with --quick, else 128,256,512,1024,2048,4096
  h2d, d2h      host<->device copies through the device's copy streams, each way alone and
  both          both at once (on the cpu backend: memcpys on stream threads), and what each
                small copy costs beyond its bytes (copy_latency)
  cpu_adam      the SIMD AdamW on all cores (and the cpu backend's device-tier AdamW)
  disk          O_DIRECT write and read through the IoEngine in DIR, as the nvme tier uses it
  memcpy        a STREAM-like copy on all threads: the bound the copies are compared with
The model and micro-batch come from CONFIG.yaml and key=value as in `strata train` (default:
the embedded demo run). --out FILE writes the profile (hardware.* keys with units) that
`strata plan --hardware FILE` and `strata train --hardware FILE` read; key=value on their
command line still wins. --save also keeps it as this machine's profile for the device,
~/.cache/strata/machine-<cpu|cuda>.yaml ($XDG_CACHE_HOME/strata or $STRATA_CACHE_DIR instead
when set), which strata plan, strata train and strata profile then use by default for a run on
that device (their --hardware FILE, or --hardware builtin for the built-in H200 rates, says
otherwise; they name the rates they used). --dir DIR: where the nvme tier would live (default: the current
directory; `--dir none` skips the disk). --quick: small sizes and fewer repeats (about 15 s
here, noisier); the full run takes about a minute on 2 cores.
)";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata bench machine: error: %s (see strata bench machine --help)\n", msg.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench machine: error: %s\n", st.message().c_str());
  return 1;
}

}  // namespace

int bench_machine_command(const std::vector<std::string>& args) {
  std::string out, config_path, dir = ".";
  std::vector<std::string> overrides;
  MachineBenchOptions o;
  bool save = false;
  std::string widths;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--quick") {
      o.quick = true;
      continue;
    }
    if (a == "--save") {
      save = true;
      continue;
    }
    if (a == "--out" || a == "--device" || a == "--dir" || a == "--widths") {
      if (i + 1 >= args.size()) return usage_error("option '" + a + "' needs a value");
      (a == "--out" ? out : a == "--device" ? o.device : a == "--dir" ? dir : widths) = args[++i];
      continue;
    }
    if (a.find('=') != std::string::npos && a[0] != '-') {
      overrides.push_back(a);
    } else if (config_path.empty() && !a.empty() && a[0] != '-') {
      config_path = a;
    } else {
      return usage_error("unexpected argument '" + a + "'");
    }
  }
  if (o.device != "cpu" && o.device != "cuda") return usage_error("--device must be cpu or cuda");
  o.disk_dir = dir == "none" ? "" : dir;
  if (widths.empty()) {
    o.widths = default_probe_widths(o.quick);
  } else if (widths != "none") {
    size_t at = 0;
    while (at <= widths.size()) {
      const size_t comma = std::min(widths.find(',', at), widths.size());
      const std::string item = widths.substr(at, comma - at);
      char* end = nullptr;
      const long long w = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || w < 64 || w > 16384 || w % 64 != 0)
        return usage_error("--widths: expected hidden sizes that are multiples of 64 from 64 to 16384, separated by "
                           "commas (or none), got '" + item + "'");
      o.widths.push_back(w);
      at = comma + 1;
    }
  }
  Result<Config> config = load_train_config(config_path, overrides);
  if (!config.ok()) return fail(config.status());
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) return fail(tc.status());
  Result<model::ModelConfig> mc = resolve_model_config(*tc);
  if (!mc.ok()) return fail(mc.status());
  o.model = *mc;
  o.micro_batch = tc->micro_batch;
  o.seq_len = tc->seq_len;
  o.keep_activations = tc->keep_activations == "true";
  std::printf("machine benchmark: %s backend, compute on %lld x %lld tokens of a %lld-layer model, hidden %lld%s\n",
              o.device.c_str(), static_cast<long long>(o.micro_batch), static_cast<long long>(o.seq_len),
              static_cast<long long>(mc->num_hidden_layers), static_cast<long long>(mc->hidden_size),
              o.quick ? " (quick)" : "");
  std::fflush(stdout);
  Result<MachineProfile> p = bench_machine(o);
  if (!p.ok()) return fail(p.status());
  std::printf("\n%-13s %12s %-9s   %12s  %s\n", "rate", "measured", "unit", "reference", "(what the reference is)");
  for (const MachineFigure& f : p->figures)
    std::printf("%-13s %12.4g %-9s   %12.4g  (%s)\n", f.name.c_str(), f.value, f.unit.c_str(), f.reference_value,
                f.reference.c_str());
  const std::string yaml = hardware_yaml(*p);
  if (out.empty() && !save) {
    std::printf("\n%s", yaml.c_str());
    return 0;
  }
  auto write = [&](const std::string& path) -> Status {
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec) return Status::IOError("cannot create " + parent.string() + " for the hardware profile: " + ec.message());
    std::ofstream f(path, std::ios::trunc);
    f << yaml;
    f.close();
    if (!f) return Status::IOError("cannot write the hardware profile " + path);
    return Status::OK();
  };
  if (!out.empty()) {
    if (Status st = write(out); !st.ok()) return fail(st);
    std::printf("\nwrote %s (strata plan --hardware %s)\n", out.c_str(), out.c_str());
  }
  if (save) {
    const std::string saved = saved_profile_path(o.device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu);
    if (saved.empty())
      return fail(Status::InvalidArgument("--save: no place to keep the profile (STRATA_CACHE_DIR is empty, or "
                                          "neither XDG_CACHE_HOME nor HOME is set); use --out FILE"));
    if (Status st = write(saved); !st.ok()) return fail(st);
    std::printf("\nsaved as this machine's %s profile: %s (strata plan, train and profile use it for %s runs; "
                "--hardware builtin ignores it)\n", o.device.c_str(), saved.c_str(), o.device.c_str());
  }
  return 0;
}

}  // namespace strata::tools
