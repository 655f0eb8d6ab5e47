// strata bench adam: how close the host AdamW (kernels/adamw_simd.h) comes to the memory
// bandwidth of this machine. In one run it times adamw_step_f32, adamw_step_mixed, the
// compiler-vectorised cpu::adamw_step and a STREAM-style triad that moves as many bytes, all
// on the same OpenMP thread count, and prints the effective bandwidth of each.
#include "tools/strata/bench_adam.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/units.h"
#include "kernels/adamw.h"
#include "kernels/adamw_simd.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/grad_norm.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench adam [--params N] [--threads T]

Times one AdamW step over N parameters (default 256M; K/M/G are powers of 1024) on T OpenMP
threads (default: all), warm-up once then best of 5:
  adamw_step_f32     fp32 param, grad, m, v: 4 arrays read, 3 written = 28 B/param
  adamw_step_mixed   bf16 grad in, fp32 master/m/v, bf16 param out    = 24 B/param
  cpu::adamw_step    the compiler-vectorised fast path, for comparison  = 28 B/param
  clip + f32 + copy  the host tier's bf16-recipe update as three passes: scale the gradients,
                     adamw_step_f32, round the master to the bf16 copy    = 42 B/param
  ..._clipped        the same fused into one pass (adamw_step_f32_clipped) = 30 B/param
  quantize_weight_e4m3  the fp8 recipe's compute copy in 128 x 128 blocks, with AVX2 where the
                     CPU has it and on plain code (the copy's pass; its amax pass rereads) = 5 B/param
  triad              a[i] = b[i] + s * c[i] over buffers that move 28 B/param (12 B/element)
and prints parameters/s, GB/s (10^9 bytes/s, bytes the kernel must move) and the ratio to the
triad. As in STREAM, the triad's GB/s leave out the read for ownership of the array it writes;
AdamW writes only arrays it has just read, so a ratio above 1 is possible. Needs about 28 B/param of memory (7 GiB for 256M); STRATA_SIMD caps the SIMD level.
)";

constexpr int kRuns = 5;

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata bench adam: error: %s (see strata bench adam --help)\n", msg.c_str());
  return 2;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A page-aligned array, first touched by the threads that will use it (memory placement follows
// the OpenMP static schedule). Null when the allocation fails.
template <typename T>
std::unique_ptr<T[], FreeDeleter> make_array(int64_t n, T (*init)(int64_t)) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 4095) / 4096 * 4096;
  std::unique_ptr<T[], FreeDeleter> a(static_cast<T*>(std::aligned_alloc(4096, bytes)));
  if (!a) return a;
  T* p = a.get();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = init(i);
  return a;
}

// Seconds of the fastest of kRuns calls of fn(run), after one warm-up call fn(0).
template <typename Fn>
double best_seconds(Fn fn) {
  fn(0);
  double best = 1e30;
  for (int run = 1; run <= kRuns; ++run) {
    const auto start = std::chrono::steady_clock::now();
    fn(run);
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// Ordinary values of AdamW state: no subnormals, which some CPUs process slowly.
float param_init(int64_t i) { return 0.02f * static_cast<float>(i % 1999 - 999) / 999.0f; }
float grad_init(int64_t i) { return 1e-3f * static_cast<float>(i % 997 - 498) / 498.0f + 1e-6f; }
float zero_init(int64_t) { return 0.0f; }
float one_init(int64_t) { return 1.0f; }
uint16_t grad_bf16_init(int64_t i) { return static_cast<uint16_t>(0x3A80 + i % 64); }  // ~1e-3
uint16_t zero_bf16_init(int64_t) { return 0; }
uint8_t zero_byte_init(int64_t) { return 0; }

// STREAM's triad. Like STREAM, the bytes counted are 12 per element: the write to `a` also costs
// a read for ownership that is not counted (AdamW writes only arrays it has just read).
void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
           int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

struct Row {
  std::string name;
  double seconds;
  double bytes_per_param;  // 0 for the triad
};

}  // namespace

int bench_adam_command(const std::vector<std::string>& args) {
  int64_t n = int64_t{256} << 20;
  int threads = omp_get_max_threads();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= args.size()) return usage_error("option '" + a + "' needs a value");
    const std::string& v = args[++i];
    if (a == "--params") {
      Result<uint64_t> count = parse_bytes(v);
      if (!count.ok()) return usage_error("--params: " + count.status().message());
      if (*count == 0 || *count > (uint64_t{1} << 40))
        return usage_error("--params must be between 1 and 1T");
      n = static_cast<int64_t>(*count);
    } else if (a == "--threads") {
      char* end = nullptr;
      const long t = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || t < 1 || t > 4096) {
        return usage_error("--threads must be a positive integer");
      }
      threads = static_cast<int>(t);
    } else {
      return usage_error("unknown option '" + a + "'");
    }
  }
  omp_set_num_threads(threads);
  const kernels::SimdLevel level = kernels::detect_simd_level();
  const std::string level_name = kernels::simd_level_name(level);
  std::printf("adam benchmark: %lld params, %d threads, SIMD %s, one warm-up then best of %d\n",
              static_cast<long long>(n), threads, level_name.c_str(), kRuns);
  std::fflush(stdout);

  std::vector<Row> rows;
  const auto out_of_memory = [](const char* what) {
    std::fprintf(stderr,
                 "strata bench adam: error: cannot allocate the %s buffers (lower --params)\n",
                 what);
    return 1;
  };
  kernels::AdamWParams p{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  {
    auto w = make_array<float>(n, param_init), g = make_array<float>(n, grad_init);
    auto m = make_array<float>(n, zero_init), v = make_array<float>(n, zero_init);
    if (!w || !g || !m || !v) return out_of_memory("fp32 AdamW");
    rows.push_back({"adamw_step_f32 (" + level_name + ")", best_seconds([&](int run) {
                      p.step = 1 + run;
                      kernels::adamw_step_f32(w.get(), g.get(), m.get(), v.get(), n, p, level);
                    }),
                    28});
    rows.push_back({"cpu::adamw_step (compiler)", best_seconds([&](int run) {
                      p.step = 1 + run;
                      kernels::cpu::adamw_step(w.get(), g.get(), m.get(), v.get(), n, p);
                    }),
                    28});
    // The host tier's update of the bf16 recipe with clipping: the clip scaling, AdamW and the
    // bf16 compute copy as three passes, and fused into one (adamw_step_f32_clipped).
    auto copy = make_array<uint16_t>(n, zero_bf16_init);
    if (!copy) return out_of_memory("bf16 copy");
    rows.push_back({"clip+f32+bf16 copy, 3 passes", best_seconds([&](int run) {
                      p.step = 1 + run;
                      kernels::cpu::scale_inplace(g.get(), n, 1.0f);
                      kernels::adamw_step_f32(w.get(), g.get(), m.get(), v.get(), n, p, level);
                      kernels::round_to_bf16(copy.get(), w.get(), n);
                    }),
                    42});
    rows.push_back({"adamw_step_f32_clipped + copy", best_seconds([&](int run) {
                      p.step = 1 + run;
                      kernels::adamw_step_f32_clipped(w.get(), g.get(), 1.0f, m.get(), v.get(), copy.get(), n, p,
                                                      level);
                    }),
                    30});
    copy.reset();
    // The fp8 recipe's copy: the new master quantised to E4M3 in 128 x 128 blocks (read 4 B,
    // write 1 B per param, twice read for the blocks' amax), on this level and on plain code.
    // Over rows of 4096: the largest such matrix within n (the rate's bytes count n).
    const int64_t cols = 4096, rows_ = n / cols;
    if (rows_ > 0) {
      auto codes = make_array<uint8_t>(static_cast<int64_t>(kernels::fp8_matrix_bytes(rows_, cols)), zero_byte_init);
      if (!codes) return out_of_memory("fp8 copy");
      rows.push_back({std::string("quantize_weight_e4m3 (") +
                          (level == kernels::SimdLevel::kScalar ? "scalar" : "avx2") + ")",
                      best_seconds([&](int) { kernels::cpu::quantize_weight_e4m3(codes.get(), w.get(), rows_, cols); }),
                      5});
      const char* before = std::getenv("STRATA_SIMD");
      const std::string saved = before != nullptr ? before : "";
      setenv("STRATA_SIMD", "scalar", 1);
      rows.push_back({"quantize_weight_e4m3 (scalar)",
                      best_seconds([&](int) { kernels::cpu::quantize_weight_e4m3(codes.get(), w.get(), rows_, cols); }),
                      5});
      if (before != nullptr) {
        setenv("STRATA_SIMD", saved.c_str(), 1);
      } else {
        unsetenv("STRATA_SIMD");
      }
    }
    g.reset();
    auto gh = make_array<uint16_t>(n, grad_bf16_init),
         out = make_array<uint16_t>(n, zero_bf16_init);
    if (!gh || !out) return out_of_memory("mixed-precision AdamW");
    rows.push_back({"adamw_step_mixed (" + level_name + ")", best_seconds([&](int run) {
                      p.step = 1 + run;
                      kernels::adamw_step_mixed(w.get(), gh.get(), m.get(), v.get(), out.get(), n,
                                                p, level);
                    }),
                    24});
  }
  // The triad moves 12 B per element (two reads, one write); size it to move 28 B per param.
  const int64_t nt = (n * 28 + 11) / 12;
  double triad_s;
  {
    auto a = make_array<float>(nt, zero_init), b = make_array<float>(nt, one_init);
    auto c = make_array<float>(nt, param_init);
    if (!a || !b || !c) return out_of_memory("triad");
    triad_s = best_seconds([&](int run) {
      triad(a.get(), b.get(), c.get(), 1.0f + 1e-3f * static_cast<float>(run), nt);
    });
  }
  const double triad_gbps = 12.0 * static_cast<double>(nt) / triad_s / 1e9;

  std::printf("\n%-30s %9s %9s %8s %8s %9s\n", "kernel", "ms", "Gparam/s", "B/param", "GB/s",
              "vs triad");
  for (const Row& r : rows) {
    const double gbps = r.bytes_per_param * static_cast<double>(n) / r.seconds / 1e9;
    std::printf("%-30s %9.2f %9.3f %8.0f %8.2f %9.2f\n", r.name.c_str(), r.seconds * 1e3,
                static_cast<double>(n) / r.seconds / 1e9, r.bytes_per_param, gbps,
                gbps / triad_gbps);
  }
  std::printf("%-30s %9.2f %9s %8s %8.2f %9.2f\n", "triad a = b + s*c", triad_s * 1e3, "-", "-",
              triad_gbps, 1.0);
  return 0;
}

}  // namespace strata::tools
