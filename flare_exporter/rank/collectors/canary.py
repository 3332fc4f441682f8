"""The canary's last results (rank/canary.py), as its snapshot holds them; nothing when the canary is off."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..canary import CanarySnapshot
from ..state import FlareState
from . import Families


class CanaryCollector:
    name = "canary"
    metrics = (
        "flare_canary_value",
        "flare_canary_relative",
        "flare_canary_failed",
        "flare_canary_ewma_ratio",
        "flare_canary_drift",
        "flare_canary_preflight_passed",
        "flare_canary_runs_total",
        "flare_canary_duration_seconds",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        canary = self.state.canary
        if canary is None or canary.snapshot.passed is None and not canary.snapshot.runs:
            return []
        return self._families(families, canary.snapshot)

    def _families(self, families: Families, snapshot: CanarySnapshot) -> list[Metric]:
        value = families.new("flare_canary_value")
        for phase, measured in (("preflight", snapshot.preflight), ("in_flight", snapshot.in_flight)):
            for (measurement, scope), number in sorted(measured.items()):
                value.add_metric(families.labels(measurement, scope, phase), number)
        relative = families.new("flare_canary_relative")
        for (measurement, scope), ratio in sorted(snapshot.relative.items()):
            relative.add_metric(families.labels(measurement, scope), ratio)
        failed = families.new("flare_canary_failed")
        measured_keys = [(key, "preflight") for key in snapshot.preflight]
        measured_keys += [(key, "in_flight") for key in snapshot.in_flight]
        for (measurement, scope), phase in sorted(measured_keys):
            flagged = (measurement, scope, phase) in snapshot.failed
            failed.add_metric(families.labels(measurement, scope, phase), 1 if flagged else 0)
        ewma = families.new("flare_canary_ewma_ratio")
        drift = families.new("flare_canary_drift")
        for (measurement, scope), ratio in sorted(snapshot.ewma_ratio.items()):
            ewma.add_metric(families.labels(measurement, scope), ratio)
            drift.add_metric(
                families.labels(measurement, scope), 1 if snapshot.drift.get((measurement, scope)) else 0
            )
        output = [value, relative, failed, ewma, drift]
        passed = families.new("flare_canary_preflight_passed")
        if snapshot.passed is not None:
            passed.add_metric(families.labels(), 1 if snapshot.passed else 0)
        runs = families.new("flare_canary_runs_total")
        durations = families.new("flare_canary_duration_seconds")
        for phase, count in sorted(snapshot.runs.items()):
            runs.add_metric(families.labels(phase), count)
            durations.add_metric(families.labels(phase), snapshot.durations.get(phase, 0.0))
        return output + [passed, runs, durations]
