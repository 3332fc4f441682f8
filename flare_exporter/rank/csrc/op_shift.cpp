// Host dispatch's per-op shift (ild.py's module docstring), kept where the native timer's samples are taken:
// each op's fastest time per sampled step never becomes a Python object. The timing manager's thread hands
// each taken step (a StepCounts) to add(); a scrape's drain reads shift(), recomputed only when a window step
// changed. Written and read under the manager's drain lock only, so it holds no lock of its own.
//
// The steps play the same parts as in ild.Drift, which keeps the same steps' bucket counts: steps before
// `warmup_steps` are left out, the next `baseline_steps` form the baseline, and later ones a ring of the last
// `window_steps` steps that have samples (a late step older than the whole ring is left out).

#include "op_shift.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dispatch_timer.h"

namespace flare {
namespace {

constexpr size_t kMaxOps = 1024;                 // ops followed; more are left out
constexpr size_t kMaxBaselineStepsPerOp = 512;   // fastest times kept per op for its baseline
constexpr size_t kMinBaselineStepsPerOp = 5;     // an op needs this many sampled baseline steps to count
constexpr double kMinOpSpreadSeconds = 10e-9;    // an op's baseline MAD is taken as at least this (the clock's
constexpr double kMinOpSpreadShare = 0.05;       // grain) and this share of its median
constexpr double kProportionalFromSeconds = 2e-6;  // ops at least this long tell the proportional part

using OpTimes = std::unordered_map<uint64_t, double>;  // op (a hash of its name) -> seconds

// The median, as Python's statistics.median: the mean of the middle two of an even count.
double median(std::vector<double> values) {
  size_t middle = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + middle, values.end());
  double upper = values[middle];
  if (values.size() % 2) return upper;
  return (*std::max_element(values.begin(), values.begin() + middle) + upper) / 2;
}

// The value at which half of the total weight lies at or below: (value, weight) pairs, weights > 0.
double weighted_median(std::vector<std::pair<double, double>> values) {
  std::sort(values.begin(), values.end());
  double half = 0.0;
  for (const auto& [value, weight] : values) half += weight;
  half /= 2;
  double below = 0.0;
  for (const auto& [value, weight] : values) {
    below += weight;
    if (below >= half) return value;
  }
  return values.back().first;
}

struct Reference {
  double median;
  double spread;  // the MAD, at least kMinOpSpreadSeconds and kMinOpSpreadShare of the median
};

class OpShift {
 public:
  OpShift(int64_t warmup_steps, int64_t baseline_steps, int64_t window_steps)
      : warmup_steps_(warmup_steps),
        baseline_end_(warmup_steps + baseline_steps),
        window_steps_(static_cast<size_t>(std::max<int64_t>(window_steps, 1))) {}

  // Each op's fastest time in `step`.
  void add(int64_t step, const OpTimes& minimums) {
    if (step < warmup_steps_) return;
    if (step < baseline_end_) {
      for (const auto& [op, seconds] : minimums) {
        auto history = baseline_.find(op);
        if (history == baseline_.end()) {
          if (baseline_.size() >= kMaxOps) continue;
          history = baseline_.emplace(op, std::vector<double>()).first;
        }
        if (history->second.size() < kMaxBaselineStepsPerOp) history->second.push_back(seconds);
      }
      return;
    }
    auto merged = window_.find(step);
    if (merged == window_.end()) {
      if (window_.size() >= window_steps_ && step < window_.begin()->first) return;  // left the window
      merged = window_.emplace(step, OpTimes()).first;
      if (window_.size() > window_steps_) window_.erase(window_.begin());
    }
    for (const auto& [op, seconds] : minimums) {
      if (!baseline_.count(op)) continue;  // an op without a baseline cannot shift from it
      auto [kept, first] = merged->second.try_emplace(op, seconds);
      if (!first && seconds < kept->second) kept->second = seconds;
    }
    changed_ = true;
  }

  // The window's shift from the baseline, in seconds; nullopt without ops to tell it. Estimated on each half
  // of the window's steps (the older and the newer), it is the one nearer zero, or 0 when they disagree in
  // sign: a shift that holds across the window, not a burst in one half.
  std::optional<double> shift() {
    if (!changed_) return shift_;
    changed_ = false;
    if (window_.empty()) return shift_ = std::nullopt;
    if (!references_) references_ = references();
    std::vector<const OpTimes*> steps;
    for (const auto& [step, minimums] : window_) steps.push_back(&minimums);
    size_t middle = steps.size() / 2;
    if (middle == 0) return shift_ = shift_over(steps.begin(), steps.end());
    auto older = shift_over(steps.begin(), steps.begin() + middle);
    auto newer = shift_over(steps.begin() + middle, steps.end());
    if (!older || !newer) return shift_ = std::nullopt;
    if ((*older > 0) != (*newer > 0)) return shift_ = 0.0;
    return shift_ = std::abs(*newer) < std::abs(*older) ? *newer : *older;
  }

  std::vector<int64_t> window_steps() const {
    std::vector<int64_t> steps;
    for (const auto& entry : window_) steps.push_back(entry.first);
    return steps;
  }

  const std::unordered_map<uint64_t, std::vector<double>>& baseline() const { return baseline_; }

  // Ops with a reference (seen in enough baseline steps); nullopt until the window has begun.
  std::optional<size_t> references_count() const {
    if (!references_) return std::nullopt;
    return references_->size();
  }

 private:
  // Op -> its baseline's median and spread, for ops seen in enough baseline steps.
  std::unordered_map<uint64_t, Reference> references() const {
    std::unordered_map<uint64_t, Reference> found;
    for (const auto& [op, history] : baseline_) {
      if (history.size() < kMinBaselineStepsPerOp) continue;
      double middle = median(history);
      std::vector<double> deviations;
      for (double seconds : history) deviations.push_back(std::abs(seconds - middle));
      double spread = std::max({median(deviations), kMinOpSpreadSeconds, kMinOpSpreadShare * middle});
      found.emplace(op, Reference{middle, spread});
    }
    return found;
  }

  // The weighted median over ops of each op's median fastest time in these steps minus its baseline's:
  // first the part proportional to each op's time (a slower core: every op x1.5), from the long ops, each
  // weighted by its relative stability (median / MAD)^2; then what is left, the same for every op, each
  // weighted by 1 / MAD^2, so that the stable short ops weigh most.
  template <typename Steps>
  std::optional<double> shift_over(Steps first, Steps last) const {
    std::unordered_map<uint64_t, std::vector<double>> by_op;
    for (Steps step = first; step != last; ++step) {
      for (const auto& [op, seconds] : **step) by_op[op].push_back(seconds);
    }
    std::vector<std::tuple<double, double, double>> moved;  // (median - baseline's, baseline's, its MAD)
    for (const auto& [op, values] : by_op) {
      auto reference = references_->find(op);
      if (reference == references_->end()) continue;
      const auto& [middle, spread] = reference->second;
      moved.emplace_back(median(values) - middle, middle, spread);
    }
    if (moved.empty()) return std::nullopt;
    std::vector<std::pair<double, double>> relative;
    for (const auto& [difference, middle, spread] : moved) {
      if (middle >= kProportionalFromSeconds) relative.emplace_back(difference / middle, std::pow(middle / spread, 2));
    }
    double proportion = relative.empty() ? 0.0 : weighted_median(relative);
    std::vector<std::pair<double, double>> left;
    for (const auto& [difference, middle, spread] : moved) {
      left.emplace_back(difference - proportion * middle, 1.0 / (spread * spread));
    }
    return weighted_median(left);
  }

  int64_t warmup_steps_;
  int64_t baseline_end_;
  size_t window_steps_;
  std::unordered_map<uint64_t, std::vector<double>> baseline_;  // op -> its fastest time per baseline step
  std::map<int64_t, OpTimes> window_;                            // window step -> each op's fastest time
  std::optional<std::unordered_map<uint64_t, Reference>> references_;  // once the window has begun
  std::optional<double> shift_;
  bool changed_ = false;
};

}  // namespace

void add_op_shift(pybind11::module_& module) {
  pybind11::class_<OpShift>(module, "OpShift")
      .def(pybind11::init<int64_t, int64_t, int64_t>(), pybind11::arg("warmup_steps"),
           pybind11::arg("baseline_steps"), pybind11::arg("window_steps"))
      .def("add", [](OpShift& shift, const StepCounts& taken) { shift.add(taken.step, taken.op_minimums); },
           "a step the timer's take() returned: its ops' fastest times")
      .def(
          "add_minimums",
          [](OpShift& shift, int64_t step, const pybind11::dict& minimums) {
            OpTimes times;
            for (const auto& [op, seconds] : minimums) {
              times.emplace(static_cast<uint64_t>(pybind11::hash(op)), seconds.cast<double>());
            }
            shift.add(step, times);
          },
          "each op's fastest time in `step`, keyed by anything that names the op (tests)")
      .def("shift", &OpShift::shift, "the window's shift from the baseline in seconds, or None")
      .def_property_readonly("window_steps", &OpShift::window_steps, "the window's steps, oldest first")
      .def_property_readonly("baseline", &OpShift::baseline, "op (a hash) -> its fastest time per baseline step")
      .def_property_readonly("references", &OpShift::references_count,
                             "ops seen in enough baseline steps to count; None until the window has begun");
}

}  // namespace flare
