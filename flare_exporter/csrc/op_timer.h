// The host dispatch timer's windows (op_timer.cpp), opened and closed by the step counter (steps.cpp) too.
// Called with the GIL held, which keeps the opens and closes of all their callers in one order.
#pragma once

#include <cstdint>

namespace flare {

// Time every aten op from now on, tagged with `step` (a RecordFunction observer, added if absent).
void open_window(int64_t step);

// Stop timing ops (the observer is removed).
void close_window();

}  // namespace flare
