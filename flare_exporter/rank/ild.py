"""Issue-latency distributions (ILD): three distributions per rank, a baseline, and the current drift.

- kernel_issue: device start minus host launch of sampled kernel launches (one in `ild_launch_sample_every`),
  resolved from device events by the timing manager;
- host_dispatch: per-op time from dispatch to return, in sampling windows (dispatch.py);
- host_gap: in the same windows, each gap of the training thread between top-level ops (dispatch.py): the
  interpreter, GIL waits and garbage collection there, which the native timer's ops do not contain (an op
  releases the GIL and waits for it again after its timed interval). Kept for its drift only: no histogram
  of its own is exported (the series budget); its seconds are rank/perf.py's host phase.

Every sample is tagged with the step it was taken in. Steps `ild_warmup_steps` .. + `ild_baseline_steps`
form the rank's baseline (one bucket-count vector); later steps go into a ring of per-step bucket counts,
the last `ild_window_steps` steps that have samples: the current window. The drift of the window from the
baseline is measured on the histogram's own buckets, so that PromQL can compute the same:

- Kolmogorov-Smirnov: the largest difference between the two cumulative distributions (0..1);
- Wasserstein-1: the area between them, each bucket at its log-midpoint, in seconds.

Both see the mixture of all ops, whose spread (from 30 ns to 60 µs here) hides a small delay added to every
op. Host dispatch timed by the native timer also has the per-op shift (the dispatch mode's own microseconds
of Python per op are too noisy for it): for each op (by name), its fastest time in each sampled step -
the dispatch path's floor, which preemption and noisy neighbours rarely move - is compared with the median
of its baseline steps' fastest times. A slower core (this VM's vCPUs slow down by x1.3-1.7 for seconds at a
time) moves every op in proportion to its time; a slower host issue path adds the same delay to every op.
So the proportional part is taken out first - the weighted median over the ops of 2 µs or more of their
relative difference, each weighted by its relative stability (median / MAD)^2 - and the shift is the
weighted median over all ops of what is left, each weighted by 1 / MAD^2: the stable small ops (views,
detach) weigh most, and no single op's outlier moves a median. The extension keeps it (csrc/op_shift.cpp,
an OpShift): the ops' times never become Python objects.

Everything here is written by the timing manager's thread only (under its drain lock); scrapes read a copy of
the histogram and one tuple of drift values.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from .. import label_values
from ..config import Config
from .device_events import EventBackend
from .exporter_health import ExporterHealth
from .histogram import Histogram
from .progress import StepTracker
from .timing import TimingManager

KERNEL_ISSUE, HOST_DISPATCH, HOST_GAP = label_values.ILD_DISTRIBUTIONS


def bucket_points(bounds: Sequence[float]) -> list[float]:
    """A value for each bucket of `bounds` (+Inf last): its log-midpoint.

    The first bucket's lower edge is one bucket ratio below its bound; the +Inf bucket sits at the last bound.
    """
    points = []
    for index, upper in enumerate(bounds):
        ratio = bounds[1] / bounds[0] if len(bounds) > 1 else 10.0
        lower = bounds[index - 1] if index else upper / ratio
        points.append(math.sqrt(lower * upper))
    points.append(float(bounds[-1]))
    return points


def drift(baseline: Sequence[int], window: Sequence[int], points: Sequence[float]) -> tuple[float, float]:
    """(Kolmogorov-Smirnov statistic, Wasserstein-1 distance) between two bucket-count vectors.

    W1 between the two discrete distributions on `points` is the integral of |F - G|: the CDF difference
    after bucket i holds from points[i] to points[i + 1].
    """
    baseline_total, window_total = sum(baseline), sum(window)
    if not baseline_total or not window_total:
        raise ValueError("drift needs samples on both sides")
    ks = wasserstein = 0.0
    below_baseline = below_window = 0
    for index in range(len(points) - 1):
        below_baseline += baseline[index]
        below_window += window[index]
        difference = abs(below_baseline / baseline_total - below_window / window_total)
        ks = max(ks, difference)
        wasserstein += difference * (points[index + 1] - points[index])
    return ks, wasserstein


class Drift:
    """A baseline and a ring of the last steps' bucket counts; `current` is (ks, wasserstein) or None."""

    def __init__(
        self,
        bounds: Sequence[float],
        warmup_steps: int,
        baseline_steps: int,
        window_steps: int,
        min_samples: int,
    ) -> None:
        self.size = len(bounds) + 1
        self.points = bucket_points(bounds)
        self.warmup_steps = warmup_steps
        self.baseline_end = warmup_steps + baseline_steps
        self.window_steps = window_steps
        self.min_samples = min_samples
        self.baseline = [0] * self.size
        self.windows: dict[int, list[int]] = {}  # step -> bucket counts, at most window_steps steps
        self.window_total = [0] * self.size  # their sum, kept as they change: a refresh adds no vectors
        self.current: tuple[float, float] | None = None
        # the per-op shift (seconds), where the native timer gives each op's fastest time per step: the
        # extension's OpShift over the same steps (op_shifts), read at every refresh
        self.op_shifts: Any = None
        self.op_shift: float | None = None
        self._changed = False

    def keep_op_shift(self, extension: Any) -> None:
        """Have the extension keep the per-op shift (an OpShift), over the steps that the bucket counts take
        the same parts in: the drain hands it each step the native timer took."""
        baseline_steps = self.baseline_end - self.warmup_steps
        self.op_shifts = extension.OpShift(self.warmup_steps, baseline_steps, self.window_steps)

    @property
    def baseline_samples(self) -> int:
        return sum(self.baseline)

    def add_counts(self, step: int, buckets: Sequence[tuple[int, int]]) -> None:
        """Samples of `step` already counted into buckets: (bucket index, samples)."""
        counts = self._counts(step) if buckets else None
        if counts is None:
            return
        for index, count in buckets:
            counts[index] += count
        if counts is not self.baseline:
            total = self.window_total
            for index, count in buckets:
                total[index] += count

    def _counts(self, step: int) -> list[int] | None:
        """The bucket counts a sample of `step` goes into: the baseline's, its window step's, or none."""
        if step < self.warmup_steps:
            return None
        if step < self.baseline_end:
            return self.baseline
        counts = self.windows.get(step)
        if counts is None:
            if len(self.windows) >= self.window_steps and step < min(self.windows):
                return None  # a late sample of a step that has left the window
            counts = self.windows[step] = [0] * self.size
            if len(self.windows) > self.window_steps:
                left = self.windows.pop(min(self.windows))
                self.window_total = [
                    total - count for total, count in zip(self.window_total, left, strict=True)
                ]
        self._changed = True
        return counts

    def window(self) -> list[int]:
        """The bucket counts of the window's steps, summed."""
        return list(self.window_total)

    def refresh(self) -> None:
        """Recompute `current` if samples arrived since the last call."""
        if not self._changed:
            return
        self._changed = False
        if self.op_shifts is not None:
            self.op_shift = self.op_shifts.shift()
        window = self.window()
        if min(self.baseline_samples, sum(window)) < self.min_samples:
            self.current = None
            return
        self.current = drift(self.baseline, window, self.points)


class IssueLatency:
    """One distribution: its histogram (all samples since start) and its drift."""

    def __init__(self, distribution: str, config: Config) -> None:
        self.distribution = distribution
        self.histogram = Histogram(label_values.ISSUE_LATENCY_BUCKETS)
        self.drift = Drift(
            label_values.ISSUE_LATENCY_BUCKETS,
            config.ild_warmup_steps,
            config.ild_baseline_steps,
            config.ild_window_steps,
            config.ild_min_samples,
        )
        self.active = False  # a source exists: the histogram is exported

    def add(self, step: int, seconds: float) -> None:
        """One sample taken in `step` (manager thread)."""
        histogram = self.histogram
        index = bisect_left(histogram.bounds, seconds)
        histogram.counts[index] += 1
        histogram.sum += seconds
        self.drift.add_counts(step, ((index, 1),))

    def add_counts(self, step: int, buckets: Sequence[tuple[int, int]], seconds: float) -> None:
        """Samples of `step` already counted into buckets: (bucket index, samples), and their sum."""
        histogram = self.histogram
        histogram.sum += seconds
        for index, count in buckets:
            histogram.counts[index] += count
        self.drift.add_counts(step, buckets)

    def add_many(self, step: int, samples: Sequence[float]) -> None:
        for seconds in samples:
            self.add(step, seconds)


class KernelSampler:
    """Times one kernel launch in `every` with a device event: issue latency = device start - host launch."""

    def __init__(
        self,
        latency: IssueLatency,
        manager: TimingManager,
        steps: StepTracker,
        every: int,
        health: ExporterHealth,
    ) -> None:
        self.latency = latency
        self.manager = manager
        self.steps = steps
        self.every = every
        self.health = health
        self.launches = 0

    def on_launch(self, backend: EventBackend, stream: Any = None) -> None:
        """Called on the launching thread just before a kernel is queued on `stream`; never raises."""
        try:
            self.launches += 1
            if self.launches % self.every:
                return
            self.latency.active = True
            launched_at = time.perf_counter()
            event = backend.record(stream)
            if event is not None:
                self.manager.watch(backend, event, launched_at, self.steps.steps, self.latency.add)
        except Exception as error:
            self.health.error("kernel_sampler", error)


class IldState:
    """The ILD part of a rank's state: both distributions and the samplers that feed them."""

    def __init__(self, config: Config, health: ExporterHealth, manager: TimingManager, steps: StepTracker):
        from .dispatch import DispatchSampler  # torch's dispatch-mode machinery, loaded with the hooks

        self.health = health
        self.kernel_issue = IssueLatency(KERNEL_ISSUE, config)
        self.host_dispatch = IssueLatency(HOST_DISPATCH, config)
        self.host_gap = IssueLatency(HOST_GAP, config)
        self.kernels = KernelSampler(
            self.kernel_issue, manager, steps, config.ild_launch_sample_every, health
        )
        self.dispatch = DispatchSampler(
            self.host_dispatch,
            self.kernels,
            manager,
            config.ild_dispatch_every_steps,
            config.ild_events,
            health,
            steps,
            gaps=self.host_gap,
        )
        self.steps = steps
        manager.after_drain.append(self.refresh)

    @property
    def distributions(self) -> tuple[IssueLatency, IssueLatency, IssueLatency]:
        return (self.kernel_issue, self.host_dispatch, self.host_gap)

    def refresh(self) -> None:
        self.dispatch.collect()
        for latency in self.distributions:
            latency.drift.refresh()

    def install(self) -> None:
        """Open host-dispatch windows from the optimizer step hook."""
        self.steps.set_listener(self.dispatch.on_step, self.dispatch.every)

    def remove(self) -> None:
        self.steps.set_listener(None, 0)
        self.dispatch.close()
