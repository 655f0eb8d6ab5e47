// Causal grouped-query attention: query head h reads key/value head h / (Hq / Hkv).
// lse (B, Hq, T) is the log-sum-exp of each softmax row (scaled scores), saved for backward so
// that backward never needs the T x T probabilities stored.
//
// Head dims: queries and keys have D, values and outputs Dv (0: Dv = D). Multi-head latent
// attention (DeepSeek-V2/V3) has D = qk_nope_head_dim + qk_rope_head_dim = 192 and Dv = 128.
// scale multiplies the scores q.k before the softmax; 0 means 1/sqrt(D) (DeepSeek's YaRN models
// multiply that by mscale^2).
//
// past: keys and values of `past` earlier positions precede the T new ones (a KV cache, in
// generation): k and v hold past + T rows per sequence, query t is at position past + t and
// sees keys 0 .. past + t. Each query row is computed as with past = 0 and the whole sequence
// (the same sums in the same order), so cached decoding gives bitwise the rows a full forward
// gives. Backward takes past = 0 only (training).
//
// positions (B, T) or null: document masks for packed sequences (data.packing: document).
// positions[b, t] is token t's position in its document, so its document starts at
// t - positions[b, t]; query t then sees keys t - positions[b, t] .. t only, never a key of an
// earlier document in the same row. Null is plain causal attention (every row one document
// starting at 0). REQUIRES with positions: past = 0, positions[b, 0] = 0 and each next
// positions[b, t] either 0 (a new document) or positions[b, t - 1] + 1 (what the CUDA kernel's
// tile skipping relies on: a key tile before a query's document start is wholly masked). A row of a
// masked batch is computed with the same sums in the same order as that document alone at the
// start of a sequence, so the masked result of each document equals its unpacked one bitwise.
//
// Key tiles (the CPU reference and fast path): scores are formed for a tile of keys at a time
// and folded into each row's online softmax (running max, sum and weighted values, rescaled
// when a tile raises the max), so no T x T, or even row x T, scores are held: a block of rows
// by a tile of keys. A row's tiles start at its first key. Backward recomputes the
// probabilities from lse tile by tile, its sums in the untiled order: its bits do not depend
// on the tile. Forward's do, within the bound of a few roundings per tile (the rescaling);
// tests/kernels/attention_test.cpp states it.
#pragma once
#include <cstdint>

namespace strata::kernels {

// Keys per tile of the CPU attention (process-wide; 0: one tile of every key, untiled).
inline constexpr int64_t kDefaultAttentionKeyTile = 512;
int64_t attention_key_tile();
void set_attention_key_tile(int64_t keys);

// Blocks of ring attention (context parallelism, model/context_parallel.h): the queries of one
// chunk of the sequence against the keys of another. kFull: every query sees every key (the
// keys' chunk comes earlier); kCausal: the same chunk (Tq = Tk), query t sees keys 0 .. t, as
// attention_forward with past = 0. A chunk after the queries' is masked whole and never computed.
enum class AttentionBlock : uint8_t { kFull, kCausal };

#define STRATA_ATTENTION_OPS                                                                      \
  void attention_forward(float* out /*(B,T,Hq,Dv)*/, float* lse /*(B,Hq,T)*/,                     \
                         const float* q /*(B,T,Hq,D)*/, const float* k /*(B,past+T,Hkv,D)*/,      \
                         const float* v /*(B,past+T,Hkv,Dv)*/, int64_t B, int64_t T, int64_t Hq,  \
                         int64_t Hkv, int64_t D, int64_t past = 0,                                 \
                         const int32_t* positions /*(B,T) or null*/ = nullptr, int64_t Dv = 0,    \
                         double scale = 0);                                                        \
  /* dq, dk, dv = (overwritten) */                                                                \
  void attention_backward(float* dq /*(B,T,Hq,D)*/, float* dk /*(B,T,Hkv,D)*/,                    \
                          float* dv /*(B,T,Hkv,Dv)*/, const float* dout /*(B,T,Hq,Dv)*/,          \
                          const float* q, const float* k, const float* v,                         \
                          const float* out /*(B,T,Hq,Dv)*/, const float* lse /*(B,Hq,T)*/,        \
                          int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,               \
                          const int32_t* positions /*(B,T) or null*/ = nullptr, int64_t Dv = 0,   \
                          double scale = 0);                                                       \
  /* Ring attention (context parallelism): one block of Tq queries against Tk keys (see above).  \
     With accumulate, the block's rows are merged into the running (out, lse) of the blocks      \
     before (lse = log(e^lse + e^lse_block), out weighted by each side's share); without, they  \
     are written. */                                                                              \
  void attention_block_forward(float* out /*(B,Tq,Hq,Dv)*/, float* lse /*(B,Hq,Tq)*/,             \
                               const float* q /*(B,Tq,Hq,D)*/, const float* k /*(B,Tk,Hkv,D)*/,  \
                               const float* v /*(B,Tk,Hkv,Dv)*/, int64_t B, int64_t Tq,          \
                               int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,                    \
                               AttentionBlock mask, bool accumulate, int64_t Dv = 0,              \
                               double scale = 0);                                                 \
  /* The block's share of the gradients, written to dq and dk, dv, or added to them (+=) with    \
     accumulate_dq and accumulate_dkv; out and lse are the whole attention's (every block       \
     merged), as the probabilities are P = exp(s - lse). */                                       \
  void attention_block_backward(float* dq /*(B,Tq,Hq,D)*/, float* dk /*(B,Tk,Hkv,D)*/,            \
                                float* dv /*(B,Tk,Hkv,Dv)*/, const float* dout /*(B,Tq,Hq,Dv)*/, \
                                const float* q, const float* k, const float* v,                   \
                                const float* out /*(B,Tq,Hq,Dv)*/, const float* lse /*(B,Hq,Tq)*/,\
                                int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,       \
                                int64_t D, AttentionBlock mask, bool accumulate_dq,               \
                                bool accumulate_dkv, int64_t Dv = 0, double scale = 0);
namespace ref { STRATA_ATTENTION_OPS }
namespace cpu { STRATA_ATTENTION_OPS }
#undef STRATA_ATTENTION_OPS
}  // namespace strata::kernels
