// The pictures of `strata profile`: one step's timeline (a lane per thread, stream and the
// nvme queue) and memory per tier over that step, as SVG drawn from the trace's events.
#pragma once

#include <string>
#include <vector>

#include "core/trace.h"

namespace strata::tools {

// The traced step to draw: the one whose duration is the median (a typical step, not the
// first after warm-up or one with a checkpoint). Returns its [start, end) in trace ns; false
// when the trace holds no step span on `training_thread`.
bool pick_step(const std::vector<trace::ThreadEvents>& threads, const std::string& training_thread, int64_t* start_ns,
               int64_t* end_ns, int64_t* step);

std::string timeline_svg(const std::vector<trace::ThreadEvents>& threads, const std::string& training_thread,
                         int64_t start_ns, int64_t end_ns, int64_t step);
std::string memory_svg(const std::vector<trace::ThreadEvents>& threads, int64_t start_ns, int64_t end_ns,
                       int64_t step);

}  // namespace strata::tools
