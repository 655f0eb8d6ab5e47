// CpuQueuedOps<Direct>: a CPU op set (kernels/cpu/backend.h) whose ops are queued on a compute
// stream, as a GPU's are, instead of run in the caller. It is what the decoder runs on a CPU
// Device: every op is a task on an in-order CpuStream (the op itself still uses every core), the
// host returns at once and runs ahead, and the paging layer orders its moves against the stream
// with events, exactly as on CUDA (train/paged_state.h, stream-ordered paging). Without a Device
// (the fp32 reference in tests) there is no stream and every op runs in the caller.
//
// The discipline the GPU needs holds here too:
// - Buffers an op reads stay valid until the stream has run it. Device and activation memory
//   does; what the caller passes in arrays that may not outlive the call (the blocks of a
//   vocabulary tensor, the experts' pointers, the aux loss's prob_grad, the token ids) is copied
//   into the task.
// - What the host reads back synchronises first, through the calls the CUDA op set makes:
//   the loss (lm_head_cross_entropy), the router statistics and the expert offsets.
// - activation_block() waits for the queue before it replaces the block queued ops may read.
//
// Not thread-safe (one host thread issues the ops); movable before the first op.
#pragma once

#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/cpu_device.h"
#include "core/device.h"
#include "core/trace.h"
#include "kernels/cpu/backend.h"

namespace strata::kernels {

template <class Direct>
class CpuQueuedOps {
 public:
  using Act = typename Direct::Act;
  using W = typename Direct::W;
  static constexpr DType kWeightDType = Direct::kWeightDType;
  static constexpr const char* kName = Direct::kName;
  static constexpr int64_t kLossChunkTokens = Direct::kLossChunkTokens;

  // device: a cpu Device. Its arena holds the activation table and it makes the compute stream
  // (in chaos mode when the device is). Null: no stream, the ops run in the caller.
  explicit CpuQueuedOps(Device* device = nullptr) : direct_(device) {
    if (device == nullptr) return;
    stream_ = device->create_stream();
    stream_->set_trace_name("compute stream");
    cpu_ = &as_cpu_stream(*stream_);
  }
  CpuQueuedOps(CpuQueuedOps&& other) noexcept
      : direct_(std::move(other.direct_)), stream_(std::move(other.stream_)), cpu_(std::exchange(other.cpu_, nullptr)) {}
  CpuQueuedOps& operator=(CpuQueuedOps&&) = delete;
  ~CpuQueuedOps() { synchronize(); }

  // The direct op set the tasks call (for tests of single ops).
  Direct& direct() { return direct_; }

  Result<void*> activation_block(uint64_t bytes, const MicroBatchShape& shape) {
    synchronize();  // queued ops may still read the block this replaces
    return direct_.activation_block(bytes, shape);
  }
  static uint64_t extra_activation_bytes(const MicroBatchShape& shape) { return Direct::extra_activation_bytes(shape); }
  int64_t lm_head_chunk_tokens(int64_t N, int64_t C, int64_t V) const { return direct_.lm_head_chunk_tokens(N, C, V); }
  // Waits for every queued op (traced as the host's wait for the compute stream, which the
  // profile report attributes to the phases the stream ran meanwhile).
  void synchronize() {
    if (stream_ == nullptr) return;
    trace::Span wait("wait", "compute stream");
    stream_->synchronize();
  }
  // Marks, in the queue, where the ops of a phase of the step begin ("forward" of layer `index`,
  // "head", ...; trace::Span names): the stream's thread records each phase as a span of its
  // own track until the next mark, and null ends the last. Without a stream the host's spans
  // are the compute's.
  void trace_phase(const char* name, int64_t index = trace::kNoIndex) {
    if (cpu_ == nullptr) return;
    launch([this, name, index] {
      phase_span_.reset();
      if (name != nullptr) phase_span_.emplace("compute", name, index);
    });
  }
  // The stream the ops are queued on; null when they run in the caller.
  Stream* compute_stream() { return stream_.get(); }
  // Host marks (kernels/cpu/backend.h): a point in the queue, the ops queued so far, which
  // wait_host_mark() waits for while the ops queued after it go on running.
  static constexpr bool kHostMemory = Direct::kHostMemory;
  using HostMark = std::shared_future<void>;
  HostMark host_mark() {
    auto reached = std::make_shared<std::promise<void>>();
    HostMark mark = reached->get_future().share();
    launch([reached] { reached->set_value(); });
    return mark;
  }
  void wait_host_mark(const HostMark& mark) {
    if (!mark.valid()) return;
    trace::Span wait("wait", "compute stream");
    mark.wait();
  }
  // REQUIRES: `host` outlives the ops' use (the decoder's own constants).
  const float* stage_constants(const float* host, int64_t /*n*/) { return host; }
  // The token ids copied into the activation table's slot on the stream (the caller may reuse
  // its array once this returns, and ops of the previous micro-batch may still read the slot).
  const int32_t* stage_tokens(const int32_t* host, int64_t N, int32_t* slot) {
    if (stream_ == nullptr) return host;
    std::vector<int32_t> ids(host, host + N);
    launch([ids = std::move(ids), slot] { std::memcpy(slot, ids.data(), ids.size() * sizeof(int32_t)); });
    return slot;
  }
  const int64_t* stage_offsets(const int64_t* host, int64_t n, int64_t* slot) {
    if (stream_ == nullptr) return host;
    std::vector<int64_t> values(host, host + n);
    launch([values = std::move(values), slot] { std::memcpy(slot, values.data(), values.size() * sizeof(int64_t)); });
    return slot;
  }
  const int64_t* expert_offsets_on_host(const int64_t* offsets, int64_t E) {
    synchronize();
    return direct_.expert_offsets_on_host(offsets, E);
  }
  void copy_to_host(float* host, const float* src, int64_t n) {
    synchronize();
    direct_.copy_to_host(host, src, n);
  }

  // Routing (fp32 on every recipe).
  void moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                         const float* selection_bias, int64_t N, const RouterConfig& config) {
    launch([=, this, config = config] {
      direct_.moe_route_forward(expert_idx, weights, probs, logits, selection_bias, N, config);
    });
  }
  void moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad, const float* probs,
                          const int32_t* expert_idx, const float* weights, int64_t N, const RouterConfig& config) {
    std::vector<float> grad;
    if (prob_grad != nullptr) grad.assign(prob_grad, prob_grad + config.num_experts);
    launch([=, this, grad = std::move(grad), config = config] {
      direct_.moe_route_backward(dlogits, dweights, grad.empty() ? nullptr : grad.data(), probs, expert_idx, weights, N,
                                 config);
    });
  }
  void moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0, int64_t rows) {
    launch([=, this] { direct_.moe_tile_offsets(tile_offsets, expert_offsets, E, row0, rows); });
  }
  void moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets, const int32_t* expert_idx,
                   int64_t N, int64_t K, int64_t E) {
    launch([=, this] { direct_.moe_permute(slot_of, token_of_slot, expert_offsets, expert_idx, N, K, E); });
  }
  // Host arrays the caller reads at once: synchronises.
  void moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx, const float* probs, int64_t N,
                        int64_t K, int64_t E) {
    launch([=, this] { direct_.moe_router_stats(counts, prob_sums, expert_idx, probs, N, K, E); });
    synchronize();
  }

  void embedding_forward(Act* out, const int32_t* tokens, const W* const* table_blocks, int64_t block_rows, int64_t N,
                         int64_t C, int64_t V) {
    std::vector<const W*> blocks(table_blocks, table_blocks + num_blocks(V, block_rows));
    launch([=, this, blocks = std::move(blocks)] {
      direct_.embedding_forward(out, tokens, blocks.data(), block_rows, N, C, V);
    });
  }
  void embedding_backward(float* const* dtable_blocks, int64_t block_rows, const Act* dout, const int32_t* tokens,
                          int64_t N, int64_t C, int64_t V) {
    std::vector<float*> blocks(dtable_blocks, dtable_blocks + num_blocks(V, block_rows));
    launch([=, this, blocks = std::move(blocks)] {
      direct_.embedding_backward(blocks.data(), block_rows, dout, tokens, N, C, V);
    });
  }
  void rmsnorm_forward(Act* out, float* rstd, const Act* x, const W* weight, int64_t N, int64_t C, float eps) {
    launch([=, this] { direct_.rmsnorm_forward(out, rstd, x, weight, N, C, eps); });
  }
  void rmsnorm_backward(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight, const float* rstd,
                        int64_t N, int64_t C) {
    launch([=, this] { direct_.rmsnorm_backward(dx, dweight, dout, x, weight, rstd, N, C); });
  }
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC) {
    launch([=, this] { direct_.linear_forward(out, x, weight, bias, N, IC, OC); });
  }
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC) {
    launch([=, this] { direct_.linear_backward(dx, dweight, dbias, dout, x, weight, N, IC, OC); });
  }
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC) {
    launch([=, this] { direct_.linear_forward_residual(out, x, weight, residual, N, IC, OC); });
  }
  void linear_forward_f32(float* out, const Act* x, const W* weight, int64_t N, int64_t IC, int64_t OC) {
    launch([=, this] { direct_.linear_forward_f32(out, x, weight, N, IC, OC); });
  }
  void linear_backward_f32(Act* dx, float* dweight, const float* dout, const Act* x, const W* weight, int64_t N,
                           int64_t IC, int64_t OC) {
    launch([=, this] { direct_.linear_backward_f32(dx, dweight, dout, x, weight, N, IC, OC); });
  }
  void rope_forward(Act* out, const Act* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                    float scale, int64_t past = 0, const int32_t* positions = nullptr) {
    launch([=, this] { direct_.rope_forward(out, x, inv_freq, B, T, H, D, scale, past, positions); });
  }
  void rope_backward(Act* dx, const Act* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                     float scale, const int32_t* positions = nullptr) {
    launch([=, this] { direct_.rope_backward(dx, dout, inv_freq, B, T, H, D, scale, positions); });
  }
  void attention_forward(Act* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B, int64_t T,
                         int64_t Hq, int64_t Hkv, int64_t D, int64_t past = 0, const int32_t* positions = nullptr,
                         int64_t Dv = 0, double scale = 0) {
    launch([=, this] { direct_.attention_forward(out, lse, q, k, v, B, T, Hq, Hkv, D, past, positions, Dv, scale); });
  }
  void attention_block_forward(float* out, float* lse, const Act* q, const Act* k, const Act* v, int64_t B, int64_t Tq,
                               int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask, bool accumulate,
                               int64_t Dv = 0, double scale = 0) {
    launch([=, this] {
      direct_.attention_block_forward(out, lse, q, k, v, B, Tq, Tk, Hq, Hkv, D, mask, accumulate, Dv, scale);
    });
  }
  void attention_block_backward(float* dq, float* dk, float* dv, const Act* dout, const Act* q, const Act* k,
                                const Act* v, const Act* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                                int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask, bool accumulate_dq,
                                bool accumulate_dkv, int64_t Dv = 0, double scale = 0) {
    launch([=, this] {
      direct_.attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, D, mask, accumulate_dq,
                                       accumulate_dkv, Dv, scale);
    });
  }
  void lora_forward(Act* y, const Act* x, const W* A, const W* B, float scale, const LoraDropout& drop, int64_t N,
                    int64_t IC, int64_t OC, int64_t R) {
    launch([=, this] { direct_.lora_forward(y, x, A, B, scale, drop, N, IC, OC, R); });
  }
  void lora_backward(Act* dx, float* dA, float* dB, const Act* dy, const Act* x, const W* A, const W* B, float scale,
                     const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R) {
    launch([=, this] { direct_.lora_backward(dx, dA, dB, dy, x, A, B, scale, drop, N, IC, OC, R); });
  }
  // Where the direct op set has it (the emulated bf16 recipes' looped experts,
  // kernels/experts_loop.h).
  void accumulate_data_grad(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight, int64_t N,
                            int64_t IC, int64_t OC)
    requires requires(Direct& d, Act* a, float* f, const Act* c, const W* w, int64_t n) {
      d.accumulate_data_grad(a, f, c, c, w, n, n, n);
    }
  {
    launch([=, this] { direct_.accumulate_data_grad(dx, dweight, dout, x, weight, N, IC, OC); });
  }
  void round_activations(Act* dst, const float* src, int64_t n) {
    launch([=, this] { direct_.round_activations(dst, src, n); });
  }
  void copy_columns(Act* dst, int64_t ld_dst, const Act* src, int64_t ld_src, int64_t rows, int64_t cols,
                    ColumnOrder order) {
    launch([=, this] { direct_.copy_columns(dst, ld_dst, src, ld_src, rows, cols, order); });
  }
  void sum_head_columns(Act* dst, const Act* src, int64_t ld_src, int64_t head_stride, int64_t rows, int64_t heads,
                        int64_t cols) {
    launch([=, this] { direct_.sum_head_columns(dst, src, ld_src, head_stride, rows, heads, cols); });
  }
  void attention_backward(Act* dq, Act* dk, Act* dv, const Act* dout, const Act* q, const Act* k, const Act* v,
                          const Act* out, const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                          const int32_t* positions = nullptr, int64_t Dv = 0, double scale = 0) {
    launch([=, this] {
      direct_.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, positions, Dv, scale);
    });
  }
  void swiglu_forward(Act* out, const Act* gate, const Act* up, int64_t n) {
    launch([=, this] { direct_.swiglu_forward(out, gate, up, n); });
  }
  void swiglu_backward(Act* dgate, Act* dup, const Act* dout, const Act* gate, const Act* up, int64_t n) {
    launch([=, this] { direct_.swiglu_backward(dgate, dup, dout, gate, up, n); });
  }
  void add_inplace(Act* a, const Act* b, int64_t n) {
    launch([=, this] { direct_.add_inplace(a, b, n); });
  }
  // The loss is read by the host: synchronises (the block arrays need no copy then).
  double lm_head_cross_entropy(Act* dx, float* const* dweight_blocks, const Act* x, const W* const* weight_blocks,
                               int64_t block_rows, const int32_t* targets, int64_t N, int64_t C, int64_t V,
                               float grad_scale, int64_t chunk_tokens) {
    double loss = 0;
    launch([&] {
      loss = direct_.lm_head_cross_entropy(dx, dweight_blocks, x, weight_blocks, block_rows, targets, N, C, V,
                                           grad_scale, chunk_tokens);
    });
    synchronize();
    return loss;
  }
  void moe_gather(Act* xs, const Act* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
    launch([=, this] { direct_.moe_gather(xs, x, token_of_slot, S, C); });
  }
  void moe_gather_backward(Act* dx, const Act* dxs, const int32_t* slot_of, int64_t N, int64_t K, int64_t C) {
    launch([=, this] { direct_.moe_gather_backward(dx, dxs, slot_of, N, K, C); });
  }
  void moe_combine_forward(Act* out, const Act* ys, const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                           int64_t C) {
    launch([=, this] { direct_.moe_combine_forward(out, ys, weights, slot_of, N, K, C); });
  }
  void moe_combine_backward(Act* dys, float* dweights, const Act* dout, const Act* ys, const float* weights,
                            const int32_t* slot_of, int64_t N, int64_t K, int64_t C) {
    launch([=, this] { direct_.moe_combine_backward(dys, dweights, dout, ys, weights, slot_of, N, K, C); });
  }
  void moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F) {
    launch([=, this, wc = ExpertPointers<const W>(w, E)] {
      direct_.moe_experts_forward(ys, gate, up, act, xs, expert_offsets, wc.view(), E, C, F);
    });
  }
  void moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact, const Act* dys,
                            const Act* xs, const Act* gate, const Act* up, const Act* act,
                            const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E, int64_t C,
                            int64_t F) {
    launch([=, this, dwc = ExpertPointers<float>(dw, E), wc = ExpertPointers<const W>(w, E)] {
      direct_.moe_experts_backward(dxs, dwc.view(), dgate, dup, dact, dys, xs, gate, up, act, expert_offsets,
                                   wc.view(), E, C, F);
    });
  }
  void shared_expert_combine(Act* out, const Act* shared_out, const float* logit, int64_t N, int64_t C) {
    launch([=, this] { direct_.shared_expert_combine(out, shared_out, logit, N, C); });
  }
  void shared_expert_backward(Act* dshared, float* dlogit, const Act* dout, const Act* shared_out, const float* logit,
                              int64_t N, int64_t C) {
    launch([=, this] { direct_.shared_expert_backward(dshared, dlogit, dout, shared_out, logit, N, C); });
  }

 private:
  // The experts' pointer arrays, owned by a task.
  template <typename T>
  struct ExpertPointers {
    ExpertPointers(const ExpertTensors<T>& t, int64_t E)
        : gate(t.gate, t.gate + E), up(t.up, t.up + E), down(t.down, t.down + E) {}
    ExpertTensors<T> view() const { return {gate.data(), up.data(), down.data()}; }
    std::vector<T*> gate, up, down;
  };

  static int64_t num_blocks(int64_t V, int64_t block_rows) { return (V + block_rows - 1) / block_rows; }
  // Queues `task` on the compute stream, or runs it now when there is none.
  template <class F>
  void launch(F&& task) {
    if (cpu_ != nullptr) {
      cpu_->enqueue(std::forward<F>(task));
    } else {
      task();
    }
  }

  Direct direct_;
  std::optional<trace::Span> phase_span_;  // the stream thread's open phase (touched there only)
  std::unique_ptr<Stream> stream_;         // null: the ops run in the caller
  CpuStream* cpu_ = nullptr;               // stream_, typed
};

}  // namespace strata::kernels
