#!/usr/bin/env python3
"""Writes the hand-made part of the fuzz seed corpus into tests/fuzz/<target>/.

Valid samples and near misses of every format (the parsers' error paths are seeds too). The
tokenizer seeds are copies of tests/fixtures/tokenizer; crash inputs that the fuzzers found
are committed beside these by hand (named crash-*) and never rewritten here. Run it from
anywhere; it only writes files it owns (seed-*).
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def put(target, name, data):
    d = os.path.join(HERE, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def raw_header(text, data=b""):
    text = text.encode()
    return struct.pack("<Q", len(text)) + text + data


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def seeds_safetensors():
    t = "safetensors"
    put(t, "f32", safetensors([("w", "F32", [2, 2], f32(1, 2, 3, 4))], {"format": "pt"}))
    put(t, "mixed", safetensors([("a", "BF16", [3], b"\x80\x3f\x00\x40\x40\x40"), ("b", "F16", [1], b"\x00\x3c"),
                                  ("c", "F8_E4M3", [2], b"\x38\x7f"), ("d", "F8_E5M2", [2], b"\x3c\x7c"),
                                  ("e", "I64", [1], b"\x01" + b"\x00" * 7), ("s", "F32", [], f32(7))]))
    put(t, "empty", raw_header("{}"))
    put(t, "zero-size", safetensors([("z", "F32", [0, 4], b"")]))
    put(t, "unknown-dtype", safetensors([("q", "Q4", [4], b"\x00\x01")]))
    put(t, "hole", raw_header('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\x00" * 8))
    put(t, "overlap", raw_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                 '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\x00" * 8))
    put(t, "short-length", struct.pack("<Q", 1000) + b"{}")
    put(t, "bad-metadata", raw_header('{"__metadata__":{"k":1}}'))


def seeds_index():
    t = "safetensors_index"
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    put(t, "valid", json.dumps({"metadata": {"total_size": 44}, "weight_map": {"a": s1, "b": s1, "c": s2}}))
    put(t, "one-shard", json.dumps({"weight_map": {"c": s2}}))
    put(t, "missing-shard", json.dumps({"weight_map": {"a": "model-00009-of-00009.safetensors"}}))
    put(t, "wrong-shard", json.dumps({"weight_map": {"a": s2}}))
    put(t, "path", json.dumps({"weight_map": {"a": "../" + s1}}))
    put(t, "dot", json.dumps({"weight_map": {"a": "."}}))
    put(t, "no-map", json.dumps({"metadata": {}}))


def seeds_manifest():
    t = "manifest"
    files = {"model.safetensors": {"size": 4096, "xxh3_64": "0123456789abcdef"},
             "optimizer.safetensors": {"size": 8192, "xxh3_64": "fedcba9876543210"}}
    m = {"format_version": 1, "strata_version": "0.1.0", "step": 500, "tokens_seen": 2048000,
         "data_cursor": {"epoch": 1, "index": 37}, "optimizer_step": 500, "rng": {"seed": 1234},
         "lr_schedule": {"step": 500}, "precision": {}, "model_config": {"hidden_size": 128},
         "layout": {}, "extra": {}, "files": files}
    put(t, "valid", json.dumps(m, indent=1))
    put(t, "newer", json.dumps(dict(m, format_version=2)))
    put(t, "bad-hex", json.dumps(dict(m, files={"model.safetensors": {"size": 1, "xxh3_64": "zzzzzzzzzzzzzzzz"}})))
    put(t, "negative", json.dumps(dict(m, step=-1, tokens_seen=-5, files={"x": {"size": -1, "xxh3_64": "0" * 16}})))
    put(t, "no-files", json.dumps({"format_version": 1, "step": 0}))


def seeds_train_config():
    t = "train_config"
    put(t, "readme", """model:
  config: /models/llama/config.json
  set: [num_hidden_layers=2]
data:
  paths: [data/train_*.bin]
train: {micro_batch: 8, seq_len: 1024, grad_accum: 4, steps: 1000, seed: 1234}
optim: {lr: 3e-4, warmup_steps: 100, schedule: cosine, weight_decay: 0.1, grad_clip: 1.0}
memory:
  device: 24GiB
  host: 100GiB
  nvme: {path: /nvme/strata, size: 500GiB}
  chunk_size: auto
ckpt: {every: 500, keep_last: 3, dir: /ckpt/my-run, if_busy: wait, staging: 64MiB}
run: {dir: runs/my-run}
""")
    put(t, "default", """model:
  preset: tiny
data:
  paths: [builtin:licenses]
train:
  micro_batch: 8
  seq_len: 128
  steps: 200
optim:
  lr: 0.003
  warmup_steps: 20
memory:
  device: 24MiB
  host: 10MiB
  nvme: {path: runs/default/nvme, size: 64MiB}
run:
  dir: runs/default
  log_every: 10
optim.lr=1e-3""")
    put(t, "typo", "trian:\n  steps: 10\n")
    put(t, "types", "train: {steps: ten, micro_batch: [1, 2]}\nmemory: {device: 12XB}\n")
    put(t, "anchors", "a: &x {steps: 5}\ntrain: *x\nrun: {dir: !!str 5}\n")
    put(t, "warmup", "train: {steps: 10}\noptim: {warmup_steps: 100}\n")


def seeds_model_config():
    t = "model_config"
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
             "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}
    put(t, "llama3", json.dumps(llama, indent=1))
    put(t, "qwen2", json.dumps({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "sliding_window": 4096, "use_sliding_window": False}))
    put(t, "mixtral", json.dumps({"architectures": ["MixtralForCausalLM"], "vocab_size": 100, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "router_aux_loss_coef": 0.02, "output_router_logits": True}))
    put(t, "qwen2moe", json.dumps({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32,
                                   "intermediate_size": 48, "moe_intermediate_size": 16,
                                   "shared_expert_intermediate_size": 24, "num_hidden_layers": 3,
                                   "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                   "decoder_sparse_step": 2, "mlp_only_layers": [0], "norm_topk_prob": False}))
    put(t, "qwen3moe", json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32,
                                   "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}))
    put(t, "huge", json.dumps(dict(llama, hidden_size=2 ** 40, num_hidden_layers=2 ** 40, vocab_size=2 ** 62)))
    put(t, "bad-heads", json.dumps(dict(llama, num_attention_heads=3)))
    put(t, "model-type", json.dumps({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
                                     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))


def seeds_tokenizer():
    t = "tokenizer"
    for name in ("gpt2", "llama3", "qwen2_nfc"):
        src = os.path.join(ROOT, "tests", "fixtures", "tokenizer", name, "tokenizer.json")
        with open(src, "rb") as f:
            put(t, name, f.read())
    put(t, "minimal", json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
                                  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
                                  "added_tokens": [{"id": 3, "content": "<|endoftext|>", "special": True}]}))
    put(t, "wordpiece", json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))


def seeds_token_files():
    t = "token_files"
    # Byte 0 picks the format (even: llm.c shard, odd: Megatron); see fuzz_token_files.cpp.
    def llmc(magic, version, tokens, fmt):
        header = struct.pack("<3i", magic, version, len(tokens)) + b"\x00" * (1024 - 12)
        return header + struct.pack("<%d%s" % (len(tokens), fmt), *tokens)
    put(t, "llmc-u16", b"\x00" + llmc(20240520, 1, [1, 2, 65535, 7], "H"))
    put(t, "llmc-u32", b"\x00" + llmc(20240801, 1, [1, 2**31 + 5, 3], "I"))
    put(t, "llmc-truncated", b"\x00" + llmc(20240520, 1, [1, 2, 3], "H")[:-2])
    put(t, "llmc-negative", b"\x00" + llmc(20240520, 1, [], "H")[:8] + struct.pack("<i", -4) + b"\x00" * 1012)

    def megatron(dtype, sizes, pointers, bin_bytes, num_docs=None):
        docs = list(range(len(sizes) + 1)) if num_docs is None else [0] * num_docs
        idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([dtype]) +
               struct.pack("<QQ", len(sizes), len(docs)) + struct.pack("<%di" % len(sizes), *sizes) +
               struct.pack("<%dq" % len(pointers), *pointers) + struct.pack("<%dq" % len(docs), *docs))
        return b"\x01" + struct.pack("<H", len(bin_bytes)) + bin_bytes + idx
    bin16 = struct.pack("<6H", 1, 2, 3, 4, 5, 6)
    put(t, "megatron-u16", megatron(8, [2, 4], [0, 4], bin16))
    put(t, "megatron-i64", megatron(5, [1], [0], struct.pack("<q", 2**40)))
    put(t, "megatron-outside", megatron(8, [4, 4], [0, 8], bin16))
    put(t, "megatron-float", megatron(6, [1], [0], f32(1.0)))
    put(t, "megatron-empty", megatron(1, [0, 0], [0, 0], b""))


if __name__ == "__main__":
    seeds_safetensors()
    seeds_index()
    seeds_manifest()
    seeds_train_config()
    seeds_model_config()
    seeds_tokenizer()
    seeds_token_files()
