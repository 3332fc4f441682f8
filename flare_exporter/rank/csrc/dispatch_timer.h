// The host dispatch timer (dispatch_timer.cpp): its windows, opened and closed by the step counter (steps.cpp)
// too, and its part of the C++ recorder's module.
// Called with the GIL held, which keeps the opens and closes of all their callers in one order.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flare {

// Time every aten op from now on, tagged with `step` (a RecordFunction observer, added if absent).
void open_window(int64_t step);

// Stop timing ops (the observer is removed).
void close_window();

// (seconds, windows): the window thread's host gaps in every window so far - with the current gap, called
// on that thread between ops - and the windows measured whole. Training thread or any reader.
std::tuple<double, int64_t> host_gaps();

// One step's samples since the last take, counted into histogram buckets, and each op's fastest time; and
// the window thread's host gaps, apart.
struct StepCounts {
  int64_t step;
  double seconds;                                     // the ops' samples' sum
  std::vector<std::pair<int64_t, int64_t>> buckets;  // (bucket index, samples), for buckets with samples
  std::unordered_map<uint64_t, double> op_minimums;   // op (name hash) -> its shortest sample in the step
  double gap_seconds;                                 // the host gaps' sum
  std::vector<std::pair<int64_t, int64_t>> gap_buckets;  // (bucket index, gaps), for buckets with gaps
};

// A collective of this process completed at `ns` (now_ns()), noted where its completion is seen as it happens
// (a future's callback, a wait that returned; not a drain's poll): a host gap in which one completed was a
// wait for it, not host time (dispatch_timer.cpp). Any thread.
void note_completion(int64_t ns);

// The dispatch timer's functions and the completion stamps, added to the C++ recorder's module (module.cpp).
void add_dispatch_timer(pybind11::module_& module);

}  // namespace flare
