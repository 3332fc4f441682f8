// The host dispatch timer's windows (op_timer.cpp), opened and closed by the step counter (steps.cpp) too.
// Called with the GIL held, which keeps the opens and closes of all their callers in one order.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flare {

// Time every aten op from now on, tagged with `step` (a RecordFunction observer, added if absent).
void open_window(int64_t step);

// Stop timing ops (the observer is removed).
void close_window();

// One step's samples since the last take, counted into histogram buckets, and each op's fastest time.
struct StepCounts {
  int64_t step;
  double seconds;                                     // their sum
  std::vector<std::pair<int64_t, int64_t>> buckets;  // (bucket index, samples), for buckets with samples
  std::unordered_map<uint64_t, double> op_minimums;   // op (name hash) -> its shortest sample in the step
};

}  // namespace flare
