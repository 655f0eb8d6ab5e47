// What `strata bench machine` measures on this machine for the planner (offload/plan.h
// MachineRates), each beside a reference measured in the same run, and the hardware profile
// (hardware.* keys) it writes for `strata plan --hardware FILE` and `strata train --hardware FILE`.
//
// Every figure is a median of a few timed repeats after a warm-up; quick mode shrinks the sizes
// and repeats (for tests) at the cost of noise. Not thread-safe; run one measurement at a time:
// each uses every core.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/io_engine.h"
#include "core/status.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/flat_access.h"
#include "offload/plan.h"

namespace strata {

struct MachineBenchOptions {
  std::string device = "cpu";  // cpu | cuda: the backend whose rates are measured
  bool quick = false;          // small sizes and fewer repeats (a few seconds in all)
  std::string disk_dir;        // where the nvme tier would live; empty: the disk is not measured
  // The shapes compute is measured on: one micro-batch of this model (the rate a backend's ops
  // reach depends on them; a GEMM alone does not predict a step on the CPU).
  model::ModelConfig model;
  int64_t micro_batch = 1;
  int64_t seq_len = 128;
  bool keep_activations = false;  // time the model as memory.keep_activations=true runs it
  // The widths (hidden sizes) the cpu backend's compute rate is also measured at, for plans of
  // other models than this one (hardware.cpu_tflops_by_width); empty: none.
  std::vector<int64_t> widths;
};

// One measured figure beside its reference, both in `unit`.
struct MachineFigure {
  std::string name;       // "h2d", ...
  double value = 0;
  std::string unit;       // "GB/s", "TFLOP/s", "Gparam/s"
  std::string reference;  // what the reference is
  double reference_value = 0;
};

// The compute rate at one model width (measure_compute_by_width).
struct WidthRate {
  int64_t width = 0;
  double flops_per_s = 0;
  double seconds = 0;  // one micro-batch of the probe
};

struct MachineProfile {
  MachineRates rates;
  std::vector<WidthRate> compute_by_width;  // ascending widths; cpu backend only
  std::vector<MachineFigure> figures;  // in the order printed
  std::string description;             // "strata bench machine, cpu backend, host X, 2026-12-01"
};

// Seconds of `fn` after one warm-up call: the median of `repeats` calls.
double median_seconds(int repeats, const std::function<void()>& fn);

// One micro-batch of the options' model (flat buffers, no paging, recompute) on the CPU
// backend, to time again and again: what measure_compute() times, and what a test times
// beside each step it measures, so that both see the machine in the same state.
class ComputeProbe {
 public:
  static Result<std::unique_ptr<ComputeProbe>> create(const MachineBenchOptions& options);
  // Seconds of one forward and backward.
  Result<double> run_once();
  double flops() const { return flops_; }  // of one micro-batch, as the planner counts them

 private:
  ComputeProbe() = default;
  // The model's parameters (all zero: the timing does not depend on their values) and
  // gradients, in flat buffers of its layout, and the access it reads them through.
  std::vector<float> params_, grads_;
  std::unique_ptr<model::FlatAccess> access_;
  std::unique_ptr<model::Model> net_;
  std::vector<int32_t> tokens_;
  int64_t B_ = 0, T_ = 0;
  double flops_ = 0;
};

// The compute rate the backend's ops reach: FLOPs of the planner's count (micro_batch_flops)
// over the median seconds of one micro-batch's forward and backward with recompute. On the
// CPU backend also measures how much of a copy stream's work hides behind that compute
// (MachineRates::copy_overlap): compute alone, copies alone, then both at once.
struct ComputeRate {
  double flops_per_s = 0;
  double copy_overlap = 1;
  double seconds = 0;  // one micro-batch
};
Result<ComputeRate> measure_compute(const MachineBenchOptions& options);

// The default widths: a few seconds of probes in quick mode, about a minute in all otherwise.
std::vector<int64_t> default_probe_widths(bool quick);
// The model a width is measured on: one Llama-shaped decoder layer of that hidden size (heads of
// 64, a quarter as many key/value heads, an MLP 3.5 times as wide) and a head over 8192 tokens,
// so that the layer's GEMMs and the head's weigh about as they do in the models people train.
model::ModelConfig width_probe_model(int64_t width);
// The cpu backend's compute rate on each width's probe model (2 x 256 tokens, recompute), as
// measure_compute counts it: a CPU's GEMMs speed up with their matrices, so a plan of a
// 1B-parameter model cannot take the rate of the 4-layer demo.
Result<std::vector<WidthRate>> measure_compute_by_width(const std::vector<int64_t>& widths, bool quick);

// Host <-> device copy bandwidth through the Device's copy streams, each way alone and both at
// once (two streams), of `bytes` per copy.
struct CopyRates {
  double h2d = 0, d2h = 0, both = 0;  // bytes/s
  double latency_s = 0;  // each copy's own cost beyond its bytes, from many small copies queued
};
Result<CopyRates> measure_copies(Device& device, uint64_t bytes, int repeats);

// A STREAM-like copy (memcpy split over all OpenMP threads, or on one thread when that is
// faster, as on a machine whose other cores are busy), bytes read + written per second: the
// bound every copy on this host's memory is measured against.
double measure_memcpy(uint64_t bytes, int repeats);

// Over tensors of these sizes (fp32 elements), one call per tensor as the optimizer makes
// them: the SIMD AdamW (kernels/adamw_simd.h, AdamW on host memory), the CPU backend's
// device-tier AdamW (cpu::adamw_step), in parameters per second, and the passes over the
// gradients (zeroing, then the sum of squares of the norm) in bytes read + written per second.
// Per-call costs (threads woken per tensor) are part of each rate, as they are of a step.
struct AdamRates {
  double simd = 0, device = 0, grad_passes = 0;
};
Result<AdamRates> measure_adamw(const std::vector<int64_t>& sizes, int repeats);

// Sequential O_DIRECT write then read of `size` bytes in `chunk` requests through `engine`,
// `buffers.size()` in flight (fsync inside the write's timing), in a temporary file in `dir`;
// then that file read back while a second one is written (both at once). The files are
// removed. Writes stamp each chunk with its index; reads check it.
struct DiskTiming {
  double write_s = 0, read_s = 0;
  double both_s = 0;  // `size` read from the file written while a second file of `size` is written
};
Result<DiskTiming> time_disk(IoEngine& engine, const std::string& dir, uint64_t size, uint64_t chunk,
                             const std::vector<char*>& buffers);
// Reads `size` bytes of `read_file` (written by stream_chunks) while writing `size` bytes to
// `write_file`, alternating requests, half the buffers (an even number) each.
Status stream_both(IoEngine& engine, int read_file, int write_file, uint64_t size, uint64_t chunk,
                   const std::vector<char*>& buffers);
// Moves `size` bytes through `engine` in chunk requests, one buffer per slot in flight.
Status stream_chunks(IoEngine& engine, int file, IoOp op, uint64_t size, uint64_t chunk,
                     const std::vector<char*>& buffers);

// Everything above, in order; figures name each rate and its reference.
Result<MachineProfile> bench_machine(const MachineBenchOptions& options);

// The profile as YAML (hardware.* keys with their units in comments) that --hardware reads.
std::string hardware_yaml(const MachineProfile& profile);

// The hardware.* keys of a profile file as key=value overrides (hardware.profile set to the
// file's path and its own description). InvalidArgument naming the file and key for anything
// but hardware.* keys; NotFound / IOError when it cannot be read.
Result<std::vector<std::string>> hardware_overrides(const std::string& path);

}  // namespace strata
