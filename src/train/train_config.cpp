#include "train/train_config.h"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "core/units.h"

namespace strata {
namespace {

ConfigSchema build_schema() {
  using T = ConfigType;
  ConfigSchema s;
  s.add({.name = "model.preset", .type = T::kString, .default_value = "tiny",
         .help = "built-in model shape (tiny, llama3.2-1b, llama3-8b), used when model.config is empty"});
  s.add({.name = "model.config", .type = T::kString, .default_value = "",
         .help = "Hugging Face config.json (or a directory holding one) describing the model"});
  s.add({.name = "model.init", .type = T::kString, .default_value = "",
         .help = "safetensors file with initial weights; empty = random init from train.seed"});
  s.add({.name = "model.from", .type = T::kString, .default_value = "",
         .help = "Hugging Face model directory (config.json + safetensors) to start from; replaces "
                 "model.config and model.init, and its tokenizer files go into run.export"});
  s.add({.name = "model.set", .type = T::kStringList, .default_value = "[]",
         .help = "config.json keys to override, e.g. [num_hidden_layers=2, hidden_size=256]"});
  s.add({.name = "data.paths", .type = T::kStringList, .default_value = "[builtin:licenses]",
         .help = "token files, directories or globs; builtin:licenses = Debian's license texts as bytes"});
  s.add({.name = "data.format", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "llmc", "megatron", "text"}, .help = "how to read data.paths"});
  s.add({.name = "data.allow_empty_loss", .type = T::kBool, .default_value = "false",
         .help = "train steps in which the loss masks leave no token to predict (a no-op step: zero gradients); "
                 "false: such a step stops the run naming the file, since an all-zero mask usually means broken "
                 "data"});
  s.add({.name = "data.packing", .type = T::kString, .default_value = "concat", .choices = {"concat", "document"},
         .help = "how documents share a sequence. concat: a window of the token stream is one sequence, documents "
                 "attend to the ones before them. document: attention and positions restart after each "
                 "data.eos_id token, and the token after an EOS is not predicted (README: Packing)"});
  s.add({.name = "data.eos_id", .type = T::kInt, .default_value = "-1", .min = -1, .max = 1 << 24,
         .help = "the token id that ends each document (the tokenizer's eos_token, which strata data tokenize "
                 "writes after every text document), for data.packing=document; -1 = the eos_token of model.from's "
                 "tokenizer"});
  s.add({.name = "data.eval_paths", .type = T::kStringList, .default_value = "[]",
         .help = "token files to evaluate on, read as data.paths are (data.format); empty = no evaluation. "
                 "Name files that data.paths does not: nothing checks that they differ"});
  s.add({.name = "data.eval_fraction", .type = T::kFloat, .default_value = "0", .min = 0, .max = 0.9,
         .help = "evaluate on this share of the documents of data.paths, held out by document (ended by "
                 "data.eos_id, or model.from's tokenizer's eos_token) and never trained on; the same documents in "
                 "every run over the same data. 0 = none; instead of data.eval_paths"});
  s.add({.name = "train.micro_batch", .type = T::kInt, .default_value = "8", .min = 1, .max = 1 << 20,
         .help = "sequences per micro-batch"});
  s.add({.name = "train.seq_len", .type = T::kInt, .default_value = "128", .min = 1, .max = 1 << 24,
         .help = "tokens per sequence"});
  s.add({.name = "train.grad_accum", .type = T::kInt, .default_value = "1", .min = 1, .max = 1 << 20,
         .help = "micro-batches per optimizer step"});
  s.add({.name = "train.steps", .type = T::kInt, .default_value = "200", .min = 1,
         .help = "optimizer steps to run"});
  s.add({.name = "train.method", .type = T::kString, .default_value = "full", .choices = {"full", "lora"},
         .help = "full: train every parameter. lora: freeze the model and train low-rank adapters (lora.*) on its "
                 "projections; the frozen weights keep only their compute copy (no gradients, master or Adam "
                 "moments), checkpoints hold the adapters, and run.export writes a PEFT adapter"});
  s.add({.name = "lora.rank", .type = T::kInt, .default_value = "16", .min = 1, .max = 4096,
         .help = "the adapters' rank r (PEFT's r)"});
  s.add({.name = "lora.alpha", .type = T::kFloat, .default_value = "32", .min = 1e-6, .max = 1e6,
         .help = "the adapters' scale is alpha / rank (PEFT's lora_alpha)"});
  s.add({.name = "lora.dropout", .type = T::kFloat, .default_value = "0", .min = 0, .max = 0.99,
         .help = "dropout on the adapters' input in training steps (PEFT's lora_dropout)"});
  s.add({.name = "lora.targets", .type = T::kStringList,
         .default_value = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
         .help = "the projections that carry adapters, by PEFT's module names: q_proj, k_proj, v_proj, o_proj, "
                 "gate_proj, up_proj, down_proj (the dense MLPs'), or all-linear"});
  s.add({.name = "lora.init", .type = T::kString, .default_value = "kaiming", .choices = {"kaiming", "gaussian"},
         .help = "how A starts (B starts at zero): kaiming = PEFT's default (uniform, bound 1/sqrt(in)); "
                 "gaussian = normal with std 1/rank"});
  s.add({.name = "lora.base", .type = T::kString, .default_value = "auto", .choices = {"auto", "bf16", "fp8", "nf4"},
         .help = "the frozen base's compute copy with train.method=lora, what pages over PCIe and to nvme: bf16, fp8 "
                 "(E4M3 with 128x128 block scales: the fp8 recipe) or nf4 (QLoRA's 4-bit NormalFloat with "
                 "double-quantised scales, decoded to bf16 for the GEMMs; the bf16 recipe otherwise); auto = "
                 "train.precision's. Sets the recipe: leave train.precision auto or name the same"});
  s.add({.name = "model.adapter", .type = T::kString, .default_value = "",
         .help = "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to start the "
                 "adapters from, with train.method=lora; its r, lora_alpha and target_modules replace lora.rank, "
                 "lora.alpha and lora.targets"});
  s.add({.name = "train.mtp_weight", .type = T::kFloat, .default_value = "0.1", .min = 0, .max = 1000,
         .help = "weight of the multi-token prediction loss, for models with MTP modules (DeepSeek-V3's "
                 "num_nextn_predict_layers): the step trains (main NLL + weight x MTP NLL) per main target. "
                 "DeepSeek-V3 pretrained with 0.3, then 0.1. 0 = the modules are neither computed nor updated, and "
                 "export as loaded"});
  s.add({.name = "train.max_skipped_steps", .type = T::kInt, .default_value = "5", .min = 0, .max = 1000000,
         .help = "a step whose loss or gradient norm is NaN/Inf is skipped (no update; the data and the lr schedule "
                 "move on, AdamW's step count does not); this many skipped in a row are tolerated, one more stops "
                 "the run with an error (0: stop at the first)"});
  s.add({.name = "train.eval_every", .type = T::kInt, .default_value = "0", .min = 0,
         .help = "evaluate on data.eval_paths every N steps and after the last (0 = after the last only); the "
                 "eval loss and perplexity join the step's line, metrics.jsonl, TensorBoard and strata plot"});
  s.add({.name = "train.eval_steps", .type = T::kInt, .default_value = "16", .min = 1, .max = 1 << 20,
         .help = "micro-batches (train.micro_batch x train.seq_len tokens each) in one evaluation, shared out "
                 "over the ranks; the same windows every time, so evaluations compare, and at most what the eval "
                 "data holds"});
  s.add({.name = "train.seed", .type = T::kInt, .default_value = "1234", .min = 0,
         .help = "seed for weights and data order; the same seed gives bitwise the same run on the same build, machine type and any thread count (README: Determinism)"});
  s.add({.name = "train.precision", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "fp32", "bf16", "fp8"},
         .help = "precision recipe. fp32: everything fp32 (the CPU reference). bf16: a bf16 compute copy of the "
                 "weights and bf16 activations, with fp32 master weights, gradients and Adam moments (the GPU's "
                 "recipe; on the cpu backend emulated, rounding where the GPU rounds). fp8: the bf16 recipe with "
                 "the linear layers' GEMMs in E4M3 with 1x128 / 128x128 block scales (DeepSeek-V3's), and their "
                 "weights paged as E4M3 copies (half the bytes); cpu backend only for now (emulated). auto: bf16 "
                 "on cuda, fp32 on the cpu"});
  s.add({.name = "optim.lr", .type = T::kFloat, .default_value = "0.003", .min = 0, .max = 10,
         .help = "peak learning rate"});
  s.add({.name = "optim.schedule", .type = T::kString, .default_value = "cosine",
         .choices = {"cosine", "linear", "constant"}, .help = "decay after warmup"});
  s.add({.name = "optim.warmup_steps", .type = T::kInt, .default_value = "20", .min = 0,
         .help = "steps of linear warmup from 0 to optim.lr"});
  s.add({.name = "optim.min_lr_ratio", .type = T::kFloat, .default_value = "0.1", .min = 0, .max = 1,
         .help = "final learning rate as a fraction of optim.lr"});
  s.add({.name = "optim.beta1", .type = T::kFloat, .default_value = "0.9", .min = 0, .max = 0.999999, .help = "AdamW beta1"});
  s.add({.name = "optim.beta2", .type = T::kFloat, .default_value = "0.95", .min = 0, .max = 0.999999, .help = "AdamW beta2"});
  s.add({.name = "optim.eps", .type = T::kFloat, .default_value = "1e-8", .min = 0, .max = 1, .help = "AdamW epsilon"});
  s.add({.name = "optim.weight_decay", .type = T::kFloat, .default_value = "0.1", .min = 0, .max = 10,
         .help = "decoupled weight decay (matrices and embeddings only)"});
  s.add({.name = "optim.grad_clip", .type = T::kFloat, .default_value = "1.0", .min = 0,
         .help = "clip the global gradient norm to this; 0 = off"});
  s.add({.name = "optim.moments", .type = T::kString, .default_value = "fp32", .choices = {"fp32", "bf16", "int8"},
         .help = "how the Adam moments are stored: fp32 (8 bytes per parameter), bf16 (4) or int8, 8-bit blocks "
                 "of 256 with a dynamic code table (2 and a little); the update itself is AdamW's in fp32"});
  s.add({.name = "optim.moments_rounding", .type = T::kString, .default_value = "nearest",
         .choices = {"nearest", "stochastic"},
         .help = "how compact moments are rounded when stored: to nearest, or stochastically (unbiased; the "
                 "random bits follow step, tensor and element, so runs stay reproducible)"});
  s.add({.name = "optim.overlap_backward", .type = T::kBool, .default_value = "false",
         .help = "start AdamW on each layer as soon as backward is done with it (needs optim.grad_clip=0)"});
  s.add({.name = "memory.device", .type = T::kBytes, .default_value = "0",
         .help = "device memory budget, e.g. 24GiB; 0 = the whole free memory of the GPU (on the cpu backend: no "
                 "limit)"});
  s.add({.name = "memory.host", .type = T::kBytes, .default_value = "0",
         .help = "pinned host memory budget; 0 = 80% of the memory this machine has available (MemAvailable, or "
                 "what the memory cgroup's limit leaves). Only what the plan places there is reserved, and a budget "
                 "beyond what is available is refused"});
  s.add({.name = "memory.nvme.path", .type = T::kString, .default_value = "",
         .help = "directory for the nvme tier (state that does not fit in host memory); empty = none. A relative "
                 "path is taken inside run.dir"});
  s.add({.name = "memory.nvme.size", .type = T::kBytes, .default_value = "0", .help = "nvme tier budget"});
  s.add({.name = "memory.chunk_size", .type = T::kString, .default_value = "auto",
         .help = "chunk size (e.g. 64MiB), or auto to pick the size that wastes the least padding"});
  s.add({.name = "memory.offload_activations", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "true", "false"}, .help = "copy the saved layer activations to host memory during forward"});
  s.add({.name = "memory.mlp_tile_tokens", .type = T::kString, .default_value = "auto",
         .help = "run each dense MLP and shared expert over tiles of this many tokens of the micro-batch, and "
                 "the routed experts (not in the fp8 recipe) over tiles of as many rows (a multiple of 128; 0: all "
                 "at once): their gate, "
                 "up and activation then take a tile's activation memory instead of the micro-batch's, and "
                 "backward recomputes them tile by tile (long sequences). auto: untiled when the plan fits so, "
                 "else the largest tile with which it fits"});
  s.add({.name = "memory.keep_activations", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "true", "false"},
         .help = "keep every layer's intermediates for backward instead of recomputing them (about a third less "
                 "compute, more device memory; bitwise the same results). auto: on cuda when they fit beside the "
                 "planned state, never on the cpu"});
  // The machine's rates the planner predicts with (offload/plan.h MachineRates). The defaults
  // are the H200 box of DESIGN §2; `strata bench machine` measures this machine and writes a
  // profile that --hardware FILE reads.
  s.add({.name = "hardware.profile", .type = T::kString, .default_value = "",
         .help = "where the hardware.* rates come from (a `strata bench machine` profile names itself here); empty: "
                 "the built-in H200 defaults"});
  s.add({.name = "hardware.gpu_tflops", .type = T::kFloat, .default_value = "781", .min = 1e-6,
         .help = "compute rate the backend's ops reach on the model's shapes, in 10^12 FLOP/s (GPU: dense bf16 "
                 "GEMM; cpu backend: what its ops reach on a decoder layer). A cpu plan with "
                 "hardware.cpu_tflops_by_width takes the rate at its width from that table instead (set it to [] "
                 "to plan with this one)"});
  s.add({.name = "hardware.cpu_tflops_by_width", .type = T::kStringList, .default_value = "",
         .help = "the cpu backend's compute rate by model width, as WIDTH:TFLOPS pairs (e.g. [128:0.07, 2048:0.15]; "
                 "strata bench machine measures them): a cpu plan takes the rate at its model's hidden size, "
                 "interpolated between the widths on either side (the nearest beyond them), in place of "
                 "hardware.gpu_tflops; empty: hardware.gpu_tflops"});
  s.add({.name = "hardware.h2d_gbps", .type = T::kFloat, .default_value = "55", .min = 1e-6,
         .help = "pinned host-to-device bandwidth in GB/s (10^9 bytes/s)"});
  s.add({.name = "hardware.d2h_gbps", .type = T::kFloat, .default_value = "55", .min = 1e-6,
         .help = "device-to-host bandwidth in GB/s"});
  s.add({.name = "hardware.both_gbps", .type = T::kFloat, .default_value = "87", .min = 1e-6,
         .help = "host-to-device and device-to-host at once, both directions together, in GB/s"});
  s.add({.name = "hardware.copy_latency_us", .type = T::kFloat, .default_value = "10", .min = 0,
         .help = "each chunk move's own cost beyond its bytes (a copy-stream task and its events), in microseconds"});
  s.add({.name = "hardware.copy_overlap", .type = T::kFloat, .default_value = "1", .min = 0, .max = 1,
         .help = "share of copy time that can run beside compute: 1 with a GPU's copy engines, near 0 on the cpu "
                 "backend, whose copies take the cores compute uses"});
  s.add({.name = "hardware.disk_read_gbps", .type = T::kFloat, .default_value = "1.7", .min = 1e-6,
         .help = "nvme tier read bandwidth in GB/s"});
  s.add({.name = "hardware.disk_write_gbps", .type = T::kFloat, .default_value = "1.7", .min = 1e-6,
         .help = "nvme tier write bandwidth in GB/s"});
  s.add({.name = "hardware.disk_both_gbps", .type = T::kFloat, .default_value = "0", .min = 0,
         .help = "nvme tier reads and writes at once, the two together, in GB/s (a disk may serve both faster than "
                 "either alone); 0: unknown, reads and writes take turns"});
  s.add({.name = "hardware.cpu_adam_gparams", .type = T::kFloat, .default_value = "3.66", .min = 1e-6,
         .help = "CPU AdamW rate (the SIMD kernel on all cores) in 10^9 parameters per second"});
  s.add({.name = "hardware.device_adam_gparams", .type = T::kFloat, .default_value = "150", .min = 1e-6,
         .help = "AdamW rate on the device tier in 10^9 parameters per second (GPU: HBM bandwidth / 28 B; cpu "
                 "backend: its device kernel on the cores)"});
  s.add({.name = "hardware.device_mem_gbps", .type = T::kFloat, .default_value = "4200", .min = 1e-6,
         .help = "device memory bandwidth (read + write) in GB/s, for the passes over every gradient (zeroing, "
                 "the norm)"});
  s.add({.name = "hardware.intra_node_gbps", .type = T::kFloat, .default_value = "150", .min = 1e-6,
         .help = "collective bus bandwidth per GPU between the ranks of one node in GB/s (what NCCL's tests call "
                 "busbw; NVLink-class; PCIe-only boxes reach ~20), for strata plan's data-parallel estimate"});
  s.add({.name = "hardware.inter_node_gbps", .type = T::kFloat, .default_value = "25", .min = 1e-6,
         .help = "collective bus bandwidth per GPU between nodes in GB/s (25 = a 200 Gb/s NIC per GPU), for strata "
                 "plan's data-parallel estimate"});
  // What only a run can tell the planner.
  s.add({.name = "plan.experts_reached", .type = T::kStringList, .default_value = "",
         .help = "MoE models: the share of each MoE layer's experts that a micro-batch's tokens reach, which "
                 "decides the experts' traffic in the plan (experts no token reaches are not fetched): one share "
                 "for every MoE layer, or a list with one per MoE layer. Empty: uniform routing's expectation, "
                 "1 - (1 - K/E)^tokens, what a trained, balanced router gives. A run reports what it measured "
                 "(metrics.jsonl's experts_reached_by_layer; the step line's moe note gives their mean)"});
  s.add({.name = "ckpt.every", .type = T::kInt, .default_value = "0", .min = 0,
         .help = "save a checkpoint every N steps (0 = only when stopped by SIGINT/SIGTERM)"});
  s.add({.name = "ckpt.dir", .type = T::kString, .default_value = "",
         .help = "checkpoint directory; empty = RUN_DIR/checkpoints"});
  s.add({.name = "ckpt.keep_last", .type = T::kInt, .default_value = "3", .min = 0,
         .help = "committed checkpoints to keep (0 = all)"});
  s.add({.name = "ckpt.keep_best", .type = T::kBool, .default_value = "false",
         .help = "save each evaluation (data.eval_paths) that has the lowest eval loss so far, name it in "
                 "CKPT_DIR/best and keep it beside ckpt.keep_last"});
  s.add({.name = "ckpt.if_busy", .type = T::kString, .default_value = "wait", .choices = {"wait", "skip"},
         .help = "when a save is due while the previous one is still being written"});
  s.add({.name = "ckpt.staging", .type = T::kBytes, .default_value = "64MiB", .min = 65536,
         .help = "host memory a save may use besides the state: pieces being written, and parts the optimizer "
                 "is about to change before they are written"});
  s.add({.name = "run.dir", .type = T::kString, .default_value = "runs/default",
         .help = "where metrics.jsonl, config.yaml and (by default) checkpoints are written. Unset: a new "
                 "runs/default/version_N per run (--resume auto continues the newest). Set: exactly that "
                 "folder, refused if it holds another run unless resumed"});
  s.add({.name = "run.export", .type = T::kString, .default_value = "",
         .help = "directory for a Hugging Face export (config.json + safetensors) after the last step; empty = none"});
  s.add({.name = "run.export_merged", .type = T::kBool, .default_value = "false",
         .help = "with train.method=lora: run.export is the model with the adapters merged into its weights (a "
                 "plain Hugging Face model) instead of the PEFT adapter"});
  s.add({.name = "run.export_dtype", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "f32", "bf16", "f16"},
         .help = "dtype of run.export's weights (and its config.json torch_dtype); auto = the precision of the "
                 "weights the run started from (model.from / model.init, or the checkpoint it resumes), f32 for a "
                 "random init"});
  s.add({.name = "run.log_every", .type = T::kInt, .default_value = "1", .min = 1, .help = "print a step line every N steps"});
  s.add({.name = "run.device", .type = T::kString, .default_value = "auto", .choices = {"auto", "cpu", "cuda"},
         .help = "where training computes; the state is paged across memory.device/host/nvme either way. cuda: on "
                 "GPU 0 in the bf16 recipe (attention head_dim 64 or 128). cpu: on the CPU in train.precision. "
                 "auto: cuda when this build has it, a GPU is visible and the model runs and fits there; cpu "
                 "otherwise (the log says why)"});
  s.add({.name = "run.log_level", .type = T::kString, .default_value = "info",
         .choices = {"debug", "info", "warn", "error"}, .help = "log verbosity"});
  // Data parallelism (src/parallel): the ranks come from the launcher's environment (torchrun,
  // mpirun, srun); these keys say how they meet and talk.
  s.add({.name = "parallel.backend", .type = T::kString, .default_value = "auto",
         .choices = {"auto", "gloo", "nccl"},
         .help = "collectives between ranks when launched as several processes: gloo (TCP; the cpu backend), nccl "
                 "(GPUs); auto: nccl on cuda, gloo on the cpu"});
  s.add({.name = "parallel.rendezvous", .type = T::kString, .default_value = "",
         .help = "a directory every rank can reach (a shared filesystem across nodes) where the ranks find each "
                 "other, one subfolder per launch (named by the launcher's job id); empty: /tmp/strata-rendezvous "
                 "on one node, required with several"});
  s.add({.name = "parallel.overlap_comm", .type = T::kBool, .default_value = "true",
         .help = "overlap the ranks' collectives with compute: at ZeRO 0 and 1 each layer's gradients are summed "
                 "on a thread of their own as soon as the step's last micro-batch's backward is done with them; at "
                 "ZeRO 2 and 3 each layer's gradient sums and weight gathers run on a communication stream, the "
                 "next layer's gather while this one computes (false: every collective on the compute path); the "
                 "results are the same bits either way. With parallel.expert_parallel at ZeRO 2 and 3 only"});
  s.add({.name = "parallel.timeout_s", .type = T::kFloat, .default_value = "300", .min = 1, .max = 86400,
         .help = "seconds a collective waits for the other ranks before the run stops with an error naming the "
                 "operation (a rank died or hangs)"});
  // What-if keys for `strata plan` (strata train takes its world from the launcher's environment;
  // of these it reads parallel.zero).
  s.add({.name = "parallel.world_size", .type = T::kInt, .default_value = "1", .min = 1, .max = 1 << 20,
         .help = "ranks (GPUs) strata plan plans for; strata train ignores it and reads its world from the "
                 "launcher's environment"});
  s.add({.name = "parallel.ranks_per_node", .type = T::kInt, .default_value = "8", .min = 1, .max = 1 << 20,
         .help = "ranks per node strata plan assumes (capped at parallel.world_size): a world within one node "
                 "talks at hardware.intra_node_gbps, a larger one at hardware.inter_node_gbps"});
  s.add({.name = "parallel.zero", .type = T::kString, .default_value = "auto", .choices = {"auto", "0", "1", "2", "3"},
         .help = "what is sharded over the data-parallel ranks: 0 nothing, 1 master weights and Adam moments, 2 "
                 "also gradients, 3 also the parameters' compute copy. strata plan: auto is the lowest level that "
                 "fits the budgets per rank. strata train runs every level (auto: 1; each rank owns a range of every "
                 "tensor)"});
  s.add({.name = "parallel.expert_parallel", .type = T::kInt, .default_value = "1", .min = 1, .max = 1 << 20,
         .help = "MoE models: split the routed experts of every layer over groups of this many ranks (consecutive "
                 "ranks; it must divide the world and the expert count); each rank computes its experts for the "
                 "tokens of its whole group, sent to it and back with all-to-all. 1: every rank computes every "
                 "expert of its own tokens"});
  s.add({.name = "parallel.context_parallel", .type = T::kInt, .default_value = "1", .min = 1, .max = 1 << 16,
         .help = "long sequences: split each sequence over groups of this many consecutive ranks (it must divide the "
                 "world, and twice it train.seq_len). Rank r of a group of N takes chunks r and 2N-1-r of the "
                 "sequence's 2N, so causal work is even; attention runs as a ring passing keys and values from rank "
                 "to rank, and everything else stays on the rank's own tokens, so each rank's activations are a 1/N "
                 "share. The groups' gradients add up as data-parallel ranks' do. The CPU backend only so far; not "
                 "with data.packing=document or parallel.expert_parallel"});
  return s;
}

}  // namespace

const ConfigSchema& train_schema() {
  static const ConfigSchema schema = build_schema();
  return schema;
}

const char* embedded_default_config() {
  return R"(# The embedded default: a 0.85M-parameter Llama learns Debian's license texts byte by byte.
model:
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
memory:              # small on purpose: every kind of state pages through host and nvme
  device: 24MiB
  host: 10MiB
  nvme: {path: nvme, size: 64MiB}   # inside the run's folder
run:
  log_every: 10
)";
}

Result<TrainConfig> make_train_config(const Config& c) {
  TrainConfig t;
  t.model_preset = c.get_string("model.preset");
  t.model_config = c.get_string("model.config");
  t.model_init = c.get_string("model.init");
  t.model_from = c.get_string("model.from");
  if (!t.model_from.empty() && (!t.model_config.empty() || !t.model_init.empty()))
    return Status::InvalidArgument(c.origin("model.from") + ": key 'model.from' replaces model.config and model.init; "
                                   "set only one of them");
  t.model_overrides = c.get_list("model.set");
  t.data_paths = c.get_list("data.paths");
  t.data_format = c.get_string("data.format");
  t.data_allow_empty_loss = c.get_bool("data.allow_empty_loss");
  t.data_packing = c.get_string("data.packing");
  t.data_eos_id = c.get_int("data.eos_id");
  if (t.data_packing == "document" && t.data_eos_id < 0 && t.model_from.empty())
    return Status::InvalidArgument(c.origin("data.packing") +
                                   ": key 'data.packing' is document but data.eos_id is not set; set data.eos_id to "
                                   "the token id that ends each document (the tokenizer's eos_token), or name the "
                                   "model with model.from to take its tokenizer's");
  t.data_eval_paths = c.get_list("data.eval_paths");
  t.data_eval_fraction = c.get_float("data.eval_fraction");
  if (t.data_eval_fraction > 0 && t.data_eos_id < 0 && t.model_from.empty())
    return Status::InvalidArgument(c.origin("data.eval_fraction") +
                                   ": key 'data.eval_fraction' holds out whole documents, but data.eos_id is not set; "
                                   "set data.eos_id to the token id that ends each document (the tokenizer's "
                                   "eos_token), or name the model with model.from to take its tokenizer's");
  t.eval_every = c.get_int("train.eval_every");
  t.eval_steps = c.get_int("train.eval_steps");
  t.micro_batch = c.get_int("train.micro_batch");
  t.seq_len = c.get_int("train.seq_len");
  t.grad_accum = c.get_int("train.grad_accum");
  t.steps = c.get_int("train.steps");
  t.max_skipped_steps = c.get_int("train.max_skipped_steps");
  t.seed = static_cast<uint64_t>(c.get_int("train.seed"));
  t.lr = c.get_float("optim.lr");
  t.lr_schedule = c.get_string("optim.schedule");
  t.warmup_steps = c.get_int("optim.warmup_steps");
  t.min_lr_ratio = c.get_float("optim.min_lr_ratio");
  t.beta1 = c.get_float("optim.beta1");
  t.beta2 = c.get_float("optim.beta2");
  t.eps = c.get_float("optim.eps");
  t.weight_decay = c.get_float("optim.weight_decay");
  t.grad_clip = c.get_float("optim.grad_clip");
  t.mtp_weight = c.get_float("train.mtp_weight");
  t.lora = c.get_string("train.method") == "lora";
  t.model_adapter = c.get_string("model.adapter");
  // Read whatever the method (strata plan sets full fine-tuning beside LoRA).
  t.lora_config.rank = c.get_int("lora.rank");
  t.lora_config.alpha = c.get_float("lora.alpha");
  t.lora_config.dropout = c.get_float("lora.dropout");
  ASSIGN_OR_RETURN(t.lora_config.targets, model::parse_lora_targets(c.get_list("lora.targets"), c.origin("lora.targets")));
  ASSIGN_OR_RETURN(t.lora_config.init, model::parse_lora_init(c.get_string("lora.init"), c.origin("lora.init")));
  if (!t.lora && !t.model_adapter.empty()) {
    return Status::InvalidArgument(c.origin("model.adapter") + ": key 'model.adapter' starts LoRA adapters; set "
                                   "train.method=lora to train them");
  } else if (!t.lora && t.run_export_merged) {
    return Status::InvalidArgument(c.origin("run.export_merged") + ": key 'run.export_merged' merges LoRA "
                                   "adapters; it needs train.method=lora");
  }
  t.overlap_backward = c.get_bool("optim.overlap_backward");
  t.precision_auto = c.get_string("train.precision") == "auto";
  t.precision = parse_precision(c.get_string("train.precision")).value_or(Precision::kFp32);
  if (const std::string base = c.get_string("lora.base"); base != "auto") {
    // The base's format is the recipe's compute copy: bf16, fp8, or the bf16 recipe over NF4.
    if (!t.lora)
      return Status::InvalidArgument(c.origin("lora.base") + ": key 'lora.base' is the frozen base's format; it "
                                     "needs train.method=lora");
    const Precision wanted = *parse_precision(base);
    if (!t.precision_auto && t.precision != wanted)
      return Status::InvalidArgument(fmt::format(
          "{}: lora.base={} computes in the {} recipe but train.precision is {}; leave train.precision auto",
          c.origin("lora.base"), base, wanted == Precision::kNf4 ? "bf16" : base, precision_name(t.precision)));
    t.precision = wanted;
    t.precision_auto = false;
  }
  t.moments = kernels::parse_moment_format(c.get_string("optim.moments")).value_or(kernels::MomentFormat::kF32);
  t.stochastic_rounding = c.get_string("optim.moments_rounding") == "stochastic";
  if (t.overlap_backward && t.grad_clip > 0)
    return Status::InvalidArgument(c.origin("optim.overlap_backward") +
                                   ": optim.overlap_backward needs optim.grad_clip=0 (clipping needs the whole "
                                   "backward's gradient norm before any layer is updated)");
  t.memory_device = c.get_bytes("memory.device");
  t.memory_host = c.get_bytes("memory.host");
  t.nvme_path = c.get_string("memory.nvme.path");
  t.nvme_size = c.get_bytes("memory.nvme.size");
  if (c.get_string("memory.chunk_size") != "auto") {
    Result<uint64_t> cs = parse_bytes(c.get_string("memory.chunk_size"));
    if (!cs.ok() || *cs == 0 || *cs % 4096 != 0)
      return Status::InvalidArgument(c.origin("memory.chunk_size") + ": key 'memory.chunk_size': expected auto or a size "
                                     "that is a multiple of 4 KiB (e.g. 64MiB), got '" + c.get_string("memory.chunk_size") + "'");
    t.chunk_size = *cs;
  }
  t.offload_activations = c.get_string("memory.offload_activations");
  t.keep_activations = c.get_string("memory.keep_activations");
  if (const std::string tile = c.get_string("memory.mlp_tile_tokens"); tile != "auto") {
    char* end = nullptr;
    const long long v = std::strtoll(tile.c_str(), &end, 10);
    if (tile.empty() || *end != '\0' || v < 0 || v > (1ll << 24) || v % 128 != 0)
      return Status::InvalidArgument(c.origin("memory.mlp_tile_tokens") + ": key 'memory.mlp_tile_tokens': expected "
                                     "auto, 0 or a multiple of 128 up to 16777216 (the GPU's GEMM tiles and the fp8 "
                                     "recipe's token blocks), got '" + tile + "'");
    t.mlp_tile_tokens = v;
  }
  if (!t.nvme_path.empty() && t.nvme_size == 0)
    return Status::InvalidArgument(c.origin("memory.nvme.path") + ": memory.nvme.path is set but memory.nvme.size is 0; "
                                   "give the nvme tier a budget (e.g. memory.nvme.size=500GiB)");
  t.gpu_flops = c.get_float("hardware.gpu_tflops") * 1e12;
  for (const std::string& pair : c.get_list("hardware.cpu_tflops_by_width")) {
    const size_t colon = pair.find(':');
    char* end = nullptr;
    const std::string width_text = pair.substr(0, colon);
    const long long width = colon == std::string::npos ? 0 : std::strtoll(width_text.c_str(), &end, 10);
    const bool width_ok = colon != std::string::npos && end != nullptr && *end == '\0' && width > 0;
    const std::string rate_text = width_ok ? pair.substr(colon + 1) : "";
    const double tflops = width_ok ? std::strtod(rate_text.c_str(), &end) : 0;
    const bool rate_ok = width_ok && !rate_text.empty() && *end == '\0' && std::isfinite(tflops) && tflops > 0;
    const bool ascending = t.cpu_flops_by_width.empty() || t.cpu_flops_by_width.back().first < width;
    if (!rate_ok || !ascending)
      return Status::InvalidArgument(c.origin("hardware.cpu_tflops_by_width") +
                                     ": key 'hardware.cpu_tflops_by_width': expected WIDTH:TFLOPS pairs with widths "
                                     "ascending and rates above 0 (e.g. [128:0.07, 2048:0.15]), got '" + pair + "'");
    t.cpu_flops_by_width.emplace_back(width, tflops * 1e12);
  }
  t.h2d_bytes_per_s = c.get_float("hardware.h2d_gbps") * 1e9;
  t.d2h_bytes_per_s = c.get_float("hardware.d2h_gbps") * 1e9;
  t.disk_read_bytes_per_s = c.get_float("hardware.disk_read_gbps") * 1e9;
  t.disk_write_bytes_per_s = c.get_float("hardware.disk_write_gbps") * 1e9;
  t.disk_both_bytes_per_s = c.get_float("hardware.disk_both_gbps") * 1e9;
  t.cpu_adam_params_per_s = c.get_float("hardware.cpu_adam_gparams") * 1e9;
  t.both_bytes_per_s = c.get_float("hardware.both_gbps") * 1e9;
  t.copy_overlap = c.get_float("hardware.copy_overlap");
  t.copy_latency_s = c.get_float("hardware.copy_latency_us") * 1e-6;
  t.device_adam_params_per_s = c.get_float("hardware.device_adam_gparams") * 1e9;
  t.device_memory_bytes_per_s = c.get_float("hardware.device_mem_gbps") * 1e9;
  t.hardware_profile = c.get_string("hardware.profile");
  if (t.hardware_profile.empty()) {
    // Rates given key by key: say where the first one came from.
    for (const ConfigKey& k : train_schema().keys()) {
      if (k.name.rfind("hardware.", 0) != 0 || !c.is_set(k.name)) continue;
      t.hardware_profile = "hardware.* keys (" + c.origin(k.name) + "), the built-in defaults for the rest";
      break;
    }
  }
  t.run_dir = c.get_string("run.dir");
  t.run_dir_named = c.is_set("run.dir");
  t.ckpt_every = c.get_int("ckpt.every");
  t.ckpt_dir = c.get_string("ckpt.dir");
  t.ckpt_dir_named = !t.ckpt_dir.empty();
  if (t.ckpt_dir.empty()) t.ckpt_dir = t.run_dir + "/checkpoints";
  t.ckpt_keep_last = c.get_int("ckpt.keep_last");
  t.ckpt_keep_best = c.get_bool("ckpt.keep_best");
  t.ckpt_skip_if_busy = c.get_string("ckpt.if_busy") == "skip";
  t.ckpt_staging = c.get_bytes("ckpt.staging");
  t.run_export = c.get_string("run.export");
  t.run_export_dtype = c.get_string("run.export_dtype");
  t.run_export_merged = c.get_bool("run.export_merged");
  t.log_every = c.get_int("run.log_every");
  t.device = c.get_string("run.device");
  t.log_level = c.get_string("run.log_level");
  t.parallel_backend = c.get_string("parallel.backend");
  t.parallel_rendezvous = c.get_string("parallel.rendezvous");
  t.parallel_timeout_s = c.get_float("parallel.timeout_s");
  t.parallel_overlap_comm = c.get_bool("parallel.overlap_comm");
  t.parallel_expert = c.get_int("parallel.expert_parallel");
  t.parallel_context = c.get_int("parallel.context_parallel");
  t.plan_world_size = c.get_int("parallel.world_size");
  t.plan_ranks_per_node = c.get_int("parallel.ranks_per_node");
  t.plan_zero = c.get_string("parallel.zero") == "auto" ? -1 : std::stoi(c.get_string("parallel.zero"));
  t.intra_node_bytes_per_s = c.get_float("hardware.intra_node_gbps") * 1e9;
  for (const std::string& text : c.get_list("plan.experts_reached")) {
    char* end = nullptr;
    const double share = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(share >= 0 && share <= 1))
      return Status::InvalidArgument(c.origin("plan.experts_reached") + ": key 'plan.experts_reached': '" + text +
                                     "' is not a share between 0 and 1 (e.g. 0.7, or [0.9, 0.6] per MoE layer)");
    t.experts_reached.push_back(share);
  }
  t.inter_node_bytes_per_s = c.get_float("hardware.inter_node_gbps") * 1e9;
  if (t.data_paths.empty())
    return Status::InvalidArgument(c.origin("data.paths") + ": key 'data.paths' is empty; name at least one token file");
  const bool evaluates = !t.data_eval_paths.empty() || t.data_eval_fraction > 0;
  if (!evaluates && (c.is_set("train.eval_every") || c.is_set("train.eval_steps"))) {
    const char* key = c.is_set("train.eval_every") ? "train.eval_every" : "train.eval_steps";
    return Status::InvalidArgument(c.origin(key) + ": key '" + key +
                                   "' is set but data.eval_paths is empty; name the token files to evaluate on, or "
                                   "hold out a share of the training documents with data.eval_fraction");
  }
  if (t.ckpt_keep_best && !evaluates)
    return Status::InvalidArgument(c.origin("ckpt.keep_best") +
                                   ": key 'ckpt.keep_best' needs evaluations; name the token files in data.eval_paths "
                                   "or set data.eval_fraction");
  if (t.data_eval_fraction > 0 && !t.data_eval_paths.empty())
    return Status::InvalidArgument(c.origin("data.eval_fraction") +
                                   ": keys 'data.eval_fraction' and 'data.eval_paths' both name evaluation data; "
                                   "set one of them");
  if (t.warmup_steps > t.steps)
    return Status::InvalidArgument(c.origin("optim.warmup_steps") + ": key 'optim.warmup_steps' (" +
                                   std::to_string(t.warmup_steps) + ") exceeds train.steps (" +
                                   std::to_string(t.steps) + ")");
  if (t.run_dir.empty()) return Status::InvalidArgument("key 'run.dir' is empty; name a directory for metrics");
  // Each key has its own bound, but their product sizes activations and counts tokens: keep it
  // small enough that token counts times any model dimension stay inside int64.
  constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 28, kMaxStepTokens = int64_t{1} << 40;
  if (t.micro_batch * t.seq_len > kMaxMicroBatchTokens)  // each at most 2^24: no overflow
    return Status::InvalidArgument(c.origin("train.micro_batch") + ": train.micro_batch x train.seq_len is " +
                                   std::to_string(t.micro_batch * t.seq_len) + " tokens; strata accepts at most " +
                                   std::to_string(kMaxMicroBatchTokens) + " per micro-batch");
  if (t.micro_batch * t.seq_len * t.grad_accum > kMaxStepTokens)  // at most 2^28 * 2^20
    return Status::InvalidArgument(c.origin("train.grad_accum") + ": train.micro_batch x train.seq_len x "
                                   "train.grad_accum is " + std::to_string(t.micro_batch * t.seq_len * t.grad_accum) +
                                   " tokens; strata accepts at most " + std::to_string(kMaxStepTokens) + " per step");
  return t;
}

Result<Config> load_train_config(const std::string& config_path, const std::vector<std::string>& overrides) {
  if (!config_path.empty()) return Config::load_file(train_schema(), config_path, overrides);
  bool names_model = false;
  for (const std::string& kv : overrides)
    for (const char* key : {"model.from=", "model.config=", "model.init=", "model.preset="})
      names_model = names_model || kv.rfind(key, 0) == 0;
  if (names_model) return Config::parse(train_schema(), "", "<defaults>", overrides);
  return Config::parse(train_schema(), embedded_default_config(), "<embedded default>", overrides);
}

}  // namespace strata
