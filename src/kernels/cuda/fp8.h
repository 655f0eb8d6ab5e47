// The CUDA side of the fp8 recipe: E4M3 block quantisers and the block-scaled GEMM, with the
// numerics of kernels/fp8.h (OCP E4M3, satfinite round-to-nearest-even, power-of-two block
// scales). The quantisers give bitwise the codes and scales of kernels::cpu::quantize_*; the
// GEMM runs on cuBLASLt's FP8 block-scaling kernels (Hopper), whose accumulation inside a
// 128-block differs from ref::fp8_gemm_nt's, so it matches the reference within a bound
// (tests/gpu/fp8_parity_test.cpp says which).
//
// Every pointer is DEVICE memory, every launcher takes its stream last. Usable from C++
// (.cpp, C++20) and CUDA (.cu, C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.h"
#include "kernels/fp8.h"
#include "kernels/fp8_operands.h"

namespace strata::kernels::cuda {

// ---- quantisers (fp8_quant.cu) ---------------------------------------------------------------
// w (rows, cols) fp32 -> the stored form of kernels/fp8.h at `out` (fp8_matrix_bytes(rows, cols)
// bytes: codes, zero padding to 16 bytes, then fp8_blocks(rows) x fp8_blocks(cols) scales),
// 128 x 128 blocks. REQUIRES out 16-byte aligned.
void quantize_weight_e4m3(uint8_t* out, const float* w /*(rows,cols)*/, int64_t rows, int64_t cols,
                          cudaStream_t stream);

// x (rows, cols) -> codes (rows, cols) and scales (rows, fp8_blocks(cols)) row-major: 1 x 128
// tiles along each row (the operand whose K runs along its rows).
void quantize_rows_e4m3(uint8_t* codes /*(rows,cols)*/, float* scales /*(rows,L)*/, const bf16* x /*(rows,cols)*/,
                        int64_t rows, int64_t cols, cudaStream_t stream);
void quantize_rows_e4m3(uint8_t* codes /*(rows,cols)*/, float* scales /*(rows,L)*/, const float* x /*(rows,cols)*/,
                        int64_t rows, int64_t cols, cudaStream_t stream);

// The same with 128 x 1 tiles down each column: scales (fp8_blocks(rows), cols) row-major (the
// operands of the weight-gradient GEMM, whose K is the token dimension). Its codes keep the
// tokens strided; the GEMM reads the transposed form below.
void quantize_cols_e4m3(uint8_t* codes /*(rows,cols)*/, float* scales /*(L,cols)*/, const bf16* x /*(rows,cols)*/,
                        int64_t rows, int64_t cols, cudaStream_t stream);
void quantize_cols_e4m3(uint8_t* codes /*(rows,cols)*/, float* scales /*(L,cols)*/, const float* x /*(rows,cols)*/,
                        int64_t rows, int64_t cols, cudaStream_t stream);
// The same tiles written transposed, as fp8_gemm_nt reads an operand whose K is the tokens:
// codes (cols, ld) with column c of x as row c (rows [rows, ld) zero codes), scales
// (cols, fp8_blocks(rows)) row-major — codes and scales are those of quantize_cols_e4m3,
// transposed. REQUIRES ld = rows rounded up to a multiple of 16 (the GEMM's K; the padding adds
// zero products) and codes 16-byte aligned.
void quantize_cols_transposed_e4m3(uint8_t* codes /*(cols,ld)*/, float* scales /*(cols,L)*/,
                                   const bf16* x /*(rows,cols)*/, int64_t rows, int64_t cols, int64_t ld,
                                   cudaStream_t stream);

// A stored weight (rows, cols) -> the stored form of W^T (cols, rows): the codes transposed and
// the 128 x 128 block scales transposed with them (exact; W^T's blocks are W's). The data
// gradient's GEMM reads the weight this way, with its K (W's rows) contiguous. REQUIRES both
// 16-byte aligned.
void transpose_weight_e4m3(uint8_t* out /*fp8_matrix_bytes(cols,rows)*/, const uint8_t* in /*(rows,cols)*/,
                           int64_t rows, int64_t cols, cudaStream_t stream);

// ---- GEMM (fp8_gemm.cpp) ------------------------------------------------------------------------
// C (M, N) row-major = A (M, K) @ B (N, K)^T + beta * C, A and B E4M3 codes row-major (K
// contiguous), fp32 accumulation, C bf16 (c_bf16) or fp32. Scales in the layouts of
// kernels/fp8.h: a_scales (M, fp8_blocks(K)) row-major — A in 1 x 128 tiles; b_scales
// (fp8_blocks(N), fp8_blocks(K)) row-major when b_blocks (a weight in 128 x 128 blocks, e.g. the
// scales of a stored weight at fp8_matrix_scale_offset) or (N, fp8_blocks(K)) row-major (1 x 128
// tiles). beta 0 overwrites C (which may then hold anything, NaN included).
//
// The scales are repacked into the layouts cuBLASLt reads (fp8_scales.cu) in the Context's
// scratch (fp8_gemm_scratch_bytes). REQUIRES M, N, K multiples of 16 (cuBLASLt's FP8 kernels
// want 16-byte aligned rows and columns) and A, B, C 16-byte aligned (b_scales too when they are
// 128 x 128 blocks with fp8_blocks(K) % 4 == 0: those are read in place); CHECKs both, naming
// the shape. Needs a GPU with FP8 block scaling in cuBLASLt (Hopper, sm_90; CUDA 12.9+): on
// others the heuristic finds nothing and the CHECK says so. The repacked scales go to the start
// of the Context's scratch: no operand may live in that scratch (CHECKed).
void fp8_gemm_nt(Context& ctx, void* C /*(M,N)*/, bool c_bf16, const uint8_t* A /*(M,K)*/,
                 const float* a_scales /*(M,L)*/, const uint8_t* B /*(N,K)*/, const float* b_scales /*(NB,L) or (N,L)*/,
                 bool b_blocks, int64_t M, int64_t N, int64_t K, float beta, cudaStream_t stream);
size_t fp8_gemm_scratch_bytes(int64_t M, int64_t N, int64_t K, bool b_blocks);

// ---- the fp8 recipe's linear layers (fp8_linear.cu) ---------------------------------------------
// The GEMMs of CpuFp8Ops' linear ops (kernels/cpu/backend.h) on cuBLASLt's block-scaled FP8
// kernels: the input in 1 x 128 tiles along K, the weight as its stored 128 x 128 blocks, the
// output gradient in 1 x 128 tiles for the data gradient, and both operands of the weight
// gradient in 128 x 1 tiles along the tokens. Each product is accumulated in fp32 (an fp32 C
// holding the added term: bias, residual, or the dx being accumulated), then rounded once to
// bf16, where the emulated recipe rounds. Token counts need not be multiples of 16: the
// quantised operands are padded with zero rows (an expert's rows are any number).
//
// `operands`: device memory for the quantised operands and the fp32 product, at least
// kernels::fp8_linear_operand_bytes(N, IC, OC) (kernels/fp8_operands.h), 256-byte aligned and outside the Context's scratch; ops
// on one stream may share it. REQUIRES IC, OC multiples of 16 (CHECKed, naming the shape).
// weight: the stored form of kernels/fp8.h, (OC, IC). x, dout, out, dx: bf16 row-major.
// out (N,OC) = q(x) @ W^T + bias (broadcast; null: none) + residual ((N,OC); null: none).
void fp8_linear_forward(Context& ctx, void* operands, bf16* out /*(N,OC)*/, const bf16* x /*(N,IC)*/,
                        const uint8_t* weight /*(OC,IC)*/, const bf16* bias /*(OC) or null*/,
                        const bf16* residual /*(N,OC) or null*/, int64_t N, int64_t IC, int64_t OC,
                        cudaStream_t stream);
// dx (N,IC) = q(dout) @ W (accumulate_dx: dx = round(dx + q(dout) @ W)); skipped when null.
// dweight (OC,IC) += q(dout)^T @ q(x) (fp32; null: none, a frozen weight); dbias (OC) += column
// sums of dout (null: none).
void fp8_linear_backward(Context& ctx, void* operands, bf16* dx /*(N,IC) or null*/, bool accumulate_dx,
                         float* dweight /*(OC,IC) or null*/, float* dbias /*(OC) or null*/, const bf16* dout /*(N,OC)*/,
                         const bf16* x /*(N,IC)*/, const uint8_t* weight /*(OC,IC)*/, int64_t N, int64_t IC,
                         int64_t OC, cudaStream_t stream);

// ---- scale layouts for cuBLASLt (fp8_scales.cu) --------------------------------------------------
// Row-major (outer, L) tile scales -> (L, outer): the K block index outermost, `outer`
// consecutive values per K block (cuBLASLt's VEC128_32F layout).
void fp8_tile_scales_k_major(float* out /*(L,outer)*/, const float* in /*(outer,L)*/, int64_t outer, int64_t L,
                             cudaStream_t stream);
// Row-major (outer_blocks, L) block scales -> the same with rows padded to L4 = L rounded up to
// a multiple of 4 (cuBLASLt's BLK128x128_32F layout; pad values are zero and never read).
void fp8_block_scales_padded(float* out /*(outer_blocks,L4)*/, const float* in /*(outer_blocks,L)*/,
                             int64_t outer_blocks, int64_t L, cudaStream_t stream);

}  // namespace strata::kernels::cuda
