// CudaOps: the decoder's op set on kernels::cuda (see backend.h).
#include "kernels/cuda/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_device.h"
#include "core/log.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/lm_head_chunks.h"

namespace strata::kernels {

Result<CudaOps> CudaOps::create(Device& device) {
  if (device.kind() != DeviceKind::kCuda) return Status::InvalidArgument("CudaOps needs a CUDA device, not " + device.name());
  const char* attention = std::getenv("STRATA_ATTENTION");
  Result<AttentionForce> force = parse_attention_force(attention == nullptr ? "" : attention);
  if (!force.ok()) return force.status();
  CudaOps ops(device);
  ops.attention_force_ = force.value();
  ops.attention_capability_ = attention_capability();
  ops.compute_ = device.create_stream();
  ops.stream_ = as_cuda_stream(*ops.compute_).handle();
  ops.timeline_ = std::make_unique<CudaTimeline>("compute stream");
  ASSIGN_OR_RETURN(ops.scratch_, device.allocate(kScratchBytes));
  ASSIGN_OR_RETURN(ops.workspace_, device.allocate(kGemmWorkspaceBytes));
  ASSIGN_OR_RETURN(ops.sums_, device.allocate(sizeof(double)));
  ops.ctx_ = std::make_unique<cuda::Context>(ops.scratch_.data(), kScratchBytes, ops.workspace_.data(),
                                             kGemmWorkspaceBytes);
  return ops;
}

CudaOps::CudaOps(CudaOps&&) noexcept = default;

CudaOps::~CudaOps() {
  if (compute_ != nullptr) synchronize();
}

void CudaOps::synchronize() {
  trace::Span wait("wait", "compute stream");  // profiles split it by the phases the stream ran
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  timeline_->flush(/*wait=*/false);  // every point has completed
}

void CudaOps::trace_phase(const char* name, int64_t index) { timeline_->point(stream_, "compute", name, index); }

void* CudaOps::grow(DeviceAllocation& buffer, uint64_t bytes, const char* what) {
  if (buffer && buffer.size() >= bytes) return buffer.data();
  synchronize();  // the old buffer may still be in use
  buffer.reset();
  Result<DeviceAllocation> a = device_->allocate(bytes);
  CHECK_MSG(a.ok(), std::string(what) + ": " + a.status().to_string());
  buffer = std::move(a).value();
  return buffer.data();
}

uint64_t CudaOps::extra_activation_bytes(const MicroBatchShape& shape) {
  [[maybe_unused]] const auto [N, E, K, C, F, V, P] = shape;
  const uint64_t n = static_cast<uint64_t>(N), e = static_cast<uint64_t>(std::max<int64_t>(E, 1));
  // losses, rounded, router, the LM head's chunks; alignment
  return n * sizeof(float) + n * e * sizeof(Act) + 20 * e + lm_head_device_scratch_bytes(std::max<int64_t>(N, 1), C, V) +
         4 * 256;
}

Result<void*> CudaOps::activation_block(uint64_t bytes, const MicroBatchShape& shape) {
  [[maybe_unused]] const auto [N, E, K, C, F, V, P] = shape;
  synchronize();
  block_.reset();
  losses_.reset();
  rounded_.reset();
  router_.reset();
  lm_head_.reset();
  const int64_t e = std::max<int64_t>(E, 1);
  for (auto [buffer, size] : {std::pair{&block_, bytes}, std::pair{&losses_, static_cast<uint64_t>(N) * sizeof(float)},
                              std::pair{&rounded_, static_cast<uint64_t>(N * e) * sizeof(Act)},
                              std::pair{&router_, static_cast<uint64_t>(e) * 20},
                              std::pair{&lm_head_, lm_head_device_scratch_bytes(std::max<int64_t>(N, 1), C, V)}}) {
    Result<DeviceAllocation> a = device_->allocate(size);
    if (!a.ok()) return a.status().with_context("the activation table");
    *buffer = std::move(a).value();
  }
  CUDA_CHECK(cudaMemsetAsync(block_.data(), 0, bytes, stream_));
  return block_.data();
}

const float* CudaOps::stage_constants(const float* host, int64_t n) {
  float* dev = static_cast<float*>(grow(constants_, static_cast<uint64_t>(n) * sizeof(float), "RoPE constants"));
  CUDA_CHECK(cudaMemcpyAsync(dev, host, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  synchronize();
  return dev;
}

const int32_t* CudaOps::stage_tokens(const int32_t* host, int64_t N, int32_t* slot) {
  // From pageable memory the copy is staged before this returns, so the caller may reuse `host`.
  CUDA_CHECK(cudaMemcpyAsync(slot, host, static_cast<size_t>(N) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  return slot;
}

void CudaOps::copy_to_host(float* host, const float* src, int64_t n) {
  CUDA_CHECK(cudaMemcpyAsync(host, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  synchronize();
}

const int64_t* CudaOps::stage_offsets(const int64_t* host, int64_t n, int64_t* slot) {
  CUDA_CHECK(cudaMemcpyAsync(slot, host, static_cast<size_t>(n) * sizeof(int64_t), cudaMemcpyHostToDevice, stream_));
  return slot;
}

const int64_t* CudaOps::expert_offsets_on_host(const int64_t* offsets, int64_t E) {
  host_offsets_.resize(static_cast<size_t>(E + 1));
  CUDA_CHECK(cudaMemcpyAsync(host_offsets_.data(), offsets, host_offsets_.size() * sizeof(int64_t),
                             cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return host_offsets_.data();
}

void CudaOps::embedding_forward(Act* out, const int32_t* tokens, const W* const* table_blocks, int64_t block_rows,
                                int64_t N, int64_t C, int64_t V) {
  cuda::embedding_forward_blocked(out, tokens, table_blocks, block_rows, N, C, V, stream_);
}

void CudaOps::embedding_backward(float* const* dtable_blocks, int64_t block_rows, const Act* dout,
                                 const int32_t* tokens, int64_t N, int64_t C, int64_t V) {
  cuda::embedding_backward_blocked(*ctx_, dtable_blocks, block_rows, dout, tokens, N, C, V, stream_);
}

void CudaOps::rmsnorm_forward(Act* out, float* rstd, const Act* x, const W* weight, int64_t N, int64_t C, float eps) {
  cuda::rmsnorm_forward(out, rstd, x, weight, N, C, eps, stream_);
}

void CudaOps::rmsnorm_backward(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight,
                               const float* rstd, int64_t N, int64_t C) {
  cuda::rmsnorm_backward(*ctx_, dx, dweight, dout, x, weight, rstd, N, C, stream_);
}

void CudaOps::linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC,
                             int64_t OC) {
  cuda::linear_forward(*ctx_, out, x, weight, bias, N, IC, OC, stream_);
}

void CudaOps::linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                              int64_t N, int64_t IC, int64_t OC) {
  cuda::linear_backward(*ctx_, dx, dweight, dbias, dout, x, weight, N, IC, OC, stream_);
}

void CudaOps::linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N,
                                      int64_t IC, int64_t OC) {
  cuda::linear_forward_residual(*ctx_, out, x, weight, residual, N, IC, OC, stream_);
}

void CudaOps::linear_forward_f32(float* out, const Act* x, const W* weight, int64_t N, int64_t IC, int64_t OC) {
  // out (N, OC) = x (N, IC) @ weight (OC, IC)^T, written in fp32.
  cuda::gemm(*ctx_, false, true, N, OC, IC, 1.0f, x, IC, weight, IC, 0.0f, out, OC, /*c_is_fp32=*/true, nullptr,
             stream_);
}

void CudaOps::linear_backward_f32(Act* dx, float* dweight, const float* dout, const Act* x, const W* weight, int64_t N,
                                  int64_t IC, int64_t OC) {
  // The GEMMs read bf16: dout is rounded once first (CpuBf16Ops does the same).
  Act* rounded = static_cast<Act*>(grow(rounded_, static_cast<uint64_t>(N * OC) * sizeof(Act), "router gradient"));
  cuda::f32_to_bf16(rounded, dout, N * OC, stream_);
  cuda::linear_backward(*ctx_, dx, dweight, nullptr, rounded, x, weight, N, IC, OC, stream_);
}

void CudaOps::rope_forward(Act* out, const Act* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                           float scale, int64_t past, const int32_t* positions) {
  cuda::rope_forward(out, x, inv_freq, B, T, H, D, scale, past, stream_, positions);
}

void CudaOps::rope_backward(Act* dx, const Act* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                            int64_t D, float scale, const int32_t* positions) {
  cuda::rope_backward(dx, dout, inv_freq, B, T, H, D, scale, stream_, positions);
}

AttentionCapability CudaOps::attention_capability() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  AttentionCapability cap;
  CUDA_CHECK(cudaDeviceGetAttribute(&cap.sm_major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&cap.sm_minor, cudaDevAttrComputeCapabilityMinor, device));
  cap.cudnn_version = cuda::cudnn_version();
  return cap;
}

AttentionImpl CudaOps::attention_impl(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  const auto key = std::make_tuple(B, T, Hq, Hkv, D);
  if (auto it = attention_impls_.find(key); it != attention_impls_.end()) return it->second;
  AttentionCase c;
  c.d_qk = D;
  c.d_v = D;
  c.hq = Hq;
  c.hkv = Hkv;
  c.seq_len = T;
  AttentionChoice choice = choose_attention(attention_capability_, c, attention_force_);
  if (choice.impl == AttentionImpl::kCudnn) {
    const cuda::CudnnAttentionPlan plan = cuda::cudnn_attention_prepare(*ctx_, B, T, Hq, Hkv, D);
    if (!plan.ready) {
      choice = attention_after_cudnn_failure(attention_capability_, c, plan.note);
    } else if (!plan.deterministic) {
      choice.reason += "; " + plan.note;
    }
  }
  const std::string shape = "B=" + std::to_string(B) + " T=" + std::to_string(T) + " Hq=" + std::to_string(Hq) +
                            " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D);
  CHECK_MSG(choice.impl != AttentionImpl::kNone, "no CUDA attention serves " + shape + ": " + choice.reason);
  LOG_INFO("attention {}: {} ({})", shape, attention_impl_name(choice.impl), choice.reason);
  attention_impls_.emplace(key, choice.impl);
  return choice.impl;
}

namespace {
bool default_attention(int64_t D, int64_t Dv, double scale) {
  return (Dv == 0 || Dv == D) && (scale == 0 || scale == 1.0 / std::sqrt(static_cast<double>(D)));
}
// Ring attention's blocks, documents and cached keys take a value head dim apart from D or a
// caller's softmax scale nowhere yet (backend.h).
void check_default_attention(int64_t D, int64_t Dv, double scale) {
  CHECK_MSG(default_attention(D, Dv, scale),
            "CUDA attention with d_v != d_qk or a caller's softmax scale (multi-head latent attention) runs on "
            "cuDNN's graph for whole causal sequences only: d_qk " + std::to_string(D) + ", d_v " + std::to_string(Dv) +
                ", scale " + std::to_string(scale) + "; use the CPU backend (run.device=cpu)");
}
}  // namespace

void CudaOps::prepare_latent_attention(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                                       double scale) {
  const cuda::CudnnAttentionPlan plan =
      cuda::cudnn_attention_prepare(*ctx_, B, T, Hq, Hkv, D, /*causal=*/true, Dv, scale);
  CHECK_MSG(plan.ready, fmt::format("latent attention (B={} T={} Hq={} Hkv={} d_qk={} d_v={}) runs on cuDNN's fused "
                                    "attention only, which cannot serve it here: {}; use the CPU backend",
                                    B, T, Hq, Hkv, D, Dv, plan.note));
}

void CudaOps::attention_forward(Act* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B, int64_t T,
                                int64_t Hq, int64_t Hkv, int64_t D, int64_t past, const int32_t* positions,
                                int64_t Dv, double scale) {
  if (!default_attention(D, Dv, scale) && positions == nullptr && past == 0 && B > 0 && T > 0) {
    prepare_latent_attention(B, T, Hq, Hkv, D, Dv, scale);
    cuda::cudnn_attention_forward(*ctx_, out, lse, q, k, v, B, T, Hq, Hkv, D, stream_, /*causal=*/true, Dv, scale);
    return;
  }
  check_default_attention(D, Dv, scale);
  if (positions != nullptr) {  // document masks: the WMMA kernel (see backend.h)
    CHECK_MSG(D == 64 || D == 128, "document-masked attention (data.packing: document) on CUDA runs the WMMA kernel, "
                                   "which needs head_dim 64 or 128, got " + std::to_string(D) +
                                       "; use data.packing: concat for this model");
    if (!logged_document_masks_) {
      LOG_INFO("attention: document-masked batches run the WMMA kernel (the cuDNN graphs take no document masks)");
      logged_document_masks_ = true;
    }
    cuda::attention_forward(out, lse, q, k, v, B, T, Hq, Hkv, D, stream_, /*tile_rows=*/0, /*past=*/0, positions);
    return;
  }
  if (past > 0) {  // decoding after cached keys: cuDNN's graphs here are square, the WMMA kernel is not
    CHECK_MSG(D == 64 || D == 128, "cached attention on CUDA needs head_dim 64 or 128, got " + std::to_string(D));
    cuda::attention_forward(out, lse, q, k, v, B, T, Hq, Hkv, D, stream_, /*tile_rows=*/0, past);
    return;
  }
  if (B > 0 && T > 0 && attention_impl(B, T, Hq, Hkv, D) == AttentionImpl::kCudnn) {
    cuda::cudnn_attention_forward(*ctx_, out, lse, q, k, v, B, T, Hq, Hkv, D, stream_);
  } else {
    cuda::attention_forward(out, lse, q, k, v, B, T, Hq, Hkv, D, stream_);
  }
}

void CudaOps::attention_backward(Act* dq, Act* dk, Act* dv, const Act* dout, const Act* q, const Act* k, const Act* v,
                                 const Act* out, const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                 int64_t D, const int32_t* positions, int64_t Dv, double scale) {
  if (!default_attention(D, Dv, scale) && positions == nullptr && B > 0 && T > 0) {
    prepare_latent_attention(B, T, Hq, Hkv, D, Dv, scale);
    cuda::cudnn_attention_backward(*ctx_, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, stream_,
                                   /*causal=*/true, Dv, scale);
    return;
  }
  check_default_attention(D, Dv, scale);
  if (positions != nullptr) {  // the forward's kernel, whose lse this is
    cuda::attention_backward(*ctx_, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, stream_, /*tile_rows=*/0,
                             positions);
    return;
  }
  // The same implementation as the forward of this shape (both read lse as max + log sum of the
  // scaled scores, so ring attention's merged lse serves either).
  if (B > 0 && T > 0 && attention_impl(B, T, Hq, Hkv, D) == AttentionImpl::kCudnn) {
    cuda::cudnn_attention_backward(*ctx_, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, stream_);
  } else {
    cuda::attention_backward(*ctx_, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, stream_);
  }
}

namespace {
// Ring attention's full blocks run on cuDNN's unmasked graph: why a shape cannot.
void check_full_block(const cuda::CudnnAttentionPlan& plan, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                      int64_t D) {
  CHECK_MSG(plan.ready, fmt::format("ring attention's full blocks (B={} T={} Hq={} Hkv={} D={}) run on cuDNN's fused "
                                    "attention, which cannot serve them here: {}",
                                    B, T, Hq, Hkv, D, plan.note));
}
}  // namespace

void CudaOps::attention_block_forward(float* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B,
                                      int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask,
                                      bool accumulate, int64_t Dv, double scale) {
  check_default_attention(D, Dv, scale);
  CHECK_MSG(Tq == Tk, "ring attention's blocks on CUDA pair chunks of one length");
  const int64_t T = Tq;
  const uint64_t out_bytes = (static_cast<uint64_t>(B * T * Hq * D) * sizeof(Act) + 255) / 256 * 256;
  char* block = static_cast<char*>(
      grow(ring_block_, out_bytes + static_cast<uint64_t>(B * Hq * T) * sizeof(float), "ring attention block"));
  Act* block_out = reinterpret_cast<Act*>(block);
  float* block_lse = reinterpret_cast<float*>(block + out_bytes);
  if (mask == AttentionBlock::kCausal) {
    attention_forward(block_out, block_lse, q, k, v, B, T, Hq, Hkv, D);
  } else {
    check_full_block(cuda::cudnn_attention_prepare(*ctx_, B, T, Hq, Hkv, D, /*causal=*/false), B, T, Hq, Hkv, D);
    cuda::cudnn_attention_forward(*ctx_, block_out, block_lse, q, k, v, B, T, Hq, Hkv, D, stream_, /*causal=*/false);
  }
  cuda::attention_merge(out, lse, block_out, block_lse, B, T, Hq, D, accumulate, stream_);
}

void CudaOps::attention_block_backward(float* dq, float* dk, float* dv, const Act* dout, const Act* q, const Act* k,
                                       const Act* v, const Act* out, const float* lse, int64_t B, int64_t Tq,
                                       int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask,
                                       bool accumulate_dq, bool accumulate_dkv, int64_t Dv, double scale) {
  check_default_attention(D, Dv, scale);
  CHECK_MSG(Tq == Tk, "ring attention's blocks on CUDA pair chunks of one length");
  const int64_t T = Tq, nq = B * T * Hq * D, nkv = B * T * Hkv * D;
  auto padded = [](int64_t n) { return (static_cast<uint64_t>(n) * sizeof(Act) + 255) / 256 * 256; };
  char* block = static_cast<char*>(grow(ring_block_, padded(nq) + 2 * padded(nkv), "ring attention block"));
  Act* bdq = reinterpret_cast<Act*>(block);
  Act* bdk = reinterpret_cast<Act*>(block + padded(nq));
  Act* bdv = reinterpret_cast<Act*>(block + padded(nq) + padded(nkv));
  // P = exp(s - lse) with the whole attention's lse, and delta from its (rounded) output: the
  // block's share of the gradients.
  if (mask == AttentionBlock::kCausal) {
    attention_backward(bdq, bdk, bdv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D);
  } else {
    check_full_block(cuda::cudnn_attention_prepare(*ctx_, B, T, Hq, Hkv, D, /*causal=*/false), B, T, Hq, Hkv, D);
    cuda::cudnn_attention_backward(*ctx_, bdq, bdk, bdv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, stream_,
                                   /*causal=*/false);
  }
  cuda::add_bf16_to_f32(dq, bdq, nq, accumulate_dq, stream_);
  cuda::add_bf16_to_f32(dk, bdk, nkv, accumulate_dkv, stream_);
  cuda::add_bf16_to_f32(dv, bdv, nkv, accumulate_dkv, stream_);
}

void CudaOps::lora_forward(Act* y, const Act* x, const W* A, const W* B, float scale, const LoraDropout& drop,
                           int64_t N, int64_t IC, int64_t OC, int64_t R) {
  cuda::lora_forward(*ctx_, y, x, A, B, scale, drop, N, IC, OC, R, stream_);
}

void CudaOps::lora_backward(Act* dx, float* dA, float* dB, const Act* dy, const Act* x, const W* A, const W* B,
                            float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R) {
  cuda::lora_backward(*ctx_, dx, dA, dB, dy, x, A, B, scale, drop, N, IC, OC, R, stream_);
}

void CudaOps::round_activations(Act* dst, const float* src, int64_t n) { cuda::f32_to_bf16(dst, src, n, stream_); }

void CudaOps::swiglu_forward(Act* out, const Act* gate, const Act* up, int64_t n) {
  cuda::swiglu_forward(out, gate, up, n, stream_);
}

void CudaOps::swiglu_backward(Act* dgate, Act* dup, const Act* dout, const Act* gate, const Act* up, int64_t n) {
  cuda::swiglu_backward(dgate, dup, dout, gate, up, n, stream_);
}

void CudaOps::add_inplace(Act* a, const Act* b, int64_t n) { cuda::add_inplace(a, b, n, stream_); }
void CudaOps::copy_columns(Act* dst, int64_t ld_dst, const Act* src, int64_t ld_src, int64_t rows, int64_t cols,
                           ColumnOrder order) {
  cuda::copy_columns(dst, ld_dst, src, ld_src, rows, cols, static_cast<int>(order), stream_);
}
void CudaOps::sum_head_columns(Act* dst, const Act* src, int64_t ld_src, int64_t head_stride, int64_t rows,
                               int64_t heads, int64_t cols) {
  cuda::sum_head_columns(dst, src, ld_src, head_stride, rows, heads, cols, stream_);
}

int64_t CudaOps::lm_head_chunk_tokens(int64_t N, int64_t C, int64_t V) const {
  // Before the activation block exists (no LM head buffer yet) the kernels' scratch serves.
  const uint64_t room = lm_head_ ? lm_head_.size() : kScratchBytes;
  return kernels::lm_head_chunk_tokens(std::max<int64_t>(N, 1), C, V, room);
}

double CudaOps::lm_head_cross_entropy(Act* dx, float* const* dweight_blocks, const Act* x,
                                      const W* const* weight_blocks, int64_t block_rows, const int32_t* targets,
                                      int64_t N, int64_t C, int64_t V, float grad_scale, int64_t chunk_tokens) {
  // The logits chunks go to the LM head's own buffer (sized per micro-batch with the activation
  // block) when there is one; the kernels' scratch serves the ops queued after.
  void* const scratch = scratch_.data();
  if (lm_head_) ctx_->use_scratch(lm_head_.data(), lm_head_.size());
  // Chunks whose logits fit (the decoder asks lm_head_chunk_tokens, which already fits them).
  while (chunk_tokens > 1 && cuda::lm_head_blocked_scratch_bytes(C, V, chunk_tokens) > ctx_->scratch_bytes())
    chunk_tokens /= 2;
  float* losses = static_cast<float*>(grow(losses_, static_cast<uint64_t>(N) * sizeof(float), "per-token losses"));
  cuda::lm_head_cross_entropy_blocked(*ctx_, losses, dx, dweight_blocks, x, weight_blocks, block_rows, targets, N, C,
                                      V, grad_scale, chunk_tokens, stream_);
  ctx_->use_scratch(scratch, kScratchBytes);
  double* sum = sums_.as<double>();
  cuda::sum(*ctx_, sum, losses, N, /*accumulate=*/false, stream_);
  double loss = 0;
  CUDA_CHECK(cudaMemcpyAsync(&loss, sum, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return loss;
}

// router_ holds (E) int64 counts, (E) double probability sums and (E) floats staged from the
// host (the selection bias or the aux loss's prob_grad), in that order.
void CudaOps::moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                                const float* selection_bias, int64_t N, const RouterConfig& config) {
  const int64_t E = config.num_experts;
  const float* bias = nullptr;
  if (selection_bias != nullptr) {
    char* base = static_cast<char*>(grow(router_, static_cast<uint64_t>(E) * 20, "router statistics"));
    float* staged = reinterpret_cast<float*>(base + 16 * E);
    CUDA_CHECK(cudaMemcpyAsync(staged, selection_bias, static_cast<size_t>(E) * sizeof(float), cudaMemcpyHostToDevice,
                               stream_));
    bias = staged;
  }
  cuda::moe_route_forward(expert_idx, weights, probs, logits, bias, N, config, stream_);
}

void CudaOps::moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad, const float* probs,
                                 const int32_t* expert_idx, const float* weights, int64_t N,
                                 const RouterConfig& config) {
  const int64_t E = config.num_experts;
  const float* staged = nullptr;
  if (prob_grad != nullptr) {
    char* base = static_cast<char*>(grow(router_, static_cast<uint64_t>(E) * 20, "router statistics"));
    float* dev = reinterpret_cast<float*>(base + 16 * E);
    CUDA_CHECK(
        cudaMemcpyAsync(dev, prob_grad, static_cast<size_t>(E) * sizeof(float), cudaMemcpyHostToDevice, stream_));
    staged = dev;
  }
  cuda::moe_route_backward(dlogits, dweights, staged, probs, expert_idx, weights, N, config, stream_);
}

void CudaOps::moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets, const int32_t* expert_idx,
                          int64_t N, int64_t K, int64_t E) {
  cuda::moe_permute(*ctx_, slot_of, token_of_slot, expert_offsets, expert_idx, N, K, E, stream_);
}

void CudaOps::moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx, const float* probs,
                               int64_t N, int64_t K, int64_t E) {
  char* base = static_cast<char*>(grow(router_, static_cast<uint64_t>(E) * 20, "router statistics"));
  int64_t* dev_counts = reinterpret_cast<int64_t*>(base);
  double* dev_sums = reinterpret_cast<double*>(base + 8 * E);
  CUDA_CHECK(cudaMemsetAsync(base, 0, static_cast<size_t>(E) * 16, stream_));
  cuda::moe_router_stats(dev_counts, dev_sums, expert_idx, probs, N, K, E, stream_);
  std::vector<int64_t> layer_counts(static_cast<size_t>(E));
  std::vector<double> layer_sums(static_cast<size_t>(E));
  CUDA_CHECK(cudaMemcpyAsync(layer_counts.data(), dev_counts, layer_counts.size() * sizeof(int64_t),
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaMemcpyAsync(layer_sums.data(), dev_sums, layer_sums.size() * sizeof(double), cudaMemcpyDeviceToHost,
                             stream_));
  synchronize();
  for (int64_t e = 0; e < E; ++e) {
    counts[e] += layer_counts[static_cast<size_t>(e)];
    prob_sums[e] += layer_sums[static_cast<size_t>(e)];
  }
}

void CudaOps::moe_gather(Act* xs, const Act* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
  cuda::moe_gather(xs, x, token_of_slot, S, C, stream_);
}

void CudaOps::moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0,
                               int64_t rows) {
  cuda::moe_tile_offsets(tile_offsets, expert_offsets, E, row0, rows, stream_);
}

void CudaOps::moe_gather_backward(Act* dx, const Act* dxs, const int32_t* slot_of, int64_t N, int64_t K, int64_t C) {
  cuda::moe_gather_backward(dx, dxs, slot_of, N, K, C, stream_);
}

void CudaOps::moe_combine_forward(Act* out, const Act* ys, const float* weights, const int32_t* slot_of, int64_t N,
                                  int64_t K, int64_t C) {
  cuda::moe_combine_forward(out, ys, weights, slot_of, N, K, C, stream_);
}

void CudaOps::moe_combine_backward(Act* dys, float* dweights, const Act* dout, const Act* ys, const float* weights,
                                   const int32_t* slot_of, int64_t N, int64_t K, int64_t C) {
  cuda::moe_combine_backward(dys, dweights, dout, ys, weights, slot_of, N, K, C, stream_);
}

void CudaOps::moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                                  const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F) {
  cuda::moe_experts_forward(*ctx_, ys, gate, up, act, xs, expert_offsets, w, E, C, F, stream_);
}

void CudaOps::moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact,
                                   const Act* dys, const Act* xs, const Act* gate, const Act* up, const Act* act,
                                   const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E,
                                   int64_t C, int64_t F) {
  cuda::moe_experts_backward(*ctx_, dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, expert_offsets, w, E, C, F,
                             stream_);
}

void CudaOps::shared_expert_combine(Act* out, const Act* shared_out, const float* logit, int64_t N, int64_t C) {
  cuda::shared_expert_combine(out, shared_out, logit, N, C, stream_);
}

void CudaOps::shared_expert_backward(Act* dshared, float* dlogit, const Act* dout, const Act* shared_out,
                                     const float* logit, int64_t N, int64_t C) {
  cuda::shared_expert_backward(dshared, dlogit, dout, shared_out, logit, N, C, stream_);
}

}  // namespace strata::kernels
