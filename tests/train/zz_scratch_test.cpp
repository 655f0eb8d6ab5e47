#include <gtest/gtest.h>
#include <chrono>
#include <cstdio>
#include "model/decoder.h"
#include "train/machine_bench.h"
#include "train/paged_engine.h"
#include "train/planning.h"
#include "train/train_test_util.h"
namespace strata {
TEST(Scratch, Bytes) {
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  mc.hidden_size = 64; mc.intermediate_size = 176; mc.num_hidden_layers = 4; mc.num_attention_heads = 4; mc.num_experts = 4; mc.num_experts_per_tok = 2; mc.moe_intermediate_size = 88;
  mc.num_key_value_heads = 2; mc.head_dim = 16; mc.vocab_size = 256; mc.tie_word_embeddings = false;
  const int64_t B = 2, T = 32;
  auto batches = make_batches(4, B * T, 3);
  TrainConfig t; t.micro_batch = B; t.seq_len = T; t.grad_accum = 2; t.keep_activations = "true"; t.offload_activations = "auto";
  t.memory_host = 1ull << 30;
  t.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc), t.precision);
  TrainConfig roomy = t; roomy.memory_device = 1ull << 30;
  const PlanInput in = make_plan_input(mc, roomy, false);
  const Plan all = make_plan(in);
  t.memory_device = all.min_device_budget + static_cast<uint64_t>(in.num_layers) * in.layer_chunks * in.chunk_size / 3;
  std::printf("chunk %llu layer_chunks %llu param_chunks %llu edge %llu min %llu dev %llu\n", (unsigned long long)in.chunk_size,
    (unsigned long long)in.layer_chunks, (unsigned long long)in.layer_param_chunks, (unsigned long long)in.edge_chunks,
    (unsigned long long)all.min_device_budget, (unsigned long long)t.memory_device);
  auto e = PagedEngine::create(mc, t, optimizer_config(1.0f));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const Plan& p = (*e)->plan();
  std::printf("plan: res param %lld grad %lld opt %lld offload %d h2d %llu d2h %llu dev %llu ws %llu\n", (long long)p.resident_param_groups,
     (long long)p.resident_grad_groups, (long long)p.device_optimizer_groups, (int)p.offload_activations,
     (unsigned long long)p.h2d_bytes, (unsigned long long)p.d2h_bytes, (unsigned long long)p.device.total(), (unsigned long long)p.device_working_set);
  std::printf("%s\n", (*e)->memory_summary().c_str());
  auto pr = [&](const char* what) {
    static ChunkSpaceStats last{};
    ChunkSpaceStats s = (*e)->chunk_stats();
    std::printf("  %-8s h2d %9llu d2h %9llu zero %9llu devpeak %llu hostpeak %llu\n", what,
      (unsigned long long)(s.host_to_device_bytes - last.host_to_device_bytes),
      (unsigned long long)(s.device_to_host_bytes - last.device_to_host_bytes),
      (unsigned long long)(s.zero_filled_bytes - last.zero_filled_bytes),
      (unsigned long long)s.tiers[0].peak_bytes, (unsigned long long)s.tiers[1].peak_bytes);
    last = s;
  };
  pr("start");
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*e)->zero_grads().ok()); pr("zero");
    for (int m = 0; m < 2; ++m) { (void)(*e)->micro_batch(batches[m].inputs.data(), batches[m].targets.data(), B, T, 1.0f, m == 1, 1e-3f); pr("mb"); }
    (void)(*e)->step(1e-3f); pr("step");
  }
}
}
