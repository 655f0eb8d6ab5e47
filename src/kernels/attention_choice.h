// Which implementation serves a causal attention case on CUDA: cuDNN's fused SDPA or the
// project's own WMMA flash kernel (kernels/cuda/attention.cu, "the fallback"). Plain C++ with no
// CUDA types, so that the rules run and are tested in every build; the CUDA op set fills in an
// AttentionCapability from the device and the cuDNN it loaded, asks once per shape, and logs
// the answer.
//
// The rules follow cuDNN's documented SDPA support surface for bf16 (cuDNN 9):
//   - compute capability 8.0 or newer;
//   - head dims multiples of 8; d_qk and d_v at most 128, except on Hopper (sm_90), where both
//     may be up to 256 (the 192/128 split of multi-head latent attention included), and on
//     Blackwell (sm_100) from cuDNN 9.11, where d_qk = 192 with d_v = 128 is allowed;
//   - Hq a multiple of Hkv (grouped-query attention);
//   - the backward refuses a sequence of length 1 (s_q = s_kv = 1) and is broken in 9.10.0 and
//     9.10.1, so those versions never serve training.
// The cuDNN graphs built here (kernels/cuda/cudnn_attention.cpp) are causal only, although
// cuDNN itself also takes unmasked attention. The fallback serves causal bf16 attention with
// d_qk = d_v in {64, 128} on sm_80 and newer.
// Passing these rules does not guarantee that cuDNN builds the graph: the op set still falls
// back, with cuDNN's status in the reason, when building or finalizing fails.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"

namespace strata::kernels {

enum class AttentionImpl : uint8_t {
  kCudnn,     // cuDNN fused SDPA (forward and backward)
  kFallback,  // the WMMA flash kernel of kernels/cuda/attention.cu
  kNone,      // neither can serve the case
};
const char* attention_impl_name(AttentionImpl impl);  // "cudnn", "fallback", "none"

// What the configuration asks for (STRATA_ATTENTION=auto|cudnn|fallback).
enum class AttentionForce : uint8_t { kAuto, kCudnn, kFallback };
const char* attention_force_name(AttentionForce force);  // "auto", "cudnn", "fallback"
// Parses "auto", "cudnn", "fallback"; an empty string is kAuto. InvalidArgument otherwise.
Result<AttentionForce> parse_attention_force(std::string_view text);

// What the machine offers.
struct AttentionCapability {
  int sm_major = 0;  // compute capability of the device
  int sm_minor = 0;
  // cuDNN's runtime version as cudnnGetVersion() reports it (major * 10000 + minor * 100 +
  // patch for cuDNN 9: 9.19.0 is 91900); 0 when the build has no cuDNN or it failed to load.
  int cudnn_version = 0;
};

// One attention call's shape and kind.
struct AttentionCase {
  int64_t d_qk = 0;  // head dim of queries and keys
  int64_t d_v = 0;   // head dim of values and outputs
  int64_t hq = 0;    // query heads
  int64_t hkv = 0;   // key/value heads
  DType dtype = DType::kBF16;
  bool causal = true;
  int64_t seq_len = 0;  // T (queries and keys alike)
};

struct AttentionChoice {
  AttentionImpl impl = AttentionImpl::kNone;
  std::string reason;  // one line: why this implementation serves the case
};

// Pure function of its arguments. kAuto prefers cuDNN and takes the fallback where cuDNN
// cannot serve. kFallback takes the fallback (kNone when it cannot serve). kCudnn takes cuDNN;
// where cuDNN cannot serve it takes the fallback and says that the request was not honoured
// (kNone when neither can).
AttentionChoice choose_attention(const AttentionCapability& cap, const AttentionCase& c,
                                 AttentionForce force);

// The choice once cuDNN, chosen, failed to build or finalize its graphs for the case (`failure`:
// the cuDNN call and status): the fallback where it can serve, else kNone; the reason carries
// the failure either way.
AttentionChoice attention_after_cudnn_failure(const AttentionCapability& cap, const AttentionCase& c,
                                              const std::string& failure);

// Why cuDNN cannot serve the case, or empty when it can (the rules above).
std::string cudnn_attention_refusal(const AttentionCapability& cap, const AttentionCase& c);
// Why the fallback kernel cannot serve the case, or empty when it can.
std::string fallback_attention_refusal(const AttentionCapability& cap, const AttentionCase& c);

}  // namespace strata::kernels
