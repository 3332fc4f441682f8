"""The exporter's own errors and dropped events."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class ExporterCollector:
    name = "exporter"
    metrics = ("flare_exporter_errors_total", "flare_exporter_dropped_events_total")

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        health = self.state.health
        errors = families.new("flare_exporter_errors_total")
        for component, count in sorted(dict(health.errors).items()):
            errors.add_metric(families.labels(component), count)
        dropped = families.new("flare_exporter_dropped_events_total")
        for queue, count in sorted(dict(health.dropped).items()):
            dropped.add_metric(families.labels(queue), count)
        return [errors, dropped]
