#!/usr/bin/python3
"""References for strata's Qwen3 parity test, from transformers' own Qwen3ForCausalLM.

Usage: reference_qwen3.py OUTDIR VARIANT
  VARIANT  qwen3         Qwen3ForCausalLM: per-head q/k RMSNorm before RoPE, no q/k/v bias, an
                         explicit head_dim (24, not hidden_size / heads = 16), grouped-query
                         attention, untied embeddings
           qwen3_tied    the same with tied embeddings
Usage: reference_qwen3.py probe
  Exits 0 when an interpreter with transformers' Qwen3 is found (the test skips otherwise).
Usage: reference_qwen3.py check REF_DIR EXPORT_DIR
  Loads both as Qwen3ForCausalLM.from_pretrained would (Qwen3Config.from_pretrained, then every
  safetensors tensor by name; from_pretrained itself calls a torch 2 API) and compares the export
  with the reference: missing and unexpected keys (load_state_dict refuses a wrong shape), every
  tensor exactly and the logits on a fixed batch. Writes EXPORT_DIR.check.json; exits 0 when they agree.

Qwen3 arrived in transformers 4.51; Debian's torch 1.13 runs 4.40, which lacks it. scripts/setup.sh
installs 4.51.3 into a virtual environment over the system's packages
(STRATA_REFERENCE_VENV, by default ~/.cache/strata/reference-transformers-4.51), and this script
runs itself there. 4.51 imports three torch 2 names the Qwen3 model never uses on the CPU; they are
given here at import time, never in transformers' files: the module torch.distributed.tensor (a
DTensor class nothing instantiates), torch.compiler (is_compiling() is False, disable() is the
identity) and the float8 / uint16-64 dtype names (aliases for its dtype tables). The model runs
unmodified, in float32 with eager attention.

Writes OUTDIR/VARIANT/: config.json and model.safetensors (save_pretrained), reference.json
(batch, targets with -1 = ignored, "loss" = "nll" = mean NLL, "grads" [{name, shape, offset}] into
grads.bin, "adamw": 3 steps on the same batch with the loss before each and params_after.bin),
grads.bin and params_after.bin (float32, concatenated in named_parameters order; a tied LM head
appears once, as the embedding).
"""

import json
import math
import os
import sys
import types

VENV = os.environ.get("STRATA_REFERENCE_VENV",
                      os.path.join(os.path.expanduser("~"), ".cache", "strata", "reference-transformers-4.51"))
IGNORE_INDEX = -100
BATCH, SEQ = 2, 12
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, steps=3)
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_theta=1e6, attention_bias=False, use_sliding_window=False, hidden_act="silu")
VARIANTS = {
    "qwen3": (dict(COMMON, tie_word_embeddings=False), 41),
    "qwen3_tied": (dict(COMMON, tie_word_embeddings=True), 42),
}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def reexec_in_venv():
    """Runs this script with the virtual environment's interpreter unless this one is it."""
    python = os.path.join(VENV, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    if not os.path.exists(python):
        log("no transformers with Qwen3: %s is missing (scripts/setup.sh installs it)" % python)
        sys.exit(3)
    os.execv(python, [python] + sys.argv)


def shim_torch():
    import torch
    if "torch.distributed.tensor" not in sys.modules:
        import torch.distributed
        tensor = types.ModuleType("torch.distributed.tensor")
        tensor.DTensor = type("DTensor", (), {})
        sys.modules["torch.distributed.tensor"] = tensor
        torch.distributed.tensor = tensor
    if not hasattr(torch, "compiler"):
        compiler = types.ModuleType("torch.compiler")
        compiler.is_compiling = lambda: False
        compiler.disable = lambda fn=None, recursive=True: fn if fn is not None else (lambda f: f)
        compiler.allow_in_graph = lambda fn: fn
        torch.compiler = compiler
        sys.modules["torch.compiler"] = compiler
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32",
                 "uint64"):
        if not hasattr(torch, name):
            setattr(torch, name, torch.uint8)
    return torch


def perturb(model, torch):
    """Weights away from the init so that every gradient matters: norms near 1, unit-variance
    projections (attention far from uniform), embeddings of std 0.25."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.25)  # (also the tied LM head: logits of a few units)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))


def run(outdir, variant):
    torch = shim_torch()
    import torch.nn.functional as F
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM
    c, seed = VARIANTS[variant]
    torch.manual_seed(seed)
    config = Qwen3Config(**c, torch_dtype="float32", attn_implementation="eager")
    model = Qwen3ForCausalLM(config).to(torch.float32)
    perturb(model, torch)
    model.train()  # attention_dropout is 0
    out = os.path.join(outdir, variant)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    generator = torch.Generator().manual_seed(seed + 100)
    inputs = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, c["vocab_size"], (BATCH, SEQ), generator=generator)
    targets[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = IGNORE_INDEX

    def loss_of():
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)

    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    entries, grads, offset = [], [], 0
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        grads.append(g)
        entries.append(dict(name=name, shape=list(g.shape), offset=offset))
        offset += g.numel()

    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=ADAMW["weight_decay"]),
                                   dict(params=no_decay, weight_decay=0.0)],
                                  lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])
    losses = []
    for step in range(ADAMW["steps"]):
        model.zero_grad(set_to_none=True)
        step_loss = loss_of()
        losses.append(step_loss.item())
        step_loss.backward()
        optimizer.step()
    assert losses[0] == loss.item()

    def flat(tensors):
        return b"".join(t.detach().contiguous().to(torch.float32).numpy().tobytes() for t in tensors)

    with open(os.path.join(out, "grads.bin"), "wb") as f:
        f.write(flat(grads))
    with open(os.path.join(out, "params_after.bin"), "wb") as f:
        f.write(flat(p for _, p in model.named_parameters()))
    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    reference = dict(
        variant=variant, architecture=model.__class__.__name__, transformers=transformers.__version__,
        torch=torch.__version__, batch=BATCH, seq=SEQ, inputs=inputs.tolist(), targets=strata_targets.tolist(),
        loss=loss.item(), nll=loss.item(), grads=entries,
        adamw=dict(lr=ADAMW["lr"], betas=list(ADAMW["betas"]), eps=ADAMW["eps"],
                   weight_decay=ADAMW["weight_decay"], weight_decay_on="2-D tensors (1-D: 0)",
                   steps=ADAMW["steps"], losses=losses, params_after="params_after.bin"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)
    log("%s: transformers %s on torch %s, loss %.6f, AdamW losses %s" %
        (variant, transformers.__version__, torch.__version__, loss.item(), " ".join("%.6f" % l for l in losses)))
    return True


def check(ref_dir, export_dir):
    torch = shim_torch()
    from transformers import Qwen3ForCausalLM

    def load(path):
        # What from_pretrained does, less its torch 2 calls (named_parameters(remove_duplicate=)):
        # the config through Qwen3Config.from_pretrained, the model built from it and every
        # tensor of the safetensors files loaded by name.
        import glob
        import safetensors.torch
        from transformers import Qwen3Config
        config = Qwen3Config.from_pretrained(path)
        model = Qwen3ForCausalLM(config).to(torch.float32)
        tensors = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            tensors.update(safetensors.torch.load_file(file))
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        result = model.load_state_dict(tensors, strict=False)
        missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
        info = dict(missing_keys=missing, unexpected_keys=list(result.unexpected_keys),
                    mismatched_keys=[])
        if config.tie_word_embeddings:
            model.tie_weights()
        return model.eval(), info

    ref, _ = load(ref_dir)
    out, info = load(export_dir)
    findings = dict(missing_keys=sorted(info["missing_keys"]), unexpected_keys=sorted(info["unexpected_keys"]),
                    mismatched_keys=[str(k) for k in info["mismatched_keys"]])
    ref_state, out_state = ref.state_dict(), out.state_dict()
    findings["differing_tensors"] = [n for n, t in ref_state.items()
                                     if n not in out_state or not torch.equal(t, out_state[n])]
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, ref.config.vocab_size, (BATCH, SEQ), generator=generator)
    with torch.no_grad():
        findings["max_logit_difference"] = (ref(input_ids=inputs).logits - out(input_ids=inputs).logits).abs().max().item()
    ok = (not findings["missing_keys"] and not findings["unexpected_keys"] and not findings["mismatched_keys"] and
          not findings["differing_tensors"] and findings["max_logit_difference"] == 0.0)
    findings["ok"] = ok
    with open(export_dir.rstrip("/") + ".check.json", "w") as f:
        json.dump(findings, f, indent=1)
    log(json.dumps(findings))
    return ok


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "check":
        reexec_in_venv()
        import torch
        torch.set_num_threads(1)
        return 0 if check(sys.argv[2], sys.argv[3]) else 1
    if len(sys.argv) == 2 and sys.argv[1] == "probe":
        reexec_in_venv()
        shim_torch()
        from transformers import Qwen3ForCausalLM  # noqa: F401
        return 0
    if len(sys.argv) != 3 or sys.argv[2] not in VARIANTS:
        print(__doc__, file=sys.stderr)
        return 2
    reexec_in_venv()
    import torch
    torch.set_num_threads(1)
    return 0 if run(sys.argv[1], sys.argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main())
