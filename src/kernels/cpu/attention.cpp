// Causal grouped-query attention on the CPU: the reference (double, one row at
// a time) and the fast path (fp32, blocks of query rows so that each key/value
// row is loaded once per block), both over tiles of keys with an online softmax.
#include "kernels/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"

namespace strata::kernels {

namespace {
void check_shapes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  CHECK(B >= 0 && T >= 0 && D > 0);
  CHECK_MSG(Hkv > 0 && Hq % Hkv == 0,
            "attention needs Hq a multiple of Hkv, got Hq=" +
                std::to_string(Hq) + " Hkv=" + std::to_string(Hkv));
}

// Document masks (kernels/attention.h): past = 0 and 0 <= positions[b, t] <= t.
void check_positions(const int32_t *positions, int64_t B, int64_t T,
                     int64_t past) {
  if (positions == nullptr)
    return;
  CHECK_MSG(past == 0, "document-masked attention takes no cached keys");
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t p = positions[b * T + t];
      // Each document runs on from its start: 0, or one more than the token before.
      const bool ok = p == 0 || (t > 0 && p == positions[b * T + t - 1] + 1);
      CHECK_MSG(ok, "attention position " + std::to_string(p) + " of token " +
                        std::to_string(t) + " in row " + std::to_string(b) +
                        " is neither 0 nor one more than the position before it");
    }
}

// The value head dim: Dv, or D when 0.
int64_t value_dim(int64_t D, int64_t Dv) {
  CHECK(Dv >= 0);
  return Dv == 0 ? D : Dv;
}

// The softmax scale: scale, or 1/sqrt(D) when 0.
double softmax_scale(int64_t D, double scale) {
  CHECK(scale >= 0 && std::isfinite(scale));
  return scale == 0 ? 1.0 / std::sqrt(double(D)) : scale;
}

// The first key query t of sequence b sees: the start of its document, 0
// without document masks.
inline int64_t first_key(const int32_t *positions, int64_t b, int64_t T,
                         int64_t t) {
  return positions == nullptr ? 0 : t - positions[b * T + t];
}

// Writes a row's attention (its out, normalised, and its lse), or with
// `accumulate` merges it into the row already there: the two softmaxes are
// over disjoint keys, so the merged lse is log(e^a + e^b) and each out weighs
// by its share e^(lse - merged). In double, once per row.
template <typename T>
inline void store_row(float *o, float *lse_slot, const T *row_out,
                      double row_lse, int64_t Dv, bool accumulate) {
  const double old = accumulate ? double(*lse_slot)
                                : -std::numeric_limits<double>::infinity();
  if (old == -std::numeric_limits<double>::infinity()) {
    for (int64_t d = 0; d < Dv; ++d)
      o[d] = static_cast<float>(row_out[d]);
    *lse_slot = static_cast<float>(row_lse);
    return;
  }
  const double hi = std::max(old, row_lse);
  const double merged = hi + std::log(std::exp(old - hi) + std::exp(row_lse - hi));
  const double w_old = std::exp(old - merged), w_new = std::exp(row_lse - merged);
  for (int64_t d = 0; d < Dv; ++d)
    o[d] = static_cast<float>(w_old * double(o[d]) + w_new * double(row_out[d]));
  *lse_slot = static_cast<float>(merged);
}
} // namespace

namespace {
std::atomic<int64_t> g_key_tile{kDefaultAttentionKeyTile};
} // namespace

int64_t attention_key_tile() { return g_key_tile.load(std::memory_order_relaxed); }
void set_attention_key_tile(int64_t keys) {
  CHECK_MSG(keys >= 0, "the attention key tile is a number of keys, 0 for untiled");
  g_key_tile.store(keys, std::memory_order_relaxed);
}

namespace ref {

namespace {
double dot(const float *a, const float *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i)
    s += double(a[i]) * double(b[i]);
  return s;
}
} // namespace

namespace {
// T queries against Tk keys per sequence: causal (query t sees keys up to
// past + t, Tk = past + T) or, with `full`, every key.
void forward_impl(float *out, float *lse, const float *q, const float *k,
                  const float *v, int64_t B, int64_t T, int64_t Tk, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t past,
                  const int32_t *positions, int64_t Dv, double scale_arg,
                  bool full, bool accumulate) {
  check_shapes(B, T, Hq, Hkv, D);
  Dv = value_dim(D, Dv);
  CHECK(past >= 0 && Tk >= 0);
  check_positions(positions, B, T, past);
  const int64_t group = Hq / Hkv;
  const double scale = softmax_scale(D, scale_arg);
  // Keys in tiles with an online softmax (as the fast path): the running max m,
  // the sum of exp(s - m) and the weighted values, rescaled when a tile raises m.
  const int64_t setting = attention_key_tile();  // (read once)
  const int64_t tile = std::max<int64_t>(setting > 0 ? std::min(setting, Tk) : Tk, 1);
  std::vector<double> s(static_cast<size_t>(tile));
  std::vector<double> acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / group;
      for (int64_t t = 0; t < T; ++t) {
        const float *qt = q + ((b * T + t) * Hq + h) * D;
        const int64_t last = full ? Tk - 1 : past + t; // the last key this query sees
        const int64_t first = first_key(positions, b, T, t);
        double m = -std::numeric_limits<double>::infinity();
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j0 = first; j0 <= last; j0 += tile) {
          const int64_t j1 = std::min(j0 + tile, last + 1);
          double m_new = m;
          for (int64_t j = j0; j < j1; ++j) {
            s[j - j0] = scale * dot(qt, k + ((b * Tk + j) * Hkv + g) * D, D);
            m_new = std::max(m_new, s[j - j0]);
          }
          const double c = std::exp(m - m_new); // 0 for the first tile
          sum *= c;
          for (double &a : acc)
            a *= c;
          m = m_new;
          for (int64_t j = j0; j < j1; ++j) {
            const double p = std::exp(s[j - j0] - m);
            sum += p;
            const float *vj = v + ((b * Tk + j) * Hkv + g) * Dv;
            for (int64_t d = 0; d < Dv; ++d)
              acc[d] += p * vj[d];
          }
        }
        for (double &a : acc)
          a /= sum;
        store_row(out + ((b * T + t) * Hq + h) * Dv, lse + (b * Hq + h) * T + t,
                  acc.data(), m + std::log(sum), Dv, accumulate);
      }
    }
  }
}
} // namespace

void attention_forward(float *out, float *lse, const float *q, const float *k,
                       const float *v, int64_t B, int64_t T, int64_t Hq,
                       int64_t Hkv, int64_t D, int64_t past,
                       const int32_t *positions, int64_t Dv, double scale_arg) {
  forward_impl(out, lse, q, k, v, B, T, past + T, Hq, Hkv, D, past, positions,
               Dv, scale_arg, /*full=*/false, /*accumulate=*/false);
}

namespace {
// dq, dk, dv are overwritten, or added to with accumulate_dq (dq) and accumulate_dkv (dk, dv). T queries against
// Tk keys: causal (Tk = T) or, with `full`, every key.
void backward_impl(float *dq, float *dk, float *dv, const float *dout,
                   const float *q, const float *k, const float *v,
                   const float *out, const float *lse, int64_t B, int64_t T,
                   int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                   const int32_t *positions, int64_t Dv, double scale_arg,
                   bool full, bool accumulate_dq, bool accumulate_dkv) {
  check_shapes(B, T, Hq, Hkv, D);
  Dv = value_dim(D, Dv);
  check_positions(positions, B, T, 0);
  CHECK(full || Tk == T);
  const int64_t group = Hq / Hkv;
  const double scale = softmax_scale(D, scale_arg);
  const size_t k_size = static_cast<size_t>(B * Tk * Hkv * D);
  const size_t v_size = static_cast<size_t>(B * Tk * Hkv * Dv);
  std::vector<double> dk_acc(k_size, 0.0), dv_acc(v_size, 0.0);
  std::vector<double> dq_row(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / group;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = ((b * T + t) * Hq + h) * D;      // of q, dq
        const int64_t orow = ((b * T + t) * Hq + h) * Dv;    // of out, dout
        const double row_lse = lse[(b * Hq + h) * T + t];
        const double delta =
            dot(dout + orow, out + orow, Dv); // D_t = dout_t . out_t
        std::fill(dq_row.begin(), dq_row.end(), 0.0);
        const int64_t last = full ? Tk - 1 : t;
        for (int64_t j = first_key(positions, b, T, t); j <= last; ++j) {
          const int64_t kv_row = ((b * Tk + j) * Hkv + g) * D;
          const int64_t v_row = ((b * Tk + j) * Hkv + g) * Dv;
          const double p =
              std::exp(scale * dot(q + row, k + kv_row, D) - row_lse);
          const double dp = dot(dout + orow, v + v_row, Dv);
          const double ds = p * (dp - delta);
          for (int64_t d = 0; d < D; ++d) {
            dq_row[d] += scale * ds * k[kv_row + d];
            dk_acc[kv_row + d] += scale * ds * q[row + d];
          }
          for (int64_t d = 0; d < Dv; ++d)
            dv_acc[v_row + d] += p * dout[orow + d];
        }
        for (int64_t d = 0; d < D; ++d)
          dq[row + d] = static_cast<float>(accumulate_dq ? double(dq[row + d]) + dq_row[d] : dq_row[d]);
      }
    }
  }
  for (size_t i = 0; i < k_size; ++i)
    dk[i] = static_cast<float>(accumulate_dkv ? double(dk[i]) + dk_acc[i] : dk_acc[i]);
  for (size_t i = 0; i < v_size; ++i)
    dv[i] = static_cast<float>(accumulate_dkv ? double(dv[i]) + dv_acc[i] : dv_acc[i]);
}
} // namespace

// dq, dk, dv are overwritten.
void attention_backward(float *dq, float *dk, float *dv, const float *dout,
                        const float *q, const float *k, const float *v,
                        const float *out, const float *lse, int64_t B,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                        const int32_t *positions, int64_t Dv,
                        double scale_arg) {
  backward_impl(dq, dk, dv, dout, q, k, v, out, lse, B, T, T, Hq, Hkv, D,
                positions, Dv, scale_arg, /*full=*/false, /*accumulate_dq=*/false, /*accumulate_dkv=*/false);
}

void attention_block_forward(float *out, float *lse, const float *q,
                             const float *k, const float *v, int64_t B,
                             int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                             int64_t D, AttentionBlock mask, bool accumulate,
                             int64_t Dv, double scale) {
  const bool full = mask == AttentionBlock::kFull;
  CHECK_MSG(full || Tq == Tk, "a causal attention block pairs a chunk with itself (Tq = Tk)");
  forward_impl(out, lse, q, k, v, B, Tq, Tk, Hq, Hkv, D, 0, nullptr, Dv, scale,
               full, accumulate);
}

void attention_block_backward(float *dq, float *dk, float *dv,
                              const float *dout, const float *q, const float *k,
                              const float *v, const float *out,
                              const float *lse, int64_t B, int64_t Tq,
                              int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                              AttentionBlock mask, bool accumulate_dq,
                              bool accumulate_dkv, int64_t Dv, double scale) {
  const bool full = mask == AttentionBlock::kFull;
  CHECK_MSG(full || Tq == Tk, "a causal attention block pairs a chunk with itself (Tq = Tk)");
  backward_impl(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, D,
                nullptr, Dv, scale, full, accumulate_dq, accumulate_dkv);
}

} // namespace ref

namespace cpu {

namespace {
// Query rows handled together: each key/value row loaded from memory serves
// this many rows.
constexpr int64_t kBlockRows = 16;

inline float dot(const float *a, const float *b, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i)
    s += a[i] * b[i];
  return s;
}

inline void axpy(float *y, float alpha, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] += alpha * x[i];
}
} // namespace

// Work units are (b, query head, block of rows); each writes only its own
// out/lse rows, so the result is the same for any thread count. Later blocks
// see more keys, hence dynamic schedule.
//
// Keys go in tiles of attention_key_tile() with an online softmax: each row
// keeps its running max m, its sum l of exp(s - m) and its weighted sum of
// values, rescaled by exp(m_old - m_new) when a tile raises the max, so the
// scores held at once are a block of rows by a tile of keys, whatever T. A
// row's tiles start at its first key (0, or its document's start) and the keys
// of a tile are visited in ascending order, so a row comes out the same
// computed alone (cached decoding, any `past`) or among the whole sequence's,
// and a document's rows as for that document alone. The block's rows are
// taken in runs that share their first key (one run without document masks).
//
// With `full` (a block of ring attention) every row sees all Tk keys; with
// `accumulate` each row is merged into the one already in out/lse.
namespace {
void forward_impl(float *out, float *lse, const float *q, const float *k,
                  const float *v, int64_t B, int64_t T, int64_t Tk, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t past,
                  const int32_t *positions, int64_t Dv, double scale_arg,
                  bool full, bool accumulate) {
  check_shapes(B, T, Hq, Hkv, D);
  Dv = value_dim(D, Dv);
  CHECK(past >= 0 && Tk >= 0);
  check_positions(positions, B, T, past);
  const int64_t group = Hq / Hkv;
  const float scale = static_cast<float>(softmax_scale(D, scale_arg));
  const int64_t blocks = (T + kBlockRows - 1) / kBlockRows;
  const int64_t units = B * Hq * blocks;
  const int64_t setting = attention_key_tile();  // (read once)
  const int64_t tile = std::max<int64_t>(setting > 0 ? std::min(setting, Tk) : Tk, 1);
#pragma omp parallel
  {
    // Scores of one block of rows against one tile of keys.
    std::vector<float> s(static_cast<size_t>(kBlockRows * tile));
    std::vector<float> acc(static_cast<size_t>(kBlockRows * Dv));
    std::vector<float> m(static_cast<size_t>(kBlockRows));
    std::vector<double> l(static_cast<size_t>(kBlockRows)); // double: tens of thousands of terms
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t blk = unit % blocks;
      const int64_t h = (unit / blocks) % Hq;
      const int64_t b = unit / (blocks * Hq);
      const int64_t g = h / group;
      const int64_t t0 = blk * kBlockRows;
      const int64_t rows = std::min(kBlockRows, T - t0);
      const int64_t p0 = past + t0; // position of the block's first row
      const float *q0 = q + ((b * T + t0) * Hq + h) * D;
      const int64_t q_stride = Hq * D;
      const float *kb = k + (b * Tk * Hkv + g) * D;
      const float *vb = v + (b * Tk * Hkv + g) * Dv;
      const int64_t kv_stride = Hkv * D;
      const int64_t v_stride = Hkv * Dv;
      std::fill(acc.begin(), acc.begin() + rows * Dv, 0.0f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.0);
      // Runs of rows [r0, r1) sharing their first key f: row r sees f .. p0 + r.
      for (int64_t r0 = 0, r1 = 0; r0 < rows; r0 = r1) {
        const int64_t f = first_key(positions, b, T, t0 + r0);
        for (r1 = r0 + 1; r1 < rows && first_key(positions, b, T, t0 + r1) == f; ++r1) {
        }
        // keys f .. keys - 1 are visible to some row of the run
        const int64_t keys = full ? Tk : p0 + r1;
        for (int64_t j0 = f; j0 < keys; j0 += tile) {
          const int64_t j1 = std::min(j0 + tile, keys);
          // Row r sees keys j <= p0 + r: start at the first row that can see key j.
          for (int64_t j = j0; j < j1; ++j) {
            const float *kj = kb + j * kv_stride;
            for (int64_t r = full ? r0 : std::max(r0, j - p0); r < r1; ++r)
              s[r * tile + (j - j0)] = scale * dot(q0 + r * q_stride, kj, D);
          }
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = std::min(j1, full ? Tk : p0 + r + 1) - j0; // keys of the tile row r sees
            if (n <= 0)
              continue;
            float *sr = s.data() + r * tile;
            float tile_max = -std::numeric_limits<float>::infinity();
            for (int64_t i = 0; i < n; ++i)
              tile_max = std::max(tile_max, sr[i]);
            const float m_new = std::max(m[r], tile_max);
            if (m_new > m[r] && m[r] != -std::numeric_limits<float>::infinity()) {
              const float c = std::exp(m[r] - m_new);
              l[r] *= c;
              float *ar = acc.data() + r * Dv;
              for (int64_t d = 0; d < Dv; ++d)
                ar[d] *= c;
            }
            m[r] = m_new;
            double sum = 0;
            for (int64_t i = 0; i < n; ++i) {
              sr[i] = std::exp(sr[i] - m_new);
              sum += sr[i];
            }
            l[r] += sum;
          }
          for (int64_t j = j0; j < j1; ++j) {
            const float *vj = vb + j * v_stride;
            for (int64_t r = full ? r0 : std::max(r0, j - p0); r < r1; ++r)
              axpy(acc.data() + r * Dv, s[r * tile + (j - j0)], vj, Dv);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = static_cast<float>(1.0 / l[r]);
        float *ar = acc.data() + r * Dv;
        for (int64_t d = 0; d < Dv; ++d)
          ar[d] *= inv;
        store_row(out + ((b * T + t0 + r) * Hq + h) * Dv, lse + (b * Hq + h) * T + t0 + r, ar,
                  double(m[r]) + std::log(l[r]), Dv, accumulate);
      }
    }
  }
}
} // namespace

void attention_forward(float *out, float *lse, const float *q, const float *k,
                       const float *v, int64_t B, int64_t T, int64_t Hq,
                       int64_t Hkv, int64_t D, int64_t past,
                       const int32_t *positions, int64_t Dv, double scale_arg) {
  forward_impl(out, lse, q, k, v, B, T, past + T, Hq, Hkv, D, past, positions,
               Dv, scale_arg, /*full=*/false, /*accumulate=*/false);
}

// dq, dk, dv are overwritten. Work units are (b, kv head): the unit owns the
// dk/dv rows of its kv head and the dq rows of the query heads in its group, so
// no two threads write the same element and the order of every sum is fixed.
// With document masks the rows that see key j are those of its document at or
// after j, visited in the same order as for that document alone.
// With `full` every row sees all Tk keys; with accumulate_dq (accumulate_dkv) the gradients are
// added to dq, dk, dv.
namespace {
void backward_impl(float *dq, float *dk, float *dv, const float *dout,
                   const float *q, const float *k, const float *v,
                   const float *out, const float *lse, int64_t B, int64_t T,
                   int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                   const int32_t *positions, int64_t Dv, double scale_arg,
                   bool full, bool accumulate_dq, bool accumulate_dkv) {
  check_shapes(B, T, Hq, Hkv, D);
  Dv = value_dim(D, Dv);
  check_positions(positions, B, T, 0);
  CHECK(full || Tk == T);
  const int64_t group = Hq / Hkv;
  const float scale = static_cast<float>(softmax_scale(D, scale_arg));
  const int64_t blocks = (T + kBlockRows - 1) / kBlockRows;
  const int64_t q_stride = Hq * D;
  const int64_t o_stride = Hq * Dv; // of out and dout
  const int64_t kv_stride = Hkv * D;
  const int64_t v_stride = Hkv * Dv;
  const int64_t setting = attention_key_tile();  // (read once)
  const int64_t tile = std::max<int64_t>(setting > 0 ? std::min(setting, Tk) : Tk, 1);
#pragma omp parallel
  {
    // A block of rows by a tile of keys.
    std::vector<float> p(static_cast<size_t>(kBlockRows * tile)); // probabilities
    std::vector<float> ds(
        static_cast<size_t>(kBlockRows * tile)); // dS = P * (dP - D_r)
    std::vector<float> dq_acc(static_cast<size_t>(kBlockRows * D));
    std::vector<float> delta(static_cast<size_t>(kBlockRows));
    std::vector<int64_t> first(static_cast<size_t>(kBlockRows));
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < B * Hkv; ++unit) {
      const int64_t b = unit / Hkv;
      const int64_t g = unit % Hkv;
      const float *kb = k + (b * Tk * Hkv + g) * D;
      const float *vb = v + (b * Tk * Hkv + g) * Dv;
      float *dkb = dk + (b * Tk * Hkv + g) * D;
      float *dvb = dv + (b * Tk * Hkv + g) * Dv;
      for (int64_t j = 0; j < Tk && !accumulate_dkv; ++j) {
        std::fill_n(dkb + j * kv_stride, D, 0.0f);
        std::fill_n(dvb + j * v_stride, Dv, 0.0f);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t t0 = blk * kBlockRows;
          const int64_t rows = std::min(kBlockRows, T - t0);
          const int64_t keys = full ? Tk : t0 + rows;
          const int64_t row0 = ((b * T + t0) * Hq + h) * D;
          const int64_t orow0 = ((b * T + t0) * Hq + h) * Dv;
          const float *q0 = q + row0;
          const float *do0 = dout + orow0;
          const float *o0 = out + orow0;
          const float *lse0 = lse + (b * Hq + h) * T + t0;
          int64_t kmin = keys;
          for (int64_t r = 0; r < rows; ++r) {
            delta[r] = dot(do0 + r * o_stride, o0 + r * o_stride, Dv);
            first[r] = first_key(positions, b, T, t0 + r);
            kmin = std::min(kmin, first[r]);
          }
          std::fill(dq_acc.begin(), dq_acc.begin() + rows * D, 0.0f);
          // Key tiles: the sums run in the order of untiled keys (each dq row over its keys
          // in ascending order, each dk/dv row over the block's rows in ascending order), so
          // the tile size changes no bit.
          for (int64_t j0 = kmin; j0 < keys; j0 += tile) {
            const int64_t j1 = std::min(j0 + tile, keys);
            for (int64_t j = j0; j < j1; ++j) {
              const float *kj = kb + j * kv_stride;
              const float *vj = vb + j * v_stride;
              for (int64_t r = full ? 0 : std::max<int64_t>(0, j - t0); r < rows; ++r) {
                if (j < first[r])
                  continue;
                const float pr =
                    std::exp(scale * dot(q0 + r * q_stride, kj, D) - lse0[r]);
                const float dp = dot(do0 + r * o_stride, vj, Dv);
                p[r * tile + (j - j0)] = pr;
                ds[r * tile + (j - j0)] = pr * (dp - delta[r]);
              }
            }
            for (int64_t j = j0; j < j1; ++j) {
              const float *kj = kb + j * kv_stride;
              float *dkj = dkb + j * kv_stride;
              float *dvj = dvb + j * v_stride;
              for (int64_t r = full ? 0 : std::max<int64_t>(0, j - t0); r < rows; ++r) {
                if (j < first[r])
                  continue;
                const float dsr = ds[r * tile + (j - j0)];
                axpy(dq_acc.data() + r * D, scale * dsr, kj, D);
                axpy(dkj, scale * dsr, q0 + r * q_stride, D);
                axpy(dvj, p[r * tile + (j - j0)], do0 + r * o_stride, Dv);
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            if (accumulate_dq)
              axpy(dq + row0 + r * q_stride, 1.0f, dq_acc.data() + r * D, D);
            else
              std::copy_n(dq_acc.data() + r * D, D, dq + row0 + r * q_stride);
          }
        }
      }
    }
  }
}
} // namespace

void attention_backward(float *dq, float *dk, float *dv, const float *dout,
                        const float *q, const float *k, const float *v,
                        const float *out, const float *lse, int64_t B,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                        const int32_t *positions, int64_t Dv,
                        double scale_arg) {
  backward_impl(dq, dk, dv, dout, q, k, v, out, lse, B, T, T, Hq, Hkv, D,
                positions, Dv, scale_arg, /*full=*/false, /*accumulate_dq=*/false, /*accumulate_dkv=*/false);
}

void attention_block_forward(float *out, float *lse, const float *q,
                             const float *k, const float *v, int64_t B,
                             int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                             int64_t D, AttentionBlock mask, bool accumulate,
                             int64_t Dv, double scale) {
  const bool full = mask == AttentionBlock::kFull;
  CHECK_MSG(full || Tq == Tk, "a causal attention block pairs a chunk with itself (Tq = Tk)");
  forward_impl(out, lse, q, k, v, B, Tq, Tk, Hq, Hkv, D, 0, nullptr, Dv, scale,
               full, accumulate);
}

void attention_block_backward(float *dq, float *dk, float *dv,
                              const float *dout, const float *q, const float *k,
                              const float *v, const float *out,
                              const float *lse, int64_t B, int64_t Tq,
                              int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                              AttentionBlock mask, bool accumulate_dq,
                              bool accumulate_dkv, int64_t Dv, double scale) {
  const bool full = mask == AttentionBlock::kFull;
  CHECK_MSG(full || Tq == Tk, "a causal attention block pairs a chunk with itself (Tq = Tk)");
  backward_impl(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, D,
                nullptr, Dv, scale, full, accumulate_dq, accumulate_dkv);
}

} // namespace cpu
} // namespace strata::kernels
