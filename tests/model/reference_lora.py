#!/usr/bin/python3
"""LoRA references for strata's adapter parity tests, from PEFT (0.11) over transformers (4.40).

Usage: reference_lora.py OUTDIR VARIANT
  VARIANT  llama_lora           tiny LlamaForCausalLM, LoRA r=4, alpha=8 on q/k/v/o and
                                gate/up/down_proj, default init (A Kaiming-uniform), then every
                                lora_B redrawn from N(0, 0.02) so that A and B both get gradients
           mixtral_lora         tiny MixtralForCausalLM (router loss in the objective), LoRA r=4,
                                alpha=8 on q/k/v/o and the experts' w1/w2/w3 (the router,
                                block_sparse_moe.gate, stays frozen), B redrawn the same way
           llama_lora_gaussian  the tiny Llama with LoRA r=8, alpha=16 on q_proj and v_proj only,
                                init_lora_weights="gaussian" (A ~ N(0, 1/r)) and B left at zero:
                                the first gradient of every A is exactly zero, B's is not
Usage: reference_lora.py probe
  Exits 0 when torch, transformers and peft import, and jinja2, which PEFT's save_pretrained
  needs for the model card it writes (the tests skip otherwise).
Usage: reference_lora.py check VARIANT_DIR EXPORT_DIR
  Loads VARIANT_DIR/base with AutoModelForCausalLM.from_pretrained and EXPORT_DIR over it as
  PeftModel.from_pretrained does, then checks: no unexpected adapter key and no missing LoRA key;
  the same tensor names as VARIANT_DIR/trained_adapter and every tensor within TENSOR_TOLERANCE
  (||a - b|| / ||b||); the logits on the batch within LOGIT_TOLERANCE (max |a - b|) of
  logits.bin. Writes EXPORT_DIR.check.json; exits 0 when all hold.
Usage: reference_lora.py check_merged VARIANT_DIR MERGED_DIR
  Loads MERGED_DIR as a plain AutoModelForCausalLM (no PEFT): its safetensors must hold exactly the
  base model's tensor names (no LoRA tensor) and its logits on the batch must be within
  LOGIT_TOLERANCE of logits.bin. Writes MERGED_DIR.check.json; exits 0 when both hold.

Everything runs in float32 with eager attention, on one CPU thread. Writes OUTDIR/VARIANT/:
  base/                 config.json, model.safetensors: the base model before LoRA is attached
                        (save_pretrained, safe_serialization)
  adapter/              adapter_config.json, adapter_model.safetensors: the initial adapter (with
                        the redrawn B), as PeftModel.save_pretrained writes it; tensor names carry no
                        adapter name (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
  trained_adapter/      the same after the AdamW steps
  reference.json        variant, versions, lora settings (r, lora_alpha, scaling = alpha / r,
                        target_modules), batch (inputs, targets with -1 = ignored), "loss" (mean NLL,
                        plus router_aux_loss_coef * aux for Mixtral as transformers computes it with
                        output_router_logits), "nll", "aux_loss" (0 for Llama), "grads"
                        [{name, shape, offset}] into grads.bin for the trainable tensors only, named as
                        in adapter_model.safetensors, "adamw" (3 steps on the same batch: settings,
                        the loss before each step, params_after.bin), "logits" (logits.bin's shape)
  grads.bin             float32 gradients of the loss, concatenated in named_parameters order
  params_after.bin      float32 trainable tensors after the AdamW steps, same layout
  logits.bin            float32 logits (BATCH, SEQ, vocab) of the adapted model after the steps
"""

import json
import os
import sys

IGNORE_INDEX = -100
BATCH, SEQ = 2, 12
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, steps=3)
B_STD = 0.02  # lora_B redrawn from N(0, B_STD) for the variants that ask for it
MARGIN = 1e-4  # smallest acceptable gap between the top-k and the next router probability
# check: ||export - reference|| / ||reference|| per adapter tensor, the metric and bound the C++
# side (lora_parity_test.cpp, kStepParamTolerance) holds strata's trained adapters to: after three
# AdamW steps, Adam's normalised update turns last-bit differences in an element's tiny gradient
# into differences of up to lr per step, so the largest element's error is no bound to hold (an
# MoE's rarely routed expert showed 3e-4 of max |reference| in one build, 4e-5 in L2).
TENSOR_TOLERANCE = 3e-4
LOGIT_TOLERANCE = 1e-4  # check, check_merged: max |logits - reference logits|

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
             attention_bias=False, tie_word_embeddings=False, hidden_act="silu")
MIXTRAL = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e6,
               sliding_window=None, tie_word_embeddings=False, hidden_act="silu", num_local_experts=4,
               num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)

# name: (config class, model class, config, lora settings, redraw lora_B, seed)
VARIANTS = {
    "llama_lora": ("LlamaConfig", "LlamaForCausalLM", LLAMA,
                   dict(r=4, lora_alpha=8, target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"],
                        init_lora_weights=True), True, 51),
    "mixtral_lora": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL,
                     dict(r=4, lora_alpha=8, target_modules=ATTENTION + ["w1", "w2", "w3"],
                          init_lora_weights=True), True, 53),
    "llama_lora_gaussian": ("LlamaConfig", "LlamaForCausalLM", LLAMA,
                            dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights="gaussian"), False, 52),
}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def perturb(model, torch):
    """Base weights away from transformers' init so that the adapted model's outputs and the LoRA
    gradients are far from trivial: norms near 1, projections of variance 1 / fan_in, embeddings
    of std 0.25, routers decisive (well-separated logits, so that rounding never flips a top-k
    choice)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.25)
            elif name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)


def make_batch(torch, vocab, seed):
    generator = torch.Generator().manual_seed(seed + 100)
    inputs = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    targets[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = IGNORE_INDEX
    return inputs, targets


def saved_name(name, adapter):
    """The name PEFT gives a parameter in adapter_model.safetensors: without the adapter name."""
    return name.replace("." + adapter + ".", ".")


def flat(torch, tensors):
    return b"".join(t.detach().contiguous().to(torch.float32).numpy().tobytes() for t in tensors)


def run(outdir, variant):
    import torch
    import torch.nn.functional as F
    import transformers
    import peft
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    config_class, model_class, c, lora, redraw_b, seed = VARIANTS[variant]
    moe = "num_local_experts" in c
    out = os.path.join(outdir, variant)
    os.makedirs(out, exist_ok=True)

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**c, torch_dtype="float32", attn_implementation="eager")
    model = getattr(transformers, model_class)(config).to(torch.float32)
    perturb(model, torch)
    model.save_pretrained(os.path.join(out, "base"), safe_serialization=True)
    base_names = [n for n, _ in model.named_parameters()]

    lora_config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **lora)
    peft_model = get_peft_model(model, lora_config)
    adapter = "default"
    scaling = lora["lora_alpha"] / lora["r"]
    if redraw_b:
        generator = torch.Generator().manual_seed(seed + 200)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * B_STD)
    peft_model.train()  # no dropout anywhere: lora_dropout and attention_dropout are 0

    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    frozen_with_grad = [n for n, p in peft_model.named_parameters() if ".lora_" not in n and p.requires_grad]
    assert not frozen_with_grad, "base parameters require grad: %s" % frozen_with_grad
    assert all(".lora_A." in n or ".lora_B." in n for n, _ in trainable), [n for n, _ in trainable]
    assert len(base_names) == sum(1 for n, _ in peft_model.named_parameters() if ".lora_" not in n)
    for name, module in peft_model.named_modules():
        if hasattr(module, "scaling") and adapter in getattr(module, "scaling", {}):
            assert module.scaling[adapter] == scaling, (name, module.scaling[adapter])
    if moe:
        assert not any("block_sparse_moe.gate." in n for n, _ in trainable), "the router must stay frozen"

    peft_model.save_pretrained(os.path.join(out, "adapter"), save_embedding_layers=False)
    names = [saved_name(n, adapter) for n, _ in trainable]
    saved = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert sorted(saved) == sorted(names), (sorted(saved), sorted(names))
    for (n, p), s in zip(trainable, names):
        assert torch.equal(saved[s], p.detach()), s

    inputs, targets = make_batch(torch, c["vocab_size"], seed)
    min_margin, min_tokens = [float("inf")], [BATCH * SEQ]

    def loss_of():
        result = peft_model(input_ids=inputs, output_router_logits=True) if moe else peft_model(input_ids=inputs)
        logits = result.logits
        nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)
        if not moe:
            return nll, nll, 0.0
        for router_logits in result.router_logits:  # (BATCH * SEQ, experts) per layer
            probs = torch.softmax(router_logits.detach().float(), dim=-1).sort(dim=-1, descending=True).values
            k = c["num_experts_per_tok"]
            min_margin[0] = min(min_margin[0], (probs[:, k - 1] - probs[:, k]).min().item())
            chosen = router_logits.detach().topk(k, dim=-1).indices
            counts = torch.bincount(chosen.flatten(), minlength=c["num_local_experts"])
            min_tokens[0] = min(min_tokens[0], counts.min().item())
        return nll + c["router_aux_loss_coef"] * result.aux_loss, nll, result.aux_loss.item()

    peft_model.zero_grad(set_to_none=True)
    loss, nll, aux = loss_of()
    loss.backward()
    entries, grads, offset = [], [], 0
    for (n, p), s in zip(trainable, names):
        g = p.grad.detach().clone()
        grads.append(g)
        entries.append(dict(name=s, shape=list(g.shape), offset=offset))
        offset += g.numel()
    base_grads = [n for n, p in peft_model.named_parameters() if ".lora_" not in n and p.grad is not None]
    assert not base_grads, "base parameters got gradients: %s" % base_grads

    # Three AdamW steps on the same batch; every trainable tensor is 2-D, so all are decayed.
    assert all(p.dim() == 2 for _, p in trainable)
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=ADAMW["lr"], betas=ADAMW["betas"],
                                  eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    losses, nlls, auxes = [], [], []
    for step in range(ADAMW["steps"]):
        peft_model.zero_grad(set_to_none=True)
        step_loss, step_nll, step_aux = loss_of()
        losses.append(step_loss.item())
        nlls.append(step_nll.item())
        auxes.append(step_aux)
        step_loss.backward()
        if step == 0:
            for (n, p), g in zip(trainable, grads):
                assert torch.equal(p.grad, g), n
        optimizer.step()
    assert losses[0] == loss.item()

    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=inputs).logits.to(torch.float32)
        if moe:
            loss_of()  # the routing margins after the last step
    peft_model.save_pretrained(os.path.join(out, "trained_adapter"), save_embedding_layers=False)

    with open(os.path.join(out, "grads.bin"), "wb") as f:
        f.write(flat(torch, grads))
    with open(os.path.join(out, "params_after.bin"), "wb") as f:
        f.write(flat(torch, (p for _, p in trainable)))
    with open(os.path.join(out, "logits.bin"), "wb") as f:
        f.write(flat(torch, [logits]))

    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    adamw = dict(lr=ADAMW["lr"], betas=list(ADAMW["betas"]), eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"],
                 weight_decay_on="2-D tensors (1-D: 0)", steps=ADAMW["steps"], losses=losses,
                 params_after="params_after.bin")
    if moe:
        adamw.update(nlls=nlls, aux_losses=auxes)
    reference = dict(
        variant=variant, architecture=model_class, torch=torch.__version__, transformers=transformers.__version__,
        peft=peft.__version__,
        lora=dict(r=lora["r"], lora_alpha=lora["lora_alpha"], scaling=scaling, lora_dropout=0.0, bias="none",
                  target_modules=lora["target_modules"], init_lora_weights=lora["init_lora_weights"],
                  lora_b_redrawn_std=B_STD if redraw_b else 0.0),
        batch=BATCH, seq=SEQ, inputs=inputs.tolist(), targets=strata_targets.tolist(),
        loss=loss.item(), nll=nll.item(), aux_loss=aux,
        router_aux_loss_coef=c.get("router_aux_loss_coef", 0.0) if moe else 0.0,
        grads=entries, adamw=adamw, logits=dict(file="logits.bin", shape=list(logits.shape)))
    if moe:
        reference["routing"] = dict(min_topk_margin=min_margin[0], min_tokens_per_expert=min_tokens[0])
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)

    log("%s: torch %s, transformers %s, peft %s: loss %.6f (nll %.6f, aux %.6f), %d trainable tensors "
        "(%d values), AdamW losses %s" % (variant, torch.__version__, transformers.__version__, peft.__version__,
                                         loss.item(), nll.item(), aux, len(trainable), offset,
                                         " ".join("%.6f" % l for l in losses)))
    ok = True
    zero = [s for s, g in zip(names, grads) if not g.any()]
    expected_zero = [s for s in names if ".lora_A." in s] if not redraw_b else []
    if zero != expected_zero:
        log("%s: all-zero gradients %s, expected %s" % (variant, zero, expected_zero))
        ok = False
    if moe:
        log("%s: min top-k router margin %.2e, min tokens per expert %d" % (variant, min_margin[0], min_tokens[0]))
        if min_margin[0] < MARGIN or min_tokens[0] < 1:
            log("%s: a routing margin is below %.0e or an expert got no tokens; pick another seed" % (variant, MARGIN))
            ok = False
    return ok


def load_base(torch, path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager",
                                                output_loading_info=True)


def reference_batch(torch, variant_dir):
    with open(os.path.join(variant_dir, "reference.json")) as f:
        ref = json.load(f)
    inputs = torch.tensor(ref["inputs"], dtype=torch.int64)
    shape = ref["logits"]["shape"]
    with open(os.path.join(variant_dir, ref["logits"]["file"]), "rb") as f:
        logits = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(shape)
    return inputs, logits


def finish(path, findings, failures):
    findings["failures"] = failures
    findings["ok"] = not failures
    with open(path.rstrip("/") + ".check.json", "w") as f:
        json.dump(findings, f, indent=1)
    log(json.dumps(findings))
    for failure in failures:
        log("FAILED: " + failure)
    return not failures


def check(variant_dir, export_dir):
    import torch
    from peft import PeftConfig, PeftModel
    from peft.mapping import MODEL_TYPE_TO_PEFT_MODEL_MAPPING
    from safetensors.torch import load_file

    findings = dict(tensor_tolerance=TENSOR_TOLERANCE, logit_tolerance=LOGIT_TOLERANCE)
    failures = []
    inputs, expected_logits = reference_batch(torch, variant_dir)
    try:
        base, _ = load_base(torch, os.path.join(variant_dir, "base"))
        # PeftModel.from_pretrained, keeping the result of loading the weights it discards.
        config = PeftConfig.from_pretrained(export_dir)
        config.inference_mode = True
        wrapper = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
        model = wrapper(base, config, "default")
        result = model.load_adapter(export_dir, "default", is_trainable=False)
    except Exception as e:  # a refused shape, an unreadable config or file
        findings["load_error"] = "%s: %s" % (type(e).__name__, e)
        return finish(export_dir, findings, ["loading: " + findings["load_error"]])
    findings["missing_lora_keys"] = sorted(k for k in result.missing_keys if "lora_" in k)
    findings["unexpected_keys"] = sorted(result.unexpected_keys)
    if findings["missing_lora_keys"]:
        failures.append("missing LoRA keys: %s" % findings["missing_lora_keys"])
    if findings["unexpected_keys"]:
        failures.append("unexpected keys: %s" % findings["unexpected_keys"])

    exported = load_file(os.path.join(export_dir, "adapter_model.safetensors"))
    reference = load_file(os.path.join(variant_dir, "trained_adapter", "adapter_model.safetensors"))
    findings["only_in_export"] = sorted(set(exported) - set(reference))
    findings["only_in_reference"] = sorted(set(reference) - set(exported))
    if findings["only_in_export"] or findings["only_in_reference"]:
        failures.append("tensor names differ: only in the export %s, only in the reference %s" %
                        (findings["only_in_export"], findings["only_in_reference"]))
    worst, worst_name, errors = 0.0, None, {}
    for name in sorted(set(exported) & set(reference)):
        a, b = exported[name].to(torch.float32), reference[name].to(torch.float32)
        if a.shape != b.shape:
            failures.append("%s: shape %s, reference %s" % (name, list(a.shape), list(b.shape)))
            continue
        scale = b.norm().item()
        err = (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()
        errors[name] = err
        if worst_name is None or not err <= worst:
            worst, worst_name = err, name
    findings["worst_tensor_error"], findings["worst_tensor"] = worst, worst_name
    findings["tensor_errors"] = errors
    if not worst <= TENSOR_TOLERANCE:
        failures.append("tensor %s: relative error %.3e > %.0e" % (worst_name, worst, TENSOR_TOLERANCE))

    with torch.no_grad():
        logits = model(input_ids=inputs).logits.to(torch.float32)
    findings["max_logit_error"] = (logits - expected_logits).abs().max().item()
    if not findings["max_logit_error"] <= LOGIT_TOLERANCE:
        failures.append("logits: max error %.3e > %.0e" % (findings["max_logit_error"], LOGIT_TOLERANCE))
    return finish(export_dir, findings, failures)


def check_merged(variant_dir, merged_dir):
    import glob
    import torch
    from safetensors import safe_open

    def names_in(path):
        names = set()
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                names.update(f.keys())
        return names

    findings = dict(logit_tolerance=LOGIT_TOLERANCE)
    failures = []
    inputs, expected_logits = reference_batch(torch, variant_dir)
    base_names, merged_names = names_in(os.path.join(variant_dir, "base")), names_in(merged_dir)
    findings["only_in_merged"] = sorted(merged_names - base_names)
    findings["missing_from_merged"] = sorted(base_names - merged_names)
    if findings["only_in_merged"] or findings["missing_from_merged"]:
        failures.append("tensor names differ from the base model's: extra %s, missing %s" %
                        (findings["only_in_merged"], findings["missing_from_merged"]))
    try:
        model, info = load_base(torch, merged_dir)
    except Exception as e:
        findings["load_error"] = "%s: %s" % (type(e).__name__, e)
        return finish(merged_dir, findings, failures + ["loading: " + findings["load_error"]])
    findings["loading_info"] = {k: [str(x) for x in v] for k, v in info.items() if k != "error_msgs"}
    findings["loading_info"]["error_msgs"] = [str(x) for x in info.get("error_msgs", [])]
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if findings["loading_info"].get(kind):
            failures.append("%s: %s" % (kind, findings["loading_info"][kind]))
    state_names = set(model.state_dict())
    lora_names = sorted(n for n in state_names if "lora_" in n)
    if lora_names:
        failures.append("LoRA tensors in the merged model: %s" % lora_names)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.to(torch.float32)
    findings["max_logit_error"] = (logits - expected_logits).abs().max().item()
    if not findings["max_logit_error"] <= LOGIT_TOLERANCE:
        failures.append("logits: max error %.3e > %.0e" % (findings["max_logit_error"], LOGIT_TOLERANCE))
    return finish(merged_dir, findings, failures)


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "probe":
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
            from peft import LoraConfig, PeftModel, get_peft_model  # noqa: F401
            import jinja2  # noqa: F401
        except Exception as e:
            log("no PEFT reference here: %s (scripts/setup.sh installs peft)" % e)
            return 3
        return 0
    if len(sys.argv) == 4 and sys.argv[1] in ("check", "check_merged"):
        import torch
        torch.set_num_threads(1)
        do = check if sys.argv[1] == "check" else check_merged
        return 0 if do(sys.argv[2], sys.argv[3]) else 1
    if len(sys.argv) != 3 or sys.argv[2] not in VARIANTS:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(1)
    return 0 if run(sys.argv[1], sys.argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main())
