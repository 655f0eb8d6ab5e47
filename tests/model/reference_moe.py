#!/usr/bin/python3
"""References for strata's architecture parity test (tests/model/moe_parity_test.cpp).

Usage: reference_moe.py OUTDIR VARIANT
  VARIANT  mixtral, qwen2_moe, mistral, qwen2   tiny random models built by transformers (4.40)
           qwen3_moe, qwen3                     a plain PyTorch Qwen3-MoE or dense Qwen3
                                                (transformers 4.40 has neither), written below
                                                after the published modeling code's conventions

Writes OUTDIR/VARIANT/:
  config.json, model.safetensors   save_pretrained(safe_serialization=True) in float32 (for
                                   qwen3_moe: the same keys and tensor names, written here)
  reference.json                   batch (inputs, targets with -1 = ignored), the loss
                                   (mean NLL + router_aux_loss_coef * aux for MoE models, as
                                   transformers' *ForCausalLM computes it with
                                   output_router_logits), its NLL and aux parts, and "grads":
                                   [{name, shape, offset}] into grads.bin
  grads.bin                        float32 gradients of the loss, concatenated in that order
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
BATCH, SEQ = 2, 12
COMMON = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, hidden_act="silu")
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)

VARIANTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, **MOE, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                     rope_theta=1e6, sliding_window=None, tie_word_embeddings=False), 31),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(COMMON, **MOE, num_hidden_layers=2, intermediate_size=80, num_experts=4,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       norm_topk_prob=False, decoder_sparse_step=1, rope_theta=10000.0,
                       use_sliding_window=False, tie_word_embeddings=False), 32),
    "qwen3_moe": (None, "Qwen3MoeForCausalLM",
                  dict(COMMON, **MOE, num_hidden_layers=3, intermediate_size=80, num_experts=4,
                       moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[1], head_dim=24, attention_bias=False, rope_theta=1e6,
                       use_sliding_window=False, tie_word_embeddings=False), 33),
    "qwen3": (None, "Qwen3ForCausalLM",
              dict(COMMON, num_hidden_layers=2, intermediate_size=80, head_dim=24, attention_bias=False,
                   rope_theta=1e6, use_sliding_window=False, tie_word_embeddings=True), 36),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(COMMON, num_hidden_layers=2, intermediate_size=80, rope_theta=10000.0,
                     sliding_window=64, tie_word_embeddings=False), 34),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(COMMON, num_hidden_layers=2, intermediate_size=80, rope_theta=1e6,
                   use_sliding_window=False, tie_word_embeddings=True), 35),
}


# ---------------------------------------------------------------------------------------------
# Qwen3 (dense, or MoE when the config has experts) in plain PyTorch, following transformers' modeling conventions (RMSNorm in fp32 with
# the weight applied last, rotate_half RoPE, repeat_kv GQA, per-head q_norm/k_norm before RoPE,
# softmax-then-top-k router with optional renormalisation, experts combined with index_add_).

class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        hidden = c["hidden_size"]
        self.q_proj = torch.nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = torch.repeat_interleave(k, rep, dim=1)
        v = torch.repeat_interleave(v, rep, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(torch.nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, width, bias=False)
        self.up_proj = torch.nn.Linear(hidden, width, bias=False)
        self.down_proj = torch.nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.top_k, self.norm_topk_prob = c["num_experts_per_tok"], c["norm_topk_prob"]
        self.gate = torch.nn.Linear(c["hidden_size"], c["num_experts"], bias=False)
        self.experts = torch.nn.ModuleList(
            [MLP(c["hidden_size"], c["moe_intermediate_size"]) for _ in range(c["num_experts"])])

    def forward(self, x):
        B, T, C = x.shape
        x = x.view(-1, C)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, tokens = torch.where(mask[e])
            out = out.index_add(0, tokens, expert(x[tokens]) * weights[tokens, idx, None])
        return out.view(B, T, C), router_logits


class DecoderLayer(torch.nn.Module):
    def __init__(self, c, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        sparse = (layer not in c.get("mlp_only_layers", []) and c.get("num_experts", 0) > 0
                  and (layer + 1) % c["decoder_sparse_step"] == 0)
        self.mlp = SparseMoe(c) if sparse else MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        m = self.mlp(self.post_attention_layernorm(h))
        router_logits = None
        if isinstance(m, tuple):
            m, router_logits = m
        return h + m, router_logits


class Backbone(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList([DecoderLayer(c, i) for i in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class PlainQwen3ForCausalLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Backbone(c)
        self.tied = c["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        d = c["head_dim"]
        self.inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def forward(self, inputs):
        T = inputs.shape[1]
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(inputs)
        router_logits = []
        for layer in self.model.layers:
            x, r = layer(x, cos, sin)
            if r is not None:
                router_logits.append(r)
        h = self.model.norm(x)
        logits = h @ self.model.embed_tokens.weight.T if self.tied else self.lm_head(h)
        return logits, tuple(router_logits)


# ---------------------------------------------------------------------------------------------

def perturb(model):
    """Weights away from transformers' init so that every gradient matters: norms near 1,
    biases nonzero, routers decisive (well-separated logits, so that float rounding never flips
    a top-k choice), shared-expert gates nonzero."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.4)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.05)


def build(variant):
    config_class, arch, c, seed = VARIANTS[variant]
    torch.manual_seed(seed)
    if config_class is None:
        model = PlainQwen3ForCausalLM(c)
    else:
        import transformers
        config = getattr(transformers, config_class)(**c, torch_dtype="float32", attn_implementation="eager")
        model = getattr(transformers, arch)(config)
        model.train()
    perturb(model)
    return model, c, seed


def run(outdir, variant):
    from safetensors.torch import save_file
    model, c, seed = build(variant)
    out = os.path.join(outdir, variant)
    os.makedirs(out, exist_ok=True)
    _, arch, _, _ = VARIANTS[variant]
    if isinstance(model, PlainQwen3ForCausalLM):
        config = dict(c, architectures=[arch], model_type=variant, torch_dtype="float32")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                  os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out, safe_serialization=True)

    generator = torch.Generator().manual_seed(seed + 100)
    inputs = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=generator)
    targets[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = IGNORE_INDEX

    moe = "num_experts_per_tok" in c
    model.zero_grad()
    aux = None
    if isinstance(model, PlainQwen3ForCausalLM):
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
        logits, router_logits = model(inputs)
        if moe:
            aux = load_balancing_loss_func(router_logits, c["num_experts"], c["num_experts_per_tok"], None)
    else:
        result = model(input_ids=inputs, output_router_logits=True) if moe else model(input_ids=inputs)
        logits = result.logits
        if moe:
            aux = result.aux_loss
    nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)
    loss = nll + c["router_aux_loss_coef"] * aux if moe else nll
    loss.backward()

    grads, blobs, offset = [], [], 0
    for name, p in model.named_parameters():  # a tied lm_head appears once, as the embedding
        g = p.grad.detach().contiguous().to(torch.float32)
        grads.append(dict(name=name, shape=list(g.shape), offset=offset))
        blobs.append(g.numpy().tobytes())
        offset += g.numel()
    with open(os.path.join(out, "grads.bin"), "wb") as f:
        for b in blobs:
            f.write(b)
    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    reference = dict(batch=BATCH, seq=SEQ, inputs=inputs.tolist(), targets=strata_targets.tolist(),
                     loss=loss.item(), nll=nll.item(), aux_loss=aux.item() if moe else 0.0, grads=grads)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)


def main():
    if len(sys.argv) != 3 or sys.argv[2] not in VARIANTS:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    run(sys.argv[1], sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
