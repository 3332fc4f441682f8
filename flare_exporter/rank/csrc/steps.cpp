// Optimizer steps counted in C++ (progress.py): the global optimizer step hook is a C function, so that a
// step costs the training thread no Python frame. Python's hook, compiled out of the cache by the backward
// pass just before it, cost 10-16 µs per step; this one is a few compare-and-stores.
//
// StepCounter keeps what StepTracker exposes: the step count, the time of the last step (the heartbeat), a
// histogram of step durations, and the last `kept` step boundaries (step number, time) for the straggler
// windows. The training thread is its only writer; readers (scrapes, the timing manager) read atomics, and
// the boundaries through a per-slot sequence check, so no lock is shared with them.
//
// On CPU hosts the counter itself opens the host dispatch timer's window (dispatch_timer.cpp) on one step in N and
// closes it at the next (set_windows). Where the ILD sampler needs Python for its windows (a GPU without the
// native shim: a dispatch mode that records CUDA events), it is the step's listener instead, called only on
// the steps that concern it: every `every`-th step, and the step after any call that returned true. The other
// steps run no Python at all.
//
// It also keeps the step breakdown's phase clock (rank/perf.py), once set_phases turns it on: a second C
// function, the optimizer step pre hook, notes when the counted optimizer's step starts (and the host gaps
// then, in a window); the step hook adds the optimizer step's time to a running total, reads the host gaps
// (dispatch_timer.cpp) where a window closed or opened, and appends a mark: the running totals at the step's
// end (step, data loader seconds, optimizer seconds, host gaps, of them those inside the data loader and the
// optimizer step, windows measured whole; -1 windows: gaps not read). The data loader's time comes from
// Python (add_data). The FLOP counter's listener is called on its step and after any call that returned true.

#include "steps.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <tuple>
#include <vector>

#include "clock.h"
#include "dispatch_timer.h"

namespace flare {
namespace {

// What a weak reference refers to, compared by identity only (nullptr once it died).
PyObject* referent_of(PyObject* weak_reference) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* referent = nullptr;
  if (PyWeakref_GetRef(weak_reference, &referent) < 0) PyErr_Clear();
  Py_XDECREF(referent);  // never dereferenced: the caller holds the object it compares it with
  return referent;
#else
  PyObject* referent = PyWeakref_GetObject(weak_reference);  // borrowed; None once it died
  if (referent == nullptr) PyErr_Clear();
  return referent == Py_None ? nullptr : referent;
#endif
}

// The phase clock's running totals at a step's end (perf.py's StepMark).
using Mark = std::tuple<int64_t, double, double, double, double, int64_t>;

struct Listener {
  PyObject* callable = nullptr;  // a strong reference, or nullptr: none
  int64_t every = 0;             // called on every `every`-th step (0: never) ...
  int64_t at = 0;                // ... on step `at` (0: none) ...
  bool call_next = false;        // ... and on the step after a call that returned true

  bool due(int64_t step) const {
    return callable != nullptr && (call_next || (every > 0 && step % every == 0) || step == at);
  }

  void set(pybind11::object listener, int64_t every_steps, int64_t at_step) {
    PyObject* old = callable;
    callable = listener.is_none() ? nullptr : listener.release().ptr();
    every = every_steps;
    at = at_step;
    call_next = false;
    Py_XDECREF(old);
  }
};

struct Boundary {
  std::atomic<int64_t> step{0};  // 0 while being written
  std::atomic<int64_t> at_ns{0};
};

class StepCounter {
 public:
  StepCounter(std::vector<double> bounds, int64_t kept)
      : bounds_(std::move(bounds)),
        counts_(new std::atomic<uint64_t>[bounds_.size() + 1]()),
        boundaries_(new Boundary[std::max<int64_t>(kept, 1)]),
        kept_(std::max<int64_t>(kept, 1)) {}

  ~StepCounter() {  // the last reference goes with a Python object: the GIL is held
    Py_CLEAR(counted_ref_);
    Py_CLEAR(listener_.callable);
    Py_CLEAR(phase_listener_.callable);
  }

  // The hook's body, on the training thread with the GIL held. False: the listener raised an exception that
  // must reach the caller (KeyboardInterrupt, SystemExit); every Exception is counted and cleared.
  bool on_step(PyObject* optimizer) {
    // The counted optimizer, unless it died and another took its address; else a second optimizer's step
    // (one step is counted once), or the first step of the next optimizer once the counted one died.
    bool counted = optimizer == counted_ && (counted_ref_ == nullptr || referent_of(counted_ref_) == optimizer);
    if (!counted && !adopt(optimizer)) return true;
    int64_t now = now_ns();
    int64_t last = last_step_ns_.load(std::memory_order_relaxed);
    if (last != 0) observe(static_cast<double>(now - last) * 1e-9);
    int64_t step = steps_.load(std::memory_order_relaxed) + 1;
    Boundary& slot = boundaries_[step % kept_];
    slot.step.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    slot.at_ns.store(now, std::memory_order_relaxed);
    slot.step.store(step, std::memory_order_release);
    last_step_ns_.store(now, std::memory_order_release);
    steps_.store(step, std::memory_order_release);
    bool windowed = window_open_;  // this step ran in a window
    if (windowed) close_open_window();
    bool opened = window_every_ > 0 && step % window_every_ == 0;
    if (opened) open_step_window(step);
    if (phases_) mark_phases(step, now, windowed, windowed || opened);
    if (phase_listener_.due(step) && !call_listener(phase_listener_, step)) return false;
    if (listener_.due(step)) return call_listener(listener_, step);
    return true;
  }

  // The pre hook's body: the counted optimizer's step starts (training thread, GIL held).
  void before_step(PyObject* optimizer) {
    if (!phases_ || (counted_ != nullptr && optimizer != counted_)) return;
    optimizer_started_ns_ = now_ns();
    if (window_open_ && phase_gaps_) optimizer_gaps_ = std::get<0>(host_gaps());
  }

  int64_t steps() const { return steps_.load(std::memory_order_acquire); }

  double last_step_at() const { return static_cast<double>(last_step_ns_.load(std::memory_order_acquire)) * 1e-9; }

  // (count per bucket, the last one +Inf; sum of the durations)
  std::tuple<std::vector<uint64_t>, double> durations() const {
    std::vector<uint64_t> counts(bounds_.size() + 1);
    for (size_t index = 0; index < counts.size(); ++index) counts[index] = counts_[index].load(std::memory_order_relaxed);
    return {counts, sum_.load(std::memory_order_relaxed)};
  }

  // (step, perf_counter time) of the kept boundaries after step `after`, oldest first
  std::vector<std::tuple<int64_t, double>> boundaries(int64_t after) const {
    int64_t newest = steps();
    std::vector<std::tuple<int64_t, double>> out;
    int64_t first = std::max({after + 1, newest - kept_ + 1, int64_t{1}});
    if (first > newest) return out;
    out.reserve(static_cast<size_t>(newest - first + 1));
    for (int64_t step = first; step <= newest; ++step) {
      const Boundary& slot = boundaries_[step % kept_];
      int64_t seen = slot.step.load(std::memory_order_acquire);
      int64_t at = slot.at_ns.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seen == step && slot.step.load(std::memory_order_relaxed) == step) {
        out.emplace_back(step, static_cast<double>(at) * 1e-9);
      }  // else overwritten by a newer step while we read: it is no longer kept
    }
    return out;
  }

  // Called on the training thread (under the GIL) as described at the top; None removes it.
  void set_listener(pybind11::object listener, int64_t every) { listener_.set(std::move(listener), every, 0); }

  // The FLOP counter's: called on step `at` and on the step after any call that returned true.
  void set_phase_listener(pybind11::object listener, int64_t at) { phase_listener_.set(std::move(listener), 0, at); }

  // Keep the phase clock's marks from the next step on (`gaps`: read the host gaps too); off: no marks, and
  // the gaps are no longer read (a GPU process). Under the GIL, as the hooks run.
  void set_phases(bool on, bool gaps) {
    phases_ = on;
    phase_gaps_ = on && gaps;
    gaps_ = phase_gaps_ ? host_gaps() : std::tuple<double, int64_t>{0.0, -1};
  }

  bool phase_gaps() const { return phase_gaps_; }

  // The data loader's next took `seconds`, of which `gap_seconds` host gaps (timed_next, perf.py).
  void add_data(double seconds, double gap_seconds) {
    data_seconds_ += seconds;
    phase_gap_seconds_ += gap_seconds;
  }

  // The marks since the last take, oldest first (the last `kept` of them).
  std::vector<Mark> take_marks() {
    std::vector<Mark> out(marks_.begin(), marks_.end());
    marks_.clear();
    return out;
  }

  // Open the host dispatch timer's window on every `every`-th step and close it at the next: from now on, if
  // the last step is one of them (the ILD sampler hands its windows over from its listener), else from the
  // next. 0: never, and an open window is closed now. Called under the GIL, as the hook runs.
  void set_windows(int64_t every) {
    window_every_ = std::max<int64_t>(every, 0);
    int64_t step = steps();
    if (window_every_ == 0 && window_open_) close_open_window();
    if (window_every_ > 0 && !window_open_ && step > 0 && step % window_every_ == 0) open_step_window(step);
  }

  bool window_open() const { return window_open_; }

  int64_t windows_closed() const { return windows_closed_; }

  uint64_t listener_errors() const { return listener_errors_.load(std::memory_order_relaxed); }

 private:
  bool adopt(PyObject* optimizer) {
    if (counted_ref_ != nullptr) {
      if (referent_of(counted_ref_) != nullptr) return false;
      Py_CLEAR(counted_ref_);
    }
    counted_ref_ = PyWeakref_NewRef(optimizer, nullptr);
    if (counted_ref_ == nullptr) PyErr_Clear();  // not weakly referenceable: counted by identity alone
    counted_ = optimizer;
    return true;
  }

  void open_step_window(int64_t step) {
    open_window(step);
    window_open_ = true;
  }

  void close_open_window() {
    close_window();
    window_open_ = false;
    ++windows_closed_;
  }

  // The step's end for the phase clock: its optimizer time, the gaps where a window closed or opened (the
  // only steps where they move whole), and its mark.
  void mark_phases(int64_t step, int64_t now, bool windowed, bool window_moved) {
    if (phase_gaps_ && window_moved) gaps_ = host_gaps();
    if (optimizer_started_ns_ != 0) {
      optimizer_seconds_ += static_cast<double>(now - optimizer_started_ns_) * 1e-9;
      if (windowed && phase_gaps_) phase_gap_seconds_ += std::get<0>(gaps_) - optimizer_gaps_;
      optimizer_started_ns_ = 0;
    }
    if (static_cast<int64_t>(marks_.size()) >= kept_) marks_.pop_front();
    marks_.emplace_back(step, data_seconds_, optimizer_seconds_, std::get<0>(gaps_), phase_gap_seconds_,
                        phase_gaps_ ? std::get<1>(gaps_) : int64_t{-1});
  }

  void observe(double seconds) {
    size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), seconds) - bounds_.begin();
    counts_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_.store(sum_.load(std::memory_order_relaxed) + seconds, std::memory_order_relaxed);
  }

  bool call_listener(Listener& due, int64_t step) {
    PyObject* listener = due.callable;
    Py_INCREF(listener);  // set_listener may drop it while the call runs Python
    PyObject* number = PyLong_FromLongLong(step);
    PyObject* result = number != nullptr ? PyObject_CallOneArg(listener, number) : nullptr;
    Py_XDECREF(number);
    Py_DECREF(listener);
    if (result != nullptr) {
      int wants_next = PyObject_IsTrue(result);
      Py_DECREF(result);
      due.call_next = wants_next == 1;
      if (wants_next >= 0) return true;
    }
    due.call_next = false;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return false;
    PyErr_Clear();
    listener_errors_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
  std::unique_ptr<Boundary[]> boundaries_;
  const int64_t kept_;
  std::atomic<int64_t> steps_{0};
  std::atomic<int64_t> last_step_ns_{0};
  std::atomic<uint64_t> listener_errors_{0};
  PyObject* counted_ = nullptr;      // the optimizer whose steps are counted (compared by identity)
  PyObject* counted_ref_ = nullptr;  // a weak reference to it: once it dies, the next optimizer is counted
  Listener listener_;        // the ILD sampler's (set_listener)
  Listener phase_listener_;  // the FLOP counter's (set_phase_listener)
  int64_t window_every_ = 0;
  bool window_open_ = false;
  int64_t windows_closed_ = 0;
  // the phase clock: written on the training thread, read by take_marks, all under the GIL
  bool phases_ = false;
  bool phase_gaps_ = false;
  int64_t optimizer_started_ns_ = 0;
  double optimizer_gaps_ = 0.0;  // the host gaps when the optimizer step started, in a window
  double data_seconds_ = 0.0;
  double optimizer_seconds_ = 0.0;
  double phase_gap_seconds_ = 0.0;
  std::tuple<double, int64_t> gaps_{0.0, -1};  // the last reading of the host gaps
  std::deque<Mark> marks_;
};

constexpr const char* kCapsuleName = "flare.StepCounter";

// The counter a hook's self (a capsule) holds; nullptr, with no error set, if it holds none.
StepCounter* counter_of(PyObject* self) {
  auto* counter = static_cast<std::shared_ptr<StepCounter>*>(PyCapsule_GetPointer(self, kCapsuleName));
  if (counter == nullptr) PyErr_Clear();
  return counter != nullptr ? counter->get() : nullptr;
}

// The hooks torch calls as hook(optimizer, args, kwargs).
PyObject* step_hook(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  StepCounter* counter = counter_of(self);
  if (counter != nullptr && nargs >= 1 && !counter->on_step(args[0])) return nullptr;
  Py_RETURN_NONE;
}

PyObject* step_start_hook(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  StepCounter* counter = counter_of(self);
  if (counter != nullptr && nargs >= 1) counter->before_step(args[0]);
  Py_RETURN_NONE;
}

PyMethodDef step_hook_def = {"flare_step_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step_hook)),
                             METH_FASTCALL, "flare-exporter's optimizer step post hook (hook(optimizer, args, kwargs))"};

PyMethodDef step_start_hook_def = {
    "flare_step_start_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step_start_hook)),
    METH_FASTCALL, "flare-exporter's optimizer step pre hook (hook(optimizer, args, kwargs)): the phase clock's"};

void free_capsule(PyObject* capsule) {
  delete static_cast<std::shared_ptr<StepCounter>*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

pybind11::object make_hook(const std::shared_ptr<StepCounter>& counter, PyMethodDef* definition) {
  auto* held = new std::shared_ptr<StepCounter>(counter);
  PyObject* capsule = PyCapsule_New(held, kCapsuleName, free_capsule);
  if (capsule == nullptr) {
    delete held;
    throw pybind11::error_already_set();
  }
  PyObject* hook = PyCFunction_NewEx(definition, capsule, nullptr);
  Py_DECREF(capsule);
  if (hook == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(hook);
}

}  // namespace

void add_steps(pybind11::module_& module) {
  pybind11::class_<StepCounter, std::shared_ptr<StepCounter>>(module, "StepCounter")
      .def(pybind11::init<std::vector<double>, int64_t>(), pybind11::arg("bounds"), pybind11::arg("kept"))
      .def_property_readonly(
          "hook", [](const std::shared_ptr<StepCounter>& counter) { return make_hook(counter, &step_hook_def); },
          "a C function to register with torch's register_optimizer_step_post_hook")
      .def_property_readonly(
          "start_hook",
          [](const std::shared_ptr<StepCounter>& counter) { return make_hook(counter, &step_start_hook_def); },
          "a C function to register with torch's register_optimizer_step_pre_hook: the phase clock's")
      .def_property_readonly("steps", &StepCounter::steps, "optimizer steps counted")
      .def_property_readonly("last_step_at", &StepCounter::last_step_at,
                             "perf_counter time of the last step (0 before the first)")
      .def("durations", &StepCounter::durations,
           "(count per bucket of `bounds`, then +Inf; sum of seconds) of the step durations")
      .def("boundaries", &StepCounter::boundaries, pybind11::arg("after") = 0,
           "[(step, perf_counter time)] of the kept steps after step `after`, oldest first")
      .def("set_listener", &StepCounter::set_listener, pybind11::arg("listener"), pybind11::arg("every"),
           "call listener(step) on every `every`-th step and on the step after any call that returned true")
      .def("set_windows", &StepCounter::set_windows, pybind11::arg("every"),
           "open the host dispatch timer's window on every `every`-th step, close it at the next (0: never)")
      .def("set_phase_listener", &StepCounter::set_phase_listener, pybind11::arg("listener"), pybind11::arg("at"),
           "call listener(step) on step `at` and on the step after any call that returned true")
      .def("set_phases", &StepCounter::set_phases, pybind11::arg("on"), pybind11::arg("gaps"),
           "keep the phase clock's marks from the next step on; `gaps`: read the host gaps too")
      .def_property_readonly("phase_gaps", &StepCounter::phase_gaps, "the phase clock reads the host gaps")
      .def("add_data", &StepCounter::add_data, pybind11::arg("seconds"), pybind11::arg("gap_seconds"),
           "the data loader's next took `seconds`, of which `gap_seconds` host gaps")
      .def("take_marks", &StepCounter::take_marks,
           "[(step, data, optimizer, gaps, phase gaps, windows)] since the last take, oldest first")
      .def_property_readonly("window_open", &StepCounter::window_open, "a window it opened is open")
      .def_property_readonly("windows_closed", &StepCounter::windows_closed, "windows it opened and closed")
      .def_property_readonly("listener_errors", &StepCounter::listener_errors,
                             "exceptions the listener raised (each counted and cleared)");
}

}  // namespace flare
