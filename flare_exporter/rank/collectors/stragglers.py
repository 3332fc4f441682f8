"""Straggler windows: each rank's last windows of step time and collective wait, and its own best."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class StragglersCollector:
    name = "stragglers"
    metrics = (
        "flare_straggler_window_step_seconds",
        "flare_straggler_window_wait_seconds",
        "flare_straggler_last_window",
        "flare_straggler_best_step_seconds",
        "flare_straggler_slowdown_ratio",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        ring = self.state.windows.ring
        windows, best, ratio = ring.windows, ring.best_step_seconds, ring.slowdown_ratio
        step = families.new("flare_straggler_window_step_seconds")
        wait = families.new("flare_straggler_window_wait_seconds")
        for ago, window in enumerate(reversed(windows)):
            step.add_metric(families.labels(str(ago)), window.step_seconds)
            wait.add_metric(families.labels(str(ago)), window.wait_seconds)
        last = families.new("flare_straggler_last_window")
        best_step = families.new("flare_straggler_best_step_seconds")
        slowdown = families.new("flare_straggler_slowdown_ratio")
        if windows:
            last.add_metric(families.labels(), windows[-1].number)
        if best is not None:
            best_step.add_metric(families.labels(), best)
        if ratio is not None:
            slowdown.add_metric(families.labels(), ratio)
        return [step, wait, last, best_step, slowdown]
