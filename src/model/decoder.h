// Decoder<Ops>: THE decoder model of strata, written once over a backend's op set (Ops: storage
// types Act and W plus one member per op; kernels/cpu/backend.h has the CPU ones, fp32 and the
// GPU's bf16 recipe emulated). A Llama-family decoder (RMSNorm, RoPE, grouped-query attention,
// SwiGLU) with explicit per-layer forward and backward. LlamaModel is the fp32 CPU reference
// (Decoder<CpuF32Ops>); LlamaModelBf16 runs the GPU recipe on the CPU. It runs every architecture
// ModelConfig reads: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), and mixture-of-experts
// MLPs with an optional shared expert (Mixtral, Qwen2-MoE, Qwen3-MoE; see moe_layer.h).
//
// MoE auxiliary loss: when config.output_router_logits and router_aux_loss_coef > 0, the
// gradient of w * coef * aux is added, with aux computed over all MoE layers of the forward as
// transformers' load_balancing_loss_func does and w = grad_scale * (valid targets of this
// micro-batch). With one micro-batch and grad_scale = 1 / valid this is exactly the gradient of
// transformers' loss, mean NLL + coef * aux. With several micro-batches sharing
// grad_scale = 1 / (valid targets of the step), each micro-batch's aux is weighted by its share
// of the step's tokens. The returned loss stays the NLL sum; last_aux_loss() reports aux.
//
// Activation memory: forward saves only each layer's input (its layer checkpoint, a saved
// activation) plus what the final norm and the LM head need; backward recomputes one layer at a
// time from its layer checkpoint into a shared scratch workspace and then runs that layer's
// backward. Or, with set_keep_layer_activations(true), every layer keeps its own intermediates
// and backward recomputes nothing (bitwise the same results). All buffers come from one
// activation table planned for the largest (B, T) seen and reused afterwards. When the
// ParamAccess offloads activations (param_access.h), the table keeps min(3, L + 1) layer
// checkpoint slots instead of L + 1: forward hands each offloaded layer checkpoint to the access
// as soon as it is written and backward fetches it back before recomputing its layer; the
// results are bitwise those of the unoffloaded model.
//
// Generation: begin_sequence() and decode() run one sequence with a KV cache: the prompt's tokens
// in one call (prefill), then one token per call. They run the training forward's own layer graph
// (layer_forward, the same ops): the only differences are that the keys and values a layer makes
// go to the cache, RoPE rotates by the tokens' positions in the sequence, and attention's queries
// see the cached keys before their own (the ops' `past`). Each token's row goes through the same
// arithmetic as in a forward of the whole sequence, so with a GEMM whose sums do not depend on the
// number of rows (STRATA_DETERMINISTIC_GEMM=1 on the CPU) the logits are bitwise those of
// recomputing the whole sequence; with OpenBLAS they differ by its summation order.
//
// MoE layers route first and then begin, through the ParamAccess, only the experts that received
// tokens (ParamAccess::begin_experts), so a paged state can fetch just those; the kernels never
// touch the other experts' tensors (they skip experts without rows).
//
// State: the model owns no parameters or gradients. It reads and accumulates them through the
// ParamAccess it is given (set_access): the paged training state (train/paged_state.h), or a
// FlatAccess over flat buffers its caller owns (flat_access.h). The ops read the backend's
// compute copy W, of the access's param_dtype(): fp32 on the CPU reference, bf16 in the GPU's
// recipe, E4M3 blocks in the fp8 recipe's linear weights. Whoever owns the fp32 master keeps the
// compute copy in step with it. Parameter gradients are fp32 on every backend.
//
// Not thread-safe; not copyable.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/queued_ops.h"
#include "kernels/lora.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/expert_parallel.h"
#include "model/mla_layer.h"
#include "model/moe_layer.h"
#include "model/param_access.h"
#include "model/params.h"

namespace strata::model {

// Number of targets >= 0 (the tokens that count towards the loss).
int64_t count_valid_targets(const int32_t* targets, int64_t n);

// What the training engines drive, whatever the backend: one virtual call per micro-batch or
// step (never per element). Decoder<Ops> implements it; make_cpu_decoder() picks the backend.
class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const ParamLayout& layout() const = 0;
  // Starts a step's expert token counts (expert_token_counts()) from zero. The gradients are
  // zeroed by whoever owns them (the ParamAccess's owner).
  virtual void reset_expert_token_counts() = 0;
  // positions (B, T) or null: packed documents (data.packing: document), each token's position
  // in its document; see Decoder::compute.
  virtual Result<double> compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                 float grad_scale, bool backward, const int32_t* positions = nullptr) = 0;
  virtual void set_access(ParamAccess* access) = 0;
  virtual double last_aux_loss() const = 0;
  // The MTP module's cross-entropy in the last compute() with backward: the sum of its token
  // NLLs and how many targets it had (0 and 0 without one; see ModelConfig::mtp_loss_weight).
  virtual std::pair<double, int64_t> last_mtp_loss() const = 0;
  virtual const std::vector<int64_t>& expert_token_counts() const = 0;
  // The same counts to change: data-parallel ranks replace theirs by the sum over ranks before
  // update_expert_bias(), so every rank moves the bias alike.
  virtual std::vector<int64_t>& mutable_expert_token_counts() = 0;
  virtual const std::vector<float>& expert_selection_bias() const = 0;
  virtual std::vector<float>& mutable_expert_selection_bias() = 0;
  virtual void update_expert_bias() = 0;
  // Keep every layer's intermediates for backward (no recomputation: about a third less
  // compute, more activation memory) or recompute each layer from its layer checkpoint. Bitwise
  // the same results either way. Takes effect at the next compute.
  virtual void set_keep_layer_activations(bool keep) = 0;
  // Run each dense MLP over tiles of `tokens` tokens of the micro-batch (0: all at once), in
  // forward and in backward, which then recomputes each tile's gate, up and activation instead
  // of keeping them: its buffers hold a tile, O(tile x intermediate) rather than O(N x
  // intermediate). The output and every input gradient are those of the untiled MLP row for
  // row (bitwise with a GEMM whose rows do not depend on each other, e.g. the fixed-order one);
  // the MLP's weight gradients sum the tiles' partial sums (within the bound of reordered fp32
  // sums). MoE layers: the shared expert over the same token tiles, and (without expert
  // parallelism, not in the fp8 recipe) the routed experts over tiles of as many rows of the
  // expert order (model/moe_layer.h). Takes effect at the next compute. REQUIRES: tokens >= 0.
  virtual void set_mlp_tile_tokens(int64_t tokens) = 0;
  // LoRA dropout's seed for the next training computes (model/lora.h): the masks depend on it, the
  // adapted weight and the element only, so the caller sets one per micro-batch (from the run's
  // seed, the step and the micro-batch) and a resumed run draws the same masks.
  virtual void set_dropout_seed(uint64_t seed) { (void)seed; }
  // Bytes of the activation table for micro-batches of `tokens` (B * T) tokens, with the layer
  // checkpoints offloaded or not, in an expert group of `expert_ranks` (1: none; see
  // set_expert_comm) and a context group of `context_ranks` (0: none; see set_context_comm).
  virtual int64_t activation_bytes_for(int64_t tokens, bool offload_activations, bool keep_layers,
                                       int64_t expert_ranks, int64_t context_ranks) const = 0;
  // The stream the model's ops are queued on, for an access that orders its moves after them;
  // null when the ops run in the calling thread (a CPU op set made without a Device).
  virtual Stream* compute_stream() = 0;
  // Expert parallelism (model/expert_parallel.h): the routed experts of every MoE layer are split
  // over the ranks of `comm` (the expert group), this process computing expert_range(E,
  // comm->world_size(), comm->rank()) for every rank's tokens, and begins only those through its
  // ParamAccess. Null (the default): this process runs every expert of its own tokens. Every rank
  // of the group must then run the same micro-batches (compute() calls) in step. Borrowed; its
  // operations are issued from the thread that calls compute(). REQUIRES: an MoE model whose
  // expert count the group's size divides; not while a sequence is generated.
  virtual void set_expert_comm(parallel::Comm* comm) = 0;
  // The ranks of the expert group (1 without expert parallelism).
  virtual int expert_ranks() const = 0;
  // Context parallelism (model/context_parallel.h): the sequences are split over the N ranks of
  // `comm` (the context group) and attention runs as a ring over them. compute() then takes this
  // rank's tokens in the layout there: B = 2S rows of T = C tokens for S sequences of 2NC tokens
  // (context_split of the inputs and targets); RoPE rotates each token by its position in its
  // sequence. Every rank of the group runs the same compute() calls in step, and their gradients
  // add up to the whole sequences' (the caller sums them, as over data-parallel ranks). Null (the
  // default): none. Borrowed; its operations are issued from the thread that calls compute().
  // REQUIRES: no document masks, not while a sequence is generated.
  virtual void set_context_comm(parallel::Comm* comm) = 0;
  // The ranks of the context group (1 without context parallelism).
  virtual int context_ranks() const = 0;

  // Generation with a KV cache, one sequence at a time (see Decoder). begin_sequence starts a
  // sequence of at most `capacity` tokens (prompt and generated), whose decode() calls take at
  // most `max_chunk` tokens each: the activation table is planned for that (the cache included;
  // a compute() in between plans it anew and ends the sequence). InvalidArgument for a capacity
  // beyond the config's sliding window or one whose cache size overflows; the backend's
  // OutOfMemory when the table does not fit.
  virtual Status begin_sequence(int64_t capacity, int64_t max_chunk) = 0;
  // Runs tokens (n) at positions sequence_length() .. + n - 1 through the model, their keys and
  // values added to the cache, and writes to logits (V, fp32, host memory) the scores of the
  // token that follows the last of them. InvalidArgument for a token outside the vocabulary, for
  // n beyond the chunk or the capacity left, and when no sequence is begun. REQUIRES: a
  // ParamAccess is set.
  virtual Status decode(const int32_t* tokens, int64_t n, float* logits) = 0;
  // Tokens in the cache: those decode() has run since begin_sequence.
  virtual int64_t sequence_length() const = 0;
};

template <class Ops>
class Decoder final : public Model {
 public:
  using Act = typename Ops::Act;
  using W = typename Ops::W;
  using OpSet = Ops;

  // REQUIRES: config.validate(...) is OK. Set a ParamAccess (set_access) before compute.
  // ops: the backend's op set (the CPU ones are default-constructed; the CUDA one is made on
  // its Device).
  explicit Decoder(const ModelConfig& config, Ops ops = Ops());
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }

  void reset_expert_token_counts() override;
  // Returns the SUM of token NLLs over targets >= 0 of this micro-batch and accumulates
  // grads += grad_scale * d(sum)/d(params); callers accumulating micro-batches pass
  // grad_scale = 1 / (valid tokens in the whole step) to get the mean loss's gradient.
  // inputs, targets: (B, T); inputs in [0, V), targets < V (negative = ignored).
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale);
  // Same sum of NLLs without touching the gradients.
  double forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T);
  // The step both wrap: forward, and when `backward` the backward too. The parameters and
  // gradients come from the ParamAccess, wherever it keeps them, and its errors (an I/O error
  // paging a group in) are returned. REQUIRES: a ParamAccess is set.
  // positions (B, T) or null: document masks for sequences that pack several documents. Token
  // t of row b is at position positions[b, t] of a document that starts at t - positions[b, t]:
  // RoPE rotates by that position and attention sees only the keys of the same document
  // (kernels/attention.h). Null: each row is one sequence from position 0 (the bits of a run
  // without packing). The targets that would cross a boundary are the caller's to mask (the
  // data loader sets them to -1). REQUIRES: positions[b, 0] = 0 and each next position is 0 or
  // the previous one plus 1.
  Result<double> compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                         bool backward, const int32_t* positions = nullptr) override;
  // Routes parameter and gradient access through `access` (null: none, to let the previous one
  // go). The model begins and ends groups as model/param_access.h describes; it does not own
  // `access`, which must outlive its use. REQUIRES: access->param_dtype() is the backend's
  // weight type.
  void set_access(ParamAccess* access) override;
  // Bytes held by the activation table (0 before the first compute).
  int64_t activation_bytes() const { return acts_.bytes(); }

  // MoE models: the auxiliary load-balancing loss of the last forward (0 for dense models),
  // reported whether or not it joins the training loss.
  double last_aux_loss() const override { return last_aux_loss_; }
  std::pair<double, int64_t> last_mtp_loss() const override { return {last_mtp_nll_, last_mtp_targets_}; }
  // (blocks, E) row-major (the MTP block's row after the layers'): assignments (a token's K choices count K times) to each expert of each
  // layer, summed over the forward_backward calls since the last reset_expert_token_counts()
  // (one optimizer step). Rows of dense layers are 0; empty for dense models.
  const std::vector<int64_t>& expert_token_counts() const override { return expert_counts_; }
  std::vector<int64_t>& mutable_expert_token_counts() override { return expert_counts_; }
  // (blocks, E): the loss-free balancing selection bias (all 0 unless
  // config.router_bias_update_rate > 0). Not a trained parameter; checkpoints save it apart.
  const std::vector<float>& expert_selection_bias() const override { return expert_bias_; }
  std::vector<float>& mutable_expert_selection_bias() override { return expert_bias_; }
  // Loss-free balancing: moves each MoE layer's bias by rate * sign(mean load - load) using
  // expert_token_counts(). Call once per optimizer step, after the micro-batches; a no-op
  // unless config.router_bias_update_rate > 0.
  void update_expert_bias() override;
  void set_keep_layer_activations(bool keep) override { keep_layers_ = keep; }
  void set_mlp_tile_tokens(int64_t tokens) override { mlp_tile_ = tokens; }
  void set_dropout_seed(uint64_t seed) override { dropout_seed_ = seed; }
  Stream* compute_stream() override { return ops_.compute_stream(); }
  void set_expert_comm(parallel::Comm* comm) override;
  int expert_ranks() const override { return expert_comm_ != nullptr ? expert_comm_->world_size() : 1; }
  void set_context_comm(parallel::Comm* comm) override;
  int context_ranks() const override { return context_comm_ != nullptr ? context_comm_->world_size() : 1; }
  Status begin_sequence(int64_t capacity, int64_t max_chunk) override;
  Status decode(const int32_t* tokens, int64_t n, float* logits) override;
  int64_t sequence_length() const override { return kv_length_; }
  int64_t activation_bytes_for(int64_t tokens, bool offload_activations, bool keep_layers, int64_t expert_ranks,
                               int64_t context_ranks) const override {
    return ActivationTable<Ops>::bytes_for(config_, tokens, offload_activations, keep_layers, expert_ranks, mlp_tile_,
                                           context_ranks);
  }

 private:
  // What latent attention's RoPE reads (model/mla_layer.h).
  MlaRope mla_rope() const;
  // Sets the RoPE frequencies (inv_freq_, inv_freq_ops_) for sequences of T tokens.
  void update_rope(int64_t T);
  // Embedding, all layers, final norm; leaves the final norm's output in acts_.final_out.
  // Sets last_aux_loss_ and the router statistics of this forward (forward_counts_ and
  // forward_prob_sums_, summed over MoE layers); when count_tokens, also adds the per-layer
  // counts to expert_counts_.
  // With `offload`, forward hands offloaded layer checkpoints to the access (see
  // param_access.h).
  // positions: as compute's (null without document masks); staged for the ops in staged_positions_.
  Status forward_layers(const int32_t* inputs, const int32_t* positions, int64_t B, int64_t T, bool count_tokens,
                        bool offload);
  // The activation table's slot for layer checkpoint l (0..L: the input of layer l, and the
  // last layer's output) of a micro-batch of N tokens.
  Act* layer_checkpoint(int64_t l, int64_t N);
  Status begin_group(int group, bool params, bool grads);
  // Ring attention over the context group (model/context_parallel.h): forward writes a.att and
  // a.lse from a.q and the layer's k, v; backward a.d_q, a.d_k, a.d_v from a.d_att. Errors: the
  // ring's exchanges (a rank that died), named with the layer.
  Status ring_attention_forward(int64_t layer, const ActivationTable<Ops>& a, const Act* k, const Act* v, int64_t B,
                                int64_t T);
  Status ring_attention_backward(int64_t layer, const ActivationTable<Ops>& a, int64_t B, int64_t T);
  void end_group(int group, bool params, bool grads);
  // The tensor starting at flat-layout `offset`, from the ParamAccess.
  const W* param(int64_t offset) { return static_cast<const W*>(access_->param(offset)); }
  // Null for a frozen tensor (an untrained MTP module's, every base tensor with LoRA): the ops
  // skip its gradient.
  float* grad(int64_t offset) { return layout_.at(offset).frozen ? nullptr : access_->grad(offset); }
  // What the ops take for a tensor's gradient blocks: null when it is frozen.
  static float* const* grad_blocks_or_null(const std::vector<float*>& blocks) {
    return blocks.empty() || blocks.front() == nullptr ? nullptr : blocks.data();
  }
  bool frozen(int64_t offset) const { return layout_.at(offset).frozen; }
  // LoRA (model/lora.h): the adapter of the weight at flat-layout `weight` (none: a no-op) adds
  // its part to y (n, OC) from x (n, IC), and in backward to dx (null: skipped) and its
  // gradients from dy. row0: the rows' first index in the micro-batch (dropout's mask).
  void lora_forward(int64_t weight, Act* y, const Act* x, int64_t n, int64_t IC, int64_t OC, int64_t row0 = 0);
  void lora_backward(int64_t weight, Act* dx, const Act* dy, const Act* x, int64_t n, int64_t IC, int64_t OC,
                     int64_t row0 = 0);
  kernels::LoraDropout lora_dropout(int64_t weight, int64_t row0) const;
  // The adapters of MoE layer `layer` as moe_layer.h applies them, and what to pass it: null
  // without LoRA, so that the block runs exactly as in full training.
  MoeAdapters<Ops> moe_adapters(int64_t layer);
  const MoeAdapters<Ops>* lora_of_moe(const MoeAdapters<Ops>& m) const { return layout_.has_lora() ? &m : nullptr; }
  // The row blocks of the tensor at `offset` (one pointer when it is not in blocks), and the
  // rows per block (its first dimension when it is not).
  std::vector<const W*> param_blocks(int64_t offset);
  std::vector<float*> grad_blocks(int64_t offset);
  int64_t block_rows(int64_t offset) const;
  auto param_at() {
    return [this](int64_t offset) { return param(offset); };
  }
  auto grad_at() {
    return [this](int64_t offset) { return grad(offset); };
  }
  // Generation: where layer_forward puts the keys and values of its T tokens and what attention
  // reads. k and v are the layer's cache, (capacity, Hkv*D) rows each (B = 1); the tokens are at
  // positions past .. past + T - 1.
  struct KvSlot {
    Act* k = nullptr;
    Act* v = nullptr;
    int64_t past = 0;
  };
  // One decoder layer from x (its layer checkpoint). When out is non-null, writes the layer output
  // there; backward's recomputation passes null because only the intermediates are needed.
  // stats (null in the recomputation) receives the MoE router statistics. An MoE layer begins
  // the experts its router picked (begin_experts, with their gradients when `grads`) and leaves
  // them begun: the caller ends them with end_experts() once done with the layer. kv: null in
  // training; in generation the cache (above), and attention sees the cached positions too.
  Status layer_forward(int64_t layer, const Act* x, Act* out, int64_t B, int64_t T, const RouterStats* stats,
                       bool grads, const KvSlot* kv = nullptr);
  // The MTP modules (ModelConfig::trains_mtp), forward and backward, after the head's backward
  // left dL/d(last layer's output) in acts_.dres, to which they add their part. Module k reads the
  // inputs k ahead and predicts the targets k ahead (positions past the row's end, and with
  // document masks those whose k tokens ahead cross the start of a document, predict nothing),
  // from the last layer's output (k = 1) or module k - 1's. Their gradients are scaled by
  // grad_scale * mtp_loss_weight / num_nextn_predict_layers.
  Status mtp_forward_backward(const int32_t* inputs, const int32_t* targets, const int32_t* positions, int64_t B,
                              int64_t T, float grad_scale);
  // Module k's forward (its output left in the table for module k + 1), or forward and backward.
  Status mtp_module(int64_t k, const int32_t* inputs, const int32_t* targets, const int32_t* positions, int64_t B,
                    int64_t T, float grad_scale, bool backward);
  // Generation's head: final norm of the (C) row x and the LM head into acts_.logits, copied to
  // logits (V) on the host.
  Status decode_head(const Act* x, float* logits);
  // MoE layers: begins, through the ParamAccess, the experts that the last routing
  // (acts_.expert_offsets) gave at least one token, and records them in active_experts_; only
  // their tensors are bound (moe_offsets()). No-ops for dense layers.
  Status begin_experts(int64_t layer, bool params, bool grads);
  void end_experts(int64_t layer, bool params, bool grads);
  // The layer's MoE offsets with -1 for the experts not in active_experts_.
  MoeOffsets moe_offsets(int64_t layer) const;
  // dres (N, C): on entry dL/d(layer output), on return dL/d(layer input x). prob_grad (E) or
  // null: the auxiliary loss's gradient with respect to the router softmax.
  // Returns expert parallelism's communication errors (other layers never fail).
  Status layer_backward(int64_t layer, const Act* x, Act* dres, int64_t B, int64_t T, const float* prob_grad);
  // The dense MLP's gate, up and activation of n rows x (n, C) into `into`'s buffers (null: the
  // shared ones, which hold a token tile when the MLP is tiled). row0: the rows' first index in
  // the micro-batch.
  void mlp_tile_forward(int64_t layer, const LayerTensors<const W>& p, const Act* x, int64_t n, int64_t row0,
                        const ActivationTable<Ops>* into = nullptr);
  const float* layer_selection_bias(int64_t layer) const;

  void check_tokens(const int32_t* inputs, const int32_t* targets, int64_t n) const;
  void check_positions(const int32_t* positions, int64_t B, int64_t T) const;

  ModelConfig config_;
  ParamLayout layout_;
  Ops ops_;
  std::vector<float> inv_freq_;  // (D/2) RoPE frequencies
  const float* inv_freq_ops_ = nullptr;  // the same where the ops read them
  float rope_scale_ = 1.0f;  // what RoPE multiplies cos and sin by (YaRN's attention factor)
  int64_t rope_length_ = -1;             // the sequence length they were made for (dynamic scaling)
  const int32_t* staged_inputs_ = nullptr;  // the last forward's input tokens where the ops read them
  const int32_t* staged_positions_ = nullptr;  // its document positions there; null without document masks
  // The positions RoPE rotates by: the document positions, or the tokens' places in their
  // sequences with context parallelism; null for 0 .. T-1 in every row.
  const int32_t* staged_rope_positions_ = nullptr;
  bool keep_layers_ = false;
  int64_t mlp_tile_ = 0;  // tokens (and expert rows) per MLP tile (0: untiled)
  uint64_t dropout_seed_ = 0;
  bool dropout_on_ = false;  // in a compute with backward (LoRA dropout trains only)
  ActivationTable<Ops> acts_;
  ParamAccess* access_ = nullptr;
  // MoE state (empty for dense models).
  std::vector<int64_t> expert_counts_;     // (L, E) since reset_expert_token_counts()
  std::vector<int64_t> forward_counts_;    // (E) this forward, summed over MoE layers
  std::vector<double> forward_prob_sums_;  // (E) this forward, summed over MoE layers
  std::vector<float> expert_bias_;         // (L, E) loss-free selection bias
  std::vector<int> active_experts_;        // the experts begun by begin_experts(), ascending
  // Expert parallelism (set_expert_comm): the expert group, and each layer's last exchange.
  parallel::Comm* expert_comm_ = nullptr;
  std::vector<ExpertRoute> expert_routes_;  // (L)
  // Context parallelism (set_context_comm): the context group and each token's place in its
  // sequence (the ring's buffers are the activation table's).
  parallel::Comm* context_comm_ = nullptr;
  std::vector<int32_t> context_positions_;
  double last_aux_loss_ = 0.0;
  double last_mtp_nll_ = 0.0;
  int64_t last_mtp_targets_ = 0;
  std::vector<int32_t> mtp_tokens_;  // (2N) an MTP module's inputs, then its targets, on the host
  // Generation (begin_sequence): the sequence's capacity, the tokens per decode() at most, and
  // the tokens in the cache.
  int64_t kv_capacity_ = 0;
  int64_t kv_chunk_ = 0;
  int64_t kv_length_ = 0;
};

// The CPU backend's op sets as the decoder runs them: queued on a compute stream when made
// with a Device, run in the caller without one (kernels/cpu/queued_ops.h).
using CpuF32Model = kernels::CpuQueuedOps<kernels::CpuF32Ops>;
using CpuBf16Model = kernels::CpuQueuedOps<kernels::CpuBf16Ops>;
using CpuFp8Model = kernels::CpuQueuedOps<kernels::CpuFp8Ops>;
using CpuNf4Model = kernels::CpuQueuedOps<kernels::CpuNf4Ops>;
// The fp32 CPU reference and the GPU's bf16 recipe on the CPU (both instantiated in
// decoder_cpu.cpp).
using LlamaModel = Decoder<CpuF32Model>;
using LlamaModelBf16 = Decoder<CpuBf16Model>;
// The fp8 recipe on the CPU (its compute copy is per-tensor bytes: no FlatAccess serves it).
using LlamaModelFp8 = Decoder<CpuFp8Model>;
// The nf4 base (LoRA over NF4 linear weights) on the CPU.
using LlamaModelNf4 = Decoder<CpuNf4Model>;
extern template class Decoder<CpuF32Model>;
extern template class Decoder<CpuBf16Model>;
extern template class Decoder<CpuFp8Model>;
extern template class Decoder<CpuNf4Model>;

// The decoder on the CPU backend whose compute copy is `compute` (F32: the reference; BF16 and
// F8_E4M3: the GPU's bf16 and fp8 recipes emulated; NF4: the bf16 recipe over an NF4 base). device: where its activation table lives
// (the arena of a cpu Device, under its budget, and its ops queued on a compute stream), or null
// for ordinary host memory and ops run in the caller.
std::unique_ptr<Model> make_cpu_decoder(DType compute, const ModelConfig& config, Device* device = nullptr);

}  // namespace strata::model
