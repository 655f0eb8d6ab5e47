// The CUDA backend of every op in src/kernels/<op>.h, namespace strata::kernels::cuda.
//
// Signatures mirror the CPU ones (same argument order and shapes) with three differences:
//   - every pointer is DEVICE memory, and every launcher takes its cudaStream_t LAST;
//   - storage types follow the mixed-precision recipe: activations and compute weights are
//     bf16 (`bf16` below), accumulation is fp32; parameter gradients, master weights, AdamW
//     moments and saved statistics (rstd, lse, per-token losses) are fp32. Parameter gradients
//     are fp32 on purpose: they accumulate over micro-batches (`+=`), and bf16 accumulation
//     loses the low bits of every addend after the first few;
//   - ops that need cuBLASLt or temporary device memory take a `Context&` first.
// Backward conventions as on the CPU: parameter gradients accumulate (`+=`), activation
// gradients are overwritten (`=`).
//
// Every reduction has a fixed order that depends on the shapes only (no float atomics), so
// each op is bitwise reproducible from run to run on the same GPU and build; the one exception
// is a cuDNN attention backward whose plan is not `deterministic` (logged; see below;
// STRATA_ATTENTION=fallback avoids it).
//
// Launchers abort (CHECK / CUDA_CHECK) on bad arguments and on launch errors. Errors inside a
// kernel (a token id outside the vocabulary) trap the kernel: the next CUDA call on the stream
// fails and its CUDA_CHECK aborts. Usable from C++ (.cpp, C++20) and CUDA (.cu, C++17).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/adamw.h"
#include "kernels/cuda/lt_plan.h"
#include "kernels/gemm_plan.h"
#include "kernels/lora.h"
#include "kernels/moe.h"
#include "kernels/moments.h"

namespace strata::kernels::cuda {

using bf16 = __nv_bfloat16;

// The cuBLASLt handle, the GEMM workspace and a scratch buffer for ops that need temporary
// device memory (rmsnorm/linear partial sums, embedding sort, logits chunks, attention delta,
// reduction partials, MoE sort and grouped-GEMM pointer tables). Created on the current device
// over memory the caller owns (from the Device's budgeted arena; tests use
// testing::TestContext), which must outlive it: a Context allocates no device memory (the
// cuBLAS handle of the grouped GEMMs is created by the first op that needs it). Not thread
// safe. Scratch is reused by every op, so all ops given one Context must run on ONE stream
// (stream order keeps the reuse safe); use one Context per stream.
class Context {
 public:
  static constexpr size_t kDefaultScratchBytes = size_t{256} << 20;
  static constexpr size_t kDefaultGemmWorkspaceBytes = size_t{32} << 20;

  // Both buffers 256-byte aligned; either may be null with a size of 0.
  Context(void* scratch, size_t scratch_bytes, void* gemm_workspace, size_t gemm_workspace_bytes);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  cublasLtHandle_t lt() const { return lt_; }
  // The cuBLAS handle (grouped GEMMs), bound to `stream` and to the GEMM workspace. Created on
  // first use, on the current device (call it on the Context's device).
  cublasHandle_t blas(cudaStream_t stream);
  void* gemm_workspace() const { return gemm_workspace_; }
  size_t gemm_workspace_bytes() const { return gemm_workspace_bytes_; }
  // The scratch buffer (256-byte aligned); CHECKs that `bytes` fit, naming `what`.
  void* scratch(size_t bytes, const char* what) const;
  size_t scratch_bytes() const { return scratch_bytes_; }
  // Points the ops queued from now on at another caller-owned scratch buffer (256-byte
  // aligned): the CUDA backend runs its LM head in a buffer of its own. Ops queued before keep
  // the buffer they were given, which must outlive them.
  void use_scratch(void* scratch, size_t scratch_bytes);

  // The cuBLASLt plans of gemm() and of fp8_gemm_nt (descriptors, layouts, the chosen
  // algorithm; kernels/cuda/lt_plan.h), one per shape, built on first use. A training step
  // repeats a few dozen shapes hundreds of times, so only its first step searches for
  // algorithms. built() counts the plans made (tests hold repeated shapes to it).
  PlanCache<GemmKey, LtPlan>& gemm_plans() { return gemm_plans_; }
  PlanCache<Fp8GemmKey, LtPlan>& fp8_gemm_plans() { return fp8_gemm_plans_; }
  // cuDNN's handle and the fused-attention graphs (execution plans and their workspace sizes),
  // one pair per shape, built on first use; defined in cudnn_attention.cpp.
  struct CudnnAttention;
  CudnnAttention& cudnn_attention();

 private:
  // A deleter defined where CudnnAttention is complete, so that this header need not know it.
  struct CudnnAttentionDeleter {
    void operator()(CudnnAttention* attention) const;
  };
  int device_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* gemm_workspace_ = nullptr;
  size_t gemm_workspace_bytes_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  PlanCache<GemmKey, LtPlan> gemm_plans_;
  PlanCache<Fp8GemmKey, LtPlan> fp8_gemm_plans_;
  std::unique_ptr<CudnnAttention, CudnnAttentionDeleter> cudnn_attention_;
};

// ---- embedding -----------------------------------------------------------------------------
// REQUIRES 0 <= tokens[n] < V (traps otherwise).
void embedding_forward(bf16* out /*(N,C)*/, const int32_t* tokens /*(N)*/,
                       const bf16* table /*(V,C)*/, int64_t N, int64_t C, int64_t V,
                       cudaStream_t stream);
// dtable (V,C) += scatter of dout rows by token. Deterministic: positions are stably sorted by
// token (CUB radix sort in scratch), then one thread per (distinct token, column) adds that
// token's rows in position order. Scratch: embedding_backward_scratch_bytes(N, V).
void embedding_backward(Context& ctx, float* dtable /*(V,C)*/, const bf16* dout /*(N,C)*/,
                        const int32_t* tokens /*(N)*/, int64_t N, int64_t C, int64_t V,
                        cudaStream_t stream);
size_t embedding_backward_scratch_bytes(int64_t N, int64_t V);
// The same over a table in row blocks of block_rows rows (the last may be shorter), each
// contiguous but apart from the others (a paged store's vocabulary blocks): HOST arrays of
// device pointers, block b holding rows [b * block_rows, ...). Same results as one table.
void embedding_forward_blocked(bf16* out /*(N,C)*/, const int32_t* tokens /*(N)*/, const bf16* const* table_blocks,
                               int64_t block_rows, int64_t N, int64_t C, int64_t V, cudaStream_t stream);
void embedding_backward_blocked(Context& ctx, float* const* dtable_blocks, int64_t block_rows,
                                const bf16* dout /*(N,C)*/, const int32_t* tokens /*(N)*/, int64_t N, int64_t C,
                                int64_t V, cudaStream_t stream);

// ---- RMSNorm --------------------------------------------------------------------------------
void rmsnorm_forward(bf16* out /*(N,C)*/, float* rstd /*(N)*/, const bf16* x /*(N,C)*/,
                     const bf16* weight /*(C)*/, int64_t N, int64_t C, float eps,
                     cudaStream_t stream);
// dx (N,C) = ; dweight (C) += (per-row-chunk partials in scratch, then a fixed-order sum;
// skipped when null: a frozen weight).
// REQUIRES C <= 65536 (ModelLimits::kHiddenSize; a block's threads hold a row's columns).
void rmsnorm_backward(Context& ctx, bf16* dx /*(N,C)*/, float* dweight /*(C)*/,
                      const bf16* dout /*(N,C)*/, const bf16* x /*(N,C)*/,
                      const bf16* weight /*(C)*/, const float* rstd /*(N)*/, int64_t N,
                      int64_t C, cudaStream_t stream);

// ---- RoPE -----------------------------------------------------------------------------------
// inv_freq: device copy of kernels::rope_inv_freq (computed on the host). out may alias x.
// scale multiplies cos and sin (YaRN's attention factor; 1 otherwise), as in kernels/rope.h.
// Token t is at position past + t (past: positions already in a KV cache), or at
// positions[b, t] (device memory) when positions is given (packed documents; past = 0).
void rope_forward(bf16* out /*(B,T,H,D)*/, const bf16* x /*(B,T,H,D)*/,
                  const float* inv_freq /*(D/2)*/, int64_t B, int64_t T, int64_t H, int64_t D,
                  float scale, int64_t past, cudaStream_t stream,
                  const int32_t* positions /*(B,T) or null*/ = nullptr);
// dx = scale * (rotation by -angle) dout. dx may alias dout.
void rope_backward(bf16* dx /*(B,T,H,D)*/, const bf16* dout /*(B,T,H,D)*/,
                   const float* inv_freq /*(D/2)*/, int64_t B, int64_t T, int64_t H, int64_t D,
                   float scale, cudaStream_t stream,
                   const int32_t* positions /*(B,T) or null*/ = nullptr);

// ---- SwiGLU ---------------------------------------------------------------------------------
void swiglu_forward(bf16* out /*(n)*/, const bf16* gate /*(n)*/, const bf16* up /*(n)*/,
                    int64_t n, cudaStream_t stream);
// dgate, dup = (overwritten)
void swiglu_backward(bf16* dgate /*(n)*/, bf16* dup /*(n)*/, const bf16* dout /*(n)*/,
                     const bf16* gate /*(n)*/, const bf16* up /*(n)*/, int64_t n,
                     cudaStream_t stream);

// ---- linear (cuBLASLt, bf16 in, fp32 accumulate) ---------------------------------------------
// out (N,OC) = x @ weight^T + bias; bias (bf16) may be null and is fused as a GEMM epilogue.
void linear_forward(Context& ctx, bf16* out /*(N,OC)*/, const bf16* x /*(N,IC)*/,
                    const bf16* weight /*(OC,IC)*/, const bf16* bias /*(OC) or null*/, int64_t N,
                    int64_t IC, int64_t OC, cudaStream_t stream);
// out (N,OC) = x @ weight^T + residual (N,OC): one GEMM reading the residual as cuBLASLt's C
// (beta = 1) and writing out as its D, so the sum is rounded to bf16 once. out may not alias
// residual (the decoder never asks).
void linear_forward_residual(Context& ctx, bf16* out /*(N,OC)*/, const bf16* x /*(N,IC)*/,
                             const bf16* weight /*(OC,IC)*/, const bf16* residual /*(N,OC)*/, int64_t N,
                             int64_t IC, int64_t OC, cudaStream_t stream);
// dx (N,IC) = (skipped when null); dweight (OC,IC) += (fp32, GEMM with beta = 1; skipped when null);
// dbias (OC) += (fp32, skipped when null; fixed-order column sums through scratch).
void linear_backward(Context& ctx, bf16* dx, float* dweight, float* dbias,
                     const bf16* dout /*(N,OC)*/, const bf16* x /*(N,IC)*/,
                     const bf16* weight /*(OC,IC)*/, int64_t N, int64_t IC, int64_t OC,
                     cudaStream_t stream);
// dbias (OC) += column sums of dout (N,OC): fp32, per row chunk through scratch, the chunks
// added in order (linear_backward's bias gradient; the fp8 recipe's too).
void bias_backward(Context& ctx, float* dbias /*(OC)*/, const bf16* dout /*(N,OC)*/, int64_t N, int64_t OC,
                   cudaStream_t stream);

// C (M,N) row-major (row stride ldc, fp32 or bf16) += bias (N) broadcast over its rows, rounded
// into C's type. gemm()'s bias where cuBLASLt has no BIAS epilogue for the shape; a bf16 C is then
// rounded twice (the GEMM's result, then the sum) where the epilogue rounds once.
void add_bias_rows(void* C, int64_t ldc, bool c_is_fp32, const bf16* bias, int64_t M, int64_t N,
                   cudaStream_t stream);

// Row-major GEMM on cuBLASLt, the building block of the ops above (exposed for tests and
// benchmarks): C (M,N) = alpha * op(A) @ op(B) + beta * C with op(X) = X or X^T; A and B bf16,
// C bf16 or fp32 (c_is_fp32), fp32 accumulation; lda/ldb/ldc are row strides; bias (bf16, N)
// is added to every row of C when non-null (requires beta == 0). The descriptors and the
// algorithm are cached per shape in the Context (Context::gemm_plans()); a shape for which
// cuBLASLt has no algorithm aborts with a message naming it.
void gemm(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, void* C,
          int64_t ldc, bool c_is_fp32, const bf16* bias, cudaStream_t stream);
// The same reading the added term from c_in instead of C: C = alpha * op(A) @ op(B) + beta *
// c_in, c_in of C's type and row stride, left unchanged (cuBLASLt's separate C and D). c_in may
// be C itself (then this is gemm()). The sum is rounded once into C.
void gemm_separate_c(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, const void* c_in, void* C,
                     int64_t ldc, bool c_is_fp32, const bf16* bias, cudaStream_t stream);

// ---- LoRA adapters (kernels/lora.h; lora.cu) ------------------------------------------------
// The adapter's products are gemm()s (bf16 operands, fp32 accumulation), rounded to bf16 where
// CpuBf16Ops rounds: drop(x), t = drop(x) A^T and dt = scale * dy B (N,R), y and dx. Dropout's
// mask is kernels::lora_dropped's hash, drawn on the device, so no mask is stored; p == 0 skips
// every mask kernel. Rows go in chunks that fit the Context's scratch (t, dt and, with dropout,
// drop(x) and the fp32 product that joins dx), so the weight gradients add one GEMM per chunk.
// A (R,IC) and B (OC,R) are the adapter's bf16 compute copies. REQUIRES R > 0.
// y (N,OC) = round(y + scale * t B^T): the second GEMM reads y as its C (beta = 1).
void lora_forward(Context& ctx, bf16* y /*(N,OC)*/, const bf16* x /*(N,IC)*/, const bf16* A /*(R,IC)*/,
                  const bf16* B /*(OC,R)*/, float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC,
                  int64_t R, cudaStream_t stream);
// dB (OC,R) += scale * dy^T t; dA (R,IC) += dt^T drop(x) (fp32, beta = 1); dx (N,IC) = round(dx +
// drop'(dt A)): without dropout one GEMM onto dx, else the product in fp32 and a kernel that
// adds its kept elements, times 1 / (1 - p), rounding once. Each of dx, dA and dB is skipped when
// null (dA, dB: an adapter that is not trained), with the products only it needs.
void lora_backward(Context& ctx, bf16* dx /*(N,IC) or null*/, float* dA /*(R,IC) or null*/,
                   float* dB /*(OC,R) or null*/, const bf16* dy /*(N,OC)*/, const bf16* x /*(N,IC)*/,
                   const bf16* A /*(R,IC)*/, const bf16* B /*(OC,R)*/, float scale, const LoraDropout& drop, int64_t N,
                   int64_t IC, int64_t OC, int64_t R, cudaStream_t stream);

// ---- causal GQA attention (flash-style: the T x T scores never reach global memory) ---------
// The WMMA kernel: CudaOps runs it where cuDNN cannot serve a shape (kernels/attention_choice.h)
// or STRATA_ATTENTION=fallback asks for it.
// D in {64, 128}. Pointers 16-byte aligned. lse (B,Hq,T) fp32 is saved for backward.
// tile_rows: rows of the query/key tiles, 0 to pick per kernel the larger (64, else 32) that
// the device's opt-in shared memory per block allows; 32 or 64 force one (tests), and fail
// when it does not fit. The two agree up to rounding (other tile boundaries).
// past: keys of `past` cached positions precede the T queries' own (kernels/attention.h): k and v
// hold past + T rows per sequence and query t sees keys 0 .. past + t.
// positions (B,T) in device memory, or null: document masks (kernels/attention.h): query t sees
// keys t - positions[b, t] .. t only (past = 0). This is the kernel document-masked batches run
// on: the cuDNN graphs take no masks.
void attention_forward(bf16* out /*(B,T,Hq,D)*/, float* lse /*(B,Hq,T)*/,
                       const bf16* q /*(B,T,Hq,D)*/, const bf16* k /*(B,past+T,Hkv,D)*/,
                       const bf16* v /*(B,past+T,Hkv,D)*/, int64_t B, int64_t T, int64_t Hq,
                       int64_t Hkv, int64_t D, cudaStream_t stream, int tile_rows = 0,
                       int64_t past = 0, const int32_t* positions /*(B,T) or null*/ = nullptr);
// The least opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) a device
// needs to run attention for head dim D (64 or 128): that of the 32-row tiles, 76.25 KiB at
// most, so every sm_80+ GPU (99 KiB or more) runs it. Devices with more get 64-row tiles.
size_t attention_shared_bytes(int64_t D);
// Dynamic shared memory per block of the forward kernel / of the larger backward kernel for
// head dim D and tile_rows-row tiles (32 or 64): a device whose opt-in limit is lower cannot
// take that tile_rows.
size_t attention_forward_shared_bytes(int64_t D, int tile_rows);
size_t attention_backward_shared_bytes(int64_t D, int tile_rows);
// dq, dk, dv = (overwritten). Recomputes P from lse. Two kernels, no atomics: one owns key
// tiles (dk, dv summed over the query heads of the group), one owns query tiles (dq).
// tile_rows as for attention_forward, chosen for each of the two kernels. positions: the
// forward's document masks.
// Scratch: B*Hq*T floats (delta = rowsum(dout * out)).
void attention_backward(Context& ctx, bf16* dq /*(B,T,Hq,D)*/, bf16* dk /*(B,T,Hkv,D)*/,
                        bf16* dv /*(B,T,Hkv,D)*/, const bf16* dout /*(B,T,Hq,D)*/,
                        const bf16* q, const bf16* k, const bf16* v,
                        const bf16* out /*(B,T,Hq,D)*/, const float* lse /*(B,Hq,T)*/, int64_t B,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D, cudaStream_t stream,
                        int tile_rows = 0, const int32_t* positions /*(B,T) or null*/ = nullptr);

// ---- causal GQA attention on cuDNN's fused SDPA (cudnn_attention.cpp) -------------------------
// Same shapes, layout and scale (1/sqrt(D)) as attention_forward/backward above; lse is the
// natural-log logsumexp of each row of scaled scores, as there, in the same (B,Hq,T) layout.
// The forward and backward graphs of a shape are built together on first use and cached in the
// Context; so each shape is served by cuDNN in both directions or not at all, and a backward
// only ever reads the lse of a forward of the same implementation. Bitwise reproducible from run
// to run when the plan says `deterministic`.
//
// The cuDNN version loaded at run time (cudnnGetVersion(), e.g. 91900), or 0 when the build has
// no cuDNN.
int cudnn_version();
// Whether cuDNN serves a shape, and how.
struct CudnnAttentionPlan {
  bool ready = false;          // both graphs built, and their scratch fits the Context's
  bool deterministic = false;  // the backward runs in a fixed order (bitwise reproducible)
  std::string note;            // why not ready, or why not deterministic; else empty
};
// Builds and caches the two graphs of a shape (d_qk = D, d_v = Dv or D when 0; the softmax scale
// `scale`, or 1/sqrt(D) when 0: multi-head latent attention's 192/128 heads and YaRN scale) unless
// cached already: the
// backward in its fixed-order form, or where that fails in the faster form that accumulates dq
// with atomics. Not ready: `note` names the cuDNN call and status that failed (the graphs are
// then never tried again for the shape) or the scratch they would need beyond the Context's.
// Never aborts for a cuDNN status.
// causal = false: the graphs without the mask, every query seeing every key (ring attention's
// full blocks, model/ring_attention.h), cached apart from the causal ones.
CudnnAttentionPlan cudnn_attention_prepare(Context& ctx, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                           int64_t D, bool causal = true, int64_t Dv = 0, double scale = 0);
// REQUIRE: cudnn_attention_prepare found the shape ready. Workspace from ctx's scratch
// (the backward's also holds delta and an fp32 dq accumulator; prepare checks that it fits).
void cudnn_attention_forward(Context& ctx, bf16* out /*(B,T,Hq,D)*/, float* lse /*(B,Hq,T)*/,
                             const bf16* q /*(B,T,Hq,D)*/, const bf16* k /*(B,T,Hkv,D)*/,
                             const bf16* v /*(B,T,Hkv,D)*/, int64_t B, int64_t T, int64_t Hq,
                             int64_t Hkv, int64_t D, cudaStream_t stream, bool causal = true, int64_t Dv = 0,
                             double scale = 0);
void cudnn_attention_backward(Context& ctx, bf16* dq /*(B,T,Hq,D)*/, bf16* dk /*(B,T,Hkv,D)*/,
                              bf16* dv /*(B,T,Hkv,D)*/, const bf16* dout /*(B,T,Hq,D)*/,
                              const bf16* q, const bf16* k, const bf16* v,
                              const bf16* out /*(B,T,Hq,D)*/, const float* lse /*(B,Hq,T)*/,
                              int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                              cudaStream_t stream, bool causal = true, int64_t Dv = 0, double scale = 0);

// ---- ring attention's blocks (ring_blocks.cu) ----------------------------------------------------
// Merges one block's attention (block_out bf16 (B,T,Hq,Dv), block_lse (B,Hq,T)) into the running
// fp32 out and lse of the blocks before, by their log-sum-exps; without accumulate, writes them.
void attention_merge(float* out, float* lse, const bf16* block_out, const float* block_lse, int64_t B, int64_t T,
                     int64_t Hq, int64_t Dv, bool accumulate, cudaStream_t stream);
// sum (n) = (accumulate ? sum : 0) + x, in fp32.
void add_bf16_to_f32(float* sum, const bf16* x, int64_t n, bool accumulate, cudaStream_t stream);

// ---- LM head + cross-entropy, chunked over tokens --------------------------------------------
// Per chunk of chunk_tokens tokens: logits (fp32, scratch) = x @ weight^T; one fused kernel
// writes the per-token loss and dlogits = (softmax - onehot) * grad_scale (bf16, scratch);
// then dx = dlogits @ weight and dweight += dlogits^T @ x. losses (N) = per-token
// -log softmax[target], 0 where target < 0 (masked; no gradient there). dx = (skipped when
// null); dweight (fp32) += (skipped when null). Scratch: lm_head_scratch_bytes(...).
// Sum the losses with sum() below.
void lm_head_cross_entropy(Context& ctx, float* losses /*(N)*/, bf16* dx /*(N,C)*/,
                           float* dweight /*(V,C)*/, const bf16* x /*(N,C)*/,
                           const bf16* weight /*(V,C)*/, const int32_t* targets /*(N)*/,
                           int64_t N, int64_t C, int64_t V, float grad_scale,
                           int64_t chunk_tokens, cudaStream_t stream);
size_t lm_head_scratch_bytes(int64_t C, int64_t V, int64_t chunk_tokens);
// The same over weight (and dweight) in row blocks, HOST arrays of device pointers as for
// embedding_forward_blocked; dweight_blocks may be null. The logits GEMM and the weight-gradient
// GEMMs run per block; dx sums the blocks in fp32 (scratch) and is rounded once. One block
// (block_rows >= V) is lm_head_cross_entropy itself. Scratch: lm_head_blocked_scratch_bytes.
void lm_head_cross_entropy_blocked(Context& ctx, float* losses /*(N)*/, bf16* dx /*(N,C)*/,
                                   float* const* dweight_blocks, const bf16* x /*(N,C)*/,
                                   const bf16* const* weight_blocks, int64_t block_rows,
                                   const int32_t* targets /*(N)*/, int64_t N, int64_t C, int64_t V,
                                   float grad_scale, int64_t chunk_tokens, cudaStream_t stream);
size_t lm_head_blocked_scratch_bytes(int64_t C, int64_t V, int64_t chunk_tokens);

// ---- AdamW over many tensors per launch -----------------------------------------------------
// One tensor's buffers: fp32 master weight, fp32 gradient, fp32 moments, and optionally the
// bf16 compute copy written from the updated master weight (null: not written).
struct AdamWTensor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  bf16* param_bf16;
  int64_t n;
};
// Same per-element operations (and roundings) as kernels::ref::adamw_step: the results are
// bitwise equal to the CPU reference. `tensors` is a HOST array of `count` entries.
void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p, cudaStream_t stream);
// The same, with the gradient clipping factor read on the device: grad_scale (device float,
// written by clip_factor) multiplies every gradient as it is read (one fp32 multiply, rounded
// as scale_inplace rounds it; the gradients in memory are left alone). A NaN factor (the
// gradient norm was not finite) leaves every tensor unchanged: the step is skipped on the
// device, and the caller, reading the norm later, does not count it. Null grad_scale: 1.
void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p, const float* grad_scale,
                cudaStream_t stream);
// The same, also checking what it writes: nonfinite (device int, or null: not checked) is set to
// 1 by every thread that writes a NaN or Inf master value, and left alone otherwise; the check
// runs in the loop that writes them. The caller zeroes it first and reads it where it waits for
// the stream anyway (a skipped step writes nothing and leaves it alone).
void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p, const float* grad_scale, int* nonfinite,
                cudaStream_t stream);

// AdamW on one tensor whose moments are stored compactly (kernels/moments.h): bitwise the
// bytes and parameters of kernels::cpu::adamw_step_compact. param, grad (n) fp32; m and v
// each moment_bytes(format, n) bytes, 4-byte aligned, updated in place (the int8 padding is
// not touched).
void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, cudaStream_t stream);
// The same with grad_scale as in adamw_step (device float or null; NaN: nothing changes).
void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, const float* grad_scale,
                        cudaStream_t stream);
// The same with nonfinite as in adamw_step (device int or null).
void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, const float* grad_scale, int* nonfinite,
                        cudaStream_t stream);

// ---- reductions for gradient clipping and losses ---------------------------------------------
// *out (device double) = sum of x[i]^2 (accumulate: += instead of =). Deterministic two-pass
// reduction in double: fixed-size block partials in scratch, then one block sums them in order.
void sum_squares(Context& ctx, double* out /*(1)*/, const float* x /*(n)*/, int64_t n,
                 bool accumulate, cudaStream_t stream);
// *out (device double) = sum of x[i] (accumulate: +=), same scheme.
void sum(Context& ctx, double* out /*(1)*/, const float* x /*(n)*/, int64_t n, bool accumulate,
         cudaStream_t stream);
// x *= s
void scale_inplace(float* x /*(n)*/, int64_t n, float s, cudaStream_t stream);

// ---- the global gradient norm and the clip factor without a host round trip -----------------
// One gradient buffer of a multi-tensor reduction: n fp32 values at x (device memory).
struct NormTensor {
  const float* x;
  int64_t n;
};
// *out (device double) = sum over the `count` tensors of the HOST array `tensors` of x[i]^2
// (accumulate: += instead of =), in double. Up to kMaxNormTensorsPerLaunch tensors per launch:
// the tensors are cut into fixed chunks of elements, numbered in table order; block b of a
// fixed-size grid sums chunks b, b + grid, ... in that order and writes one partial to scratch,
// and one block adds the partials in block order. The result depends on the table's sizes
// only (not on timing), so it is reproducible; it is not bitwise the per-tensor sum_squares.
constexpr int kMaxNormTensorsPerLaunch = 64;
void multi_tensor_sum_squares(Context& ctx, double* out /*(1)*/, const NormTensor* tensors, int count,
                              bool accumulate, cudaStream_t stream);
// From *sum_squares (device double): *norm = sqrt(sum_squares) (skipped when norm is null) and
// *factor = kernels::clip_coefficient(norm, max_norm) bit for bit when the norm is finite, NaN
// when it is not (so that AdamW reading the factor skips the step). Device pointers; one thread.
void clip_factor(float* factor /*(1)*/, double* norm /*(1)*/, const double* sum_squares /*(1)*/, double max_norm,
                 cudaStream_t stream);

// ---- mixture of experts (kernels/moe.h) -----------------------------------------------------
// Shapes and semantics as in kernels/moe.h; S = N*K slots. REQUIRES N*K < 2^31.
// Storage: the router is fp32 end to end (logits, probs, routing weights and their gradients:
// small, and the top-k choices must be the reference's); token activations moved by
// gather/combine (x, xs, ys, out and their gradients) and the experts' SwiGLU intermediates
// are bf16, with fp32 accumulation inside every op; the experts' weights are their bf16 compute
// copies and their gradients fp32 (`+=`), as everywhere in this backend.

// One warp per token; probabilities, selection scores and weights are computed in double like
// the reference, so the selected experts agree with it (ties to the lower expert index) except
// where two scores differ by less than a double rounding. REQUIRES E <= 2048.
void moe_route_forward(int32_t* expert_idx /*(N,K)*/, float* weights /*(N,K)*/,
                       float* probs /*(N,E)*/, const float* logits /*(N,E)*/,
                       const float* selection_bias /*(E) or null*/, int64_t N,
                       const RouterConfig& config, cudaStream_t stream);
// dlogits (N,E) = (overwritten). One warp per token, double arithmetic. REQUIRES E <= 2048.
void moe_route_backward(float* dlogits /*(N,E)*/, const float* dweights /*(N,K)*/,
                        const float* prob_grad /*(E) or null*/, const float* probs /*(N,E)*/,
                        const int32_t* expert_idx /*(N,K)*/, const float* weights /*(N,K)*/,
                        int64_t N, const RouterConfig& config, cudaStream_t stream);
// Stable sort of the N*K assignments by expert: a CUB radix sort of (expert, assignment)
// pairs in scratch (one 8-bit counting pass when E <= 256), so the slots are exactly the
// reference's: by expert, then (token, k). Traps on an expert index outside [0, E).
// Scratch: moe_permute_scratch_bytes(N * K, E).
void moe_permute(Context& ctx, int32_t* slot_of /*(N,K)*/, int32_t* token_of_slot /*(N*K)*/,
                 int64_t* expert_offsets /*(E+1)*/, const int32_t* expert_idx /*(N,K)*/,
                 int64_t N, int64_t K, int64_t E, cudaStream_t stream);
size_t moe_permute_scratch_bytes(int64_t assignments, int64_t E);
// kernels/moe.h moe_tile_offsets, on the device (both arrays device memory).
void moe_tile_offsets(int64_t* tile_offsets /*(E+1)*/, const int64_t* expert_offsets /*(E+1)*/, int64_t E,
                      int64_t row0, int64_t rows, cudaStream_t stream);
// xs = x[token_of_slot] (a copy: exact).
void moe_gather(bf16* xs /*(S,C)*/, const bf16* x /*(N,C)*/,
                const int32_t* token_of_slot /*(S)*/, int64_t S, int64_t C, cudaStream_t stream);
// dx (N,C) = (overwritten); each element sums its token's K slots in k order in fp32 and
// rounds once.
void moe_gather_backward(bf16* dx /*(N,C)*/, const bf16* dxs /*(N*K,C)*/,
                         const int32_t* slot_of /*(N,K)*/, int64_t N, int64_t K, int64_t C,
                         cudaStream_t stream);
// out (N,C) = (overwritten), k order; fp32 weights and sum, one rounding.
void moe_combine_forward(bf16* out /*(N,C)*/, const bf16* ys /*(N*K,C)*/,
                         const float* weights /*(N,K)*/, const int32_t* slot_of /*(N,K)*/,
                         int64_t N, int64_t K, int64_t C, cudaStream_t stream);
// dys (N*K,C) = (the fp32 product w * dout, rounded once), dweights (N,K) = (fp32); one warp
// per (token, k), dot products by a fixed-order warp reduction.
void moe_combine_backward(bf16* dys /*(N*K,C)*/, float* dweights /*(N,K)*/,
                          const bf16* dout /*(N,C)*/, const bf16* ys /*(N*K,C)*/,
                          const float* weights /*(N,K)*/, const int32_t* slot_of /*(N,K)*/,
                          int64_t N, int64_t K, int64_t C, cudaStream_t stream);
// The experts' SwiGLU MLPs. The activation GEMMs (gate, up, ys; dact, dxs) are grouped GEMMs
// (cublasGemmGroupedBatchedEx: bf16 A, B and C, fp32 accumulation, one group per expert with
// rows); the weight gradients, which cuBLAS's grouped GEMM cannot write in fp32, are one
// cuBLASLt gemm() per expert with rows (bf16 inputs, fp32 C, beta = 1). The pointer arrays of
// `w` (bf16 compute copies) and `dw` (fp32) are HOST arrays of E device pointers; the gradient
// tensors of different experts must not overlap. The launch shapes come from the host: each
// call copies expert_offsets (E+1 int64s) to the host and synchronises the stream. The grouped
// GEMMs' device pointer tables go to scratch (at most 9 * E pointers). REQUIRES C, F and the
// rows of every expert < 2^31.
void moe_experts_forward(Context& ctx, bf16* ys /*(S,C)*/, bf16* gate /*(S,F)*/,
                         bf16* up /*(S,F)*/, bf16* act /*(S,F)*/, const bf16* xs /*(S,C)*/,
                         const int64_t* expert_offsets /*(E+1)*/,
                         const ExpertTensors<const bf16>& w, int64_t E, int64_t C, int64_t F,
                         cudaStream_t stream);
// dxs (S,C) =; dw.gate/up/down (fp32) += (an expert's null entry: that gradient is skipped, a
// frozen weight); dgate, dup, dact (S,F) are scratch (overwritten).
// dxs = dgate @ W_gate, then += dup @ W_up: two bf16 roundings, like the dense MLP's dx.
void moe_experts_backward(Context& ctx, bf16* dxs /*(S,C)*/, const ExpertTensors<float>& dw,
                          bf16* dgate /*(S,F)*/, bf16* dup /*(S,F)*/, bf16* dact /*(S,F)*/,
                          const bf16* dys /*(S,C)*/, const bf16* xs /*(S,C)*/,
                          const bf16* gate /*(S,F)*/, const bf16* up /*(S,F)*/,
                          const bf16* act /*(S,F)*/, const int64_t* expert_offsets /*(E+1)*/,
                          const ExpertTensors<const bf16>& w, int64_t E, int64_t C, int64_t F,
                          cudaStream_t stream);
// counts (E) += (integer atomics: exact); prob_sums (E) += column sums of probs in double, in a
// fixed order. Traps on an expert index outside [0, E).
void moe_router_stats(int64_t* counts /*(E)*/, double* prob_sums /*(E)*/,
                      const int32_t* expert_idx /*(N,K)*/, const float* probs /*(N,E)*/,
                      int64_t N, int64_t K, int64_t E, cudaStream_t stream);

}  // namespace strata::kernels::cuda
