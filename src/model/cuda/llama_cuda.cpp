#include "model/cuda/llama_cuda.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "kernels/grad_norm.h"
#include "kernels/rope.h"
#include "model/cuda/elementwise.h"
#include "model/decoder.h"

namespace strata::model {
namespace {

namespace cu = kernels::cuda;

constexpr size_t kActivationAlignment = 256;  // bytes; cuBLASLt and vector loads like it

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Hands out aligned pieces of one block; with a null base it only measures.
class BlockCarver {
 public:
  explicit BlockCarver(char* base) : base_(base) {}
  template <typename T>
  void take(T*& field, int64_t count) {
    offset_ = align_up(offset_, kActivationAlignment);
    field = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    offset_ += static_cast<size_t>(count) * sizeof(T);
  }
  size_t bytes() const { return align_up(offset_, kActivationAlignment); }

 private:
  char* base_;
  size_t offset_ = 0;
};

template <typename T>
T* device_alloc(int64_t n) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(n > 0 ? n : 1) * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace

Status CudaLlama::supports(const ModelConfig& config) {
  RETURN_IF_ERROR(config.validate("CudaLlama config"));
  if (config.is_moe()) {
    return Status::Unimplemented(
        fmt::format("the CUDA backend runs dense models only for now; {} has num_experts={} (use "
                    "run.device=cpu for mixture-of-experts models)",
                    config.architecture, config.num_experts));
  }
  if (config.head_dim != 64 && config.head_dim != 128) {
    return Status::Unimplemented(fmt::format(
        "the CUDA attention kernel supports head_dim 64 and 128, the config has head_dim={}",
        config.head_dim));
  }
  return Status::OK();
}

Result<std::unique_ptr<CudaLlama>> CudaLlama::create(const ModelConfig& config, bool keep_layer_activations) {
  RETURN_IF_ERROR(supports(config));
  return std::unique_ptr<CudaLlama>(new CudaLlama(config, keep_layer_activations));
}

CudaLlama::CudaLlama(const ModelConfig& config, bool keep_layer_activations)
    : config_(config), layout_(config), keep_layers_(keep_layer_activations) {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  ctx_ = std::make_unique<cu::Context>();
  const int64_t n = layout_.total_size();
  params_ = device_alloc<float>(n);
  params_bf16_ = device_alloc<bf16>(n);
  grads_ = device_alloc<float>(n);
  m_ = device_alloc<float>(n);
  v_ = device_alloc<float>(n);
  CUDA_CHECK(cudaMemsetAsync(params_, 0, static_cast<size_t>(n) * sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(params_bf16_, 0, static_cast<size_t>(n) * sizeof(bf16), stream_));
  CUDA_CHECK(cudaMemsetAsync(grads_, 0, static_cast<size_t>(n) * sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(m_, 0, static_cast<size_t>(n) * sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(v_, 0, static_cast<size_t>(n) * sizeof(float), stream_));
  std::vector<float> inv_freq(static_cast<size_t>(config_.head_dim / 2));
  kernels::rope_inv_freq(inv_freq.data(), config_.head_dim, config_.rope);
  inv_freq_ = device_alloc<float>(static_cast<int64_t>(inv_freq.size()));
  sums_ = device_alloc<double>(2);
  CUDA_CHECK(cudaMemcpyAsync(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // inv_freq is a stack buffer
}

CudaLlama::~CudaLlama() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  ctx_.reset();
  for (void* p : {static_cast<void*>(params_), static_cast<void*>(params_bf16_),
                  static_cast<void*>(grads_), static_cast<void*>(m_), static_cast<void*>(v_),
                  static_cast<void*>(inv_freq_), static_cast<void*>(sums_), acts_block_}) {
    if (p != nullptr) CUDA_CHECK(cudaFree(p));
  }
  CUDA_CHECK(cudaStreamDestroy(stream_));
}

void CudaLlama::synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

size_t CudaLlama::param_state_bytes() const { return param_state_bytes_for(config_); }

// ---- host <-> device state ------------------------------------------------------------------

void CudaLlama::load_params(const float* host_flat) {
  const int64_t n = layout_.total_size();
  CUDA_CHECK(cudaMemcpyAsync(params_, host_flat, static_cast<size_t>(n) * sizeof(float),
                             cudaMemcpyHostToDevice, stream_));
  cuda::f32_to_bf16(params_bf16_, params_, n, stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaLlama::store_params(float* host_flat) {
  CUDA_CHECK(cudaMemcpyAsync(host_flat, params_, static_cast<size_t>(layout_.total_size()) * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaLlama::store_grads(float* host_flat) {
  CUDA_CHECK(cudaMemcpyAsync(host_flat, grads_, static_cast<size_t>(layout_.total_size()) * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaLlama::store_moments(float* host_m, float* host_v) {
  const size_t bytes = static_cast<size_t>(layout_.total_size()) * sizeof(float);
  CUDA_CHECK(cudaMemcpyAsync(host_m, m_, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaMemcpyAsync(host_v, v_, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaLlama::load_moments(const float* host_m, const float* host_v) {
  const size_t bytes = static_cast<size_t>(layout_.total_size()) * sizeof(float);
  CUDA_CHECK(cudaMemcpyAsync(m_, host_m, bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(v_, host_v, bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaLlama::zero_grads() {
  CUDA_CHECK(cudaMemsetAsync(grads_, 0, static_cast<size_t>(layout_.total_size()) * sizeof(float), stream_));
}

// ---- activation table -----------------------------------------------------------------------

size_t CudaLlama::carve_activations(const ModelConfig& config, int64_t N, bool keep_layers, char* base, Acts& a,
                                     std::vector<Acts>* layers) {
  const int64_t C = config.hidden_size;
  const int64_t F = config.intermediate_size;
  const int64_t Hq = config.num_attention_heads;
  const int64_t Hkv = config.num_key_value_heads;
  const int64_t QD = config.q_dim();
  const int64_t KD = config.kv_dim();
  const int64_t L = config.num_hidden_layers;
  const int64_t qk = config.qk_norm ? 1 : 0;
  BlockCarver c(base);
  // What a layer's forward writes and its backward reads: one set shared by every layer when
  // backward recomputes, one per layer when the forward keeps them.
  auto saved = [&](Acts& s) {
    c.take(s.ln1, N * C);
    c.take(s.ln1_rstd, N);
    c.take(s.q, N * QD);
    c.take(s.k, N * KD);
    c.take(s.q_raw, qk * N * QD);
    c.take(s.k_raw, qk * N * KD);
    c.take(s.q_norm_rstd, qk * N * Hq);
    c.take(s.k_norm_rstd, qk * N * Hkv);
    c.take(s.v, N * KD);
    c.take(s.att, N * QD);
    c.take(s.lse, N * Hq);
    c.take(s.h, N * C);
    c.take(s.ln2, N * C);
    c.take(s.ln2_rstd, N);
    c.take(s.gate, N * F);
    c.take(s.up, N * F);
    c.take(s.act, N * F);
  };
  c.take(a.checkpoints, (L + 1) * N * C);
  c.take(a.final_out, N * C);
  c.take(a.final_rstd, N);
  c.take(a.d_final, N * C);
  c.take(a.dres, N * C);
  saved(a);
  c.take(a.d_ln, N * C);
  c.take(a.d_tmp, N * C);
  c.take(a.d_q, N * QD);
  c.take(a.d_k, N * KD);
  c.take(a.d_v, N * KD);
  c.take(a.d_att, N * QD);
  c.take(a.d_gate, N * F);
  c.take(a.d_up, N * F);
  c.take(a.d_act, N * F);
  c.take(a.d_qk_raw, qk * N * QD);
  c.take(a.losses, N);
  c.take(a.inputs, N);
  c.take(a.targets, N);
  if (keep_layers) {
    // Layers 0..L-2 get sets of their own; the last layer uses the shared one.
    std::vector<Acts> measured;
    std::vector<Acts>& out = layers != nullptr ? *layers : measured;
    out.assign(static_cast<size_t>(L), a);
    for (int64_t l = 0; l + 1 < L; ++l) saved(out[static_cast<size_t>(l)]);
  } else if (layers != nullptr) {
    layers->clear();
  }
  return c.bytes();
}

size_t CudaLlama::activation_bytes_for(const ModelConfig& config, int64_t tokens, bool keep_layers) {
  Acts measured;
  return carve_activations(config, tokens, keep_layers, nullptr, measured, nullptr);
}

size_t CudaLlama::param_state_bytes_for(const ModelConfig& config) {
  return static_cast<size_t>(ParamLayout(config).total_size()) * (4 * sizeof(float) + sizeof(bf16));
}

Status CudaLlama::reserve_activations(int64_t tokens) {
  if (tokens <= planned_tokens_) return Status::OK();
  const size_t bytes = activation_bytes_for(config_, tokens, keep_layers_);
  void* block = nullptr;
  if (cudaMalloc(&block, bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation that failed leaves no sticky error
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return Status::OutOfMemory(fmt::format("the activation table for {} tokens ({} bytes) does not fit the {} bytes "
                                           "of device memory free",
                                           tokens, bytes, free_bytes));
  }
  adopt_activations(block, bytes, tokens);
  return Status::OK();
}

void CudaLlama::adopt_activations(void* block, size_t bytes, int64_t N) {
  if (acts_block_ != nullptr) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old block may still be in use
    CUDA_CHECK(cudaFree(acts_block_));
  }
  acts_block_ = block;
  carve_activations(config_, N, keep_layers_, static_cast<char*>(acts_block_), acts_, &layer_acts_);
  acts_bytes_ = bytes;
  planned_tokens_ = N;
}

void CudaLlama::plan_activations(int64_t N) {
  if (N <= planned_tokens_) return;
  const size_t bytes = activation_bytes_for(config_, N, keep_layers_);
  void* block = nullptr;
  CUDA_CHECK(cudaMalloc(&block, bytes));
  adopt_activations(block, bytes, N);
}

CudaLlama::bf16* CudaLlama::checkpoint(int64_t l, int64_t N) const {
  return acts_.checkpoints + l * N * config_.hidden_size;
}

// ---- layers ---------------------------------------------------------------------------------

void CudaLlama::layer_forward(int64_t layer, const bf16* x /*(N,C)*/, bf16* out /*(N,C)*/,
                              int64_t B, int64_t T) {
  const LayerOffsets& o = layout_.layer(layer);
  const Acts& a = layer_acts(layer);
  cu::Context& ctx = *ctx_;
  cudaStream_t s = stream_;
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  // Attention block: h = x + o_proj(attention(rope(q), rope(k), v)); with qk_norm, q and k
  // are RMS-normalised per head (rows of D) before RoPE.
  cu::rmsnorm_forward(a.ln1, a.ln1_rstd, x, w(o.input_layernorm), N, C, eps, s);
  if (o.q_norm >= 0) {
    cu::linear_forward(ctx, a.q_raw, a.ln1, w(o.q_proj), w(o.q_bias), N, C, Hq * D, s);
    cu::linear_forward(ctx, a.k_raw, a.ln1, w(o.k_proj), w(o.k_bias), N, C, Hkv * D, s);
    cu::rmsnorm_forward(a.q, a.q_norm_rstd, a.q_raw, w(o.q_norm), N * Hq, D, eps, s);
    cu::rmsnorm_forward(a.k, a.k_norm_rstd, a.k_raw, w(o.k_norm), N * Hkv, D, eps, s);
  } else {
    cu::linear_forward(ctx, a.q, a.ln1, w(o.q_proj), w(o.q_bias), N, C, Hq * D, s);
    cu::linear_forward(ctx, a.k, a.ln1, w(o.k_proj), w(o.k_bias), N, C, Hkv * D, s);
  }
  cu::linear_forward(ctx, a.v, a.ln1, w(o.v_proj), w(o.v_bias), N, C, Hkv * D, s);
  cu::rope_forward(a.q, a.q, inv_freq_, B, T, Hq, D, s);
  cu::rope_forward(a.k, a.k, inv_freq_, B, T, Hkv, D, s);
  cu::attention_forward(a.att, a.lse, a.q, a.k, a.v, B, T, Hq, Hkv, D, s);
  cu::linear_forward(ctx, a.h, a.att, w(o.o_proj), nullptr, N, Hq * D, C, s);
  cuda::add_inplace(a.h, x, N * C, s);

  // MLP block: out = h + down(silu(gate(ln2)) * up(ln2)).
  cu::rmsnorm_forward(a.ln2, a.ln2_rstd, a.h, w(o.post_attention_layernorm), N, C, eps, s);
  cu::linear_forward(ctx, a.gate, a.ln2, w(o.gate_proj), nullptr, N, C, F, s);
  cu::linear_forward(ctx, a.up, a.ln2, w(o.up_proj), nullptr, N, C, F, s);
  cu::swiglu_forward(a.act, a.gate, a.up, N * F, s);
  if (out == nullptr) return;
  cu::linear_forward(ctx, out, a.act, w(o.down_proj), nullptr, N, F, C, s);
  cuda::add_inplace(out, a.h, N * C, s);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
void CudaLlama::layer_backward(int64_t layer, const bf16* x /*(N,C)*/, bf16* dres /*(N,C)*/,
                               int64_t B, int64_t T) {
  const LayerOffsets& o = layout_.layer(layer);
  const Acts& a = layer_acts(layer);
  cu::Context& ctx = *ctx_;
  cudaStream_t s = stream_;
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;

  // MLP block. out = h + mlp(ln2): dres is dL/dout, and dL/dh starts as dres.
  cu::linear_backward(ctx, a.d_act, g(o.down_proj), nullptr, dres, a.act, w(o.down_proj), N, F, C, s);
  cu::swiglu_backward(a.d_gate, a.d_up, a.d_act, a.gate, a.up, N * F, s);
  cu::linear_backward(ctx, a.d_ln, g(o.gate_proj), nullptr, a.d_gate, a.ln2, w(o.gate_proj), N, C, F, s);
  cu::linear_backward(ctx, a.d_tmp, g(o.up_proj), nullptr, a.d_up, a.ln2, w(o.up_proj), N, C, F, s);
  cuda::add_inplace(a.d_ln, a.d_tmp, N * C, s);
  cu::rmsnorm_backward(ctx, a.d_tmp, g(o.post_attention_layernorm), a.d_ln, a.h,
                       w(o.post_attention_layernorm), a.ln2_rstd, N, C, s);
  cuda::add_inplace(dres, a.d_tmp, N * C, s);  // dres is now dL/dh

  // Attention block. h = x + o_proj(att): dL/dx starts as dL/dh.
  cu::linear_backward(ctx, a.d_att, g(o.o_proj), nullptr, dres, a.att, w(o.o_proj), N, Hq * D, C, s);
  cu::attention_backward(ctx, a.d_q, a.d_k, a.d_v, a.d_att, a.q, a.k, a.v, a.att, a.lse, B, T, Hq,
                         Hkv, D, s);
  cu::rope_backward(a.d_q, a.d_q, inv_freq_, B, T, Hq, D, s);
  cu::rope_backward(a.d_k, a.d_k, inv_freq_, B, T, Hkv, D, s);
  if (o.q_norm >= 0) {
    // Through the per-head norms; d_qk_raw serves q, then k.
    cu::rmsnorm_backward(ctx, a.d_qk_raw, g(o.q_norm), a.d_q, a.q_raw, w(o.q_norm), a.q_norm_rstd,
                         N * Hq, D, s);
    cu::linear_backward(ctx, a.d_ln, g(o.q_proj), g(o.q_bias), a.d_qk_raw, a.ln1, w(o.q_proj), N, C,
                        Hq * D, s);
    cu::rmsnorm_backward(ctx, a.d_qk_raw, g(o.k_norm), a.d_k, a.k_raw, w(o.k_norm), a.k_norm_rstd,
                         N * Hkv, D, s);
    cu::linear_backward(ctx, a.d_tmp, g(o.k_proj), g(o.k_bias), a.d_qk_raw, a.ln1, w(o.k_proj), N, C,
                        Hkv * D, s);
  } else {
    cu::linear_backward(ctx, a.d_ln, g(o.q_proj), g(o.q_bias), a.d_q, a.ln1, w(o.q_proj), N, C, Hq * D, s);
    cu::linear_backward(ctx, a.d_tmp, g(o.k_proj), g(o.k_bias), a.d_k, a.ln1, w(o.k_proj), N, C, Hkv * D, s);
  }
  cuda::add_inplace(a.d_ln, a.d_tmp, N * C, s);
  cu::linear_backward(ctx, a.d_tmp, g(o.v_proj), g(o.v_bias), a.d_v, a.ln1, w(o.v_proj), N, C, Hkv * D, s);
  cuda::add_inplace(a.d_ln, a.d_tmp, N * C, s);
  cu::rmsnorm_backward(ctx, a.d_tmp, g(o.input_layernorm), a.d_ln, x, w(o.input_layernorm), a.ln1_rstd,
                       N, C, s);
  cuda::add_inplace(dres, a.d_tmp, N * C, s);  // dres is now dL/dx
}

// ---- the step -------------------------------------------------------------------------------

Result<double> CudaLlama::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                           int64_t T, float grad_scale) {
  return compute(inputs, targets, B, T, grad_scale, /*backward=*/true);
}

Result<double> CudaLlama::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T) {
  return compute(inputs, targets, B, T, 1.0f, /*backward=*/false);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
Result<double> CudaLlama::compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                  float grad_scale, bool backward) {
  CHECK(B > 0 && T > 0);
  RETURN_IF_ERROR(config_.check_sequence_length(T, "CudaLlama config"));
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t V = config_.vocab_size;
  const int64_t L = config_.num_hidden_layers;
  for (int64_t i = 0; i < N; ++i) {
    if (inputs[i] < 0 || inputs[i] >= V) {
      return Status::InvalidArgument(fmt::format(
          "input token {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V));
    }
    if (targets[i] >= V) {
      return Status::InvalidArgument(fmt::format(
          "target token {} at position {} is outside the vocabulary [0, {})", targets[i], i, V));
    }
  }
  plan_activations(N);
  const Acts& a = acts_;
  cu::Context& ctx = *ctx_;
  cudaStream_t s = stream_;
  CUDA_CHECK(cudaMemcpyAsync(a.inputs, inputs, static_cast<size_t>(N) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(a.targets, targets, static_cast<size_t>(N) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, s));

  // Forward: the embedding, then every layer from its checkpoint into the next.
  cu::embedding_forward(checkpoint(0, N), a.inputs, w(layout_.embed_tokens()), N, C, V, s);
  for (int64_t l = 0; l < L; ++l) layer_forward(l, checkpoint(l, N), checkpoint(l + 1, N), B, T);

  // The head: final norm, LM head and cross-entropy. With tied embeddings lm_head() is the
  // embedding's offset, so both gradients add up there.
  cu::rmsnorm_forward(a.final_out, a.final_rstd, checkpoint(L, N), w(layout_.final_norm()), N, C,
                      static_cast<float>(config_.rms_norm_eps), s);
  // Chunks of kLossChunkTokens tokens, fewer where a large vocabulary's logits would not fit
  // the scratch buffer (256 tokens x 256k vocabulary x 6 bytes is 384 MiB).
  int64_t loss_chunk = kLossChunkTokens;
  while (loss_chunk > 1 && cu::lm_head_scratch_bytes(C, V, loss_chunk) > ctx.scratch_bytes()) loss_chunk /= 2;
  cu::lm_head_cross_entropy(ctx, a.losses, backward ? a.d_final : nullptr,
                            backward ? g(layout_.lm_head()) : nullptr, a.final_out,
                            w(layout_.lm_head()), a.targets, N, C, V, backward ? grad_scale : 1.0f,
                            loss_chunk, s);
  cu::sum(ctx, sums_, a.losses, N, /*accumulate=*/false, s);

  if (backward) {
    cu::rmsnorm_backward(ctx, a.dres, g(layout_.final_norm()), a.d_final, checkpoint(L, N),
                         w(layout_.final_norm()), a.final_rstd, N, C, s);
    for (int64_t l = L - 1; l >= 0; --l) {
      const bf16* x = checkpoint(l, N);  // (N, C)
      // Kept intermediates are there for every layer; the shared set holds only the last
      // layer's forward, so every other layer is recomputed into it.
      if (!keep_layers_ && l != L - 1) layer_forward(l, x, /*out=*/nullptr, B, T);
      layer_backward(l, x, a.dres, B, T);
    }
    cu::embedding_backward(ctx, g(layout_.embed_tokens()), a.dres, a.inputs, N, C, V, s);
  }

  double loss = 0;
  CUDA_CHECK(cudaMemcpyAsync(&loss, sums_, sizeof(double), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return loss;
}

double CudaLlama::adamw_step(float lr, const CudaAdamWConfig& config) {
  cu::Context& ctx = *ctx_;
  cudaStream_t s = stream_;
  double* norm_sq_device = sums_ + 1;
  const std::vector<TensorSpec>& tensors = layout_.tensors();

  // The global norm, tensor by tensor in layout order (as strata::AdamW::grad_norm does).
  for (size_t i = 0; i < tensors.size(); ++i) {
    cu::sum_squares(ctx, norm_sq_device, grads_ + tensors[i].offset, tensors[i].numel,
                    /*accumulate=*/i > 0, s);
  }
  double norm_sq = 0;
  CUDA_CHECK(cudaMemcpyAsync(&norm_sq, norm_sq_device, sizeof(double), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  const double norm = std::sqrt(norm_sq);
  const float coefficient = kernels::clip_coefficient(norm, config.grad_clip);
  if (coefficient != 1.0f) {
    for (const TensorSpec& t : tensors) cu::scale_inplace(grads_ + t.offset, t.numel, coefficient, s);
  }

  // One launch for the tensors with weight decay, one for the others.
  std::vector<cu::AdamWTensor> decayed, plain;
  for (const TensorSpec& t : tensors) {
    const cu::AdamWTensor entry{params_ + t.offset, grads_ + t.offset, m_ + t.offset,
                                v_ + t.offset,      params_bf16_ + t.offset, t.numel};
    (t.weight_decay ? decayed : plain).push_back(entry);
  }
  kernels::AdamWParams p;
  p.lr = lr;
  p.beta1 = config.beta1;
  p.beta2 = config.beta2;
  p.eps = config.eps;
  p.step = ++step_count_;
  p.weight_decay = config.weight_decay;
  cu::adamw_step(decayed.data(), static_cast<int>(decayed.size()), p, s);
  p.weight_decay = 0.0f;
  cu::adamw_step(plain.data(), static_cast<int>(plain.size()), p, s);
  return norm;
}

}  // namespace strata::model
