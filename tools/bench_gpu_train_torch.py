#!/usr/bin/python3
"""PyTorch baseline of `strata bench train-gpu`: the same Llama trained on one GPU the usual way.

Hugging Face LlamaForCausalLM built from a LlamaConfig of the preset's shape (untied
embeddings, attn_implementation="sdpa"), fp32 parameters, torch.autocast bf16, gradient
clipping at norm 1.0 and fused AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
every parameter), random tokens, MICRO_BATCH x SEQ tokens x GRAD_ACCUM per step. WARMUP untimed
steps, then STEPS timed ones, each ending with torch.cuda.synchronize().

Model FLOPs per token = 6*N + 12*L*H*T (N every parameter, embeddings and LM head included; L
layers, H hidden size, T sequence length), as strata prints them. The last line,
"RESULT {json}", is for tools/gpu_check.sh.

Usage: bench_gpu_train_torch.py [--preset 0.44b|tiny] [--steps 20] [--warmup 3]
                                [--micro-batch 8] [--seq 2048] [--grad-accum 1] [--lr 3e-4]
"""

import argparse
import json
import math
import statistics
import sys
import time

PRESETS = {
    "0.44b": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                  num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8),
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=768,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="0.44b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 1 or args.seq < 2 or args.grad_accum < 1:
        parser.error("--steps, --micro-batch, --grad-accum must be >= 1, --seq >= 2, --warmup >= 0")

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("bench_gpu_train_torch: error: no CUDA device is visible to torch", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    shape = PRESETS[args.preset]
    # Defaults of LlamaConfig kept: rope_theta 10000, no biases, SiLU (strata's preset matches).
    config = LlamaConfig(**shape, max_position_embeddings=max(2048, args.seq), rms_norm_eps=1e-6,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(1)
    with device:  # initialise on the GPU: the CPU init of 0.44B parameters takes long
        model = LlamaForCausalLM(config)
    model.train()
    attention = getattr(model.config, "_attn_implementation", "?")
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, fused=True)

    B, T, A = args.micro_batch, args.seq, args.grad_accum
    tokens_per_step = B * T * A
    L, H = shape["num_hidden_layers"], shape["hidden_size"]
    flops_per_token = 6.0 * n_params + 12.0 * L * H * T
    print(f"torch train benchmark on {torch.cuda.get_device_name(0)}: torch {torch.__version__}, "
          f"transformers {transformers.__version__}, attention {attention}, preset {args.preset}, "
          f"{n_params / 1e9:.3f}B parameters, {B} x {T} tokens x {A} micro-batches = "
          f"{tokens_per_step} tokens/step, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)

    generator = torch.Generator(device=device)
    generator.manual_seed(12345)
    step_seconds = []
    first_loss = last_loss = None
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(A):
            ids = torch.randint(0, shape["vocab_size"], (B, T), device=device, generator=generator)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / A
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        timed = step >= args.warmup
        if timed:
            step_seconds.append(seconds)
        loss_value = float(loss_sum)
        if first_loss is None:
            first_loss = loss_value
            print(f"device memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak allocated",
                  flush=True)
        last_loss = loss_value
        print(f"step {step:3d}  loss {loss_value:8.4f}  grad norm {float(norm):8.4f}  "
              f"{seconds * 1e3:9.2f} ms  {tokens_per_step / seconds:10.0f} tokens/s"
              f"{'' if timed else '  (warm-up)'}", flush=True)
        if not math.isfinite(loss_value):
            print(f"bench_gpu_train_torch: error: the loss is not finite at step {step}",
                  file=sys.stderr)
            return 1

    total = sum(step_seconds)
    tokens_per_s = tokens_per_step * args.steps / total
    tflops = tokens_per_s * flops_per_token / 1e12
    median_ms = statistics.median(step_seconds) * 1e3
    print()
    print(f"step time       mean {total / args.steps * 1e3:.2f} ms, median {median_ms:.2f} ms, "
          f"min {min(step_seconds) * 1e3:.2f} ms, max {max(step_seconds) * 1e3:.2f} ms")
    print(f"tokens/s        {tokens_per_s:.0f}")
    print(f"model TFLOP/s   {tflops:.1f}  (6N + 12*L*H*T = {flops_per_token / 1e9:.3f} GFLOP/token, "
          f"N = {n_params}, all parameters)")
    print(f"loss            {first_loss:.4f} -> {last_loss:.4f} "
          f"(random tokens: ln(vocab) = {math.log(shape['vocab_size']):.4f})")
    result = dict(impl="torch", preset=args.preset, params=n_params, micro_batch=B, seq=T,
                  grad_accum=A, tokens_per_step=tokens_per_step, steps=args.steps,
                  step_ms_median=round(median_ms, 3), tokens_per_s=round(tokens_per_s, 1),
                  tflops=round(tflops, 2), final_loss=round(last_loss, 4),
                  attention=attention, torch=torch.__version__,
                  transformers=transformers.__version__)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
