// Host dispatch latency in C++: a RecordFunction observer that times every aten op while a sampling window
// is open, for a fraction of the cost of a Python dispatch mode (tens of ns per op instead of microseconds).
//
// One observer per process, registered while a window is open and removed at its close. It times each
// op from its RecordFunction start to its end on the thread that runs it (nested ops are timed too: each op
// is one sample) and appends (window step, seconds) to a bounded multi-producer ring; the timing manager's
// thread takes the samples (take()). A full ring drops the sample and counts it; nothing waits or allocates.
//
// For benchmarks and tests, inject_delay(seconds) registers a second observer, always enabled, that
// busy-waits at the end of every op: a slower host, inside each op's timed interval.

#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <time.h>

namespace {

constexpr uint64_t kCapacity = 1 << 17;  // samples between two takes: 5 s of windows of a fast job
constexpr int kMaxDepth = 64;            // nesting of ops on one thread that is timed

struct Slot {
  std::atomic<uint64_t> ready{0};  // the claim index + 1 once written, so a reader sees whole samples only
  int64_t step = 0;
  double seconds = 0.0;
};

Slot ring[kCapacity];
std::atomic<uint64_t> claimed{0};  // next index to claim (producers)
std::atomic<uint64_t> taken{0};    // next index to take (written by the single consumer)
std::atomic<uint64_t> dropped{0};
std::atomic<int64_t> window_step{0};
std::atomic<uint64_t> window_id{0};  // changes at every open: starts from an earlier window are discarded
at::CallbackHandle timer_handle = at::INVALID_CALLBACK_HANDLE;
at::CallbackHandle delay_handle = at::INVALID_CALLBACK_HANDLE;
std::atomic<int64_t> delay_ns{0};

struct ThreadStack {
  uint64_t window = 0;
  int depth = 0;
  int64_t started_ns[kMaxDepth];
};
thread_local ThreadStack stack;

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // the clock of Python's time.perf_counter on Linux
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  ThreadStack& s = stack;
  uint64_t window = window_id.load(std::memory_order_relaxed);
  if (s.window != window) {  // first op of this thread in this window
    s.window = window;
    s.depth = 0;
  }
  if (s.depth < kMaxDepth) s.started_ns[s.depth] = now_ns();
  ++s.depth;
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) {
  int64_t ended = now_ns();
  ThreadStack& s = stack;
  if (s.window != window_id.load(std::memory_order_relaxed) || s.depth == 0) return;  // began before the window
  --s.depth;
  if (s.depth >= kMaxDepth) return;
  uint64_t index = claimed.load(std::memory_order_relaxed);
  do {
    if (index - taken.load(std::memory_order_acquire) >= kCapacity) {  // the consumer is behind: keep its
      dropped.fetch_add(1, std::memory_order_relaxed);                 // unread samples, drop this one
      return;
    }
  } while (!claimed.compare_exchange_weak(index, index + 1, std::memory_order_relaxed));
  Slot& slot = ring[index % kCapacity];
  slot.step = window_step.load(std::memory_order_relaxed);
  slot.seconds = static_cast<double>(ended - s.started_ns[s.depth]) * 1e-9;
  slot.ready.store(index + 1, std::memory_order_release);
}

void busy_wait(const at::RecordFunction&, at::ObserverContext*) {
  int64_t until = now_ns() + delay_ns.load(std::memory_order_relaxed);
  while (now_ns() < until) {
  }
}

std::unique_ptr<at::ObserverContext> no_start(const at::RecordFunction&) { return nullptr; }

// Open a window: ops from now on are timed and tagged with `step`. The observer exists only inside
// windows: a registered callback, even disabled, costs every op outside them a little (about 1 % of the
// benchmark's small step), so it is added here and removed at close, as torch's profiler does.
void open_window(int64_t step) {
  window_step.store(step, std::memory_order_relaxed);
  window_id.fetch_add(1, std::memory_order_relaxed);
  if (timer_handle == at::INVALID_CALLBACK_HANDLE) {
    timer_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                             .scopes({at::RecordScope::FUNCTION})
                                             .needsInputs(false)
                                             .needsOutputs(false)
                                             .needsIds(false));
  }
}

// Close the window: ops that start from now on are not timed.
void close_window() {
  if (timer_handle != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(timer_handle);
    timer_handle = at::INVALID_CALLBACK_HANDLE;
  }
}

// The samples written since the last take, as (steps, seconds); the single consumer's call.
std::tuple<std::vector<int64_t>, std::vector<double>> take() {
  std::vector<int64_t> steps;
  std::vector<double> seconds;
  uint64_t next = taken.load(std::memory_order_relaxed);
  uint64_t end = claimed.load(std::memory_order_acquire);
  steps.reserve(end - next);
  seconds.reserve(end - next);
  for (; next < end; ++next) {
    Slot& slot = ring[next % kCapacity];
    if (slot.ready.load(std::memory_order_acquire) != next + 1) break;  // still being written: next time
    steps.push_back(slot.step);
    seconds.push_back(slot.seconds);
  }
  taken.store(next, std::memory_order_release);
  return {steps, seconds};
}

uint64_t dropped_samples() { return dropped.load(std::memory_order_relaxed); }

// Busy-wait `seconds` at the end of every aten op from now on (0: stop). Benchmarks and tests only.
void inject_delay(double seconds) {
  delay_ns.store(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  if (seconds > 0 && delay_handle == at::INVALID_CALLBACK_HANDLE) {
    delay_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(no_start, busy_wait).scopes({at::RecordScope::FUNCTION}).needsIds(false));
  } else if (seconds <= 0 && delay_handle != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(delay_handle);
    delay_handle = at::INVALID_CALLBACK_HANDLE;
  }
}

}  // namespace

PYBIND11_MODULE(flare_op_timer, m) {
  m.doc() = "flare-exporter's host dispatch timer: a RecordFunction observer enabled in sampling windows";
  m.def("open_window", &open_window, "time every aten op from now on, tagged with the window's step");
  m.def("close_window", &close_window, "stop timing ops");
  m.def("take", &take, "the samples since the last take: (steps, seconds)");
  m.def("dropped_samples", &dropped_samples, "samples dropped because the ring was full");
  m.def("inject_delay", &inject_delay, "busy-wait this long at the end of every aten op (benchmarks, tests)");
  m.attr("capacity") = kCapacity;
}
