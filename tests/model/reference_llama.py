#!/usr/bin/python3
"""Reference Llama in plain PyTorch (fp32) for strata's model parity test.

Follows the conventions of Hugging Face's modeling_llama.py (RMSNorm with the weight applied
after normalising in fp32, rotate_half RoPE with optional Llama-3 frequency scaling, grouped-query
attention through repeat_kv, SwiGLU MLP, optionally tied LM head) without importing
transformers. For each variant it writes, into OUTDIR/<variant>/:

  config.json          Hugging Face config keys
  model.safetensors    initial weights, F32, Hugging Face names (written by hand)
  grads.safetensors    gradient of the mean loss of batch 0 for every parameter
  reference.json       batches (inputs, targets with -1 = ignored), loss of batch 0, optimizer
                       settings, and the loss and pre-clip gradient norm of each AdamW step

Usage: reference_llama.py OUTDIR [untied|tied ...]   (default: both variants)
"""

import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

VARIANTS = {
    # Top-level rope_theta, separate LM head.
    "untied": dict(tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, seed=1234),
    # Tied LM head and Llama-3 RoPE scaling with a short original context, so that T = 16
    # positions reach the scaled frequencies.
    "tied": dict(
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32),
        seed=4321,
    ),
}

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5)
BATCH, SEQ, NUM_BATCHES, STEPS = 3, 16, 2, 20
OPTIM = dict(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def rope_inv_freq(head_dim, theta, scaling):
    # transformers: _compute_default_rope_parameters, then _compute_llama3_parameters.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c["num_attention_heads"]
        self.kv_heads = c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        hidden = c["hidden_size"]
        self.q_proj = torch.nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # repeat_kv: query head h reads key/value head h // (Hq / Hkv).
        rep = self.heads // self.kv_heads
        k = torch.repeat_interleave(k, rep, dim=1)
        v = torch.repeat_interleave(v, rep, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, Hq, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = torch.nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = torch.nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = torch.nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList([DecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Backbone(c)
        self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        self.inv_freq = rope_inv_freq(head_dim, c["rope_theta"], c["rope_scaling"])

    def forward(self, inputs, targets):
        T = inputs.shape[1]
        # transformers: freqs = inv_freq @ positions in fp32, emb = cat(freqs, freqs).
        positions = torch.arange(T, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # (T, D), broadcast over (B, H, T, D)
        x = self.model.embed_tokens(inputs)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                               ignore_index=IGNORE_INDEX)


def named_tensors(model):
    # Hugging Face names; a tied lm_head is saved only as the embedding (as transformers does).
    seen = set()
    out = []
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def write_safetensors(path, tensors):
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors:
        data = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def make_batches(generator, vocab):
    inputs = torch.randint(0, vocab, (NUM_BATCHES, BATCH, SEQ), generator=generator)
    targets = torch.randint(0, vocab, (NUM_BATCHES, BATCH, SEQ), generator=generator)
    # Ignore a few positions (padding, prompt tokens): roughly one in five.
    ignored = torch.rand((NUM_BATCHES, BATCH, SEQ), generator=generator) < 0.2
    targets[ignored] = IGNORE_INDEX
    return inputs, targets


def run_variant(outdir, name):
    v = VARIANTS[name]
    c = dict(SIZES, tie_word_embeddings=v["tie_word_embeddings"], rope_theta=v["rope_theta"],
             rope_scaling=v["rope_scaling"])
    torch.manual_seed(v["seed"])
    model = LlamaForCausalLM(c)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:  # RMSNorm weights away from 1 so that their gradients matter
                p.uniform_(0.8, 1.2)

    os.makedirs(os.path.join(outdir, name), exist_ok=True)
    path = lambda f: os.path.join(outdir, name, f)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  torch_dtype="float32", attention_bias=False, **c)
    with open(path("config.json"), "w") as f:
        json.dump(config, f, indent=2)
    params = named_tensors(model)
    write_safetensors(path("model.safetensors"), params)

    generator = torch.Generator().manual_seed(v["seed"] + 1)
    inputs, targets = make_batches(generator, c["vocab_size"])

    model.zero_grad()
    loss = model(inputs[0], targets[0])
    loss.backward()
    write_safetensors(path("grads.safetensors"), [(n, p.grad) for n, p in params])

    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    step_losses, step_norms = [], []
    for step in range(STEPS):
        b = step % NUM_BATCHES
        opt.zero_grad()
        step_loss = model(inputs[b], targets[b])
        step_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], OPTIM["grad_clip"])
        opt.step()
        step_losses.append(step_loss.item())
        step_norms.append(norm.item())

    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    reference = dict(batch=BATCH, seq=SEQ, inputs=inputs.tolist(), targets=strata_targets.tolist(),
                     loss=loss.item(), optimizer=OPTIM, step_losses=step_losses, step_grad_norms=step_norms)
    with open(path("reference.json"), "w") as f:
        json.dump(reference, f)


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    names = sys.argv[2:] or list(VARIANTS)
    for name in names:
        if name not in VARIANTS:
            print(f"unknown variant {name}; choose from {list(VARIANTS)}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    for name in names:
        run_variant(sys.argv[1], name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
