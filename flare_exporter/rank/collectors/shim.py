"""The NCCL calls the launch shim sampled (rank/shim.py), by op; nothing when the shim is not loaded."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class ShimCollector:
    name = "shim"
    metrics = ("flare_shim_collective_duration_seconds", "flare_shim_collective_bytes_total")

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        feed = self.state.shim_feed
        if feed is None:
            return []
        durations = families.new("flare_shim_collective_duration_seconds")
        sent = families.new("flare_shim_collective_bytes_total")
        for op, stats in sorted(list(feed.collectives.items())):
            families.add_histogram(durations, (op,), stats.durations)
            sent.add_metric(families.labels(op), stats.bytes_total)
        return [durations, sent]
