#!/usr/bin/python3
"""References for strata's generation test (tests/model/generate_test.cpp).

Usage: reference_generate.py OUTDIR VARIANT
  VARIANT  llama, mixtral, qwen2_moe   tiny random models of that transformers (4.40) class

Writes OUTDIR/VARIANT/:
  config.json, model.safetensors   save_pretrained(safe_serialization=True) in float32
  reference.json                   "prompt": token ids; "generated": the ids transformers'
                                   generate(do_sample=False, use_cache=True) appends to them
                                   (greedy with its KV cache, max_new_tokens of them: EOS is
                                   switched off so that it never stops early); "scores": the
                                   logits (V floats) it chose each of them from

The weights are drawn with initializer_range 0.2 (not transformers' 0.02) so that the logits
spread over a few units and greedy choices are not decided by rounding.
"""

import json
import os
import sys

import torch

PROMPT_LEN, NEW_TOKENS = 19, 12  # the prompt crosses a 16-row attention block
COMMON = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, hidden_act="silu",
              initializer_range=0.2, tie_word_embeddings=False)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(COMMON, num_hidden_layers=2, intermediate_size=96, rope_theta=10000.0), 41),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                     num_experts_per_tok=2, rope_theta=1e6, sliding_window=None), 42),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(COMMON, num_hidden_layers=2, intermediate_size=80, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                       decoder_sparse_step=1, rope_theta=10000.0, use_sliding_window=False), 43),
}


def run(outdir, variant):
    import transformers
    config_cls, model_cls, kwargs, seed = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    out = os.path.join(outdir, variant)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), generator=g)
    with torch.no_grad():
        result = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                use_cache=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                eos_token_id=None, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True)
    generated = result.sequences[0, PROMPT_LEN:].tolist()
    assert len(generated) == NEW_TOKENS, generated
    scores = [s[0].tolist() for s in result.scores]
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"prompt": prompt[0].tolist(), "generated": generated, "scores": scores,
                   "transformers": transformers.__version__}, f)


def main():
    if len(sys.argv) != 3 or sys.argv[2] not in VARIANTS:
        sys.exit(__doc__)
    run(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
