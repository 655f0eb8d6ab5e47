// Causal GQA attention on cuDNN's fused SDPA engines, through the cuDNN 9 backend graph API; and
// the same without the mask (every query sees every key), ring attention's full blocks.
//
// cuDNN recognises a fused flash-attention engine by the shape of an operation graph, so the
// graphs below spell out the math the engine implements, operation by operation (cuDNN's own
// frontend builds the same shapes):
//   forward   S = Q K^T (fp32) * scale; causal mask (row index >= column index, else -inf);
//             M = rowmax S; E = exp(S - M); Z = rowsum E; stats = M + log Z; P = E / Z (bf16);
//             O = P V.
//   backward  delta = rowsum(dO * O) * 1 (fp32, a tensor of its own in the workspace);
//             P = exp(mask(Q K^T * scale) - stats); dV = P^T dO; dP = dO V^T;
//             dS = (dP - delta) * P * scale; dK = dS^T Q; dQ = dS K, straight into dq (the
//             fixed-order form), or, where that form fails, through an fp32 accumulator in the
//             workspace copied to bf16 by an identity op (cuDNN adds into it with atomics).
//             With GQA, dK and dV are computed per query head and summed over each group by a
//             reduction over the head dimension.
// The stats are the natural-log logsumexp of each row of scaled scores: the (B,Hq,T) lse of
// the WMMA kernel, in the same layout. Tensors keep the project's (B,T,H,D) layout; the graphs
// see them as (B,H,T,D) through strides. K and V are read transposed (K^T, V^T) by strides too.
//
// Nothing here aborts on a cuDNN status while building: a failure is recorded as one line and
// the shape is served by the WMMA kernel instead. Executing a plan that was built is checked
// (an error there is a CUDA or programmer error).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

#if STRATA_HAVE_CUDNN
#include <cudnn_graph.h>

#include <cmath>
#include <limits>
#endif

namespace strata::kernels::cuda {

#if !STRATA_HAVE_CUDNN

struct Context::CudnnAttention {};
void Context::CudnnAttentionDeleter::operator()(CudnnAttention* attention) const { delete attention; }
Context::CudnnAttention& Context::cudnn_attention() {
  if (!cudnn_attention_) cudnn_attention_.reset(new CudnnAttention());
  return *cudnn_attention_;
}

int cudnn_version() { return 0; }
CudnnAttentionPlan cudnn_attention_prepare(Context&, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t,
                                           double) {
  return {false, false, "this build has no cuDNN"};
}
void cudnn_attention_forward(Context&, bf16*, float*, const bf16*, const bf16*, const bf16*, int64_t,
                             int64_t, int64_t, int64_t, int64_t, cudaStream_t, bool, int64_t, double) {
  CHECK_MSG(false, "cudnn_attention_forward: this build has no cuDNN");
}
void cudnn_attention_backward(Context&, bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*,
                              const bf16*, const bf16*, const float*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, cudaStream_t, bool, int64_t, double) {
  CHECK_MSG(false, "cudnn_attention_backward: this build has no cuDNN");
}

#else  // STRATA_HAVE_CUDNN

namespace {

using Desc = cudnnBackendDescriptor_t;
using Dims = std::vector<int64_t>;

// Unique ids of the tensors the caller supplies (variant pack); virtual tensors count up from
// kFirstVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK,  // read as K^T
  kV,  // read as V (forward) or V^T (backward)
  kO,
  kStats,
  kScale,    // by value: the softmax scale (1/sqrt(D) unless given)
  kNegInf,   // by value: the masked score
  kOne,      // by value: 1
  kDO,
  kDQ,
  kDK,
  kDV,
  kDelta,    // workspace: rowsum(dO * O)
  kDQAccum,  // workspace: fp32 dq
  kFirstVirtual = 100,
};

std::string status_text(cudnnStatus_t status) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  std::string text = cudnnGetErrorString(status);
  if (detail[0] != '\0') text += std::string(" (") + detail + ")";
  return text;
}

// Builds one operation graph and its execution plan. Every descriptor made is kept (and
// destroyed with the Graph), because a plan may refer to them. After the first failing call
// every further call does nothing and `error` names that call and its status.
class Graph {
 public:
  explicit Graph(cudnnHandle_t handle) : handle_(handle) {}
  ~Graph() {
    for (auto it = descs_.rbegin(); it != descs_.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  Desc plan() const { return plan_; }
  int64_t workspace_bytes() const { return workspace_; }

  // A tensor the caller supplies (by pointer, or by value for scalars), or a virtual one.
  Desc tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
              bool is_virtual, bool by_value = false) {
    Desc d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const int64_t alignment = 16;
    const bool virt = is_virtual;
    set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor type");
    set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.size(), dims.data(), "tensor dims");
    set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.size(), strides.data(),
        "tensor strides");
    set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
    if (by_value) {
      const bool yes = true;
      set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes, "tensor by value");
    }
    finalize(d, "tensor " + std::to_string(uid));
    return d;
  }
  // A virtual tensor with a fresh uid.
  Desc temp(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_++, type, dims, strides, /*is_virtual=*/true);
  }
  // A scalar passed by value (dims and strides all 1).
  Desc scalar(int64_t uid, cudnnDataType_t type) {
    return tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, /*is_virtual=*/false, /*by_value=*/true);
  }

  // y = mode(x[, b[, t]]). GEN_INDEX takes an axis.
  void pointwise(cudnnPointwiseMode_t mode, Desc x, Desc b, Desc y, Desc t = nullptr,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &precision, "pointwise precision");
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    finalize(pw, "pointwise mode " + std::to_string(mode));
    Desc op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise op");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pw");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "pw x");
    if (b != nullptr) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "pw b");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "pw y");
    if (t != nullptr) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, "pw t");
    finalize(op, "pointwise op mode " + std::to_string(mode));
    ops_.push_back(op);
  }
  // c = a @ b over the last two dims, batched (and broadcast over heads) on the first two.
  void matmul(Desc a, Desc b, Desc c) {
    Desc mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
    finalize(mm, "matmul");
    Desc op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul a");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "matmul b");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, "matmul c");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, "matmul desc");
    finalize(op, "matmul op");
    ops_.push_back(op);
  }
  // y = reduce(x) over the dims where y has extent 1 (or a group of heads).
  void reduction(cudnnReduceTensorOp_t mode, Desc x, Desc y) {
    Desc red = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction mode");
    set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction compute type");
    finalize(red, "reduction");
    Desc op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction op");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reduction x");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reduction y");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red, "reduction desc");
    finalize(op, "reduction op");
    ops_.push_back(op);
  }
  // y = x seen through other dims and strides (a transpose here).
  void reshape(Desc x, Desc y) {
    Desc op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape op");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
    finalize(op, "reshape op");
    ops_.push_back(op);
  }

  // The operation graph, the heuristics' engine configurations in their order, and the first
  // configuration whose execution plan finalizes.
  void build_plan(const char* what) {
    if (!ok()) return;
    Desc graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_.size(), ops_.data(),
        "graph ops");
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "graph handle");
    finalize(graph, std::string(what) + " operation graph");
    Desc heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "heur graph");
    set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heur mode");
    finalize(heur, std::string(what) + " engine heuristics");
    if (!ok()) return;
    int64_t count = 0;
    call(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                  &count, nullptr),
         std::string(what) + ": counting engine configurations");
    if (!ok()) return;
    if (count == 0) {
      error_ = std::string(what) + ": cuDNN's heuristics offer no engine for this graph";
      return;
    }
    std::vector<Desc> configs(static_cast<size_t>(count));
    for (Desc& c : configs) c = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
    if (!ok()) return;
    int64_t got = 0;
    call(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                  count, &got, configs.data()),
         std::string(what) + ": reading engine configurations");
    if (!ok()) return;
    std::string last_failure = "no engine configuration";
    for (int64_t i = 0; i < got; ++i) {
      Desc plan = nullptr;
      if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) !=
          CUDNN_STATUS_SUCCESS) {
        continue;
      }
      cudnnStatus_t s = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE,
                                                 1, &handle_);
      if (s == CUDNN_STATUS_SUCCESS) {
        s = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &configs[i]);
      }
      if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendFinalize(plan);
      int64_t workspace = 0, n = 0;
      if (s == CUDNN_STATUS_SUCCESS) {
        s = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                     &n, &workspace);
      }
      if (s == CUDNN_STATUS_SUCCESS) {
        descs_.push_back(plan);
        plan_ = plan;
        workspace_ = workspace;
        return;
      }
      last_failure = status_text(s);
      cudnnBackendDestroyDescriptor(plan);
    }
    error_ = std::string(what) + ": no execution plan finalizes (" + std::to_string(got) +
             " engine configurations tried; last: " + last_failure + ")";
  }

 private:
  Desc make(cudnnBackendDescriptorType_t type, const char* what) {
    if (!ok()) return nullptr;
    Desc d = nullptr;
    call(cudnnBackendCreateDescriptor(type, &d), std::string("creating a ") + what + " descriptor");
    if (d != nullptr) descs_.push_back(d);
    return d;
  }
  void set(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, size_t count,
           const void* value, const char* what) {
    if (!ok()) return;
    call(cudnnBackendSetAttribute(d, name, type, static_cast<int64_t>(count), value),
         std::string("setting ") + what);
  }
  void finalize(Desc d, const std::string& what) {
    if (!ok()) return;
    call(cudnnBackendFinalize(d), "finalizing " + what);
  }
  void call(cudnnStatus_t status, const std::string& what) {
    if (status != CUDNN_STATUS_SUCCESS && ok()) error_ = what + ": " + status_text(status);
  }

  cudnnHandle_t handle_;
  std::vector<Desc> descs_;
  std::vector<Desc> ops_;
  Desc plan_ = nullptr;
  int64_t workspace_ = 0;
  int64_t next_virtual_ = kFirstVirtual;
  std::string error_;
};

// (B,T,H,D) storage seen as (B,H,T,D): dims and strides.
Dims bhtd_dims(int64_t B, int64_t H, int64_t T, int64_t D) { return {B, H, T, D}; }
Dims bhtd_strides(int64_t H, int64_t T, int64_t D) { return {T * H * D, D, H * D, 1}; }
// The same storage transposed in its last two dims: (B,H,D,T).
Dims bhdt_dims(int64_t B, int64_t H, int64_t T, int64_t D) { return {B, H, D, T}; }
Dims bhdt_strides(int64_t H, int64_t T, int64_t D) { return {T * H * D, D, 1, H * D}; }

// Scalars passed by value: the variant pack points at these, so they live with the plans.
struct Scalars {
  float scale = 0.0f;
  float neg_inf = 0.0f;
  float one = 1.0f;
};

float masked_score(int version) {
  // Before 9.10 cuDNN wanted the lowest finite value for masked scores (what its frontend does).
  return version < 91000 ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
}

// The causal mask on scores `s` (B,Hq,T,T fp32): keep where row >= column, else the masked score.
Desc causal_mask(Graph& g, Desc s, const Dims& dims, const Dims& strides, Desc neg_inf) {
  Desc row = g.temp(CUDNN_DATA_INT32, dims, strides);
  Desc col = g.temp(CUDNN_DATA_INT32, dims, strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, nullptr, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, nullptr, CUDNN_DATA_FLOAT, 3);
  Desc keep = g.temp(CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, keep, nullptr, CUDNN_DATA_BOOLEAN);
  Desc masked = g.temp(CUDNN_DATA_FLOAT, dims, strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, neg_inf, masked, keep);
  return masked;
}

// causal = false: every query sees every key (ring attention's full blocks), no mask.
void build_forward(Graph& g, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, bool causal, int64_t Dv) {
  const Dims row_dims{B, Hq, T, 1}, row_strides{Hq * T, T, 1, 1};
  const Dims s_dims{B, Hq, T, T}, s_strides{Hq * T * T, T * T, T, 1};
  Desc q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, D), bhtd_strides(Hq, T, D), false);
  Desc kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, bhdt_dims(B, Hkv, T, D), bhdt_strides(Hkv, T, D), false);
  Desc v = g.tensor(kV, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hkv, T, Dv), bhtd_strides(Hkv, T, Dv), false);
  Desc o = g.tensor(kO, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, Dv), bhtd_strides(Hq, T, Dv), false);
  Desc stats = g.tensor(kStats, CUDNN_DATA_FLOAT, row_dims, row_strides, false);
  Desc scale = g.scalar(kScale, CUDNN_DATA_FLOAT);
  Desc neg_inf = causal ? g.scalar(kNegInf, CUDNN_DATA_FLOAT) : nullptr;

  Desc s = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(q, kt, s);
  Desc scaled = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, scaled);
  Desc masked = causal ? causal_mask(g, scaled, s_dims, s_strides, neg_inf) : scaled;
  Desc row_max = g.temp(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  Desc shifted = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, masked, row_max, shifted);
  Desc e = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, e);
  Desc row_sum = g.temp(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  Desc log_sum = g.temp(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, stats);
  // P in the i/o type: the second matmul's A operand must be bf16.
  Desc p = g.temp(CUDNN_DATA_BFLOAT16, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_DIV, e, row_sum, p);
  g.matmul(p, v, o);
  g.build_plan("SDPA forward");
}

// accumulate_dq: dQ = dS K into an fp32 accumulator in the workspace, then copied to bf16 (cuDNN
// adds into it with atomics); else straight into dq.
void build_backward(Graph& g, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, bool accumulate_dq,
                    bool causal, int64_t Dv) {
  const Dims row_dims{B, Hq, T, 1}, row_strides{Hq * T, T, 1, 1};
  const Dims s_dims{B, Hq, T, T}, s_strides{Hq * T * T, T * T, T, 1};
  // The same scores transposed: (B,Hq,T_kv,T_q).
  const Dims st_strides{Hq * T * T, T * T, 1, T};
  Desc q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, D), bhtd_strides(Hq, T, D), false);
  Desc kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, bhdt_dims(B, Hkv, T, D), bhdt_strides(Hkv, T, D), false);
  Desc vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, bhdt_dims(B, Hkv, T, Dv), bhdt_strides(Hkv, T, Dv), false);
  Desc o = g.tensor(kO, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, Dv), bhtd_strides(Hq, T, Dv), false);
  Desc d_o = g.tensor(kDO, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, Dv), bhtd_strides(Hq, T, Dv), false);
  Desc stats = g.tensor(kStats, CUDNN_DATA_FLOAT, row_dims, row_strides, false);
  Desc dq = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hq, T, D), bhtd_strides(Hq, T, D), false);
  Desc dk = g.tensor(kDK, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hkv, T, D), bhtd_strides(Hkv, T, D), false);
  Desc dv = g.tensor(kDV, CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hkv, T, Dv), bhtd_strides(Hkv, T, Dv), false);
  Desc scale = g.scalar(kScale, CUDNN_DATA_FLOAT);
  Desc neg_inf = causal ? g.scalar(kNegInf, CUDNN_DATA_FLOAT) : nullptr;
  Desc one = g.scalar(kOne, CUDNN_DATA_FLOAT);
  // Contiguous (B,Hq,T,*) fp32 buffers in the workspace.
  Desc delta = g.tensor(kDelta, CUDNN_DATA_FLOAT, row_dims, row_strides, false);

  // delta = rowsum(dO * O) * 1
  Desc d_o_o = g.temp(CUDNN_DATA_FLOAT, bhtd_dims(B, Hq, T, Dv), bhtd_strides(Hq, T, Dv));
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, d_o_o);
  Desc row_dot = g.temp(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_dot);
  g.pointwise(CUDNN_POINTWISE_MUL, row_dot, one, delta);

  // P = exp(mask(Q K^T * scale) - stats)
  Desc s = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(q, kt, s);
  Desc scaled = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, scaled);
  Desc centred = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, centred);
  Desc masked = causal ? causal_mask(g, centred, s_dims, s_strides, neg_inf) : centred;
  Desc p = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, p);

  // dV = P^T dO, per query head, then summed over each group of heads.
  Desc pt = g.temp(CUDNN_DATA_BFLOAT16, {B, Hq, T, T}, st_strides);
  g.reshape(p, pt);
  if (Hq == Hkv) {
    g.matmul(pt, d_o, dv);
  } else {
    Desc dv_heads = g.temp(CUDNN_DATA_BFLOAT16, {B, Hq, T, Dv}, {Hq * T * Dv, T * Dv, Dv, 1});
    g.matmul(pt, d_o, dv_heads);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv);
  }

  // dS = (dO V^T - delta) * P * scale
  Desc dp = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.matmul(d_o, vt, dp);
  Desc dp_centred = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, delta, dp_centred);
  Desc dp_p = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centred, p, dp_p);
  Desc ds = g.temp(CUDNN_DATA_FLOAT, s_dims, s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_p, scale, ds);

  // dK = dS^T Q, per query head, then summed over each group.
  Desc dst = g.temp(CUDNN_DATA_BFLOAT16, {B, Hq, T, T}, st_strides);
  g.reshape(ds, dst);
  if (Hq == Hkv) {
    g.matmul(dst, q, dk);
  } else {
    Desc dk_heads = g.temp(CUDNN_DATA_BFLOAT16, {B, Hq, T, D}, {Hq * T * D, T * D, D, 1});
    g.matmul(dst, q, dk_heads);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk);
  }

  // dQ = dS K: K is K^T read transposed back.
  Desc k = g.temp(CUDNN_DATA_BFLOAT16, bhtd_dims(B, Hkv, T, D), bhtd_strides(Hkv, T, D));
  g.reshape(kt, k);
  if (accumulate_dq) {
    Desc dq_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, {B, Hq, T, D}, {Hq * T * D, T * D, D, 1}, false);
    g.matmul(ds, k, dq_accum);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, dq);
  } else {
    g.matmul(ds, k, dq);
  }
  g.build_plan("SDPA backward");
}

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// B, T, Hq, Hkv, D, causal, Dv, the softmax scale
using ShapeKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t, double>;

// The two plans of one shape, or why there are none.
struct Entry {
  CudnnAttentionPlan plan;
  std::unique_ptr<Graph> forward, backward;
  bool accumulates_dq = false;  // the backward's form
  bool causal = true;           // the graphs mask (else no masked-score scalar in them)
  Scalars scalars;
  // Scratch layout of the backward: delta, the fp32 dq accumulator, then cuDNN's workspace.
  size_t delta_offset = 0, dq_accum_offset = 0, backward_workspace_offset = 0, backward_bytes = 0;
};

void execute(cudnnHandle_t handle, const Graph& graph, const std::vector<int64_t>& uids,
             const std::vector<void*>& pointers, void* workspace, cudaStream_t stream) {
  CHECK(uids.size() == pointers.size());
  CHECK(cudnnSetStream(handle, stream) == CUDNN_STATUS_SUCCESS);
  Desc pack = nullptr;
  cudnnStatus_t s = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  CHECK_MSG(s == CUDNN_STATUS_SUCCESS, "cuDNN variant pack: " + status_text(s));
  const int64_t n = static_cast<int64_t>(uids.size());
  s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data());
  if (s == CUDNN_STATUS_SUCCESS) {
    s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                                 pointers.data());
  }
  if (s == CUDNN_STATUS_SUCCESS) {
    s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  }
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendFinalize(pack);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendExecute(handle, graph.plan(), pack);
  cudnnBackendDestroyDescriptor(pack);
  CHECK_MSG(s == CUDNN_STATUS_SUCCESS, "cuDNN SDPA execution: " + status_text(s));
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

struct Context::CudnnAttention {
  cudnnHandle_t handle = nullptr;
  std::string handle_error;  // why cudnnCreate failed, once it has
  std::map<ShapeKey, Entry> entries;
  ~CudnnAttention() {
    entries.clear();  // plans before the handle they were built on
    if (handle != nullptr) cudnnDestroy(handle);
  }
};

void Context::CudnnAttentionDeleter::operator()(CudnnAttention* attention) const { delete attention; }

Context::CudnnAttention& Context::cudnn_attention() {
  if (!cudnn_attention_) cudnn_attention_.reset(new CudnnAttention());
  return *cudnn_attention_;
}

int cudnn_version() { return static_cast<int>(cudnnGetVersion()); }

namespace {

// The backward of `entry` in one of its two forms, with its scratch layout; empty when it is
// built and fits the scratch, else why not.
std::string build_backward_entry(Entry& entry, cudnnHandle_t handle, size_t scratch_bytes, int64_t B,
                                 int64_t T, int64_t Hq, int64_t Hkv, int64_t D, bool accumulate_dq, bool causal,
                                 int64_t Dv) {
  entry.backward = std::make_unique<Graph>(handle);
  build_backward(*entry.backward, B, T, Hq, Hkv, D, accumulate_dq, causal, Dv);
  if (!entry.backward->ok()) {
    const std::string failure = entry.backward->error();
    entry.backward.reset();
    return failure;
  }
  entry.accumulates_dq = accumulate_dq;
  entry.delta_offset = 0;
  const size_t delta_bytes = round_up_256(static_cast<size_t>(B * Hq * T) * sizeof(float));
  const size_t accum_bytes = accumulate_dq ? round_up_256(static_cast<size_t>(B * Hq * T * D) * sizeof(float)) : 0;
  entry.dq_accum_offset = delta_bytes;
  entry.backward_workspace_offset = delta_bytes + accum_bytes;
  entry.backward_bytes = entry.backward_workspace_offset + static_cast<size_t>(entry.backward->workspace_bytes());
  if (entry.backward_bytes > scratch_bytes) {
    entry.backward.reset();
    return "the backward needs " + std::to_string(entry.backward_bytes) + " bytes of scratch (delta" +
           (accumulate_dq ? ", an fp32 dq accumulator" : "") + " and cuDNN's workspace), the kernel context has " +
           std::to_string(scratch_bytes);
  }
  return "";
}

}  // namespace

namespace {
int64_t value_dim(int64_t D, int64_t Dv) { return Dv > 0 ? Dv : D; }
double softmax_scale(int64_t D, double scale) { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)); }
}  // namespace

CudnnAttentionPlan cudnn_attention_prepare(Context& ctx, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                           int64_t D, bool causal, int64_t Dv, double scale) {
  CHECK(B > 0 && T > 0 && Hq > 0 && Hkv > 0 && D > 0 && Hq % Hkv == 0 && Dv >= 0);
  Dv = value_dim(D, Dv);
  scale = softmax_scale(D, scale);
  Context::CudnnAttention& cache = ctx.cudnn_attention();
  const ShapeKey key{B, T, Hq, Hkv, D, causal, Dv, scale};
  if (auto it = cache.entries.find(key); it != cache.entries.end()) return it->second.plan;
  Entry& entry = cache.entries[key];
  if (cache.handle == nullptr && cache.handle_error.empty()) {
    const cudnnStatus_t s = cudnnCreate(&cache.handle);
    if (s != CUDNN_STATUS_SUCCESS) {
      cache.handle = nullptr;
      cache.handle_error = "cudnnCreate: " + status_text(s);
    }
  }
  if (cache.handle == nullptr) {
    entry.plan.note = cache.handle_error;
    return entry.plan;
  }
  entry.scalars.scale = static_cast<float>(scale);
  entry.scalars.neg_inf = masked_score(cudnn_version());
  entry.causal = causal;
  entry.forward = std::make_unique<Graph>(cache.handle);
  build_forward(*entry.forward, B, T, Hq, Hkv, D, causal, Dv);
  if (entry.forward->ok() && static_cast<size_t>(entry.forward->workspace_bytes()) > ctx.scratch_bytes()) {
    entry.plan.note = "the forward needs " + std::to_string(entry.forward->workspace_bytes()) +
                      " bytes of workspace, the kernel context has " + std::to_string(ctx.scratch_bytes());
  } else if (!entry.forward->ok()) {
    entry.plan.note = entry.forward->error();
  }
  if (!entry.plan.note.empty()) {
    entry = Entry{.plan = entry.plan};  // keep no half-built graphs
    return entry.plan;
  }
  // dq written directly by the last matmul is the form cuDNN computes in a fixed order on
  // sm_80 and sm_90 (what its frontend builds when asked for a deterministic backward); the
  // form with an fp32 accumulator is usually faster but adds into it with atomics.
  const std::string fixed_order = build_backward_entry(entry, cache.handle, ctx.scratch_bytes(), B, T, Hq, Hkv, D,
                                                       /*accumulate_dq=*/false, causal, Dv);
  if (fixed_order.empty()) {
    entry.plan = {true, true, ""};
    return entry.plan;
  }
  const std::string atomics = build_backward_entry(entry, cache.handle, ctx.scratch_bytes(), B, T, Hq, Hkv, D,
                                                   /*accumulate_dq=*/true, causal, Dv);
  if (atomics.empty()) {
    entry.plan = {true, false, "its backward accumulates dq with atomics, not bitwise reproducible (the fixed-order "
                               "form failed: " + fixed_order + ")"};
    return entry.plan;
  }
  entry = Entry{.plan = {false, false, fixed_order + "; with an fp32 dq accumulator: " + atomics}};
  return entry.plan;
}

namespace {

// The graphs promise cuDNN 16-byte aligned tensors.
void check_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    CHECK_MSG(reinterpret_cast<uintptr_t>(p) % 16 == 0, "cuDNN attention tensors must be 16-byte aligned");
  }
}

Entry& prepared(Context& ctx, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, bool causal, int64_t Dv,
               double scale) {
  Context::CudnnAttention& cache = ctx.cudnn_attention();
  const auto it = cache.entries.find(ShapeKey{B, T, Hq, Hkv, D, causal, value_dim(D, Dv), softmax_scale(D, scale)});
  CHECK_MSG(it != cache.entries.end() && it->second.plan.ready,
            "cuDNN attention called for a shape that cudnn_attention_prepare did not accept");
  return it->second;
}

}  // namespace

void cudnn_attention_forward(Context& ctx, bf16* out, float* lse, const bf16* q, const bf16* k,
                             const bf16* v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                             cudaStream_t stream, bool causal, int64_t Dv, double scale) {
  Entry& e = prepared(ctx, B, T, Hq, Hkv, D, causal, Dv, scale);
  check_aligned({out, lse, q, k, v});
  void* workspace = ctx.scratch(static_cast<size_t>(e.forward->workspace_bytes()), "cuDNN SDPA forward");
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> pointers{const_cast<bf16*>(q), const_cast<bf16*>(k), const_cast<bf16*>(v),
                              out, lse, &e.scalars.scale};
  if (e.causal) {  // the unmasked graph has no masked score
    uids.push_back(kNegInf);
    pointers.push_back(&e.scalars.neg_inf);
  }
  execute(ctx.cudnn_attention().handle, *e.forward, uids, pointers, workspace, stream);
}

void cudnn_attention_backward(Context& ctx, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                              const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                              const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                              int64_t D, cudaStream_t stream, bool causal, int64_t Dv, double scale) {
  Entry& e = prepared(ctx, B, T, Hq, Hkv, D, causal, Dv, scale);
  check_aligned({dq, dk, dv, dout, q, k, v, out, lse});
  char* scratch = static_cast<char*>(ctx.scratch(e.backward_bytes, "cuDNN SDPA backward"));
  float* delta = reinterpret_cast<float*>(scratch + e.delta_offset);
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kOne, kDelta};
  std::vector<void*> pointers{const_cast<bf16*>(q), const_cast<bf16*>(k), const_cast<bf16*>(v),
                              const_cast<bf16*>(out), const_cast<bf16*>(dout),
                              const_cast<float*>(lse), dq, dk, dv, &e.scalars.scale,
                              &e.scalars.one, delta};
  if (e.causal) {
    uids.push_back(kNegInf);
    pointers.push_back(&e.scalars.neg_inf);
  }
  if (e.accumulates_dq) {
    float* dq_accum = reinterpret_cast<float*>(scratch + e.dq_accum_offset);
    // The accumulator starts at zero (cuDNN before 9.6 expects its caller to clear it).
    CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, static_cast<size_t>(B * Hq * T * D) * sizeof(float), stream));
    uids.push_back(kDQAccum);
    pointers.push_back(dq_accum);
  }
  execute(ctx.cudnn_attention().handle, *e.backward, uids, pointers,
          scratch + e.backward_workspace_offset, stream);
}

#endif  // STRATA_HAVE_CUDNN

}  // namespace strata::kernels::cuda
