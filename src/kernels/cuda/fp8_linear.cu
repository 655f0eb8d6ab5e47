// The fp8 recipe's linear layers on CUDA (kernels/cuda/fp8.h): quantise the operands, run the
// block-scaled GEMM into an fp32 product that already holds the added term, round once to bf16.
// The CPU reference is CpuFp8Ops (kernels/cpu/backend_fp8.cpp), which fake-quantises the same
// operands with the same tiles and rounds at the same points.
//
// The operand buffer, in 256-byte aligned sections (sized by kernels/fp8_operands.cpp, which
// must follow these sections), holds what one GEMM at a time needs
// (forward, data gradient, weight gradient run one after another on one stream):
//   forward        A codes (Mp, IC), A scales (Mp, L(IC)), C fp32 (Mp, OC)
//   data gradient  A codes (Mp, OC), A scales (Mp, L(OC)), W^T stored (IC, OC), C fp32 (Mp, IC)
//   weight grad.   dout^T codes (OC, Mp), scales (OC, L(N)); x^T codes (IC, Mp), scales (IC, L(N))
// Mp is the token count rounded up to 16, the rows past N zero codes: cuBLASLt's FP8 kernels
// want every dimension a multiple of 16, and an expert sees any number of tokens.
#include <string>

#include "core/round_up.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/fp8.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

uint64_t aligned_bytes(int64_t bytes) { return static_cast<uint64_t>(round_up(bytes, 256)); }

// Carves sections off the operand buffer in order.
class Sections {
 public:
  explicit Sections(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += aligned_bytes(count * static_cast<int64_t>(sizeof(T)));
    return p;
  }

 private:
  char* base_;
  uint64_t used_ = 0;
};

// c (Mp, cols) = add (N, cols, bf16; null: 0) + bias (cols; null: 0) for rows < N, 0 below.
__global__ void init_product_kernel(float* c, const bf16* add, const bf16* bias, int64_t N, int64_t Mp,
                                    int64_t cols) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= Mp * cols) return;
  const int64_t row = i / cols, col = i % cols;
  float v = 0.0f;
  if (row < N) {
    if (add != nullptr) v += to_float(add[i]);
    if (bias != nullptr) v += to_float(bias[col]);
  }
  c[i] = v;
}

std::string shape_text(int64_t N, int64_t IC, int64_t OC) {
  return "a linear layer of " + std::to_string(N) + " tokens, " + std::to_string(IC) + " in, " + std::to_string(OC) +
         " out";
}

void check_shape(const char* op, int64_t N, int64_t IC, int64_t OC) {
  CHECK(N >= 0 && IC > 0 && OC > 0);
  CHECK_MSG(IC % 16 == 0 && OC % 16 == 0, std::string(op) + ": the fp8 GEMMs need in and out widths that are "
                                                              "multiples of 16; " + shape_text(N, IC, OC));
}

// codes (Mp, cols) and scales (Mp, L(cols)) of x (N, cols) in 1 x 128 tiles, rows past N zero.
void quantize_padded_rows(uint8_t* codes, float* scales, const bf16* x, int64_t N, int64_t Mp, int64_t cols,
                          cudaStream_t stream) {
  quantize_rows_e4m3(codes, scales, x, N, cols, stream);
  if (Mp > N) {
    const int64_t L = fp8_blocks(cols);
    CUDA_CHECK(cudaMemsetAsync(codes + N * cols, 0, static_cast<size_t>((Mp - N) * cols), stream));
    CUDA_CHECK(cudaMemsetAsync(scales + N * L, 0, static_cast<size_t>((Mp - N) * L) * sizeof(float), stream));
  }
}

// c (Mp, cols) fp32 = the added term of a product (see init_product_kernel); false when there
// is none (the GEMM then overwrites c: beta 0).
bool init_product(float* c, const bf16* add, const bf16* bias, int64_t N, int64_t Mp, int64_t cols,
                  cudaStream_t stream) {
  if (add == nullptr && bias == nullptr) return false;
  init_product_kernel<<<static_cast<unsigned>(ceil_div(Mp * cols, kThreads)), kThreads, 0, stream>>>(c, add, bias, N,
                                                                                                      Mp, cols);
  CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

void fp8_linear_forward(Context& ctx, void* operands, bf16* out, const bf16* x, const uint8_t* weight,
                        const bf16* bias, const bf16* residual, int64_t N, int64_t IC, int64_t OC,
                        cudaStream_t stream) {
  check_shape("fp8_linear_forward", N, IC, OC);
  if (N == 0) return;
  const int64_t Mp = round_up(N, 16);
  Sections s(operands);
  auto* codes = s.take<uint8_t>(Mp * IC);
  auto* scales = s.take<float>(Mp * fp8_blocks(IC));
  auto* product = s.take<float>(Mp * OC);
  quantize_padded_rows(codes, scales, x, N, Mp, IC, stream);
  const bool added = init_product(product, residual, bias, N, Mp, OC, stream);
  const auto* w_scales = reinterpret_cast<const float*>(weight + fp8_matrix_scale_offset(OC, IC));
  fp8_gemm_nt(ctx, product, /*c_bf16=*/false, codes, scales, weight, w_scales, /*b_blocks=*/true, Mp, OC, IC,
              added ? 1.0f : 0.0f, stream);
  f32_to_bf16(out, product, N * OC, stream);  // rows past N are padding
}

void fp8_linear_backward(Context& ctx, void* operands, bf16* dx, bool accumulate_dx, float* dweight, float* dbias,
                         const bf16* dout, const bf16* x, const uint8_t* weight, int64_t N, int64_t IC, int64_t OC,
                         cudaStream_t stream) {
  check_shape("fp8_linear_backward", N, IC, OC);
  if (N == 0) return;
  const int64_t Mp = round_up(N, 16);
  if (dx != nullptr) {
    // dx (N, IC) = q(dout) (N, OC) @ W (OC, IC): K = OC, so the weight is read as W^T (IC, OC).
    Sections s(operands);
    auto* codes = s.take<uint8_t>(Mp * OC);
    auto* scales = s.take<float>(Mp * fp8_blocks(OC));
    auto* wt = s.take<uint8_t>(static_cast<int64_t>(fp8_matrix_bytes(IC, OC)));
    auto* product = s.take<float>(Mp * IC);
    quantize_padded_rows(codes, scales, dout, N, Mp, OC, stream);
    transpose_weight_e4m3(wt, weight, OC, IC, stream);
    const bool added = init_product(product, accumulate_dx ? dx : nullptr, nullptr, N, Mp, IC, stream);
    const auto* wt_scales = reinterpret_cast<const float*>(wt + fp8_matrix_scale_offset(IC, OC));
    fp8_gemm_nt(ctx, product, false, codes, scales, wt, wt_scales, /*b_blocks=*/true, Mp, IC, OC,
                added ? 1.0f : 0.0f, stream);
    f32_to_bf16(dx, product, N * IC, stream);
  }
  if (dweight != nullptr) {
    // dweight (OC, IC) += q(dout)^T (OC, tokens) @ q(x) (tokens, IC): K is the tokens, so both
    // operands are quantised down their columns and written transposed, K contiguous.
    Sections s(operands);
    auto* dout_codes = s.take<uint8_t>(OC * Mp);
    auto* dout_scales = s.take<float>(OC * fp8_blocks(Mp));
    auto* x_codes = s.take<uint8_t>(IC * Mp);
    auto* x_scales = s.take<float>(IC * fp8_blocks(Mp));
    quantize_cols_transposed_e4m3(dout_codes, dout_scales, dout, N, OC, Mp, stream);
    quantize_cols_transposed_e4m3(x_codes, x_scales, x, N, IC, Mp, stream);
    fp8_gemm_nt(ctx, dweight, false, dout_codes, dout_scales, x_codes, x_scales, /*b_blocks=*/false, OC, IC, Mp,
                1.0f, stream);
  }
  if (dbias != nullptr) bias_backward(ctx, dbias, dout, N, OC, stream);
}

}  // namespace strata::kernels::cuda
