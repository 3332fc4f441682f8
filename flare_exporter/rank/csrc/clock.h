// The host clock that flare's extension stamps events with.
#pragma once

#include <cstdint>
#include <time.h>

namespace flare {

// Nanoseconds of CLOCK_MONOTONIC: the clock of Python's time.perf_counter on Linux.
inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace flare
