// Ring attention over the context group (model/context_parallel.h): the Decoder's two methods,
// included at the end of decoder_impl.h.
//
// Forward: at step s this rank holds the keys and values of rank (r - s) mod N, its own at step 0
// (the layer's own k, v), later in ring_k/ring_v by turns. The blocks of step s are queued first;
// then the keys and values held go on to rank r + 1 while those for step s + 1 come in from
// r - 1, over the buffer the blocks of step s - 1 read. The blocks merge into fp32 sums
// (ring_out, and the lse in a.lse itself), rounded into a.att at the end.
// Backward: the same ring, with the fp32 gradients of the keys and values held (ring_dk,
// ring_dv) travelling beside them: each step's blocks add to them and to dq, then they go on to
// the next rank, and after the N-th exchange each rank holds its own keys' sums.
//
// Overlap: on the CPU backend (host memory, ops queued on a compute stream's thread) the
// exchanges run on the calling thread while the step's blocks run on the stream: a host mark
// taken before the blocks says when what an exchange sends or receives over is free. The
// gradient sums wait for the step's own blocks. On CUDA the exchanges are queued on the compute
// stream behind the blocks (NCCL), in order. The buffers are the activation table's
// (ring_k .. ring_dq); no sum is zeroed: each half's first block writes it.
#pragma once

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "model/context_parallel.h"
#include "model/decoder.h"

namespace strata::model {

// One exchange of the ring: `send` to the next rank, `recv` from the one before. With host-memory
// op sets it runs on this thread once the ops before `mark` are done (those that wrote `send` or
// read `recv` last), while the ops queued after the mark run on; otherwise it is queued on the
// compute stream behind them.
template <class Ops>
Status ring_exchange(Ops& ops, parallel::Comm& comm, const typename Ops::HostMark& mark, const void* send, void* recv,
                     size_t bytes) {
  const int N = comm.world_size(), r = comm.rank();
  const int to = (r + 1) % N, from = (r + N - 1) % N;
  if constexpr (Ops::kHostMemory) {
    ops.wait_host_mark(mark);
    return comm.send_recv(send, to, recv, from, bytes);
  } else {
    return comm.send_recv(send, to, recv, from, bytes, ops.compute_stream());
  }
}

template <class Ops>
Status Decoder<Ops>::ring_attention_forward(int64_t layer, const ActivationTable<Ops>& a, const Act* k, const Act* v,
                                            int64_t B, int64_t T) {
  parallel::Comm& comm = *context_comm_;
  const int64_t N = comm.world_size(), r = comm.rank();
  const int64_t S = B / 2, Hq = config_.num_attention_heads, Hkv = config_.num_key_value_heads,
                D = config_.head_dim;
  const int64_t kv_elems = B * T * Hkv * D, out_elems = B * T * Hq * D;
  const size_t kv_bytes = static_cast<size_t>(kv_elems) * sizeof(Act);
  auto failed = [&](const Status& st) {
    access_->collectives_failed(st);
    return st.with_context(fmt::format("layer {}: ring attention forward", layer));
  };
  // Half h (0, 1) of a local tensor with `width` elements per token.
  auto half = [&](auto* base, int h, int64_t width) { return base + h * S * T * width; };
  bool started[2] = {false, false};  // a query half's first block writes, the later ones merge
  const Act* held_k = k;
  const Act* held_v = v;
  for (int64_t s = 0; s < N; ++s) {
    // The ops before this mark wrote what is sent (RoPE, at step 0) and read last what is
    // received over (the blocks of step s - 1); the blocks of step s run during the exchange.
    const typename Ops::HostMark mark = ops_.host_mark();
    const int64_t src = context_ring_source(N, r, s);
    for (int qh = 0; qh < 2; ++qh)
      for (int kh = 0; kh < 2; ++kh) {
        const std::optional<kernels::AttentionBlock> block =
            context_block(context_chunk(N, r, qh), context_chunk(N, src, kh));
        if (!block) continue;
        ops_.attention_block_forward(half(acts_.ring_out, qh, Hq * D), half(a.lse, qh, Hq), half(a.q, qh, Hq * D),
                                     half(held_k, kh, Hkv * D), half(held_v, kh, Hkv * D), S, T, T, Hq, Hkv, D, *block,
                                     started[qh]);
        started[qh] = true;
      }
    if (s + 1 == N) break;
    if (Status st = ring_exchange(ops_, comm, mark, held_k, acts_.ring_k[s % 2], kv_bytes); !st.ok()) return failed(st);
    if (Status st = ring_exchange(ops_, comm, mark, held_v, acts_.ring_v[s % 2], kv_bytes); !st.ok()) return failed(st);
    held_k = acts_.ring_k[s % 2];
    held_v = acts_.ring_v[s % 2];
  }
  ops_.round_activations(a.att, acts_.ring_out, out_elems);
  return Status::OK();
}

template <class Ops>
Status Decoder<Ops>::ring_attention_backward(int64_t layer, const ActivationTable<Ops>& a, int64_t B, int64_t T) {
  parallel::Comm& comm = *context_comm_;
  const int64_t N = comm.world_size(), r = comm.rank();
  const int64_t S = B / 2, Hq = config_.num_attention_heads, Hkv = config_.num_key_value_heads,
                D = config_.head_dim;
  const int64_t kv_elems = B * T * Hkv * D, q_elems = B * T * Hq * D;
  const size_t kv_bytes = static_cast<size_t>(kv_elems) * sizeof(Act);
  const size_t sum_bytes = static_cast<size_t>(kv_elems) * sizeof(float);
  auto failed = [&](const Status& st) {
    access_->collectives_failed(st);
    return st.with_context(fmt::format("layer {}: ring attention backward", layer));
  };
  auto half = [&](auto* base, int h, int64_t width) { return base + h * S * T * width; };
  // At step 0 the first block of each half writes its sums (dq's, and those of this rank's own
  // keys); later blocks, and the sums received, are added to.
  bool dq_started[2] = {false, false}, dkv_started[2] = {false, false};
  const Act* held_k = a.k;
  const Act* held_v = a.v;
  for (int64_t s = 0; s < N; ++s) {
    const typename Ops::HostMark mark = ops_.host_mark();
    float* dk = acts_.ring_dk[s % 2];
    float* dv = acts_.ring_dv[s % 2];
    const int64_t src = context_ring_source(N, r, s);
    for (int qh = 0; qh < 2; ++qh)
      for (int kh = 0; kh < 2; ++kh) {
        const std::optional<kernels::AttentionBlock> block =
            context_block(context_chunk(N, r, qh), context_chunk(N, src, kh));
        if (!block) continue;
        ops_.attention_block_backward(half(acts_.ring_dq, qh, Hq * D), half(dk, kh, Hkv * D), half(dv, kh, Hkv * D),
                                      half(a.d_att, qh, Hq * D), half(a.q, qh, Hq * D), half(held_k, kh, Hkv * D),
                                      half(held_v, kh, Hkv * D), half(a.att, qh, Hq * D), half(a.lse, qh, Hq), S, T,
                                      T, Hq, Hkv, D, *block, dq_started[qh], s > 0 || dkv_started[kh]);
        dq_started[qh] = true;
        if (s == 0) dkv_started[kh] = true;
      }
    // The keys and values for the next step come in while this step's blocks run (the blocks of
    // step s - 1 read last what they come in over).
    if (s + 1 < N) {
      if (Status st = ring_exchange(ops_, comm, mark, held_k, acts_.ring_k[s % 2], kv_bytes); !st.ok())
        return failed(st);
      if (Status st = ring_exchange(ops_, comm, mark, held_v, acts_.ring_v[s % 2], kv_bytes); !st.ok())
        return failed(st);
      held_k = acts_.ring_k[s % 2];
      held_v = acts_.ring_v[s % 2];
    }
    // The gradient sums go on once this step's blocks have added to them; the ones coming in
    // replace those sent a step before.
    const typename Ops::HostMark blocks_done = ops_.host_mark();
    if (Status st = ring_exchange(ops_, comm, blocks_done, dk, acts_.ring_dk[(s + 1) % 2], sum_bytes); !st.ok())
      return failed(st);
    if (Status st = ring_exchange(ops_, comm, blocks_done, dv, acts_.ring_dv[(s + 1) % 2], sum_bytes); !st.ok())
      return failed(st);
  }
  // After N exchanges the sums of this rank's own keys are back, in the buffer of step N.
  ops_.round_activations(a.d_q, acts_.ring_dq, q_elems);
  ops_.round_activations(a.d_k, acts_.ring_dk[N % 2], kv_elems);
  ops_.round_activations(a.d_v, acts_.ring_dv[N % 2], kv_elems);
  return Status::OK();
}

}  // namespace strata::model
