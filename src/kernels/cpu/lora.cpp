#include "kernels/lora.h"

#include <vector>

#include "kernels/linear.h"

namespace strata::kernels::cpu {
namespace {

// drop(x): x itself without dropout, else a rounded copy with the dropped elements zero.
const float* dropped_input(std::vector<float>& buf, const float* x, const LoraDropout& drop, int64_t N, int64_t IC,
                           RoundFn round) {
  if (drop.p <= 0) return x;
  buf.assign(x, x + N * IC);
  const float keep = 1.0f / (1.0f - drop.p);
  for (int64_t i = 0; i < N * IC; ++i) {
    const uint64_t index = static_cast<uint64_t>((drop.row0 * IC) + i);
    buf[static_cast<size_t>(i)] = lora_dropped(drop.seed, index, drop.p) ? 0.0f : buf[static_cast<size_t>(i)] * keep;
  }
  round(buf.data(), N * IC);
  return buf.data();
}

}  // namespace

void lora_forward(float* y, float* t, const float* x, const float* A, const float* B, float scale,
                  const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R, RoundFn round) {
  std::vector<float> buf;
  const float* xd = dropped_input(buf, x, drop, N, IC, round);
  sgemm(false, true, N, R, IC, 1.0f, xd, IC, A, IC, 0.0f, t, R);
  round(t, N * R);
  sgemm(false, true, N, OC, R, scale, t, R, B, R, 1.0f, y, OC);
  round(y, N * OC);
}

void lora_backward(float* dx, float* dA, float* dB, const float* dy, const float* x, const float* A, const float* B,
                   float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R,
                   RoundFn round) {
  std::vector<float> buf;
  const float* xd = dropped_input(buf, x, drop, N, IC, round);
  std::vector<float> t(static_cast<size_t>(N * R)), dt(static_cast<size_t>(N * R));
  sgemm(false, true, N, R, IC, 1.0f, xd, IC, A, IC, 0.0f, t.data(), R);
  round(t.data(), N * R);
  if (dB != nullptr) sgemm(true, false, OC, R, N, scale, dy, OC, t.data(), R, 1.0f, dB, R);
  sgemm(false, false, N, R, OC, scale, dy, OC, B, R, 0.0f, dt.data(), R);
  round(dt.data(), N * R);
  if (dA != nullptr) sgemm(true, false, R, IC, N, 1.0f, dt.data(), R, xd, IC, 1.0f, dA, IC);
  if (dx == nullptr) return;
  if (drop.p <= 0) {
    sgemm(false, false, N, IC, R, 1.0f, dt.data(), R, A, IC, 1.0f, dx, IC);
  } else {
    std::vector<float> g(static_cast<size_t>(N * IC));
    sgemm(false, false, N, IC, R, 1.0f, dt.data(), R, A, IC, 0.0f, g.data(), IC);
    const float keep = 1.0f / (1.0f - drop.p);
    for (int64_t i = 0; i < N * IC; ++i) {
      const uint64_t index = static_cast<uint64_t>((drop.row0 * IC) + i);
      if (!lora_dropped(drop.seed, index, drop.p)) dx[i] += g[static_cast<size_t>(i)] * keep;
    }
  }
  round(dx, N * IC);
}

}  // namespace strata::kernels::cpu
