#!/usr/bin/python3
"""References for strata's DeepSeek-V2/V3 parity test, from DeepSeek's published modeling code.

Usage: reference_deepseek.py OUTDIR VARIANT
  VARIANT  deepseek_v3          DeepseekV3ForCausalLM: q LoRA, sigmoid router with
                                e_score_correction_bias, noaux_tc group-limited top-k,
                                normalised weights x routed_scaling_factor, 1 shared expert
           deepseek_v3_noqlora  the same without q LoRA (q_proj) and with YaRN rope scaling
           deepseek_v2          DeepseekV2ForCausalLM: softmax router, group_limited_greedy,
                                unnormalised weights x routed_scaling_factor, 2 shared experts,
                                sequence-level auxiliary loss (aux_loss_alpha, seq_aux)
           deepseek_v3_mtp      deepseek_v3 with one multi-token prediction module (an MoE
                                block) whose loss weighs MTP_WEIGHT
           deepseek_v3_mtp2     the same with two modules (the second reads the first's output)

The model code is the published Hugging Face remote code kept unmodified under
tests/fixtures/deepseek/ (see its README.md), imported with importlib. Tiny random models
(hidden 64, vocab 97, 3 layers, 8 routed experts) are built from it in float32.

Shim (applied here at import time, never in the fixture files): the published V3 code is
inference-only. Its gate asserts `not self.training` for topk_method "noaux_tc", and
DeepseekV3MoE.forward only has the inference branch, `moe_infer`, which is decorated with
@torch.no_grad(). The V3 variants therefore run in eval mode (dropout is 0 everywhere, so
nothing else changes) with DeepseekV3MoE.moe_infer replaced by the published function
itself without the no_grad decorator (moe_infer.__wrapped__), so that autograd gives gradients
to the routed experts and, through the gathered sigmoid weights, to the gate. The V2 variant
runs the published code in train mode, unpatched: its gate computes the auxiliary loss only
in training, and its MoE training branch adds the aux loss's gradient through
AddAuxiliaryLoss (the returned loss never includes it).

Multi-token prediction: the published modeling code builds no MTP module (DeepSeek-V3's
checkpoints store it as layer num_hidden_layers, which the code leaves unloaded). The module here
is assembled from the published classes as the DeepSeek-V3 report (section 2.2) describes it and
as the checkpoints name its tensors: model.layers.{L}.enorm / hnorm (the published RMSNorm),
eh_proj (a bias-free Linear over the concatenation, embedding first, as DeepSeek's serving code
orders it), one published DecoderLayer(config, L) (MoE, with its own gate and
e_score_correction_bias) and shared_head.norm; the embedding and LM head are the model's (the
checkpoint's model.layers.{L}.embed_tokens and shared_head.head copies are written too). Position
t of module k (1, 2, ...) combines the previous hidden state (the model's last before its final
norm, or module k - 1's block output) with the embedding of input t + k and predicts target t + k;
the last k positions predict nothing. The training loss is mean main NLL + MTP_WEIGHT / D x (sum of
the D modules' NLL) / (main targets), strata's definition (ModelConfig::mtp_loss_weight).

Writes OUTDIR/VARIANT/:
  config.json, model.safetensors   save_pretrained(safe_serialization=True) in float32, with
                                   the published tensor names; config.json holds
                                   architectures, model_type and auto_map like the
                                   published configs
  reference.json                   batch (inputs, targets with -1 = ignored), "loss" (mean
                                   NLL + the aux loss the code trains with: for deepseek_v2
                                   the sum over MoE layers of the gate's aux_loss, which
                                   already includes aux_loss_alpha; 0 for V3), "nll",
                                   "aux_loss", "aux_losses" (per MoE layer), "grads":
                                   [{name, shape, offset}] into grads.bin, "zero_grads"
                                   (tensors with no gradient path), "adamw" (3 steps on the
                                   same batch: hyper-parameters and the loss before each
                                   step) and "routing" (diagnostics)
  grads.bin                        float32 gradients of "loss", concatenated in that order
  params_after.bin                 float32 parameters after the 3 AdamW steps, same layout

Usage: reference_deepseek.py probe
  Exits 0 when this interpreter imports the published code (the tests skip otherwise).

Usage: reference_deepseek.py check REF_DIR EXPORT_DIR
  Loads both directories with the published code's from_pretrained (the class and version named
  by each config.json) and compares the export with the reference: the loading info (missing,
  unexpected and mismatched keys), every tensor exactly, and the logits on a fixed batch.
  Writes the findings to EXPORT_DIR.check.json and exits 0 when they agree.

Prints routing diagnostics to stderr (how many token choices group limiting and the
correction bias change, the smallest top-k and group margins over the 3 AdamW steps).
"""

import importlib
import json
import math
import os
import sys
import types

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
BATCH, SEQ = 2, 12
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fixtures", "deepseek")
MTP_WEIGHT = 0.3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, steps=3)
MARGIN = 1e-4  # smallest acceptable gap at a top-k / group boundary (routing must not flip)

COMMON = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-5, hidden_act="silu",
              num_hidden_layers=3, intermediate_size=80, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=16,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_theta=10000.0,
              rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
              attention_dropout=0.0, initializer_range=0.02, ep_size=1, use_cache=False,
              bos_token_id=0, eos_token_id=1)
V3 = dict(COMMON, q_lora_rank=24, topk_method="noaux_tc", scoring_func="sigmoid",
          norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
          num_nextn_predict_layers=0, aux_loss_alpha=0.001, seq_aux=True)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# variant: (fixture folder, version, config, seed, gate weight std x sqrt(hidden))
VARIANTS = {
    "deepseek_v3": ("DeepSeek-V3", 3, V3, 62, 1.0),
    "deepseek_v3_noqlora": ("DeepSeek-V3", 3, dict(V3, q_lora_rank=None, rope_scaling=YARN), 51, 1.0),
    "deepseek_v2": ("DeepSeek-V2-Lite", 2,
                    dict(COMMON, q_lora_rank=None, topk_method="group_limited_greedy",
                         scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5,
                         n_shared_experts=2, aux_loss_alpha=0.001, seq_aux=True), 47, 2.0),
    # deepseek_v3 with a 256-token vocabulary, for training on bytes through the CLI.
    "deepseek_v3_bytes": ("DeepSeek-V3", 3, dict(V3, vocab_size=256), 64, 1.0),
    # deepseek_v3 with one MTP module, and with two.
    "deepseek_v3_mtp": ("DeepSeek-V3", 3, dict(V3, num_nextn_predict_layers=1), 66, 1.0),
    "deepseek_v3_mtp2": ("DeepSeek-V3", 3, dict(V3, num_nextn_predict_layers=2), 71, 1.0),
    # The same with a 256-token vocabulary, for training on bytes through the CLI.
    "deepseek_v3_mtp_bytes": ("DeepSeek-V3", 3, dict(V3, num_nextn_predict_layers=1, vocab_size=256), 77, 1.0),
    # The same without the auxiliary loss (strata refuses aux_loss_alpha > 0 for V2).
    "deepseek_v2_noaux": ("DeepSeek-V2-Lite", 2,
                          dict(COMMON, q_lora_rank=None, topk_method="group_limited_greedy",
                               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5,
                               n_shared_experts=2, aux_loss_alpha=0.0, seq_aux=True), 47, 2.0),
}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def load_published(folder, version):
    """Imports configuration_deepseek and modeling_deepseek of a fixture folder as a package
    (modeling_deepseek does `from .configuration_deepseek import ...`), writing no bytecode
    into the source tree."""
    package = "published_deepseek_v%d" % version
    if package + ".modeling_deepseek" in sys.modules:
        return sys.modules[package + ".configuration_deepseek"], sys.modules[package + ".modeling_deepseek"]
    sys.dont_write_bytecode = True
    # Names the published files import that later transformers releases dropped (DeepSeek's own
    # later commit removes the first): given their 4.40 values where missing.
    import transformers.pytorch_utils
    import transformers.utils.import_utils
    if not hasattr(transformers.pytorch_utils, "is_torch_greater_or_equal_than_1_13"):
        transformers.pytorch_utils.is_torch_greater_or_equal_than_1_13 = True
    if not hasattr(transformers.utils.import_utils, "is_torch_fx_available"):
        transformers.utils.import_utils.is_torch_fx_available = lambda: True
    pkg = types.ModuleType(package)
    pkg.__path__ = [os.path.abspath(os.path.join(FIXTURES, folder))]
    sys.modules[package] = pkg
    configuration = importlib.import_module(package + ".configuration_deepseek")
    modeling = importlib.import_module(package + ".modeling_deepseek")
    # The shim described above: the published moe_infer, without @torch.no_grad() (V3, and V2
    # run in eval mode when it has no auxiliary loss).
    moe = getattr(modeling, "DeepseekV%dMoE" % version)
    moe_infer = moe.moe_infer
    moe.moe_infer = getattr(moe_infer, "__wrapped__", moe_infer)
    assert moe.moe_infer is not moe_infer, "moe_infer is not a no_grad wrapper"
    return configuration, modeling


def perturb(model, gate_gain, version):
    """Weights away from the published init so that every gradient matters: unit-variance
    projections (attention is far from uniform), norms near 1, routers decisive, and for V3 a
    small random e_score_correction_bias (the published code leaves it uninitialised)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, gate_gain / math.sqrt(p.shape[1]))
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))


class MtpModule(torch.nn.Module):
    """One multi-token prediction module from the published classes (see the docstring)."""

    def __init__(self, modeling, config, version, depth):
        super().__init__()
        norm = getattr(modeling, "DeepseekV%dRMSNorm" % version)
        C = config.hidden_size
        self.depth = depth  # 1, 2, ...: reads the inputs `depth` ahead
        self.layer = config.num_hidden_layers + depth - 1
        self.enorm = norm(C, eps=config.rms_norm_eps)
        self.hnorm = norm(C, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * C, C, bias=False)
        self.block = getattr(modeling, "DeepseekV%dDecoderLayer" % version)(config, self.layer)
        self.head_norm = norm(C, eps=config.rms_norm_eps)
        self.modeling = modeling

    def checkpoint_name(self, name):
        if name.startswith("block."):
            return "model.layers.%d.%s" % (self.layer, name[len("block."):])
        if name.startswith("head_norm."):
            return "model.layers.%d.shared_head.norm.%s" % (self.layer, name[len("head_norm."):])
        return "model.layers.%d.%s" % (self.layer, name)

    def named_checkpoint_parameters(self):
        return [(self.checkpoint_name(n), p) for n, p in self.named_parameters()]

    def forward(self, model, hidden, inputs, targets):
        """(block output, logits (B, T, V)) from `hidden` (the model's last hidden state before
        its final norm, or the previous module's block output) and the inputs `depth` ahead. At
        t + depth = T the input is the row's last target (0 where ignored), beyond it 0: those
        positions predict nothing."""
        B, T = inputs.shape
        k = self.depth
        ahead = torch.zeros_like(inputs)
        ahead[:, :T - k] = inputs[:, k:]
        ahead[:, T - k] = targets[:, T - 1].clamp(min=0)
        embedded = model.model.embed_tokens(ahead)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        mask = self.modeling._prepare_4d_causal_attention_mask(None, (B, T), x, 0)
        positions = torch.arange(T, dtype=torch.long).unsqueeze(0)
        out = self.block(x, attention_mask=mask, position_ids=positions)[0]
        return out, model.lm_head(self.head_norm(out))


def build(variant):
    folder, version, c, seed, gate_gain = VARIANTS[variant]
    configuration, modeling = load_published(folder, version)
    config_class = getattr(configuration, "DeepseekV%dConfig" % version)
    model_class = getattr(modeling, "DeepseekV%dForCausalLM" % version)
    torch.manual_seed(seed)
    config = config_class(**c, torch_dtype="float32", attn_implementation="eager")
    config.auto_map = {"AutoConfig": "configuration_deepseek.DeepseekV%dConfig" % version,
                       "AutoModel": "modeling_deepseek.DeepseekV%dModel" % version,
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV%dForCausalLM" % version}
    model = model_class(config).to(torch.float32)
    perturb(model, gate_gain, version)
    if getattr(config, "num_nextn_predict_layers", 0):
        model.mtp = torch.nn.ModuleList([MtpModule(modeling, config, version, d + 1)
                                         for d in range(config.num_nextn_predict_layers)]).to(torch.float32)
        perturb(model.mtp, gate_gain, version)
        model.mtp.train(model.training)
    # V2 with an auxiliary loss: train mode (the gate's aux loss and the MoE training branch;
    # the published training branch needs aux_loss_alpha > 0). V3, and V2 without it: eval mode
    # (the published noaux_tc gate asserts not training). Dropout is 0 either way.
    model.train(version == 2 and config.aux_loss_alpha > 0)
    return model, config, modeling, version, seed


# ---------------------------------------------------------------------------------------------
# Routing diagnostics: an independent re-implementation of the published gate, checked against
# what the gate returned, plus margins at every top-k / group boundary.

class RoutingProbe:
    def __init__(self, model, config, version):
        self.config, self.version = config, version
        layers = list(model.model.layers) + [module.block for module in getattr(model, "mtp", [])]
        self.gates = [(i, layer.mlp.gate) for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
        self.records = []
        for i, gate in self.gates:
            gate.register_forward_hook(self.hook(i))

    def hook(self, layer):
        def fn(gate, inputs, output):
            self.records.append((layer, gate, inputs[0].detach(), [o.detach() if o is not None else None
                                                                    for o in output]))
        return fn

    def reset(self):
        self.records = []

    def aux_losses(self):
        return [out[2] for _, _, _, out in self.records if out[2] is not None] if self.version == 2 else []

    def check(self, stats):
        c = self.config
        E, K, G, TG = c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group
        for layer, gate, x, out in self.records:
            h = x.reshape(-1, x.shape[-1]).double()
            logits = h @ gate.weight.detach().double().T
            if self.version == 3:
                scores = logits.sigmoid()
                choice = scores + gate.e_score_correction_bias.detach().double()
                group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
            else:
                scores = logits.softmax(-1)
                choice = scores
                group_scores = choice.view(-1, G, E // G).max(-1).values

            def select(ch, gs):
                gsorted = gs.sort(-1, descending=True).values
                gmargin = (gsorted[:, TG - 1] - gsorted[:, TG]).min().item() if TG < G else math.inf
                gidx = gs.topk(TG, -1).indices
                gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
                smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
                tmp = ch.masked_fill(~smask.bool(), 0.0)
                tsorted = tmp.sort(-1, descending=True).values
                return tmp.topk(K, -1).indices, (tsorted[:, K - 1] - tsorted[:, K]).min().item(), gmargin

            idx, kmargin, gmargin = select(choice, group_scores)
            got = out[0]
            assert torch.equal(idx.sort(-1).values, got.sort(-1).values), "re-implemented routing differs"
            # weights, as re-implemented
            if self.version == 3:
                w = scores.gather(1, got)
                w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
            else:
                w = scores.gather(1, got)
                w = (w / (w.sum(-1, keepdim=True) + 1e-20)) if (K > 1 and c.norm_topk_prob) else w * c.routed_scaling_factor
            assert torch.allclose(w.float(), out[1], rtol=1e-5, atol=1e-6), "re-implemented weights differ"
            if self.version == 2 and out[2] is not None:
                bsz, seq = x.shape[0], x.shape[1]
                ce = torch.zeros(bsz, E, dtype=torch.float64)
                ce.scatter_add_(1, got.view(bsz, -1), torch.ones(bsz, seq * K, dtype=torch.float64))
                ce /= seq * K / E
                aux = (ce * scores.view(bsz, seq, E).mean(1)).sum(1).mean() * c.aux_loss_alpha
                assert abs(aux.item() - out[2].item()) <= 1e-6 * max(1.0, abs(aux.item())), "aux differs"
            plain = choice.topk(K, -1).indices.sort(-1).values
            stats["group_limit_changes"] += int((plain != idx.sort(-1).values).any(-1).sum())
            if self.version == 3:
                nob = scores
                nob_idx, _, _ = select(nob, nob.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1))
                stats["bias_changes"] += int((nob_idx.sort(-1).values != idx.sort(-1).values).any(-1).sum())
            stats["min_topk_margin"] = min(stats["min_topk_margin"], kmargin)
            stats["min_group_margin"] = min(stats["min_group_margin"], gmargin)
            counts = torch.bincount(got.reshape(-1), minlength=E)
            stats["min_tokens_per_expert"] = min(stats["min_tokens_per_expert"], int(counts.min()))
            stats["choices"] += got.shape[0]


# ---------------------------------------------------------------------------------------------

def parameters_by_name(model):
    """The model's parameters by checkpoint name, the MTP module's after the model's."""
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("mtp.")]
    for module in getattr(model, "mtp", []):
        named += module.named_checkpoint_parameters()
    return named


def forward_loss(model, probe, inputs, targets):
    """(training loss, main mean NLL, aux, aux per layer, MTP NLL sum, MTP targets)."""
    probe.reset()
    mtp = getattr(model, "mtp", None)
    captured = []
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.append(i[0])) if mtp is not None else None
    logits = model(input_ids=inputs).logits
    if hook is not None:
        hook.remove()
    nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)
    aux_losses = probe.aux_losses()
    aux = sum(a.item() for a in aux_losses) if aux_losses else 0.0
    # For V2 the aux gradient is injected by the published AddAuxiliaryLoss during backward of
    # anything downstream of the MoE output, so backward(nll) yields d(nll + aux).
    loss, mtp_sum, mtp_count = nll, 0.0, 0
    if mtp is not None:
        hidden, total, valid = captured[0], 0.0, int((targets != IGNORE_INDEX).sum())
        for module in mtp:
            k = module.depth
            mtp_targets = torch.full_like(targets, IGNORE_INDEX)
            mtp_targets[:, :-k] = targets[:, k:]
            hidden, mtp_logits = module(model, hidden, inputs, targets)
            mtp_nll = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), mtp_targets.reshape(-1),
                                      ignore_index=IGNORE_INDEX, reduction="sum")
            total = total + mtp_nll
            mtp_sum += mtp_nll.item()
            mtp_count += int((mtp_targets != IGNORE_INDEX).sum())
        loss = nll + MTP_WEIGHT / len(mtp) * total / valid
    return loss, nll, aux, [a.item() for a in aux_losses], mtp_sum, mtp_count


def flat(tensors):
    return b"".join(t.detach().contiguous().to(torch.float32).numpy().tobytes() for t in tensors)


def check_aux_gradient_trick(model, modeling, inputs, targets, probe, grads):
    """V2 only: the gradients with the published AddAuxiliaryLoss must equal those of
    nll + sum(aux) computed explicitly with the trick turned off."""
    assert "apply" not in vars(modeling.AddAuxiliaryLoss)
    modeling.AddAuxiliaryLoss.apply = staticmethod(lambda y, loss: y)
    try:
        model.zero_grad(set_to_none=True)
        probe.reset()
        captured = []
        hooks = [g.register_forward_hook(lambda m, i, o: captured.append(o[2])) for _, g in probe.gates]
        logits = model(input_ids=inputs).logits
        for h in hooks:
            h.remove()
        nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX)
        (nll + sum(captured)).backward()
        worst = 0.0
        for (name, p), g in zip(model.named_parameters(), grads):
            e = p.grad if p.grad is not None else torch.zeros_like(p)
            worst = max(worst, ((e - g).norm() / max(g.norm(), 1e-30)).item())
        log("aux gradient trick vs explicit nll + aux: worst relative difference %.2e" % worst)
        assert worst < 1e-5
    finally:
        del modeling.AddAuxiliaryLoss.apply  # back to torch.autograd.Function.apply
        model.zero_grad(set_to_none=True)


def run(outdir, variant):
    model, config, modeling, version, seed = build(variant)
    out = os.path.join(outdir, variant)
    os.makedirs(out, exist_ok=True)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        del model.mtp  # save_pretrained writes the published model's tensors; the modules' follow
    model.save_pretrained(out, safe_serialization=True)
    if mtp is not None:
        model.mtp = mtp
        import safetensors.torch
        path = os.path.join(out, "model.safetensors")
        tensors = safetensors.torch.load_file(path)
        for module in mtp:
            for name, p in module.named_checkpoint_parameters():
                tensors[name] = p.detach().clone().contiguous()
            tensors["model.layers.%d.embed_tokens.weight" % module.layer] = model.model.embed_tokens.weight.detach().clone()
            tensors["model.layers.%d.shared_head.head.weight" % module.layer] = model.lm_head.weight.detach().clone()
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    initial = {n: p.detach().clone() for n, p in parameters_by_name(model)}

    generator = torch.Generator().manual_seed(seed + 100)
    inputs = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    targets[torch.rand((BATCH, SEQ), generator=generator) < 0.2] = IGNORE_INDEX

    probe = RoutingProbe(model, config, version)
    stats = dict(choices=0, group_limit_changes=0, bias_changes=0, min_topk_margin=math.inf,
                 min_group_margin=math.inf, min_tokens_per_expert=1 << 30)

    # Gradient of the loss at the initial weights.
    model.zero_grad(set_to_none=True)
    total, nll, aux, aux_layers, mtp_sum, mtp_count = forward_loss(model, probe, inputs, targets)
    probe.check(stats)
    total.backward()
    names, grads, zero_grads, entries, offset = [], [], [], [], 0
    for name, p in parameters_by_name(model):
        if p.grad is None:  # no gradient path (e_score_correction_bias only selects experts)
            zero_grads.append(name)
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        names.append(name)
        grads.append(g)
        entries.append(dict(name=name, shape=list(g.shape), offset=offset))
        offset += g.numel()
    loss = total.item() + aux
    if version == 2 and config.aux_loss_alpha > 0:
        check_aux_gradient_trick(model, modeling, inputs, targets, probe, grads)

    # Three AdamW steps on the same batch, from the same initial weights.
    with torch.no_grad():
        for n, p in parameters_by_name(model):
            p.copy_(initial[n])
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=ADAMW["weight_decay"]),
                                   dict(params=no_decay, weight_decay=0.0)],
                                  lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])
    losses, nlls, auxes = [], [], []
    for step in range(ADAMW["steps"]):
        model.zero_grad(set_to_none=True)
        step_total, step_nll, step_aux, _, _, _ = forward_loss(model, probe, inputs, targets)
        probe.check(stats)
        losses.append(step_total.item() + step_aux)
        nlls.append(step_nll.item())
        auxes.append(step_aux)
        step_total.backward()
        if step == 0:
            for (n, p), g in zip(parameters_by_name(model), grads):
                assert torch.equal(p.grad if p.grad is not None else torch.zeros_like(p), g), n
        unexpected = [n for n, p in parameters_by_name(model)
                      if p.grad is None and not n.endswith("e_score_correction_bias")]
        assert not unexpected, "no gradient (an expert got no tokens?): %s" % unexpected
        optimizer.step()
    assert losses[0] == loss

    with open(os.path.join(out, "grads.bin"), "wb") as f:
        f.write(flat(grads))
    with open(os.path.join(out, "params_after.bin"), "wb") as f:
        f.write(flat(p for _, p in parameters_by_name(model)))

    strata_targets = targets.clone()
    strata_targets[strata_targets == IGNORE_INDEX] = -1
    alpha = config.aux_loss_alpha if version == 2 else 0.0
    reference = dict(
        variant=variant, architecture=model.__class__.__name__, batch=BATCH, seq=SEQ,
        inputs=inputs.tolist(), targets=strata_targets.tolist(),
        loss=loss, nll=nll.item(), aux_loss=aux, aux_losses=aux_layers,
        mtp_weight=MTP_WEIGHT if mtp is not None else 0.0, mtp_nll_sum=mtp_sum, mtp_targets=mtp_count,
        aux_loss_alpha=alpha, aux_loss_unscaled=(aux / alpha if alpha else 0.0),
        grads=entries, zero_grads=zero_grads,
        adamw=dict(lr=ADAMW["lr"], betas=list(ADAMW["betas"]), eps=ADAMW["eps"],
                   weight_decay=ADAMW["weight_decay"], weight_decay_on="2-D tensors (1-D: 0)",
                   steps=ADAMW["steps"], losses=losses, nlls=nlls, aux_losses=auxes,
                   params_after="params_after.bin"),
        routing=stats)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)

    log("%s: loss %.6f (nll %.6f, aux %.3e), AdamW losses %s" % (variant, loss, nll.item(), aux,
                                                                 " ".join("%.6f" % l for l in losses)))
    log("%s: %d token choices over 4 forwards x %d MoE layers: group limiting changed %d, "
        "correction bias changed %d; min top-k margin %.2e, min group margin %.2e, min tokens/expert %d"
        % (variant, stats["choices"], len(probe.gates), stats["group_limit_changes"], stats["bias_changes"],
           stats["min_topk_margin"], stats["min_group_margin"], stats["min_tokens_per_expert"]))
    log("%s: tensors without a gradient path: %s" % (variant, zero_grads or "none"))
    ok = stats["min_topk_margin"] >= MARGIN and stats["min_group_margin"] >= MARGIN
    if not ok:
        log("%s: a routing margin is below %.0e; pick another seed" % (variant, MARGIN))
    if stats["min_tokens_per_expert"] < 1:
        log("%s: an expert got no tokens in some forward; pick another seed" % variant)
        ok = False
    all_zero = [n for n, g in zip(names, grads) if not g.any() and n not in zero_grads]
    if all_zero:
        log("%s: all-zero gradients (routed only to ignored targets?): %s; pick another seed" % (variant, all_zero))
        ok = False
    if stats["group_limit_changes"] == 0 or (version == 3 and stats["bias_changes"] == 0):
        log("%s: group limiting or the correction bias never changed a choice; pick another seed" % variant)
        ok = False
    return ok


def load_dir(path):
    """The published model class of a directory's config.json, loaded by from_pretrained."""
    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    version = 3 if "V3" in arch else 2
    configuration, modeling = load_published("DeepSeek-V3" if version == 3 else "DeepSeek-V2-Lite", version)
    config = getattr(configuration, "DeepseekV%dConfig" % version).from_pretrained(path)
    model, info = getattr(modeling, "DeepseekV%dForCausalLM" % version).from_pretrained(
        path, config=config, torch_dtype=torch.float32, output_loading_info=True)
    model.eval()
    return model, info, arch


def check(ref_dir, export_dir):
    ref, _, ref_arch = load_dir(ref_dir)
    out, info, arch = load_dir(export_dir)
    findings = dict(architecture=arch, reference_architecture=ref_arch,
                    missing_keys=sorted(info["missing_keys"]), unexpected_keys=sorted(info["unexpected_keys"]),
                    mismatched_keys=[str(k) for k in info["mismatched_keys"]])
    ref_state, out_state = ref.state_dict(), out.state_dict()
    differing = [n for n, t in ref_state.items() if n not in out_state or not torch.equal(t, out_state[n])]
    findings["differing_tensors"] = differing
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, ref.config.vocab_size, (BATCH, SEQ), generator=generator)
    with torch.no_grad():
        a = ref(input_ids=inputs).logits
        b = out(input_ids=inputs).logits
    findings["max_logit_difference"] = (a - b).abs().max().item()
    ok = (arch == ref_arch and not findings["missing_keys"] and not findings["unexpected_keys"] and
          not findings["mismatched_keys"] and not differing and findings["max_logit_difference"] == 0.0)
    findings["ok"] = ok
    with open(export_dir.rstrip("/") + ".check.json", "w") as f:
        json.dump(findings, f, indent=1)
    log(json.dumps(findings))
    return ok


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "probe":  # can this interpreter run the published code?
        for folder, version in (("DeepSeek-V3", 3), ("DeepSeek-V2-Lite", 2)):
            load_published(folder, version)
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "check":
        torch.set_num_threads(1)
        return 0 if check(sys.argv[2], sys.argv[3]) else 1
    if len(sys.argv) != 3 or sys.argv[2] not in VARIANTS:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    return 0 if run(sys.argv[1], sys.argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main())
