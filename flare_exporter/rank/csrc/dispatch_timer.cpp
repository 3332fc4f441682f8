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
// The host gaps: on the thread that opened the window (the training thread: the step hook opens it), each
// stretch of time outside top-level ops - from the window's open to its first op, from each top-level op's
// end to the next one's start, from the last op's end to the window's close - is a gap: the interpreter
// between ops, waits for the GIL, garbage collection, and the waits that run no op (the data loader's queue,
// a collective's wait, a sleep). A gap in which one of the process's collectives completed (note_completion:
// the recording backend's and the completion stamps' callbacks) was a wait for it - DDP's at the end of the
// backward pass, a work's wait() - and is left out: that time is the collective phase's. Each other gap is a
// sample in the same ring, marked as a gap (op kGapOp), which take() counts apart; the thread also adds it to
// a running total that host_gaps() reads (the step's phases: rank/perf.py). It costs the window's thread a
// load, a subtraction, an add and a ring slot per top-level op, with the timestamps the op's own timing reads
// anyway; nested ops and other threads' ops cost nothing more.
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
#include <tuple>
#include <unordered_map>

#include "clock.h"
#include "op_shift.h"
#include "dispatch_timer.h"

namespace {

constexpr uint64_t kCapacity = 1 << 17;  // samples between two takes: 5 s of windows of a fast job
constexpr int kMaxDepth = 64;            // nesting of ops on one thread that is timed
constexpr uint64_t kGapOp = 0;           // the op of a gap's sample (an op name's hash is never 0 in practice)

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
  // The window's thread only (0 elsewhere): when its current gap began (the window's open, or its last
  // top-level op's end).
  int64_t gap_from_ns = 0;
  int64_t started_ns[kMaxDepth] = {};
};
thread_local ThreadStack stack;  // constant-initialised: no guard on each access

// Written by the window's thread only (relaxed loads and stores: one writer), read by host_gaps().
std::atomic<int64_t> gap_total_ns{0};  // every window's gaps so far
std::atomic<int64_t> gap_windows{0};   // windows closed on the thread that opened them: their gaps are whole
std::atomic<int64_t> last_completion_ns{0};  // when a collective last completed (note_completion)

using flare::now_ns;

// A hash of the name's length and its last 24 characters (where op names differ: the autograd ones share a
// 37-character prefix), taken eight bytes at a time (a multiply and a shift each): a key per op for a few
// ns; a collision only merges two ops' minimums.
inline uint64_t name_hash(const char* name) {
  constexpr uint64_t kPrime = 0x9E3779B97F4A7C15ULL;
  uint64_t hash = 1469598103934665603ULL;
  if (name == nullptr) return hash;
  size_t length = std::strlen(name);
  hash = (hash ^ length) * kPrime;
  size_t index = length > 24 ? length - 24 : 0;
  for (; index + 8 <= length; index += 8) {
    uint64_t word;
    std::memcpy(&word, name + index, 8);
    hash = (hash ^ word) * kPrime;
    hash ^= hash >> 29;
  }
  uint64_t tail = 0;
  for (; index < length; ++index) tail = (tail << 8) | static_cast<unsigned char>(name[index]);
  hash = (hash ^ tail) * kPrime;
  return hash ^ (hash >> 32);
}

// One sample into the ring, tagged with the window's step; a full ring drops it and counts it.
void push(double seconds, uint64_t op) {
  uint64_t index = claimed.load(std::memory_order_relaxed);
  do {
    if (index - taken.load(std::memory_order_acquire) >= kCapacity) {  // the consumer is behind: keep its
      dropped.fetch_add(1, std::memory_order_relaxed);                 // unread samples, drop this one
      return;
    }
  } while (!claimed.compare_exchange_weak(index, index + 1, std::memory_order_relaxed));
  Slot& slot = ring[index % kCapacity];
  slot.step = window_step.load(std::memory_order_relaxed);
  slot.seconds = seconds;
  slot.op = op;
  slot.ready.store(index + 1, std::memory_order_release);
}

// A gap of the window's thread, from `from` to `now`, ended: a sample, unless a collective completed in it (a
// wait).
void end_gap(int64_t from, int64_t now) {
  if (last_completion_ns.load(std::memory_order_relaxed) >= from) return;
  int64_t gap = now - from;
  gap_total_ns.store(gap_total_ns.load(std::memory_order_relaxed) + gap, std::memory_order_relaxed);
  push(static_cast<double>(gap) * 1e-9, kGapOp);
}

// This thread's stack, its address taken once: a shared object reaches its thread-locals through
// __tls_get_addr, which the compiler would otherwise call again at each use (the empty asm hides where the
// pointer came from, so it stays in a register).
inline ThreadStack& this_thread_stack() {
  ThreadStack* s = &stack;
  asm("" : "+r"(s));
  return *s;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  int64_t started = now_ns();
  ThreadStack& s = this_thread_stack();
  uint64_t window = window_id.load(std::memory_order_relaxed);
  if (s.window != window) {  // first op of this thread in this window (never the window's thread: open set it)
    s.window = window;
    s.depth = 0;
    s.gap_from_ns = 0;
  }
  int64_t gap_from = s.depth == 0 ? s.gap_from_ns : 0;  // the window's thread, between ops: a gap ends
  if (s.depth < kMaxDepth) s.started_ns[s.depth] = started;
  ++s.depth;
  if (gap_from != 0) end_gap(gap_from, started);
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  int64_t ended = now_ns();
  uint64_t op = name_hash(fn.name());
  ThreadStack& s = this_thread_stack();
  if (s.window != window_id.load(std::memory_order_relaxed) || s.depth == 0) return;  // began before the window
  --s.depth;
  if (s.depth == 0 && s.gap_from_ns != 0) s.gap_from_ns = ended;  // the window's thread: a gap begins
  if (s.depth >= kMaxDepth) return;
  push(static_cast<double>(ended - s.started_ns[s.depth]) * 1e-9, op);
}

void busy_wait(const at::RecordFunction&, at::ObserverContext*) {
  int64_t until = now_ns() + delay_ns.load(std::memory_order_relaxed);  // reads the clock at 0 s as well
  while (now_ns() < until) {
  }
}

std::unique_ptr<at::ObserverContext> no_start(const at::RecordFunction&) { return nullptr; }

}  // namespace

namespace flare {

void note_completion(int64_t ns) { last_completion_ns.store(ns, std::memory_order_relaxed); }

// Open a window: ops from now on are timed and tagged with `step`. The observer exists only inside
// windows: a registered callback, even disabled, costs every op outside them a little (about 1 % of the
// benchmark's small step), so it is added here and removed at close, as torch's profiler does.
void open_window(int64_t step) {
  window_step.store(step, std::memory_order_relaxed);
  ThreadStack& s = stack;  // the window's thread: its gaps are measured, the first from now
  s.window = window_id.fetch_add(1, std::memory_order_relaxed) + 1;
  s.depth = 0;
  s.gap_from_ns = now_ns();
  if (timer_handle == at::INVALID_CALLBACK_HANDLE) {
    timer_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                             .scopes({at::RecordScope::FUNCTION})
                                             .needsInputs(false)
                                             .needsOutputs(false)
                                             .needsIds(false));
  }
}

// Close the window: ops that start from now on are not timed. On the thread that opened it, its last gap
// ends now and the window counts as measured whole; elsewhere (a shutdown, a hand-back) it does not.
void close_window() {
  if (timer_handle != at::INVALID_CALLBACK_HANDLE) {
    ThreadStack& s = stack;
    if (s.window == window_id.load(std::memory_order_relaxed) && s.gap_from_ns != 0 && s.depth == 0) {
      end_gap(s.gap_from_ns, now_ns());
      gap_windows.fetch_add(1, std::memory_order_relaxed);
    }
    s.gap_from_ns = 0;
    at::removeCallback(timer_handle);
    timer_handle = at::INVALID_CALLBACK_HANDLE;
  }
}

// (seconds, windows): every window's gaps so far - with the current gap, when called between ops on the
// thread of an open window (the phase hooks: rank/perf.py) - and the windows measured whole.
std::tuple<double, int64_t> host_gaps() {
  int64_t total = gap_total_ns.load(std::memory_order_relaxed);
  const ThreadStack& s = stack;
  if (timer_handle != at::INVALID_CALLBACK_HANDLE && s.window == window_id.load(std::memory_order_relaxed) &&
      s.gap_from_ns != 0 && s.depth == 0) {
    total += now_ns() - s.gap_from_ns;
  }
  return {static_cast<double>(total) * 1e-9, gap_windows.load(std::memory_order_relaxed)};
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
  std::vector<int64_t> gap_counts(bounds.size() + 1, 0);
  auto flush = [&]() {
    StepCounts& last = taken_steps.back();
    for (size_t index = 0; index < counts.size(); ++index) {
      if (counts[index]) last.buckets.emplace_back(static_cast<int64_t>(index), counts[index]);
      if (gap_counts[index]) last.gap_buckets.emplace_back(static_cast<int64_t>(index), gap_counts[index]);
      counts[index] = gap_counts[index] = 0;
    }
  };
  uint64_t next = taken.load(std::memory_order_relaxed);
  uint64_t end = claimed.load(std::memory_order_acquire);
  for (; next < end; ++next) {
    Slot& slot = ring[next % kCapacity];
    if (slot.ready.load(std::memory_order_acquire) != next + 1) break;  // still being written: next time
    if (taken_steps.empty() || taken_steps.back().step != slot.step) {
      if (!taken_steps.empty()) flush();
      taken_steps.push_back({slot.step, 0.0, {}, {}, 0.0, {}});
    }
    size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), slot.seconds) - bounds.begin();
    if (slot.op == kGapOp) {
      taken_steps.back().gap_seconds += slot.seconds;
      ++gap_counts[bucket];
      continue;
    }
    taken_steps.back().seconds += slot.seconds;
    auto [minimum, first] = taken_steps.back().op_minimums.try_emplace(slot.op, slot.seconds);
    if (!first && slot.seconds < minimum->second) minimum->second = slot.seconds;
    ++counts[bucket];
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
        int64_t now = now_ns();
        flare::note_completion(now);
        stamp->failed.store(done.hasError(), std::memory_order_relaxed);
        stamp->completed_ns.store(now, std::memory_order_release);
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
                    "op (a hash of its name) -> its shortest sample (OpShift.add reads it without a dict)")
      .def_readonly("gap_seconds", &StepCounts::gap_seconds, "the sum of the step's host gaps")
      .def_readonly("gap_buckets", &StepCounts::gap_buckets, "(bucket index, gaps) for buckets with gaps");
  m.def("take", &take, "the samples since the last take, bucketed by these bounds: a StepCounts per step");
  m.def("dropped_samples", &dropped_samples, "samples dropped because the ring was full");
  m.def("note_completion", [](double at) { flare::note_completion(static_cast<int64_t>(at * 1e9)); },
        "a collective completed at this perf_counter time (Python's completion callbacks): host gaps around "
        "it are waits");
  m.def("last_completion", []() { return static_cast<double>(last_completion_ns.load()) * 1e-9; },
        "perf_counter time at which a collective last completed (0: none yet)");
  m.def("host_gaps", &flare::host_gaps,
        "(seconds, windows): the window thread's time outside top-level ops in every window so far (with the "
        "current gap, called on that thread between ops), and the windows measured whole");
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
