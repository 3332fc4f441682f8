"""Steps, step duration and the heartbeat of the training thread."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from .. import progress, stall
from ..state import FlareState
from . import Families


class ProgressCollector:
    name = "progress"
    metrics = ("flare_steps_total", "flare_step_duration_seconds", "flare_heartbeat_timestamp_seconds")

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        steps = self.state.steps
        total = families.new("flare_steps_total")
        total.add_metric(families.labels(), steps.steps)
        durations = families.new("flare_step_duration_seconds")
        families.add_histogram(durations, (), steps.durations)
        heartbeat = families.new("flare_heartbeat_timestamp_seconds")
        last_progress = stall.last_progress(self.state)
        if last_progress:
            heartbeat.add_metric(families.labels(), progress.wall_time(last_progress))
        return [total, durations, heartbeat]
