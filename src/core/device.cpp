#include "core/device.h"

#include "core/cpu_device.h"
#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {

const char* device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

Result<std::unique_ptr<Device>> open_device(const std::string& kind, int index,
                                            uint64_t budget_bytes) {
  if (kind != "cpu" && kind != "cuda" && kind != "auto") {
    return Status::InvalidArgument("unknown device kind '" + kind +
                                   "'; expected \"cpu\", \"cuda\" or \"auto\"");
  }
  if (index < 0) {
    return Status::InvalidArgument("device index must be >= 0, got " + std::to_string(index));
  }
#if STRATA_HAVE_CUDA
  if (kind == "cuda" || (kind == "auto" && cuda_device_count() > 0)) {
    ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> device, CudaDevice::create(index, budget_bytes));
    return std::unique_ptr<Device>(std::move(device));
  }
#else
  if (kind == "cuda") {
    return Status::Unimplemented(
        "device 'cuda' requested but this strata was built without CUDA (STRATA_CUDA=OFF); "
        "rebuild with the CUDA toolkit or use device \"cpu\"");
  }
#endif
  ASSIGN_OR_RETURN(std::unique_ptr<CpuDevice> device, CpuDevice::create(index, budget_bytes));
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace strata
