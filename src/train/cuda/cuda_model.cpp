#include "train/cuda/cuda_model.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_device.h"
#include "core/log.h"
#include "core/units.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/llama_cuda.h"

namespace strata {
namespace {

// The CUDA context, cuBLAS/cuBLASLt handles and allocator rounding are not in any table.
constexpr uint64_t kRuntimeMargin = 512ull << 20;

class CudaModel final : public ResidentModel {
 public:
  CudaModel(std::unique_ptr<model::CudaLlama> net, const OptimizerConfig& oc, std::string name)
      : net_(std::move(net)), name_(std::move(name)) {
    adam_.beta1 = oc.beta1;
    adam_.beta2 = oc.beta2;
    adam_.eps = oc.eps;
    adam_.weight_decay = oc.weight_decay;
    adam_.grad_clip = oc.grad_clip;
  }

  const model::ParamLayout& layout() const override { return net_->layout(); }
  std::string device_name() const override { return name_; }
  uint64_t resident_bytes() const override {
    return net_->param_state_bytes() + net_->activation_bytes() + kernels::cuda::Context::kDefaultScratchBytes +
           kernels::cuda::Context::kDefaultGemmWorkspaceBytes;
  }
  void* allocate_host(size_t bytes) override {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();  // a refused pinned allocation is not an error: the engine falls back
      return nullptr;
    }
    return p;
  }
  void free_host(void* p) override { CUDA_CHECK(cudaFreeHost(p)); }
  void load_params(const float* flat) override { net_->load_params(flat); }
  void store_params(float* flat) override { net_->store_params(flat); }
  void load_moments(const float* m, const float* v) override { net_->load_moments(m, v); }
  void store_moments(float* m, float* v) override { net_->store_moments(m, v); }
  void zero_grads() override { net_->zero_grads(); }
  Result<double> forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                  float grad_scale) override {
    return net_->forward_backward(inputs, targets, B, T, grad_scale);
  }
  Result<double> adamw_step(float lr) override {
    const double norm = net_->adamw_step(lr, adam_);
    // The update runs on; the step's timing (and a host copy right after) must see it finished.
    net_->synchronize();
    return norm;
  }
  int64_t step_count() const override { return net_->step_count(); }
  void set_step_count(int64_t steps) override { net_->set_step_count(steps); }

 private:
  std::unique_ptr<model::CudaLlama> net_;
  std::string name_;
  model::CudaAdamWConfig adam_;
};

}  // namespace

uint64_t cuda_model_bytes(const model::ModelConfig& config, int64_t micro_batch, int64_t seq_len,
                          bool keep_layer_activations) {
  return model::CudaLlama::param_state_bytes_for(config) +
         model::CudaLlama::activation_bytes_for(config, micro_batch * seq_len, keep_layer_activations) +
         kernels::cuda::Context::kDefaultScratchBytes + kernels::cuda::Context::kDefaultGemmWorkspaceBytes +
         kRuntimeMargin;
}

CudaMemoryPlan plan_cuda_memory(const model::ModelConfig& config, const CudaModelOptions& options) {
  CudaMemoryPlan p;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  p.budget_limits = options.budget_bytes > 0 && options.budget_bytes < free_bytes;
  p.available = p.budget_limits ? options.budget_bytes : free_bytes;
  p.keep_bytes = cuda_model_bytes(config, options.micro_batch, options.seq_len, true);
  p.recompute_bytes = cuda_model_bytes(config, options.micro_batch, options.seq_len, false);
  switch (options.activations) {
    case ActivationMode::kKeep: p.keep = true; break;
    case ActivationMode::kRecompute: p.keep = false; break;
    case ActivationMode::kAuto: p.keep = p.keep_bytes <= p.available; break;
  }
  p.fits = (p.keep ? p.keep_bytes : p.recompute_bytes) <= p.available;
  return p;
}

Result<std::unique_ptr<ResidentModel>> make_cuda_model(const model::ModelConfig& config, const OptimizerConfig& oc,
                                                       const CudaModelOptions& options) {
  const int count = cuda_device_count();
  if (count == 0) return Status::NotFound("no usable CUDA device (no GPU visible, or no driver)");
  RETURN_IF_ERROR(model::CudaLlama::supports(config));
  if (options.device < 0 || options.device >= count)
    return Status::InvalidArgument(fmt::format("CUDA device {} does not exist; this machine has {}", options.device, count));
  CUDA_CHECK(cudaSetDevice(options.device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
  if (prop.major < 8)
    return Status::Unimplemented(fmt::format("{} (compute capability {}.{}): the CUDA kernels need bf16 tensor cores "
                                             "(compute capability 8.0 or newer)",
                                             prop.name, prop.major, prop.minor));
  int shared_optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, options.device));
  const size_t shared_need = kernels::cuda::attention_shared_bytes(config.head_dim);
  if (shared_need > static_cast<size_t>(shared_optin))
    return Status::Unimplemented(fmt::format("{} offers {} of shared memory per block; the attention kernels for "
                                             "head_dim {} need {} (GPUs of compute capability 8.0 and newer have "
                                             "99 KiB or more)",
                                             prop.name, format_bytes(static_cast<uint64_t>(shared_optin)),
                                             config.head_dim, format_bytes(shared_need)));
  const CudaMemoryPlan mem = plan_cuda_memory(config, options);
  if (!mem.fits) {
    const int64_t tokens = options.micro_batch * options.seq_len;
    return Status::OutOfMemory(fmt::format(
        "the model's state and activations need {} of device memory ({} for parameters, gradients and Adam "
        "moments, {} for micro-batches of {} x {} tokens{}), and {} has {}{}; the CUDA engine keeps everything on "
        "the GPU: lower train.micro_batch, or use run.device=cpu, which pages the state through host memory and nvme",
        format_bytes(mem.keep ? mem.keep_bytes : mem.recompute_bytes),
        format_bytes(model::CudaLlama::param_state_bytes_for(config)),
        format_bytes(model::CudaLlama::activation_bytes_for(config, tokens, mem.keep)), options.micro_batch,
        options.seq_len, mem.keep ? ", every layer's kept" : ", layers recomputed in backward", prop.name,
        format_bytes(mem.available), mem.budget_limits ? " within memory.device" : " free"));
  }
  LOG_INFO("cuda: {} activations ({}; {} in all, {} {})",
           mem.keep ? "every layer keeps its" : "backward recomputes each layer's",
           format_bytes(model::CudaLlama::activation_bytes_for(config, options.micro_batch * options.seq_len,
                                                               mem.keep)),
           format_bytes(mem.keep ? mem.keep_bytes : mem.recompute_bytes), format_bytes(mem.available),
           mem.budget_limits ? "within memory.device" : "free");
  ASSIGN_OR_RETURN(std::unique_ptr<model::CudaLlama> net, model::CudaLlama::create(config, mem.keep));
  // The activation table now rather than at the first step, so that memory taken meanwhile by
  // others ends the run here with a message, and the start-up memory line counts it.
  RETURN_IF_ERROR(net->reserve_activations(options.micro_batch * options.seq_len));
  return std::unique_ptr<ResidentModel>(
      new CudaModel(std::move(net), oc, fmt::format("cuda:{} ({})", options.device, prop.name)));
}

}  // namespace strata
