#!/usr/bin/python3
"""Hugging Face references for strata's safetensors and hf_io tests.

Modes:
  hf_reference.py safetensors OUT_FILE
      Writes OUT_FILE with the `safetensors` package: F32, F16 and BF16 tensors, a scalar, an
      empty tensor, "f16_as_f32" (the F16 values as F32) and "bf16_source" (F32) whose torch round-to-nearest-even BF16 is "bf16"
      and F16 "f16_of_source".
  hf_reference.py generate OUT_DIR VARIANT        VARIANT: llama, llama_tied, mistral, qwen2, llama_dynamic
      A tiny random model of that transformers class saved with save_pretrained in float32:
        OUT_DIR/hf            model.safetensors (+ config.json, generation_config.json, a
                              stand-in tokenizer_config.json to check copying)
        OUT_DIR/hf_sharded    the same with max_shard_size="20KB" (index + many shards)
        OUT_DIR/reference.json  a batch (inputs, targets with -1 = ignored) and transformers'
                              mean cross-entropy on it
        OUT_DIR/grads.safetensors  the gradient of that loss for every parameter
  hf_reference.py check REF_DIR EXPORT_DIR...
      Loads each EXPORT_DIR with AutoModelForCausalLM.from_pretrained and compares it with
      REF_DIR/hf: class, loading info (missing/unexpected keys), weights (exactly, or against
      torch's BF16 / F16 rounding when the export is bfloat16 / float16) and logits/loss on
      REF_DIR's batch.
      Writes the findings to EXPORT_DIR.check.json.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5)
BATCH, SEQ = 2, 16
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0), 11),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500000.0), 12),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0), 13),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0), 14),
    # Dynamic-NTK RoPE scaling with a context of 8 positions: the batch's 16 tokens run past it,
    # so the frequencies are the rescaled ones.
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      dict(tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=8,
                           rope_scaling={"type": "dynamic", "factor": 2.0}), 15),
}


def write_safetensors_sample(out_file):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    source = torch.randn(64, generator=g) * 3
    special = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 2.0**-8 + 2.0**-20,
                            float("inf"), float("-inf"), float("nan"), 3.3895313892515355e38,
                            1e-40, -0.0, 0.0, 65504.0, 2.0**-133, 1.0 - 2.0**-9, 448.0, 5e-8,
                            65519.99, 65520.0, -70000.0, 2.0**-25, 3 * 2.0**-25, 2.0**-14 - 2.0**-25,
                            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2.0**-24 * 1.5, 6.1e-5])
    source = torch.cat([source, special])
    f16 = (torch.randn(2, 3, 4, generator=g) * 100).half()
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": f16,
        "f16_as_f32": f16.float(),
        "bf16": source.bfloat16(),
        "bf16_source": source,
        "f16_of_source": source.half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, out_file, metadata={"format": "pt", "note": "written by safetensors"})


def build_model(variant):
    import transformers
    config_cls, model_cls, extra, seed = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**SIZES, **extra})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
            else:  # RMSNorm weights away from 1 so that their gradients matter
                p.uniform_(0.8, 1.2)
    return model, seed


def batch(seed, vocab):
    g = torch.Generator().manual_seed(seed + 1000)
    inputs = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    targets[torch.rand((BATCH, SEQ), generator=g) < 0.2] = IGNORE_INDEX
    return inputs, targets


def mean_loss(model, inputs, targets):
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    return loss, logits


def generate(out_dir, variant):
    from safetensors.torch import save_file
    model, seed = build_model(variant)
    model.config._attn_implementation = "eager"
    hf = os.path.join(out_dir, "hf")
    model.save_pretrained(hf, safe_serialization=True)
    model.save_pretrained(os.path.join(out_dir, "hf_sharded"), safe_serialization=True, max_shard_size="20KB")
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": SIZES["max_position_embeddings"], "note": "stand-in"}, f)

    inputs, targets = batch(seed, SIZES["vocab_size"])
    model.zero_grad()
    loss, _ = mean_loss(model, inputs, targets)
    loss.backward()
    grads = {}
    seen = set()
    for name, p in model.named_parameters():  # a tied lm_head is the embedding: listed once
        if id(p) in seen:
            continue
        seen.add(id(p))
        grads[name] = p.grad.detach().contiguous()
    save_file(grads, os.path.join(out_dir, "grads.safetensors"))
    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(dict(batch=BATCH, seq=SEQ, inputs=inputs.tolist(), targets=strata_targets.tolist(),
                       loss=loss.item(), architecture=model.__class__.__name__), f)


def check(ref_dir, export_dirs):
    from transformers import AutoModelForCausalLM
    original = AutoModelForCausalLM.from_pretrained(os.path.join(ref_dir, "hf"), torch_dtype=torch.float32,
                                                    attn_implementation="eager")
    for export_dir in export_dirs:
        check_one(original, export_dir, ref_dir, export_dir.rstrip("/") + ".check.json")


def check_one(original, export_dir, ref_dir, out_json):
    from transformers import AutoModelForCausalLM
    result = {}
    exported, info = AutoModelForCausalLM.from_pretrained(export_dir, output_loading_info=True,
                                                          torch_dtype=torch.float32, attn_implementation="eager")
    with open(os.path.join(export_dir, "config.json")) as f:
        torch_dtype = json.load(f).get("torch_dtype")
    result["torch_dtype"] = torch_dtype
    result["class"] = exported.__class__.__name__
    result["original_class"] = original.__class__.__name__
    result["missing_keys"] = list(info["missing_keys"])
    result["unexpected_keys"] = list(info["unexpected_keys"])
    result["mismatched_keys"] = [str(k) for k in info["mismatched_keys"]]
    a, b = original.state_dict(), exported.state_dict()
    result["same_keys"] = sorted(a) == sorted(b)
    worst = 0.0
    for name, t in a.items():
        if name not in b:
            continue
        want = {"bfloat16": t.bfloat16().float(), "float16": t.half().float()}.get(torch_dtype, t)
        worst = max(worst, (b[name].float() - want).abs().max().item() if t.numel() else 0.0)
    result["max_weight_diff"] = worst
    with open(os.path.join(ref_dir, "reference.json")) as f:
        ref = json.load(f)
    inputs = torch.tensor(ref["inputs"])
    targets = torch.tensor(ref["targets"])
    targets[targets < 0] = IGNORE_INDEX
    with torch.no_grad():
        loss_a, logits_a = mean_loss(original, inputs, targets)
        loss_b, logits_b = mean_loss(exported, inputs, targets)
    result["logits_max_diff"] = (logits_a - logits_b).abs().max().item()
    result["logits_max_abs"] = logits_a.abs().max().item()
    result["loss_original"] = loss_a.item()
    result["loss_export"] = loss_b.item()
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2)


def main():
    torch.set_num_threads(1)
    if len(sys.argv) >= 3 and sys.argv[1] == "safetensors":
        write_safetensors_sample(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "generate" and sys.argv[3] in VARIANTS:
        generate(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
