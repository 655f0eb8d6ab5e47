#!/usr/bin/env python3
"""The reference for `strata bench attention`: PyTorch's scaled_dot_product_attention on the
CPU, causal, fp32, batch 1, forward and backward, at the same shapes and thread count.

Usage: /usr/bin/python3 tools/attention_bench_torch.py [--seq 4096,8192,16384] [--heads 2]
           [--kv-heads 2] [--head-dim 64] [--repeat 3] [--threads N]
Prints tokens/s (forward, backward, both; the best of --repeat), as strata's bench does. A torch
older than 2.0 has no scaled_dot_product_attention: the script then runs its math form (scores,
causal mask, softmax, weighted values, which holds T x T scores) and says so.
"""
import argparse
import time

import torch
import torch.nn.functional as F


def attention(q, k, v, gqa):
    if hasattr(F, "scaled_dot_product_attention"):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    T = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", default="4096,8192,16384")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    impl = "scaled_dot_product_attention" if hasattr(F, "scaled_dot_product_attention") else "math attention (no SDPA)"
    print(f"torch {torch.__version__} {impl}, causal, fp32, batch 1, {a.heads} query heads, "
          f"{a.kv_heads} kv heads, head dim {a.head_dim}, {torch.get_num_threads()} threads, best of {a.repeat}")
    print(f"{'T':>8}  {'fwd tok/s':>12} {'bwd tok/s':>12} {'both tok/s':>12}")
    g = torch.Generator().manual_seed(0)
    for T in (int(s) for s in a.seq.split(",")):
        q = (torch.rand(1, a.heads, T, a.head_dim, generator=g) * 2 - 1).requires_grad_()
        k = (torch.rand(1, a.kv_heads, T, a.head_dim, generator=g) * 2 - 1).requires_grad_()
        v = (torch.rand(1, a.kv_heads, T, a.head_dim, generator=g) * 2 - 1).requires_grad_()
        dout = torch.rand(1, a.heads, T, a.head_dim, generator=g) * 2 - 1
        fwd, bwd = float("inf"), float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            out = attention(q, k, v, a.heads != a.kv_heads)
            t1 = time.perf_counter()
            out.backward(dout)
            t2 = time.perf_counter()
            fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
            q.grad = k.grad = v.grad = None
        print(f"{T:>8}  {T / fwd:>12.0f} {T / bwd:>12.0f} {T / (fwd + bwd):>12.0f}")


if __name__ == "__main__":
    main()
