"""The policies both sides apply: when a rank counts as a straggler, when its issue latency has shifted,
what bounds a rank's step.

The rules engine (engine/diagnosis.py and its rule modules) decides with them; the generated alert rules
and dashboards (mixin/) draw the same thresholds from them, so that a page and `flare diagnose` agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Config


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank that waits least counts as a straggler."""

    min_ranks: int = 3
    min_steps: float = 10
    robust_z: float = 5.0  # distance below the median wait, in MADs (scaled to a standard deviation)
    min_share_of_step: float = 0.25  # ... and at least this share of the median step time
    # from the exported straggler windows (preferred when every rank exports them; see window_verdicts)
    hold_windows: int = 3  # the last this many windows that every rank has closed
    window_z: float = 2.0  # in each: the rank waits least, this many robust sigmas below the median share
    window_gap: float = 0.01  # ... and this share of its step below it (load bursts decay, stragglers hold)
    pooled_z: float = 4.0  # over all of them together: at least this many robust sigmas below ...
    min_wait_gap: float = 0.03  # ... and at least this share of the step below the median wait share
    job_slowdown: float = 0.5  # no straggler, every rank this much slower than its own best: job-wide
    clock_below_max: float = 0.9  # an SM clock below this share of its max is a hardware reason


@dataclass(frozen=True)
class IldPolicy:
    """When a rank's issue-latency distribution counts as shifted from its own baseline."""

    ks: float = 0.3  # Kolmogorov-Smirnov statistic (largest CDF difference) at or above which it shifted
    min_wasserstein_seconds: float = 1e-7  # ... provided the shift moves it at least this far (W1)
    # A partial shift (a share of the ops, e.g. those that wait for a contended core or interpreter) that
    # moves far: KS at least partial_ks and W1 at least far_factor times the ranks' median W1 (3+ ranks).
    partial_ks: float = 0.12
    far_factor: float = 50.0
    # Host dispatch: a delay added to every op, estimated from each op's fastest time (ild.py's per-op
    # shift), at or above which it shifted whatever KS and W1 say (the config key ild_op_shift_seconds).
    op_shift_seconds: float = Config.ild_op_shift_seconds

    def floors(self) -> tuple[float, float, float]:
        """(op shift, KS, W1): a drift counts as shifted (ild_shifted), whatever its peers', only if its op
        shift reaches the first, or its KS reaches the second while its W1 is not below the third. A source
        that finds no rank there need not read every rank's drift."""
        ks = [bound for bound in (self.ks, self.partial_ks) if not math.isnan(bound)]  # NaN: never reached
        return self.op_shift_seconds, min(ks, default=math.inf), self.min_wasserstein_seconds


@dataclass(frozen=True)
class HostLoadPolicy:
    """When a host was busy enough to explain a slowdown of its ranks (engine/host_load.py).

    Busy: some runnable task waited for a CPU for at least `cpu_pressure` of the last 10 s (PSI), and that
    share rose by at least `pressure_rise` above its floor, the lowest the rank read as it closed its windows
    (a job that crowds its own cores has always done so: its slowdown is not the host's); where the kernel
    has no PSI, at least `runnable_per_cpu` runnable tasks per CPU the rank may use. A host's figure is the
    median of its ranks' readings. Versioned: a change of a threshold is a new `version`, which the
    verdict's evidence carries.
    """

    version: int = 1
    # quiet, this 2-core machine read 0.00-0.06; with a spinning process more than its cores, 0.9-1.0
    cpu_pressure: float = 0.25
    pressure_rise: float = 0.15
    runnable_per_cpu: float = 1.5


BOTTLENECKS = ("input_bound", "communication_bound", "transfer_bound", "launch_bound", "compute_bound")


@dataclass(frozen=True)
class BottleneckPolicy:
    """Which bottleneck class a rank's step is in, from the shares of its step time per phase.

    The first class whose phase reaches its share wins, in this order: input (data), communication
    (collective time not overlapped by compute), pipeline bubble (waits in sends and receives), transfer
    (host-device copies), launch (host gaps); else compute. Versioned: a change of a threshold is a new
    `version`, which `flare perf` reports.
    """

    # 2: host gaps measured (launch_bound); a rank that mostly waits for the last arriver takes its class
    # 3: the pipeline bubble, a phase of its own (bubble_bound)
    version: int = 3
    input_share: float = 0.3  # of the step in the data loader's next
    # of the step waiting for collectives: 4 compute-bound gloo ranks sharing 2 cores waited 31-40 % of
    # their steps (scheduling skew), 19 MB all-reduced over a batch of 1 waited 70-75 %
    # (tests/engine/test_perf.py)
    communication_share: float = 0.5
    bubble_share: float = 0.5  # of the step waiting in sends and receives for the other pipeline stages
    transfer_share: float = 0.3  # of the step in host-device copies
    launch_share: float = 0.3  # of the step in host gaps (interpreter, GIL, GC, launch)
    # a rank whose compute FLOP/s (model FLOPs over compute seconds per step) is below this share of its
    # peers' median runs on a slower device than theirs (`flare perf`: slow_ranks)
    slow_device_share: float = 0.8

    def thresholds(self) -> tuple[tuple[str, str, float], ...]:
        """(class, phase, share) in the order they are tried; compute_bound is the rest."""
        return (
            ("input_bound", "data", self.input_share),
            ("communication_bound", "collective", self.communication_share),
            ("bubble_bound", "bubble", self.bubble_share),
            ("transfer_bound", "transfer", self.transfer_share),
            ("launch_bound", "host", self.launch_share),
        )

    def classify(self, shares: dict[str, float]) -> str:
        """The class of a step whose phases take `shares` of it (phase -> 0..1)."""
        for bottleneck, phase, share in self.thresholds():
            if shares.get(phase, 0.0) >= share:
                return bottleneck
        return "compute_bound"


@dataclass(frozen=True)
class ProfilePolicy:
    """Which bottleneck class a profiler capture shows, from its summary (rank/profile_summary.py).

    The perf monitor's classes, tried in the same order: input (the data loader's share of the captured
    span), communication (communication the device ran while it computed nothing: exposed), transfer
    (host-device copies under neither compute nor communication), launch (the device idle outside the
    data loader, or most of its kernel time in short kernels); else compute. The shares are of the span
    without the time the rank waited for a slower peer (classify's `peers`). Versioned: a change of a
    threshold is a new `version`, which the verdict's evidence carries.
    """

    version: int = 1
    # the same shares as BottleneckPolicy's, so that a capture and `flare perf` class a step alike
    input_share: float = 0.3  # of the span in the data loader's next
    communication_share: float = 0.5  # of the span in exposed communication
    transfer_share: float = 0.3  # of the span in host-device copies that nothing else hides
    launch_share: float = 0.3  # of the span with the device idle outside the data loader
    # of the kernel time in kernels shorter than the summary's short threshold (10 us): launch overhead
    # (5-10 us a launch) then exceeds the work, whatever the idle share (GPU captures only)
    short_kernel_share: float = 0.5

    def thresholds(self) -> tuple[tuple[str, str, float], ...]:
        """(class, share, threshold) in the order they are tried; compute_bound is the rest."""
        return (
            ("input_bound", "data", self.input_share),
            ("communication_bound", "communication", self.communication_share),
            ("transfer_bound", "transfer", self.transfer_share),
            ("launch_bound", "host_gap", self.launch_share),
            ("launch_bound", "short_kernels", self.short_kernel_share),
        )


@dataclass(frozen=True)
class ProfileTriggerPolicy:
    """When a rank's own signals ask for a capture (rank/profile_trigger.py; profile_on_anomaly only).

    A rank knows no peer's numbers, so it calls itself a straggler only where its last straggler windows
    all ran slower than its best window and it spent little of them in collectives: the ranks that wait
    for a straggler slow down as much, but in collectives. An ILD shift is its distribution's own drift from
    its baseline, as IldPolicy's floors say; a failed in-flight canary is the canary's verdict. Versioned:
    a change of a threshold is a new `version`, which the capture's evidence carries.
    """

    version: int = 1
    slow_windows: int = 2  # consecutive closed straggler windows, each:
    slowdown: float = 1.5  # ... at least this many times the best window's mean step time
    max_wait_share: float = 0.2  # ... with at most this share of it waiting in collectives
