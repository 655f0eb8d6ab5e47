#include "kernels/attention_choice.h"

#include <string>

namespace strata::kernels {
namespace {

std::string dims_text(const AttentionCase& c) {
  return "d_qk=" + std::to_string(c.d_qk) + " d_v=" + std::to_string(c.d_v);
}

std::string sm_text(const AttentionCapability& cap) {
  return "sm_" + std::to_string(cap.sm_major) + std::to_string(cap.sm_minor);
}

std::string version_text(int version) {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

// Shape rules both implementations share.
std::string common_refusal(const AttentionCapability& cap, const AttentionCase& c) {
  if (cap.sm_major < 8) return sm_text(cap) + " is older than sm_80 (no bf16 tensor cores)";
  if (c.dtype != DType::kBF16) return std::string("dtype ") + dtype_name(c.dtype) + " is not bf16";
  if (c.hq <= 0 || c.hkv <= 0 || c.hq % c.hkv != 0) {
    return "Hq=" + std::to_string(c.hq) + " is not a multiple of Hkv=" + std::to_string(c.hkv);
  }
  if (c.d_qk <= 0 || c.d_v <= 0) return "head dims must be positive, got " + dims_text(c);
  return "";
}

// cuDNN's head-dim limits for a graph that has a backward (training needs both directions).
std::string cudnn_dims_refusal(const AttentionCapability& cap, const AttentionCase& c) {
  if (c.d_qk % 8 != 0 || c.d_v % 8 != 0) return dims_text(c) + " are not multiples of 8";
  const bool split_192_128 = c.d_qk == 192 && c.d_v == 128;
  if (cap.sm_major == 9) {
    if (c.d_qk > 256 || c.d_v > 256) return dims_text(c) + " exceed 256 on " + sm_text(cap);
    // 9.11 and 9.12 take head dims between 128 and 192 only as the 192/128 split.
    const bool middle = c.d_qk > 128 && c.d_qk <= 192 && c.d_v > 64 && c.d_v <= 128;
    if (cap.cudnn_version >= 91100 && cap.cudnn_version < 91300 && middle && !split_192_128) {
      return dims_text(c) + ": cuDNN " + version_text(cap.cudnn_version) +
             " takes d_qk in (128, 192] only as d_qk=192 with d_v=128";
    }
    return "";
  }
  if (cap.sm_major == 10 && cap.cudnn_version >= 91100 && split_192_128) return "";
  if (c.d_qk > 128 || c.d_v > 128) {
    return dims_text(c) + " exceed 128, the backward's limit on " + sm_text(cap) +
           (cap.sm_major == 10 ? " (192/128 needs cuDNN 9.11+)" : "");
  }
  return "";
}

}  // namespace

const char* attention_impl_name(AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::kCudnn:
      return "cudnn";
    case AttentionImpl::kFallback:
      return "fallback";
    case AttentionImpl::kNone:
      break;
  }
  return "none";
}

const char* attention_force_name(AttentionForce force) {
  switch (force) {
    case AttentionForce::kCudnn:
      return "cudnn";
    case AttentionForce::kFallback:
      return "fallback";
    case AttentionForce::kAuto:
      break;
  }
  return "auto";
}

Result<AttentionForce> parse_attention_force(std::string_view text) {
  if (text.empty() || text == "auto") return AttentionForce::kAuto;
  if (text == "cudnn") return AttentionForce::kCudnn;
  if (text == "fallback") return AttentionForce::kFallback;
  return Status::InvalidArgument("STRATA_ATTENTION='" + std::string(text) +
                                 "' is not one of auto, cudnn, fallback");
}

std::string cudnn_attention_refusal(const AttentionCapability& cap, const AttentionCase& c) {
  if (cap.cudnn_version == 0) return "cuDNN is absent (not built in, or it failed to load)";
  if (cap.cudnn_version < 90000) {
    return "cuDNN " + version_text(cap.cudnn_version) + " is older than 9.0";
  }
  if (cap.cudnn_version == 91000 || cap.cudnn_version == 91001) {
    return "cuDNN " + version_text(cap.cudnn_version) +
           " has a broken SDPA backward (fixed in 9.10.2)";
  }
  if (std::string why = common_refusal(cap, c); !why.empty()) return why;
  if (!c.causal) return "the cuDNN graphs built here are causal only";
  if (std::string why = cudnn_dims_refusal(cap, c); !why.empty()) return why;
  if (c.seq_len == 1) return "T=1: cuDNN's SDPA backward refuses s_q = s_kv = 1";
  // Up to 9.15.0 the backward needs a padding mask when the key length is not a multiple of 128
  // (NVIDIA's own frontend adds one to work around it); the graphs built here have none.
  if (cap.cudnn_version <= 91500 && c.seq_len % 128 != 0) {
    return "T=" + std::to_string(c.seq_len) + ": cuDNN " + version_text(cap.cudnn_version) +
           "'s SDPA backward needs T a multiple of 128 without a padding mask (fixed after 9.15.0)";
  }
  return "";
}

std::string fallback_attention_refusal(const AttentionCapability& cap, const AttentionCase& c) {
  if (std::string why = common_refusal(cap, c); !why.empty()) return why;
  if (!c.causal) return "the fallback kernel is causal only";
  if (c.d_qk != c.d_v || (c.d_qk != 64 && c.d_qk != 128)) {
    return dims_text(c) + ": the fallback kernel takes d_qk = d_v in {64, 128}";
  }
  return "";
}

AttentionChoice choose_attention(const AttentionCapability& cap, const AttentionCase& c,
                                 AttentionForce force) {
  const std::string cudnn_no = cudnn_attention_refusal(cap, c);
  const std::string fallback_no = fallback_attention_refusal(cap, c);
  const std::string cudnn_name =
      "cuDNN " + version_text(cap.cudnn_version) + " fused SDPA on " + sm_text(cap);
  switch (force) {
    case AttentionForce::kFallback:
      if (fallback_no.empty()) return {AttentionImpl::kFallback, "STRATA_ATTENTION=fallback"};
      return {AttentionImpl::kNone,
              "STRATA_ATTENTION=fallback, but the fallback kernel cannot serve it: " + fallback_no};
    case AttentionForce::kCudnn:
      if (cudnn_no.empty()) return {AttentionImpl::kCudnn, cudnn_name + " (STRATA_ATTENTION=cudnn)"};
      if (fallback_no.empty()) {
        return {AttentionImpl::kFallback,
                "STRATA_ATTENTION=cudnn not honoured, cuDNN cannot serve it: " + cudnn_no};
      }
      return {AttentionImpl::kNone, "cuDNN cannot serve it: " + cudnn_no +
                                        "; nor can the fallback kernel: " + fallback_no};
    case AttentionForce::kAuto:
      break;
  }
  if (cudnn_no.empty()) return {AttentionImpl::kCudnn, cudnn_name};
  if (fallback_no.empty()) return {AttentionImpl::kFallback, "cuDNN cannot serve it: " + cudnn_no};
  return {AttentionImpl::kNone,
          "cuDNN cannot serve it: " + cudnn_no + "; nor can the fallback kernel: " + fallback_no};
}

AttentionChoice attention_after_cudnn_failure(const AttentionCapability& cap, const AttentionCase& c,
                                              const std::string& failure) {
  const std::string fallback_no = fallback_attention_refusal(cap, c);
  if (fallback_no.empty()) return {AttentionImpl::kFallback, "cuDNN failed: " + failure};
  return {AttentionImpl::kNone,
          "cuDNN failed: " + failure + "; and the fallback kernel cannot serve it: " + fallback_no};
}

}  // namespace strata::kernels
