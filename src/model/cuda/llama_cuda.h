// CudaLlama: the dense Llama decoder of LlamaModel (llama.h) on one CUDA device, composed from
// the CUDA ops of kernels/cuda/ops.h. Same structure as the CPU model: explicit per-layer
// forward and backward, layer-boundary checkpoints, and a backward that recomputes each layer
// (the last one excepted) from its checkpoint into one shared set of intermediates; or, where
// memory allows, a forward that keeps every layer's intermediates so that backward recomputes
// nothing.
//
// Precision (the recipe of kernels/cuda/ops.h): fp32 master parameters, a bf16 compute copy of
// them that every op reads, bf16 activations and activation gradients (the residual stream and
// the checkpoints included), fp32 accumulation inside every op, fp32 parameter gradients
// (accumulated with `+=` over micro-batches) and fp32 AdamW moments. The bf16 copy is written
// from the master by load_params() and by every adamw_step() (the AdamW kernel writes it).
//
// All state lives in device memory laid out like the CPU flat buffers (same ParamLayout and
// offsets), so load_params / store_params / store_grads exchange the CPU model's buffers
// unchanged. Architectures: the dense Llama family with q/k/v biases (Qwen2) and per-head q/k
// RMSNorm; mixture-of-experts configs are refused (create() returns Unimplemented), as are
// head dims the attention kernel lacks (64 and 128 only).
//
// Every method runs on the model's one stream with its one kernels::cuda::Context; the methods
// that return host values (losses, norms, stored buffers) synchronise the stream. CUDA errors
// abort (CUDA_CHECK). Not thread-safe; not copyable. REQUIRES: the device current at create()
// stays current for every call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "kernels/cuda/ops.h"
#include "model/config.h"
#include "model/params.h"

namespace strata::model {

// AdamW hyper-parameters of CudaLlama::adamw_step, as strata::OptimizerConfig (train/) holds
// them: weight decay applies to tensors with TensorSpec::weight_decay only.
struct CudaAdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;  // max global gradient norm; <= 0 turns clipping off
};

class CudaLlama {
 public:
  // Allocates the parameter state (master, bf16 copy, gradients, moments: all zero) on the
  // current device. Unimplemented for MoE configs and head dims other than 64 and 128;
  // the Status of config.validate() when it does not validate.
  // keep_layer_activations: the forward keeps every layer's intermediates for backward, which
  // then recomputes nothing (about a third less compute per step, activation_bytes_for(...,
  // true) of memory); otherwise one set is shared and backward recomputes each layer but the
  // last from its checkpoint. Both give bitwise the same results.
  static Result<std::unique_ptr<CudaLlama>> create(const ModelConfig& config, bool keep_layer_activations = false);
  // The checks of create() without allocating anything: OK when create() would accept config.
  static Status supports(const ModelConfig& config);
  ~CudaLlama();
  CudaLlama(const CudaLlama&) = delete;
  CudaLlama& operator=(const CudaLlama&) = delete;

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }

  // Host flat buffers of layout().total_size() floats, in the CPU model's layout.
  // load_params also refreshes the bf16 compute copy.
  void load_params(const float* host_flat);
  void store_params(float* host_flat);
  void store_grads(float* host_flat);
  // The AdamW moments (m, v) in the same layout; store for checkpoints, load to resume.
  void store_moments(float* host_m, float* host_v);
  void load_moments(const float* host_m, const float* host_v);

  void zero_grads();
  // As LlamaModel::forward_backward: returns the SUM of token NLLs over targets >= 0 of this
  // micro-batch and accumulates grads += grad_scale * d(sum)/d(params). inputs, targets: HOST
  // (B, T) arrays; inputs in [0, V), targets < V (negative = ignored). InvalidArgument names
  // the first token outside the vocabulary; Unimplemented when a sliding window shorter than
  // T would change attention.
  Result<double> forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                  int64_t T, float grad_scale);
  // The same sum of NLLs without touching the gradients.
  Result<double> forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B,
                              int64_t T);

  // Global gradient norm (tensor by tensor in layout order, summed in double), clipping to
  // config.grad_clip as torch.nn.utils.clip_grad_norm_, then one AdamW update of every tensor
  // at learning rate `lr` (step count incremented first, as strata::AdamW does), writing the
  // bf16 compute copy. Returns the pre-clip norm (NaN or Inf propagate into the update as in
  // strata::AdamW; the caller decides whether to skip such steps).
  double adamw_step(float lr, const CudaAdamWConfig& config);
  int64_t step_count() const { return step_count_; }

  // Waits until every operation queued on the model's stream has finished (adamw_step returns
  // with the update still running; time a step only after this).
  void synchronize();
  void set_step_count(int64_t steps) { step_count_ = steps; }

  // Bytes of device memory held by the parameter state and by the activation table.
  size_t param_state_bytes() const;
  size_t activation_bytes() const { return acts_bytes_; }
  // The same, before creating a model: its parameter state, and its activation table for
  // micro-batches of `tokens` (B * T) tokens. The model's Context (kernels/cuda/ops.h) adds
  // its scratch and GEMM workspace.
  static size_t param_state_bytes_for(const ModelConfig& config);
  static size_t activation_bytes_for(const ModelConfig& config, int64_t tokens, bool keep_layer_activations);
  bool keeps_layer_activations() const { return keep_layers_; }
  // Allocates the activation table for micro-batches of up to `tokens` (B * T) tokens now
  // (otherwise the first forward does). OutOfMemory, naming the bytes, when the device cannot
  // provide it.
  Status reserve_activations(int64_t tokens);

 private:
  using bf16 = kernels::cuda::bf16;

  // Device pointers into the activation block (see plan_activations). N = B * T.
  struct Acts {
    bf16* checkpoints = nullptr;  // (L+1, N, C) layer inputs; slot L feeds the final norm
    bf16* final_out = nullptr;    // (N, C)
    float* final_rstd = nullptr;  // (N)
    bf16* d_final = nullptr;      // (N, C)
    bf16* dres = nullptr;         // (N, C) gradient of the residual stream
    bf16* ln1 = nullptr;          // (N, C)
    float* ln1_rstd = nullptr;    // (N)
    bf16* q = nullptr;            // (N, Hq*D) after RoPE
    bf16* k = nullptr;            // (N, Hkv*D) after RoPE
    bf16* q_raw = nullptr;        // (N, Hq*D) qk_norm only
    bf16* k_raw = nullptr;        // (N, Hkv*D) qk_norm only
    float* q_norm_rstd = nullptr;  // (N*Hq) qk_norm only
    float* k_norm_rstd = nullptr;  // (N*Hkv) qk_norm only
    bf16* v = nullptr;            // (N, Hkv*D)
    bf16* att = nullptr;          // (N, Hq*D)
    float* lse = nullptr;         // (B, Hq, T)
    bf16* h = nullptr;            // (N, C) residual after attention
    bf16* ln2 = nullptr;          // (N, C)
    float* ln2_rstd = nullptr;    // (N)
    bf16* gate = nullptr;         // (N, F)
    bf16* up = nullptr;           // (N, F)
    bf16* act = nullptr;          // (N, F)
    bf16* d_ln = nullptr;         // (N, C)
    bf16* d_tmp = nullptr;        // (N, C)
    bf16* d_q = nullptr;          // (N, Hq*D)
    bf16* d_k = nullptr;          // (N, Hkv*D)
    bf16* d_v = nullptr;          // (N, Hkv*D)
    bf16* d_att = nullptr;        // (N, Hq*D)
    bf16* d_gate = nullptr;       // (N, F)
    bf16* d_up = nullptr;         // (N, F)
    bf16* d_act = nullptr;        // (N, F)
    bf16* d_qk_raw = nullptr;     // (N, Hq*D) qk_norm only
    float* losses = nullptr;      // (N) per-token NLL
    int32_t* inputs = nullptr;    // (N)
    int32_t* targets = nullptr;   // (N)
  };

  CudaLlama(const ModelConfig& config, bool keep_layer_activations);
  // Lays the activation table for N tokens out from `base` (null: only measures) into `a`, and
  // with keep_layers one Acts per layer into `layers` (when not null): the shared table with
  // the fields a layer's backward reads from its forward in a set of the layer's own (the last
  // layer uses the shared set). Returns the bytes.
  static size_t carve_activations(const ModelConfig& config, int64_t N, bool keep_layers, char* base, Acts& a,
                                  std::vector<Acts>* layers);
  const Acts& layer_acts(int64_t layer) const {
    return keep_layers_ ? layer_acts_[static_cast<size_t>(layer)] : acts_;
  }
  // Frees the current activation table (after the stream drains) and lays out `block` of
  // `bytes` for N tokens in its place.
  void adopt_activations(void* block, size_t bytes, int64_t N);
  // Plans the activation table for N tokens (B*T; attention's lse uses B, T), reallocating
  // only when N grows.
  void plan_activations(int64_t N);
  Result<double> compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                         float grad_scale, bool backward);
  // One decoder layer from x; writes the layer output to `out` unless null (recomputation).
  void layer_forward(int64_t layer, const bf16* x, bf16* out, int64_t B, int64_t T);
  // dres (N, C): on entry dL/d(layer output), on return dL/d(layer input x).
  void layer_backward(int64_t layer, const bf16* x, bf16* dres, int64_t B, int64_t T);
  bf16* checkpoint(int64_t l, int64_t N) const;
  const bf16* w(int64_t offset) const { return offset < 0 ? nullptr : params_bf16_ + offset; }
  float* g(int64_t offset) const { return offset < 0 ? nullptr : grads_ + offset; }

  ModelConfig config_;
  ParamLayout layout_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::cuda::Context> ctx_;
  // Parameter state: (total_size) each, ParamLayout offsets.
  float* params_ = nullptr;
  bf16* params_bf16_ = nullptr;
  float* grads_ = nullptr;
  float* m_ = nullptr;
  float* v_ = nullptr;
  float* inv_freq_ = nullptr;  // (D/2) RoPE frequencies
  double* sums_ = nullptr;     // (2) the loss sum and the squared gradient norm
  int64_t step_count_ = 0;
  // Activation table: one block, planned for planned_tokens_.
  void* acts_block_ = nullptr;
  size_t acts_bytes_ = 0;
  int64_t planned_tokens_ = 0;
  bool keep_layers_ = false;
  Acts acts_;
  std::vector<Acts> layer_acts_;  // per layer, with keep_layers_
};

}  // namespace strata::model
