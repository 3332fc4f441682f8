// Host dispatch latency in C++: a RecordFunction observer that times every aten op while a sampling window
// is open, for a fraction of the cost of a Python dispatch mode (tens of ns per op instead of microseconds).
//
// One observer per process, registered while a window is open and removed at its close. It times each
// op from its RecordFunction start to its end on the thread that runs it (nested ops are timed too: each op
// is one sample) and appends (window step, seconds) to a bounded multi-producer ring; the timing manager's
// thread takes them, counted into histogram buckets per step (take()). A full ring drops the sample and
// counts it; nothing waits or allocates. Each sample also carries a hash of its op's name, so that take() can
// hand over each op's fastest time in the step, which OpShift (op_shift.cpp) compares with a baseline.
//
// For benchmarks and tests, inject_delay(seconds) registers a second observer, always enabled, that
// busy-waits at the end of every op: a slower host, inside each op's timed interval.
//
// The same extension records gloo groups' collectives without Python (collectives.cpp), and stamps the
// completions of the collectives that the Python hooks record (stamp_completion): a C++ callback on the work's future
// notes the host time at which the collective completed, on the thread that completes it (gloo's), without
// the GIL; the timing manager reads the stamp at its next drain. A Python callback there would take the GIL
// from training for every collective, and create and destroy a Python thread state each time.

#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>

#include "clock.h"
#include "op_shift.h"
#include "dispatch_timer.h"

namespace {

constexpr uint64_t kCapacity = 1 << 17;  // samples between two takes: 5 s of windows of a fast job
constexpr int kMaxDepth = 64;            // nesting of ops on one thread that is timed

struct Slot {
  std::atomic<uint64_t> ready{0};  // the claim index + 1 once written, so a reader sees whole samples only
  int64_t step = 0;
  double seconds = 0.0;
  uint64_t op = 0;  // a hash of the op's name (names are not all alive by the time they are taken)
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

using flare::now_ns;

// FNV-1a over the name's length and its last 24 characters (where op names differ: the autograd ones share a
// 37-character prefix): a key per op for ~10 ns; a collision only merges two ops' minimums.
inline uint64_t name_hash(const char* name) {
  uint64_t hash = 1469598103934665603ULL;
  if (name == nullptr) return hash;
  size_t length = std::strlen(name);
  hash = (hash ^ length) * 1099511628211ULL;
  for (size_t index = length > 24 ? length - 24 : 0; index < length; ++index) {
    hash = (hash ^ static_cast<unsigned char>(name[index])) * 1099511628211ULL;
  }
  return hash;
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

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
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
  slot.op = name_hash(fn.name());
  slot.ready.store(index + 1, std::memory_order_release);
}

void busy_wait(const at::RecordFunction&, at::ObserverContext*) {
  int64_t until = now_ns() + delay_ns.load(std::memory_order_relaxed);  // reads the clock at 0 s as well
  while (now_ns() < until) {
  }
}

std::unique_ptr<at::ObserverContext> no_start(const at::RecordFunction&) { return nullptr; }

}  // namespace

namespace flare {

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

}  // namespace flare

namespace {

using flare::StepCounts;

// The samples written since the last take, bucketed by `bounds` (ascending upper bounds; index
// len(bounds) is +Inf; a sample equal to a bound counts in that bound's bucket, as Python's bisect_left),
// one StepCounts per step in the order first seen. The single consumer's call: per-sample Python work on
// the timing thread would hold the GIL against training for every op of every window.
std::vector<StepCounts> take(const std::vector<double>& bounds) {
  std::vector<StepCounts> taken_steps;
  std::vector<int64_t> counts(bounds.size() + 1, 0);
  auto flush = [&]() {
    StepCounts& last = taken_steps.back();
    for (size_t index = 0; index < counts.size(); ++index) {
      if (counts[index]) last.buckets.emplace_back(static_cast<int64_t>(index), counts[index]);
      counts[index] = 0;
    }
  };
  uint64_t next = taken.load(std::memory_order_relaxed);
  uint64_t end = claimed.load(std::memory_order_acquire);
  for (; next < end; ++next) {
    Slot& slot = ring[next % kCapacity];
    if (slot.ready.load(std::memory_order_acquire) != next + 1) break;  // still being written: next time
    if (taken_steps.empty() || taken_steps.back().step != slot.step) {
      if (!taken_steps.empty()) flush();
      taken_steps.push_back({slot.step, 0.0, {}, {}});
    }
    taken_steps.back().seconds += slot.seconds;
    auto [minimum, first] = taken_steps.back().op_minimums.try_emplace(slot.op, slot.seconds);
    if (!first && slot.seconds < minimum->second) minimum->second = slot.seconds;
    ++counts[std::lower_bound(bounds.begin(), bounds.end(), slot.seconds) - bounds.begin()];
  }
  if (!taken_steps.empty()) flush();
  taken.store(next, std::memory_order_release);
  return taken_steps;
}

uint64_t dropped_samples() { return dropped.load(std::memory_order_relaxed); }

// Busy-wait `seconds` at the end of every aten op from now on. 0 keeps the injector's observer registered
// without waiting (so that a benchmark's healthy and delayed steps differ by the wait alone); a negative
// value removes it. Benchmarks and tests only.
void inject_delay(double seconds) {
  delay_ns.store(static_cast<int64_t>(std::max(seconds, 0.0) * 1e9), std::memory_order_relaxed);
  if (seconds >= 0 && delay_handle == at::INVALID_CALLBACK_HANDLE) {
    delay_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(no_start, busy_wait).scopes({at::RecordScope::FUNCTION}).needsIds(false));
  } else if (seconds < 0 && delay_handle != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(delay_handle);
    delay_handle = at::INVALID_CALLBACK_HANDLE;
  }
}

// When a collective's future completed (perf_counter seconds), and whether it completed with an error.
struct CompletionStamp {
  std::atomic<int64_t> completed_ns{0};  // 0 until the future completes; written once, by its callback
  std::atomic<bool> failed{false};       // written before completed_ns

  std::optional<double> completed_at() const {
    int64_t ns = completed_ns.load(std::memory_order_acquire);
    if (ns == 0) return std::nullopt;
    return static_cast<double>(ns) * 1e-9;
  }
  bool has_failed() const { return failed.load(std::memory_order_acquire); }
};

// A stamp that the future's completion fills in (at once, if the future has completed already).
std::shared_ptr<CompletionStamp> stamp_completion(const std::shared_ptr<torch::jit::PythonFutureWrapper>& future) {
  auto stamp = std::make_shared<CompletionStamp>();
  future->fut->addCallback(
      [stamp](c10::ivalue::Future& done) {
        stamp->failed.store(done.hasError(), std::memory_order_relaxed);
        stamp->completed_ns.store(now_ns(), std::memory_order_release);
      },
      /*uses_future=*/false);
  return stamp;
}

}  // namespace

void flare::add_dispatch_timer(pybind11::module_& m) {
  m.def("open_window", &flare::open_window, "time every aten op from now on, tagged with the window's step");
  m.def("close_window", &flare::close_window, "stop timing ops");
  pybind11::class_<StepCounts>(m, "StepCounts")
      .def_readonly("step", &StepCounts::step)
      .def_readonly("seconds", &StepCounts::seconds, "the sum of the step's samples")
      .def_readonly("buckets", &StepCounts::buckets, "(bucket index, samples) for buckets with samples")
      .def_readonly("op_minimums", &StepCounts::op_minimums,
                    "op (a hash of its name) -> its shortest sample (OpShift.add reads it without a dict)");
  m.def("take", &take, "the samples since the last take, bucketed by these bounds: a StepCounts per step");
  m.def("dropped_samples", &dropped_samples, "samples dropped because the ring was full");
  m.def("inject_delay", &inject_delay,
        "busy-wait this long at the end of every aten op (0: observer kept, no wait; < 0: removed)");
  m.attr("capacity") = kCapacity;
  pybind11::class_<CompletionStamp, std::shared_ptr<CompletionStamp>>(m, "CompletionStamp")
      .def_property_readonly("completed_at", &CompletionStamp::completed_at,
                             "perf_counter time of the future's completion; None until it completes")
      .def_property_readonly("failed", &CompletionStamp::has_failed, "the future completed with an error");
  m.def("stamp_completion", &stamp_completion,
        "a CompletionStamp that the future's completion fills in, from C++ on the completing thread");
}
