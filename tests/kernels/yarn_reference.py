#!/usr/bin/python3
"""Writes the YaRN RoPE tables tests/kernels/rope_test.cpp checks against.

transformers 4.40 (the release /usr/bin/python3 runs with Debian's PyTorch 1.13) has no YaRN, and
newer releases need a newer PyTorch. The YaRN function itself needs only math and torch, so this
takes `_compute_yarn_parameters` out of a newer release's modeling_rope_utils.py and runs it alone:

  pip download --no-deps transformers==4.57.1 && unzip transformers-4.57.1-*.whl 'transformers/*'
  /usr/bin/python3 tests/kernels/yarn_reference.py transformers/modeling_rope_utils.py \
      > tests/fixtures/rope/yarn_transformers_4.57.1.txt

Output: one line per case, "name head_dim theta max_position_embeddings scaling-json
attention_factor inv_freq...", the floats as Python writes them (shortest round-trip text).
"""
import ast
import json
import math
import sys

import torch

CASES = [
    # Qwen2.5's long-context setting.
    ("qwen2.5", 128, 1000000.0, 32768,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # Older configs name the type "type" and leave the original context to max_position_embeddings.
    ("small", 64, 10000.0, 256, {"type": "yarn", "factor": 8.0}),
    ("betas", 64, 10000.0, 512,
     {"rope_type": "yarn", "factor": 2.5, "beta_fast": 16.0, "beta_slow": 2.0,
      "original_max_position_embeddings": 128}),
    # DeepSeek-style mscale / mscale_all_dim.
    ("mscale", 64, 10000.0, 4096,
     {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
      "original_max_position_embeddings": 4096}),
    ("attn", 32, 10000.0, 64,
     {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.75, "truncate": False}),
]


def load_yarn(path):
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_yarn_parameters")
    fn.returns = None
    for arg in fn.args.args:
        arg.annotation = None
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["_compute_yarn_parameters"]


class Config:
    pass


def main():
    yarn = load_yarn(sys.argv[1])
    for name, head_dim, theta, max_pos, scaling in CASES:
        c = Config()
        c.rope_theta, c.head_dim, c.max_position_embeddings, c.rope_scaling = theta, head_dim, max_pos, scaling
        c.hidden_size, c.num_attention_heads = head_dim, 1
        inv_freq, attention_factor = yarn(c, "cpu")
        values = " ".join(repr(float(v)) for v in inv_freq)
        print(f"{name} {head_dim} {theta!r} {max_pos} {json.dumps(scaling, separators=(',', ':'))} "
              f"{float(attention_factor)!r} {values}")


if __name__ == "__main__":
    main()
