#include "train/host_ram.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "ckpt/save_plan.h"
#include "core/units.h"
#include "model/params.h"
#include "train/metrics.h"
#include "train/paged_state.h"
#include "train/planning.h"

namespace strata {
namespace {

// The resident memory of `strata train` before it allocates anything for the run (the
// executable, libstdc++, OpenBLAS, gloo, spdlog, the allocator's first arenas), plus what the
// OpenBLAS and OpenMP threads add on the first steps. Measured on Debian 12 (glibc 2.36,
// OpenBLAS 0.3.21, release build, 2 cores): a peak of 10.0 MiB for a run refused before its
// engine, and 11-13 MiB left over beside the other items once small runs had trained. More
// threads (cores) add their stacks and buffers; 16 MiB leaves room for a few.
constexpr uint64_t kProcessBaseline = 16 * kMiB;
// What the CUDA libraries of a build with the CUDA backend touch as the process exits, beyond
// its peak while it ran (Debian 12, CUDA 13, measured on a cpu run: 61 MiB).
constexpr uint64_t kCudaLibrariesAtExit = 64 * kMiB;
#if STRATA_HAVE_CUDA
constexpr bool kCudaBuild = true;
#else
constexpr bool kCudaBuild = false;
#endif
// The CUDA runtime's and cuBLAS's host memory (context, module images, driver buffers): an
// estimate, not measured by strata's tests, which run without a GPU.
constexpr uint64_t kCudaRuntime = 512 * kMiB;
// One I/O engine: io_uring's rings (32 entries of 64 B, twice as many completions of 16 B) or
// the thread pool's stacks as far as they are touched, and the engine's bookkeeping.
constexpr uint64_t kIoEngine = 64 * kKiB;
// Several ranks' Gloo communicator: its context and loop thread, and per other rank a pair
// (socket buffers, state). An estimate with headroom over what was measured (see its item).
constexpr uint64_t kCommBase = 2 * kMiB;
constexpr uint64_t kCommPerPeer = 128 * kKiB;
// The communication stream's thread and communicator (ZeRO-2 and 3 overlapped): an estimate
// with headroom (worlds 2 and 4, cpu backend: up to 0.2 MiB above the items without it).
constexpr uint64_t kCommStream = 1 * kMiB;
// A safetensors reader's index: about this much per tensor (name, shape, offsets).
constexpr uint64_t kReaderIndexPerTensor = 512;
// Loading weights converts non-F32 tensors through a staging buffer of at most this much
// (model/safetensors.h ReaderOptions::piece_bytes).
constexpr uint64_t kWeightPiece = 64 * kMiB;
// A resume hashes each checkpoint file through an 8 MiB buffer and converts bf16 tensors
// through 2 MiB (ckpt/reader.cpp).
constexpr uint64_t kResumeBuffers = 10 * kMiB;

std::string bytes(uint64_t n) { return format_bytes(n); }

}  // namespace

uint64_t HostRamPlan::pinned_tier() const {
  uint64_t pinned = 0;
  for (const HostRamItem& i : items)
    if (i.name == "chunks" || i.name == "staging") pinned += i.pinned;
  return pinned;
}

uint64_t HostRamPlan::peak() const {
  uint64_t sum = 0;
  for (const HostRamItem& i : items) sum += i.bytes;
  return sum - std::min(sum, load_overlap);
}

uint64_t HostRamPlan::pinned() const {
  uint64_t sum = 0;
  for (const HostRamItem& i : items) sum += i.pinned;
  return sum;
}

uint64_t HostRamPlan::reclaimable() const {
  uint64_t sum = 0;
  for (const HostRamItem& i : items) sum += i.reclaimable ? i.bytes : 0;
  return sum;
}

uint64_t HostRamPlan::bytes_of(const std::string& name) const {
  for (const HostRamItem& i : items)
    if (i.name == name) return i.bytes;
  return 0;
}

HostRamData host_ram_data(const TokenDataset& dataset, int64_t windows) {
  namespace fs = std::filesystem;
  HostRamData d;
  d.windows = static_cast<uint64_t>(std::max<int64_t>(windows, 0));
  if (dataset.has_masks()) d.mask_bytes = static_cast<uint64_t>(dataset.num_tokens());
  std::error_code ec;
  for (int64_t i = 0; i < dataset.num_sources(); ++i) {
    const fs::path path = dataset.source(i).path();
    const uintmax_t size = fs::file_size(path, ec);
    if (!ec) d.mapped_bytes += size;
    // A Megatron pair's .idx is read into memory (sequence starts and offsets).
    const uintmax_t idx = fs::file_size(fs::path(path).replace_extension(".idx"), ec);
    if (!ec && path.extension() == ".bin") d.index_bytes += idx;
  }
  return d;
}

uint64_t process_baseline_bytes(DeviceKind device) {
  // A build with the CUDA backend maps cuBLAS and the CUDA libraries at start, about 160 MiB
  // resident even for a cpu run: the process's own peak so far (in whole MiB, so that two plans
  // in a row agree) covers that, and the threads of the first steps fit under it. Those
  // libraries touch about 60 MiB more when the process exits (measured: `strata plan` peaks at
  // 222 MiB after 161 MiB when it planned), which is the run's peak unless the run is larger.
  const uint64_t so_far = (peak_resident_bytes() + kMiB - 1) / kMiB * kMiB;
  const uint64_t at_exit = kCudaBuild ? kCudaLibrariesAtExit : 0;
  return std::max(kProcessBaseline, so_far + at_exit) + (device == DeviceKind::kCuda ? kCudaRuntime : 0);
}

HostRamPlan plan_host_ram(const model::ModelConfig& mc, const TrainConfig& t, const Plan& plan, DeviceKind device,
                          const HostRamData& data, uint64_t process_bytes) {
  HostRamPlan ram;
  const model::ParamLayout layout(mc);
  const bool cuda = device == DeviceKind::kCuda;
  const Precision precision = planned_precision(t, device);
  const bool has_nvme = !t.nvme_path.empty() && t.nvme_size > 0;

  // The host tier: slots of one chunk for the state, and beside them the staging slots.
  PagedStateOptions po;
  po.host_bytes = t.memory_host;
  po.nvme_bytes = has_nvme ? t.nvme_size : 0;
  po.chunk_bytes = t.chunk_size;
  po.offload_activations = plan.offload_activations;
  po.activation_tokens = t.rank_tokens();
  po.precision = precision;
  po.moments = t.moments;
  // A data-parallel rank's share, as the plan places it (its sliced kinds hold its ranges).
  if (plan.placement.num_groups() == static_cast<int>(layout.num_layers()) + 2) {
    po.placement = plan.placement;
    po.rank = std::clamp(t.dp_rank, 0, std::max(plan.placement.world(), 1) - 1);
  }
  const HostTierSize tier = PagedState::host_tier_size(layout, po);
  const uint64_t chunk = tier.chunk_bytes;
  // Pinned: cudaHostAlloc on cuda; on the cpu, registering with io_uring (an nvme tier) locks it.
  const bool tier_pinned = cuda || has_nvme;
  // Saved activations the plan homes on nvme pass through the staging slot, not slots of their own.
  const int64_t act_at_host = plan.placement.activation_host_chunks();
  const uint64_t act_slots = act_at_host >= 0 ? std::min<uint64_t>(tier.activation_chunks, static_cast<uint64_t>(act_at_host))
                                              : tier.activation_chunks;
  const uint64_t staging = std::min(tier.reserved_bytes, (act_slots + tier.staging_chunks) * chunk);
  // A pinned tier is resident whole. Otherwise only the slots written are: those of the state
  // homed there, those the optimizer updates there of state homed on the device (they stay as
  // copies), and the few a pass over the state (loading, restoring) goes through at a time
  // (PagedState::fill_kind sends each slice home after it).
  const uint64_t reserved_chunks = tier.reserved_bytes - staging;
  const uint64_t written = tier.host_home_chunks + tier.host_update_chunks + tier.pass_chunks;
  const uint64_t chunks = tier_pinned ? reserved_chunks : std::min(reserved_chunks, written * chunk);
  const uint64_t state_slots = tier.state_chunks + tier.activation_chunks;
  const uint64_t rounding = state_slots * chunk > tier.state_bytes ? state_slots * chunk - tier.state_bytes : 0;
  ram.items.push_back({"chunks", chunks, tier_pinned ? chunks : 0, false,
                       !chunk ? std::string("no host tier")
                       : chunks < reserved_chunks
                           ? fmt::format("{} slots of {}: {} for the state homed here, {} the optimizer updates "
                                         "here, {} passing through",
                                         chunks / chunk, bytes(chunk), tier.host_home_chunks, tier.host_update_chunks,
                                         tier.pass_chunks)
                           : fmt::format("{} slots of {} for the state, {} of it padding and slot rounding",
                                         chunks / chunk, bytes(chunk), bytes(std::min(rounding, chunks)))
});
  ram.items.push_back({"staging", staging, tier_pinned ? staging : 0, false,
                       fmt::format("{} saved-activation slots{}, {} nvme staging slot", act_slots,
                                   act_slots < tier.activation_chunks
                                       ? fmt::format(" ({} more on nvme)", tier.activation_chunks - act_slots)
                                       : std::string(),
                                   tier.staging_chunks)});

  // On the cpu backend the device is host memory: its arena holds the device tier's slots and the
  // activations, as far as the budget lets them grow (pages are committed as they are touched).
  if (!cuda) {
    const uint64_t all_chunks = (tier.state_chunks + tier.activation_chunks) * chunk;
    const uint64_t device = std::min(t.memory_device, all_chunks + plan.device.act);
    ram.items.push_back({"device", device, 0, false,
                         fmt::format("the cpu device's memory: up to {} of chunks and {} of activations",
                                     bytes(std::min(t.memory_device, all_chunks)), bytes(plan.device.act))});
  }

  // The bf16 recipe emulated on the cpu widens each op's bf16 operands into fp32 temporaries on
  // the heap (kernels/cpu/backend_bf16.cpp): at worst a linear layer's backward, holding its
  // input, output gradient and result over N tokens and its weight and weight gradient. The fp8
  // recipe (backend_fp8.cpp) holds two more quantised copies of the token operands.
  uint64_t scratch = 0;
  if (!cuda && precision != Precision::kFp32) {
    const uint64_t N = static_cast<uint64_t>(t.rank_tokens());
    const uint64_t wide = static_cast<uint64_t>(std::max({mc.hidden_size, mc.intermediate_size, mc.q_dim()}));
    const uint64_t narrow = static_cast<uint64_t>(mc.hidden_size);
    // LoRA's ops widen their input, output gradient and data gradient too, beside its dropout copy.
    const uint64_t token_operands = (precision == Precision::kFp8 ? 5 : 3) + (mc.lora.enabled() ? 3 : 0);
    // An nf4 base's weight is decoded into fp32, rounded into bf16 and widened again: a matrix more.
    const uint64_t matrices = precision == Precision::kNf4 ? 3 : 2;
    scratch = sizeof(float) * (token_operands * N * wide + matrices * wide * narrow);
  }
  ram.items.push_back({"compute", scratch, 0, false,
                       scratch ? fmt::format("fp32 temporaries of the {} ops emulated on the cpu", precision_name(precision))
                               : std::string("none outside the device's memory")});

  // The checkpoint writer allocates ckpt.staging at the first save and keeps it; every byte it
  // writes (fp32 weights and both Adam moments: 12 bytes per parameter) passes through a slot of
  // it and is hashed through one more piece of scratch, so pages beyond those stay untouched.
  uint64_t ckpt = 0;
  const uint64_t piece = ckpt::piece_bytes_for_staging(t.ckpt_staging);
  if (t.ckpt_every > 0) {
    const uint64_t saved = 12 * static_cast<uint64_t>(layout.total_size());
    uint64_t extra = 0;  // the MoE routers' balancing bias, copied for each save
    if (mc.has_selection_bias())
      extra = static_cast<uint64_t>(mc.num_blocks()) * static_cast<uint64_t>(mc.num_experts) * sizeof(float);
    ckpt = std::min(t.ckpt_staging / piece * piece, saved + std::min(saved, piece)) + extra;
  }
  ram.items.push_back({"checkpoint", ckpt, 0, false,
                       ckpt ? fmt::format("ckpt.staging {} in pieces of {}, as far as a save's pieces fill it",
                                          bytes(t.ckpt_staging), bytes(piece))
                            : std::string("no periodic saves (a save after a signal stages ckpt.staging)")});

  const int engines = (has_nvme ? 1 : 0) + (t.ckpt_every > 0 ? 1 : 0);
  ram.items.push_back({"io", engines * kIoEngine, 0, false, fmt::format("{} I/O engines", engines)});

  // The loop's batch (inputs and targets of every micro-batch of a step), the loader's window
  // and its order of windows, loss masks and indexes; the token files are mapped.
  const uint64_t tokens = static_cast<uint64_t>(t.micro_batch * t.seq_len * t.grad_accum);
  const uint64_t loader = 2 * tokens * sizeof(int32_t) + static_cast<uint64_t>(t.seq_len + 1) * 5 +
                          data.windows * sizeof(int64_t) + data.mask_bytes + data.index_bytes;
  ram.items.push_back({"data", loader, 0, false,
                       fmt::format("batches {}, window order {}", bytes(2 * tokens * sizeof(int32_t)),
                                   bytes(data.windows * sizeof(int64_t)))});
  ram.items.push_back({"mapped data", data.mapped_bytes, 0, true, "token files, file pages the kernel can drop"});
  ram.items.push_back({"tokenizer", 0, 0, false, "none: strata train reads token ids"});

  // Loading: a tensor in row blocks is filled whole, then copied into its blocks, and so is every
  // tensor of a kind a rank holds its ranges of (sharded over the ranks) or stores compact (the
  // moments' encodings); a non-F32 source converts through a staging piece; a resume hashes and
  // converts through its buffers.
  const bool staged = (t.dp_world > 1 && t.plan_zero != 0) || t.moments != kernels::MomentFormat::kF32;
  uint64_t whole = 0, largest = 0;
  for (const model::TensorSpec& s : layout.tensors()) {
    if (s.num_blocks() > 1 || staged) whole = std::max(whole, static_cast<uint64_t>(s.numel) * sizeof(float));
    largest = std::max(largest, static_cast<uint64_t>(s.numel));
  }
  uint64_t reading = 0;
  std::string what = "initialised in place";
  if (!t.resume.empty()) {
    reading = kResumeBuffers;
    what = "resume buffers " + bytes(kResumeBuffers);
  } else if (!t.model_from.empty() || !t.model_init.empty()) {
    reading = std::min(kWeightPiece, largest * 2) + layout.tensors().size() * kReaderIndexPerTensor;
    what = "safetensors staging and index " + bytes(reading);
  }
  ram.items.push_back({"weights", reading + whole, 0, false,
                       whole ? what + fmt::format(", a tensor filled whole {}", bytes(whole)) : what});
  // A fresh run loads only the weights into the cpu device's memory (a resume restores every
  // kind): its other chunks and the activations are first written by the first step, after
  // the loading buffers are gone.
  if (!cuda && t.resume.empty()) {
    const uint64_t device = ram.bytes_of("device");
    const uint64_t loaded = std::min(device, plan.device.param + plan.device.master);
    ram.load_overlap = std::min(reading + whole, device - loaded);
  }
  // Several ranks: Gloo's connection to each other rank (its socket buffers and the pair's
  // state) and its loop thread (an estimate: ranks at worlds 2 to 4 on the cpu backend, 2 cores,
  // peaked 0.5 to 1.5 MiB above what the other items plan for a lone process).
  const int world = std::max(t.dp_world, static_cast<int>(t.plan_world_size));
  uint64_t comm = world > 1 ? kCommBase + static_cast<uint64_t>(world - 1) * kCommPerPeer : 0;
  // ZeRO-2 and 3 overlapped: a second communicator moves data, from the communication stream's
  // thread (its stack and allocator arena as far as touched, and that communicator's buffers).
  const bool stream = world > 1 && plan.zero >= 2 && overlaps_collectives(t, plan.zero);
  if (stream) comm += kCommStream;
  ram.items.push_back({"communication", comm, 0, false,
                       world > 1 ? fmt::format("connections to {} other ranks{}", world - 1,
                                               stream ? ", a communication stream" : "")
                                 : std::string("one process")});
  ram.items.push_back({"process", process_bytes ? process_bytes : process_baseline_bytes(device), 0, false,
                       cuda ? "executable, libraries, CUDA runtime (estimate)" : "executable and libraries"});
  return ram;
}

std::string format_host_ram(const HostRamPlan& ram) {
  // The items add up to the peak, less what loading holds in memory the step writes only later.
  std::string text = fmt::format("host RAM: peak {} (pinned {}{}):", bytes(ram.peak()), bytes(ram.pinned()),
                                 ram.load_overlap > 0 ? fmt::format("; less {} of weights loaded before the step "
                                                                    "writes the device's other state",
                                                                    bytes(ram.load_overlap))
                                                      : std::string());
  bool first = true;
  for (const HostRamItem& i : ram.items) {
    text += fmt::format("{} {} {}", first ? "" : ",", i.name, bytes(i.bytes));
    first = false;
  }
  return text;
}

std::string format_host_ram_items(const HostRamPlan& ram, const std::string& indent) {
  std::string text;
  for (const HostRamItem& i : ram.items)
    text += fmt::format("{}{} {}{}: {}\n", indent, i.name, bytes(i.bytes),
                        i.pinned ? " (pinned " + bytes(i.pinned) + ")" : std::string(), i.detail);
  return text;
}

namespace {

// The setting that shrinks an item, for the refusal's advice.
std::string setting_for(const std::string& item) {
  if (item == "chunks" || item == "staging") return "lower memory.host (with memory.nvme.* the rest pages to disk)";
  if (item == "device") return "lower memory.device (the cpu device's memory is host memory) or train.micro_batch";
  if (item == "compute" || item == "data") return "lower train.micro_batch or train.seq_len";
  if (item == "checkpoint") return "lower ckpt.staging";
  return "";
}

}  // namespace

Status check_host_ram(const HostRamPlan& ram, const HostMemory& machine) {
  const uint64_t needed = ram.peak() - ram.reclaimable();
  if (!machine.known || needed <= machine.available) return Status::OK();
  const HostRamItem* largest = nullptr;
  for (const HostRamItem& i : ram.items)
    if (!i.reclaimable && (largest == nullptr || i.bytes > largest->bytes)) largest = &i;
  return Status::OutOfMemory(fmt::format(
      "host memory: the run needs {} at its peak but this machine has {} available ({}); {}; the largest part is "
      "{} ({}): {}free memory",
      bytes(needed), bytes(machine.available), machine.source, format_host_ram(ram), largest->name,
      bytes(largest->bytes), setting_for(largest->name).empty() ? "" : setting_for(largest->name) + ", or "));
}

}  // namespace strata
