// ResidentEngine: training with the whole state (parameters, gradients, Adam moments) resident
// in one memory, a GPU's for the CUDA model, with no paging. The model behind it exchanges
// its state with the host as flat fp32 buffers in ParamLayout order (ResidentModel).
//
// Checkpoints: a save first copies parameters and moments into host buffers (capture(), 12
// bytes per parameter, allocated at the first save and kept), which the checkpoint writer
// then writes in place while training goes on; the next capture waits until that save no
// longer reads them (the checkpointer's before_modify). Restores, the starting weights and
// exports go through the same host buffers (an export only through the parameters' 4 bytes per
// parameter). Not thread-safe.
#pragma once

#include <cstdint>
#include <array>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "core/status.h"
#include "train/engine.h"

namespace strata {

// A model with its training state in one memory. Host buffers hold layout().total_size()
// floats in ParamLayout order.
class ResidentModel {
 public:
  virtual ~ResidentModel() = default;
  virtual const model::ParamLayout& layout() const = 0;
  virtual std::string device_name() const = 0;
  // Bytes of memory the state and the activation workspace hold.
  virtual uint64_t resident_bytes() const = 0;

  // Host memory for the engine's copy of the state, at least 4 KiB aligned (pinned memory
  // for a GPU, so that copies run at full speed); null when it cannot be had, and the engine
  // falls back to ordinary memory. Freed with free_host.
  virtual void* allocate_host(size_t /*bytes*/) { return nullptr; }
  virtual void free_host(void* /*p*/) {}

  virtual void load_params(const float* flat) = 0;
  virtual void store_params(float* flat) = 0;
  virtual void load_moments(const float* m, const float* v) = 0;
  virtual void store_moments(float* m, float* v) = 0;

  virtual void zero_grads() = 0;
  // As TrainEngine::micro_batch.
  virtual Result<double> forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                          float grad_scale) = 0;
  // Clips the global gradient norm and applies one AdamW update (step count incremented
  // first); returns the pre-clip norm.
  virtual Result<double> adamw_step(float lr) = 0;
  virtual int64_t step_count() const = 0;
  virtual void set_step_count(int64_t steps) = 0;
};

class ResidentEngine final : public TrainEngine, private SavableState {
 public:
  explicit ResidentEngine(std::unique_ptr<ResidentModel> model);
  ~ResidentEngine() override;

  const model::ParamLayout& layout() const override { return model_->layout(); }
  SavableState& state() override { return *this; }
  std::string device_name() const override { return model_->device_name(); }
  std::string memory_summary() const override;

  Status zero_grads() override;
  Result<double> micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                             bool last, float lr) override;
  Result<double> step(float lr) override;
  EngineStats stats() const override;

 private:
  // SavableState. fill_kind writes through the host buffer of the kind into the model;
  // read_flat reads the state as it is now (refreshing the host copy when a step changed it).
  Status fill_kind(StateKind kind, const TensorFill& fill) override;
  Status read_flat(StateKind kind, uint64_t offset, uint64_t length, void* dst) override;
  Status capture() override;
  const void* flat_data(StateKind kind) const override;
  void set_before_modify(std::function<void(int group)> hook) override { before_modify_ = std::move(hook); }
  int64_t step_count() const override { return model_->step_count(); }
  void set_step_count(int64_t steps) override { model_->set_step_count(steps); }

  // The host buffer of kParam, kAdamM or kAdamV, allocated (4 KiB aligned) on first use.
  float* host(StateKind kind);
  // Copies the model's current parameters and/or moments into their host buffers where those
  // are stale, after letting a save that still reads them finish with them.
  void refresh_host(bool params, bool moments);
  void before_overwriting_host();

  struct HostBuffer {
    float* data = nullptr;
    bool from_model = false;  // allocate_host's, else std::aligned_alloc's
  };
  std::unique_ptr<ResidentModel> model_;
  HostBuffer host_[3];  // params, m, v
  std::array<bool, 3> current_{};  // each host buffer holds the model's state as it is now
  std::function<void(int group)> before_modify_;
};

}  // namespace strata
