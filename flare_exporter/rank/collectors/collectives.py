"""Collective durations, bytes and sequence numbers per process group."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class CollectivesCollector:
    name = "collectives"
    metrics = (
        "flare_collective_duration_seconds",
        "flare_collective_bytes_total",
        "flare_collective_last_issued_seq",
        "flare_collective_last_completed_seq",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        durations = families.new("flare_collective_duration_seconds")
        sent = families.new("flare_collective_bytes_total")
        for (group, op), stats in sorted(list(self.state.manager.stats.items())):
            families.add_histogram(durations, (group, op), stats.durations)
            sent.add_metric(families.labels(group, op), stats.bytes_total)
        issued = families.new("flare_collective_last_issued_seq")
        completed = families.new("flare_collective_last_completed_seq")
        for tracker in list(self.state.groups.values()):
            issued.add_metric(families.labels(tracker.name), tracker.last_issued_seq)
            completed.add_metric(families.labels(tracker.name), tracker.last_completed_seq)
        return [durations, sent, issued, completed]
