// CudaTimeline (see the header).
#include "core/cuda/cuda_timeline.h"

#include <cmath>

#include "core/cuda/cuda_check.h"

namespace strata {

CudaTimeline::CudaTimeline(const char* track_name) : track_(track_name) {}

CudaTimeline::~CudaTimeline() {
  for (Point& p : points_) CUDA_CHECK(cudaEventDestroy(p.event));
  for (cudaEvent_t e : spare_) CUDA_CHECK(cudaEventDestroy(e));
  if (anchor_ != nullptr) CUDA_CHECK(cudaEventDestroy(anchor_));
}

cudaEvent_t CudaTimeline::take_event() {
  if (!spare_.empty()) {
    cudaEvent_t e = spare_.back();
    spare_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreate(&e));  // timing enabled
  return e;
}

void CudaTimeline::point(cudaStream_t stream, const char* category, const char* name, int64_t index) {
  if (!trace::enabled()) return;
  if (anchor_ns_ < 0) {
    CUDA_CHECK(cudaEventCreate(&anchor_));
    CUDA_CHECK(cudaEventRecord(anchor_, stream));
    CUDA_CHECK(cudaEventSynchronize(anchor_));
    anchor_ns_ = trace::now_ns();
  }
  Point p{category, name, index, take_event()};
  CUDA_CHECK(cudaEventRecord(p.event, stream));
  points_.push_back(p);
}

bool CudaTimeline::resolve(Point& p, bool wait) {
  if (p.ns >= 0) return true;
  if (wait) {
    CUDA_CHECK(cudaEventSynchronize(p.event));
  } else {
    const cudaError_t done = cudaEventQuery(p.event);
    if (done == cudaErrorNotReady) return false;
    CUDA_CHECK(done);
  }
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, anchor_, p.event));
  p.ns = anchor_ns_ + static_cast<int64_t>(std::llround(static_cast<double>(ms) * 1e6));
  return true;
}

void CudaTimeline::flush(bool wait) {
  // A span is done when the point after its own has resolved; the last point stays, since it
  // may begin a span still running.
  while (points_.size() >= 2) {
    Point& first = points_[0];
    Point& next = points_[1];
    if (!resolve(first, wait) || !resolve(next, wait)) return;
    if (first.name != nullptr) track_.complete(first.category, first.name, first.index, first.ns, next.ns);
    spare_.push_back(first.event);
    points_.pop_front();
  }
  if (points_.size() == 1 && points_.front().name == nullptr && resolve(points_.front(), wait)) {
    spare_.push_back(points_.front().event);  // an end with nothing after it
    points_.pop_front();
  }
}

}  // namespace strata
