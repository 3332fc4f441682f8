"""Where the step time goes: seconds per phase over the accounted steps, model FLOPs, achieved FLOP/s, MFU."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class PerfCollector:
    name = "perf"
    metrics = (
        "flare_step_phase_seconds_total",
        "flare_step_phase_steps_total",
        "flare_model_flops_per_step",
        "flare_achieved_flops",
        "flare_mfu_ratio",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        families_out = [families.new(name) for name in self.metrics]
        phases, steps, flops, achieved, mfu = families_out
        monitor = self.state.perf
        if monitor is None:
            return families_out
        for phase, seconds in monitor.phase_seconds.items():
            if phase == "transfer" or (phase == "host" and not monitor.host_measured):
                continue  # not measured (yet): absent rather than a zero that says "none"
            phases.add_metric(families.labels(phase), seconds)
        steps.add_metric(families.labels(), monitor.steps)
        for family, value in (
            (flops, monitor.flops_per_step),
            (achieved, monitor.achieved_flops),
            (mfu, monitor.mfu),
        ):
            if value is not None:
                family.add_metric(families.labels(), value)
        return families_out
