// CudaOps: the CUDA backend of the decoder's op set (model/decoder.h; the CPU ones are in
// kernels/cpu/backend.h, with the same members). The bf16 recipe: bf16 activations and compute
// weights, fp32 accumulation inside every op, fp32 parameter gradients, statistics and router.
// Its CPU reference is CpuBf16Ops, which rounds at the same points.
//
// One CudaOps belongs to one model on one Device: it owns the model's compute stream, the
// kernels' Context (cuBLASLt handle, scratch and GEMM workspace) and the activation block, all
// of whose memory comes from the Device's budgeted arena, so memory.device bounds them. Every op
// is queued on the compute stream; the ops that return host values (the loss, the expert
// offsets, the router statistics) synchronise it, and so does synchronize(), which the model
// calls before it hands a group back to the paging layer.
//
// Vocabulary tensors in row blocks (ParamLayout::block_rows, each block a chunk-space tensor of
// its own) are computed block by block (the *_blocked ops of kernels/cuda/ops.h).
// Not thread-safe; movable, not copyable. CUDA errors abort (CUDA_CHECK).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "core/cuda/cuda_timeline.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "kernels/attention.h"
#include "kernels/attention_choice.h"
#include "kernels/columns.h"
#include "kernels/cuda/ops.h"
#include "kernels/experts_loop.h"
#include "kernels/lora.h"
#include "kernels/micro_batch_shape.h"
#include "kernels/moe.h"

namespace strata::kernels {

class CudaOps {
 public:
  using Act = cuda::bf16;
  using W = cuda::bf16;
  static constexpr DType kWeightDType = DType::kBF16;
  static constexpr const char* kName = "cuda bf16";
  static constexpr size_t kScratchBytes = cuda::Context::kDefaultScratchBytes;
  static constexpr size_t kGemmWorkspaceBytes = cuda::Context::kDefaultGemmWorkspaceBytes;

  // REQUIRES: `device` is a CUDA device, outlives the ops, and is current on the calling thread.
  // Takes kScratchBytes + kGemmWorkspaceBytes of its arena: OutOfMemory (the arena's message,
  // naming the budget) when they do not fit. Reads STRATA_ATTENTION (auto, cudnn or fallback;
  // unset is auto): InvalidArgument for any other value.
  static Result<CudaOps> create(Device& device);
  // What the current device and the loaded cuDNN offer attention (kernels/attention_choice.h).
  static AttentionCapability attention_capability();
  // The implementation that serves attention of this shape: chosen on first use (cuDNN's graphs
  // built then, the fallback taken if that fails), logged once, then fixed, so that a backward
  // always runs the implementation of its forward. CHECK-fails when none can serve the shape.
  AttentionImpl attention_impl(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D);
  ~CudaOps();
  CudaOps(CudaOps&&) noexcept;
  CudaOps& operator=(CudaOps&&) = delete;
  CudaOps(const CudaOps&) = delete;

  cudaStream_t stream() const { return stream_; }
  Stream* compute_stream() { return compute_.get(); }
  // Device memory: a Comm moves it queued on the compute stream, in its order (no host marks).
  static constexpr bool kHostMemory = false;
  using HostMark = int;
  HostMark host_mark() { return 0; }
  void wait_host_mark(HostMark /*mark*/) {}
  cuda::Context& context() { return *ctx_; }

  // The activation table's block, and with it the ops' own per-micro-batch buffers for a
  // micro-batch of that shape (per-token losses, a rounded router gradient, router statistics,
  // the LM head's logits chunks), so that no op allocates later. All from the arena;
  // OutOfMemory names the request and the budget.
  Result<void*> activation_block(uint64_t bytes, const MicroBatchShape& shape);
  // The bytes of those buffers (what activation_block takes besides `bytes`).
  static uint64_t extra_activation_bytes(const MicroBatchShape& shape);
  // Tokens per LM-head chunk for N tokens: as many as the LM head's buffer holds, up to
  // kernels::kLmHeadTargetChunkTokens (kernels/lm_head_chunks.h), evened over the micro-batch.
  int64_t lm_head_chunk_tokens(int64_t N, int64_t C, int64_t V) const;
  void synchronize();
  // Marks, in the queue, where the ops of a phase of the step begin (kernels/cpu/queued_ops.h
  // does the same on the CPU): while tracing, each phase is timed on the GPU with CUDA events
  // and shown as a span of the "compute stream" track (core/cuda/cuda_timeline.h), so profiles
  // show device time; null ends the last phase.
  void trace_phase(const char* name, int64_t index = trace::kNoIndex);
  const float* stage_constants(const float* host, int64_t n);
  const int32_t* stage_tokens(const int32_t* host, int64_t N, int32_t* slot);
  const int64_t* stage_offsets(const int64_t* host, int64_t n, int64_t* slot);
  const int64_t* expert_offsets_on_host(const int64_t* offsets, int64_t E);
  // host (n) = src (n) on the device, waiting for it (generation's logits).
  void copy_to_host(float* host, const float* src, int64_t n);

  void embedding_forward(Act* out, const int32_t* tokens, const W* const* table_blocks, int64_t block_rows, int64_t N,
                         int64_t C, int64_t V);
  void embedding_backward(float* const* dtable_blocks, int64_t block_rows, const Act* dout, const int32_t* tokens,
                          int64_t N, int64_t C, int64_t V);
  void rmsnorm_forward(Act* out, float* rstd, const Act* x, const W* weight, int64_t N, int64_t C, float eps);
  void rmsnorm_backward(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight, const float* rstd,
                        int64_t N, int64_t C);
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC);
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC);
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC);
  void linear_forward_f32(float* out, const Act* x, const W* weight, int64_t N, int64_t IC, int64_t OC);
  void linear_backward_f32(Act* dx, float* dweight, const float* dout, const Act* x, const W* weight, int64_t N,
                           int64_t IC, int64_t OC);
  void rope_forward(Act* out, const Act* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                    float scale, int64_t past = 0, const int32_t* positions = nullptr);
  void rope_backward(Act* dx, const Act* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                     float scale, const int32_t* positions = nullptr);
  // past > 0 (queries after cached keys, kernels/attention.h) runs the WMMA kernel. So do document
  // masks (positions non-null, staged by stage_tokens): the cuDNN graphs built here take no
  // sequence lengths or ragged offsets yet, so a document-masked batch never runs on cuDNN.
  // A value head dim apart from D or a caller's scale (kernels/attention.h; multi-head latent
  // attention's 192/128 heads) runs on cuDNN's graph built for it, whole causal sequences only
  // (no document masks, cached keys or ring blocks), and aborts naming the shape where cuDNN
  // cannot build it.
  // Builds (once) cuDNN's graphs for latent attention's shape, or aborts naming why not.
  void prepare_latent_attention(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, double scale);
  void attention_forward(Act* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B, int64_t T,
                         int64_t Hq, int64_t Hkv, int64_t D, int64_t past = 0, const int32_t* positions = nullptr,
                         int64_t Dv = 0, double scale = 0);
  void attention_backward(Act* dq, Act* dk, Act* dv, const Act* dout, const Act* q, const Act* k, const Act* v,
                          const Act* out, const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                          const int32_t* positions = nullptr, int64_t Dv = 0, double scale = 0);
  // Ring attention's blocks (context parallelism, model/ring_attention.h): the causal block is the
  // whole-sequence attention of its chunk (cuDNN or the WMMA kernel, as the shape chooses), a
  // full block cuDNN's graph without the mask; each block's bf16 results then join the fp32 sums
  // (ring_blocks.cu). Compiled, not yet run on a GPU: the trainer still refuses
  // parallel.context_parallel on CUDA. The block's buffer (ring_block_) is not in the plan yet.
  void attention_block_forward(float* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B, int64_t Tq,
                               int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask, bool accumulate,
                               int64_t Dv = 0, double scale = 0);
  void attention_block_backward(float* dq, float* dk, float* dv, const Act* dout, const Act* q, const Act* k,
                                const Act* v, const Act* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                                int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask, bool accumulate_dq,
                                bool accumulate_dkv, int64_t Dv = 0, double scale = 0);
  // LoRA adapters (kernels/lora.h): cuda::lora_forward / lora_backward (ops.h), their chunks'
  // buffers in the kernels' scratch. The fp8 recipe runs these too: adapters are bf16 tensors.
  void lora_forward(Act* y, const Act* x, const W* A, const W* B, float scale, const LoraDropout& drop, int64_t N,
                    int64_t IC, int64_t OC, int64_t R);
  void lora_backward(Act* dx, float* dA, float* dB, const Act* dy, const Act* x, const W* A, const W* B, float scale,
                     const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R);
  void round_activations(Act* dst, const float* src, int64_t n);
  void swiglu_forward(Act* out, const Act* gate, const Act* up, int64_t n);
  void swiglu_backward(Act* dgate, Act* dup, const Act* dout, const Act* gate, const Act* up, int64_t n);
  void add_inplace(Act* a, const Act* b, int64_t n);
  void copy_columns(Act* dst, int64_t ld_dst, const Act* src, int64_t ld_src, int64_t rows, int64_t cols,
                    ColumnOrder order);
  void sum_head_columns(Act* dst, const Act* src, int64_t ld_src, int64_t head_stride, int64_t rows, int64_t heads,
                        int64_t cols);
  // Runs in the LM head's buffer (kernels' scratch before activation_block), chunk_tokens at a
  // time (the decoder passes lm_head_chunk_tokens(); a larger one is halved until it fits).
  double lm_head_cross_entropy(Act* dx, float* const* dweight_blocks, const Act* x, const W* const* weight_blocks,
                               int64_t block_rows, const int32_t* targets, int64_t N, int64_t C, int64_t V,
                               float grad_scale, int64_t chunk_tokens);

  void moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                         const float* selection_bias /*HOST (E) or null*/, int64_t N, const RouterConfig& config);
  void moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad /*HOST (E) or null*/,
                          const float* probs, const int32_t* expert_idx, const float* weights, int64_t N,
                          const RouterConfig& config);
  void moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets, const int32_t* expert_idx,
                   int64_t N, int64_t K, int64_t E);
  void moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0, int64_t rows);
  // counts, prob_sums: HOST arrays, added to (the device's statistics are copied back).
  void moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx, const float* probs, int64_t N,
                        int64_t K, int64_t E);
  void moe_gather(Act* xs, const Act* x, const int32_t* token_of_slot, int64_t S, int64_t C);
  void moe_gather_backward(Act* dx, const Act* dxs, const int32_t* slot_of, int64_t N, int64_t K, int64_t C);
  void moe_combine_forward(Act* out, const Act* ys, const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                           int64_t C);
  void moe_combine_backward(Act* dys, float* dweights, const Act* dout, const Act* ys, const float* weights,
                            const int32_t* slot_of, int64_t N, int64_t K, int64_t C);
  void moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F);
  void moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact, const Act* dys,
                            const Act* xs, const Act* gate, const Act* up, const Act* act,
                            const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E, int64_t C,
                            int64_t F);
  void shared_expert_combine(Act* out, const Act* shared_out, const float* logit, int64_t N, int64_t C);
  void shared_expert_backward(Act* dshared, float* dlogit, const Act* dout, const Act* shared_out, const float* logit,
                              int64_t N, int64_t C);

 protected:
  explicit CudaOps(Device& device) : device_(&device) {}
  // A device buffer of at least `bytes` from the arena (grown after the stream drains).
  void* grow(DeviceAllocation& buffer, uint64_t bytes, const char* what);

  Device* device_ = nullptr;
  std::unique_ptr<Stream> compute_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaTimeline> timeline_;  // the compute stream's phases, while tracing
  DeviceAllocation scratch_, workspace_;
  std::unique_ptr<cuda::Context> ctx_;
  DeviceAllocation block_;      // the activation table
  DeviceAllocation constants_;  // RoPE frequencies
  DeviceAllocation losses_;     // (N) per-token NLL
  DeviceAllocation sums_;       // (1) double: the loss sum
  DeviceAllocation rounded_;    // an fp32 output gradient rounded to bf16
  DeviceAllocation lm_head_;    // the LM head's scratch: logits chunks (lm_head_device_scratch_bytes)
  DeviceAllocation router_;     // selection bias or prob_grad (E floats), counts (E) and prob sums (E)
  // Ring attention: one block's output and lse, or its dq, dk and dv, before they join the sums.
  DeviceAllocation ring_block_;
  std::vector<int64_t> host_offsets_;
  AttentionCapability attention_capability_;
  AttentionForce attention_force_ = AttentionForce::kAuto;
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>, AttentionImpl> attention_impls_;  // B,T,Hq,Hkv,D
  bool logged_document_masks_ = false;  // the WMMA kernel's taking document-masked batches, said once
};

// An op set of CudaOps whose experts run as a loop over experts of Self's own linear ops
// (kernels/experts_loop.h; Self has accumulate_data_grad), each expert's weights in Self's
// format: the expert offsets are read back to the host, which synchronises the stream.
template <class Self>
class CudaLoopedExperts : public CudaOps {
 public:
  void moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F) {
    const int64_t* offsets = expert_offsets_on_host(expert_offsets, E);
    looped_experts::forward(static_cast<Self&>(*this), ys, gate, up, act, xs, offsets, w, E, C, F);
  }
  void moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact, const Act* dys,
                            const Act* xs, const Act* gate, const Act* up, const Act* act,
                            const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E, int64_t C,
                            int64_t F) {
    const int64_t* offsets = expert_offsets_on_host(expert_offsets, E);
    looped_experts::backward(static_cast<Self&>(*this), dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, offsets, w,
                             E, C, F);
  }

 protected:
  explicit CudaLoopedExperts(CudaOps&& base) : CudaOps(std::move(base)) {}
};

// The fp8 recipe on CUDA (DeepSeek-V3's; its CPU reference is CpuFp8Ops, kernels/cpu/backend.h):
// the bf16 recipe, except that the linear layers' GEMMs (attention and MLP projections, the
// experts, the shared expert) read E4M3 operands with block scales (kernels/cuda/fp8.h's
// fp8_linear_*), and the compute copy of a linear layer's weight is its stored E4M3 blocks, typed
// as the W pointers every other tensor has. The experts run as a loop over experts of those
// linear ops (kernels/experts_loop.h), as CpuFp8Ops runs them. Embedding, norms, attention,
// router, the shared expert's gate, the LM head and the LoRA adapters (bf16 tensors, not fp8
// linear weights) are the bf16 recipe's. The members declared here hide CudaOps' of the same name.
class CudaFp8Ops : public CudaLoopedExperts<CudaFp8Ops> {
 public:
  static constexpr DType kWeightDType = DType::kF8E4M3;
  static constexpr const char* kName = "cuda fp8";

  // As CudaOps::create.
  static Result<CudaFp8Ops> create(Device& device);
  // CudaOps' buffers and the quantised operands of the widest linear layer at N tokens (an
  // expert's at N * K rows, its most).
  Result<void*> activation_block(uint64_t bytes, const MicroBatchShape& shape);
  static uint64_t extra_activation_bytes(const MicroBatchShape& shape);

  // weight: E4M3 blocks of (OC, IC).
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC);
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC);
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC);
  // dx (N,IC) = round(dx + q(dout) @ W), dweight += q(dout)^T @ q(x) (null: skipped, a frozen
  // expert): the experts' second data gradient accumulating onto the first (kernels/experts_loop.h).
  void accumulate_data_grad(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight, int64_t N,
                            int64_t IC, int64_t OC);

 private:
  explicit CudaFp8Ops(CudaOps&& base) : CudaLoopedExperts(std::move(base)) {}
  // The operand buffer for a linear layer of N tokens (grown, after the stream drains, when a
  // call needs more than activation_block planned).
  void* operands(int64_t N, int64_t IC, int64_t OC);

  DeviceAllocation operands_;
};

// The nf4 base on CUDA (LoRA's frozen linear weights as NF4, lora.base=nf4; its CPU reference is
// CpuNf4Ops): the bf16 recipe, except that each linear op first dequantises its weight's NF4 bytes
// into a bf16 buffer (kernels/cuda/nf4.h: exactly the values CpuNf4Ops rounds to) and runs the
// bf16 op on them, on the same stream, so the buffer is reused op after op. The experts run as a
// loop over experts of those ops (kernels/experts_loop.h). The weights are frozen: weight
// gradients of them must be null. The members declared here hide CudaOps' of the same name.
class CudaNf4Ops : public CudaLoopedExperts<CudaNf4Ops> {
 public:
  static constexpr DType kWeightDType = DType::kNF4;
  static constexpr const char* kName = "cuda nf4 base";

  // As CudaOps::create.
  static Result<CudaNf4Ops> create(Device& device);
  // CudaOps' buffers and the dequantised weight's, sized for the widest linear layer
  // (kernels::nf4_dequantized_weight_bytes), planned with the activation table.
  Result<void*> activation_block(uint64_t bytes, const MicroBatchShape& shape);
  static uint64_t extra_activation_bytes(const MicroBatchShape& shape);

  // weight: the NF4 bytes of (OC, IC).
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC);
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC);
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC);
  // dx (N,IC) = round(dx + dout @ W), one rounding (cuBLASLt's beta = 1 onto the bf16 output), as
  // CpuBf16Ops::accumulate_data_grad: the experts' second data gradient onto the first.
  void accumulate_data_grad(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight, int64_t N,
                            int64_t IC, int64_t OC);

 private:
  explicit CudaNf4Ops(CudaOps&& base) : CudaLoopedExperts(std::move(base)) {}
  // The (OC, IC) weight at `weight` (NF4 bytes) dequantised into weight_'s bf16 buffer (grown,
  // after the stream drains, for a weight wider than the planned one).
  const W* dequantized(const W* weight, int64_t OC, int64_t IC);

  DeviceAllocation weight_;
};

}  // namespace strata::kernels
