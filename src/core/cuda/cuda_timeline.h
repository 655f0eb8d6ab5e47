// CudaTimeline: spans of the work queued on CUDA streams, timed by CUDA events on the GPU and
// placed on the trace's clock (core/trace.h), on a track of its own: what the device ran and
// when, not when the host queued it. The CUDA backend's compute stream marks its phases with it
// (forward of layer 3, backward, ...) and the copy streams their copies, so `strata profile`
// shows device time and the copy time that hid behind compute, as the CPU backend's stream
// threads show theirs.
//
// Points: point(stream, category, name, index) says that the work queued on `stream` from now
// on belongs to span (category, name, index), until the next point; a null name ends the span
// without starting another. A span's start and end are the completion times of the events
// recorded at its two points.
//
// Clock: the first point after tracing starts records an anchor event and waits for it, so
// the trace time of one GPU instant is known (the wait ends within microseconds of the event);
// every other event's time is the anchor's plus cudaEventElapsedTime (half-microsecond
// resolution). A timeline assumes one trace::start() in its life (a profile's).
//
// Costs nothing while tracing is off (one flag read per point). Not thread-safe: the owner of
// the stream(s) calls it. REQUIRES: the streams belong to the current device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "core/trace.h"

namespace strata {

class CudaTimeline {
 public:
  explicit CudaTimeline(const char* track_name);  // a static string
  ~CudaTimeline();
  CudaTimeline(const CudaTimeline&) = delete;
  CudaTimeline& operator=(const CudaTimeline&) = delete;

  void point(cudaStream_t stream, const char* category, const char* name, int64_t index = trace::kNoIndex);
  // Moves the spans whose end has completed to the track. With `wait`, waits for every point
  // first (free after the streams were synchronized).
  void flush(bool wait);

 private:
  struct Point {
    const char* category;
    const char* name;  // null: the end of the previous span only
    int64_t index;
    cudaEvent_t event;
    int64_t ns = -1;  // the event's trace time, once known
  };
  cudaEvent_t take_event();
  // The trace time of p's event, when it has completed (waiting for it with `wait`).
  bool resolve(Point& p, bool wait);

  trace::Track track_;
  cudaEvent_t anchor_ = nullptr;
  int64_t anchor_ns_ = -1;
  std::deque<Point> points_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace strata
