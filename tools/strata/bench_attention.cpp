// strata bench attention: tokens/s of the CPU attention (kernels/attention.h), forward and
// backward, in key tiles of --key-tile and in one tile of every key, at each --seq, with the
// scores each holds at once. The reference for the machine is PyTorch's
// scaled_dot_product_attention on the same shapes (tools/attention_bench_torch.py), run beside
// it; bench/results records both.
#include "tools/strata/bench_attention.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "core/units.h"
#include "kernels/attention.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench attention [--seq 4096,8192,16384] [--heads 2] [--kv-heads 2]
                              [--head-dim 64] [--key-tile 512] [--repeat 3]

Times the CPU attention's forward and backward (causal, fp32, batch 1) at each sequence length,
once in key tiles of --key-tile keys and once with a single tile of every key (the same code
holding the scores of 16 query rows by all T keys, as a kernel without key tiles does), and
prints tokens/s of each (forward, backward, both; the best of --repeat) and the scores each
holds per thread. tools/attention_bench_torch.py times PyTorch's scaled_dot_product_attention
at the same shapes and thread count for comparison.
)";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata bench attention: error: %s (see strata bench attention --help)\n", msg.c_str());
  return 2;
}

bool parse_list(const std::string& s, std::vector<int64_t>* out) {
  std::stringstream in(s);
  std::string item;
  out->clear();
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0 || v > (1 << 20)) return false;
    out->push_back(v);
  }
  return !out->empty();
}

// A fixed pseudo-random fill in [-1, 1).
void fill(std::vector<float>& v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : v) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    f = static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  }
}

struct Timing {
  double forward_s = 1e30, backward_s = 1e30;
};

Timing time_attention(int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t tile, int repeat) {
  std::vector<float> q(T * Hq * D), k(T * Hkv * D), v(T * Hkv * D), dout(T * Hq * D);
  fill(q, 1), fill(k, 2), fill(v, 3), fill(dout, 4);
  std::vector<float> out(q.size()), lse(Hq * T), dq(q.size()), dk(k.size()), dv(v.size());
  const int64_t before = kernels::attention_key_tile();
  kernels::set_attention_key_tile(tile);
  Timing t;
  for (int r = 0; r < repeat; ++r) {
    auto a = std::chrono::steady_clock::now();
    kernels::cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), 1, T, Hq, Hkv, D);
    auto b = std::chrono::steady_clock::now();
    kernels::cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                     out.data(), lse.data(), 1, T, Hq, Hkv, D);
    auto c = std::chrono::steady_clock::now();
    t.forward_s = std::min(t.forward_s, std::chrono::duration<double>(b - a).count());
    t.backward_s = std::min(t.backward_s, std::chrono::duration<double>(c - b).count());
  }
  kernels::set_attention_key_tile(before);
  return t;
}

}  // namespace

int bench_attention_command(const std::vector<std::string>& args) {
  std::vector<int64_t> seqs = {4096, 8192, 16384};
  int64_t heads = 2, kv_heads = 2, head_dim = 64, tile = kernels::kDefaultAttentionKeyTile, repeat = 3;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= args.size()) return usage_error(a + " needs a value");
    const std::string& value = args[++i];
    std::vector<int64_t> one;
    if (a == "--seq") {
      if (!parse_list(value, &seqs)) return usage_error("--seq is '" + value + "'; use lengths such as 4096,16384");
      continue;
    }
    if (!parse_list(value, &one) || one.size() != 1) return usage_error(a + " is '" + value + "'; use a positive number");
    if (a == "--heads") heads = one[0];
    else if (a == "--kv-heads") kv_heads = one[0];
    else if (a == "--head-dim") head_dim = one[0];
    else if (a == "--key-tile") tile = one[0];
    else if (a == "--repeat") repeat = one[0];
    else return usage_error("unknown option '" + a + "'");
  }
  if (heads % kv_heads != 0) return usage_error("--heads must be a multiple of --kv-heads");
  const int threads = omp_get_max_threads();
  std::printf("causal attention, fp32, batch 1, %lld query heads, %lld kv heads, head dim %lld, %d threads, best of %lld\n",
              static_cast<long long>(heads), static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
              threads, static_cast<long long>(repeat));
  std::printf("%8s  %-12s %12s %12s %12s  %s\n", "T", "keys", "fwd tok/s", "bwd tok/s", "both tok/s",
              "scores held per thread (fwd, bwd)");
  for (const int64_t T : seqs) {
    for (const int64_t keys : {tile, int64_t{0}}) {
      const Timing t = time_attention(T, heads, kv_heads, head_dim, keys, static_cast<int>(repeat));
      const int64_t held = keys > 0 ? std::min(keys, T) : T;
      // 16 rows of scores forward; probabilities and dS backward.
      const uint64_t fwd_bytes = 16 * held * sizeof(float), bwd_bytes = 2 * fwd_bytes;
      std::printf("%8lld  %-12s %12.0f %12.0f %12.0f  %s, %s\n", static_cast<long long>(T),
                  keys > 0 ? ("tiles of " + std::to_string(keys)).c_str() : "one tile",
                  static_cast<double>(T) / t.forward_s, static_cast<double>(T) / t.backward_s,
                  static_cast<double>(T) / (t.forward_s + t.backward_s), format_bytes(fwd_bytes).c_str(),
                  format_bytes(bwd_bytes).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace strata::tools
