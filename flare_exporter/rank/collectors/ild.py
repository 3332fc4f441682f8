"""Issue-latency distributions (ILD): two histograms, and every distribution's drift from its baseline."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class IldCollector:
    name = "ild"
    metrics = (
        "flare_kernel_issue_latency_seconds",
        "flare_host_dispatch_latency_seconds",
        "flare_ild_drift_ks",
        "flare_ild_drift_wasserstein_seconds",
        "flare_ild_op_shift_seconds",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        ild = self.state.ild
        kernel = families.new("flare_kernel_issue_latency_seconds")
        dispatch = families.new("flare_host_dispatch_latency_seconds")
        ks = families.new("flare_ild_drift_ks")
        wasserstein = families.new("flare_ild_drift_wasserstein_seconds")
        op_shift = families.new("flare_ild_op_shift_seconds")
        if ild is None:
            return [kernel, dispatch, ks, wasserstein, op_shift]
        histograms = ((kernel, ild.kernel_issue), (dispatch, ild.host_dispatch), (None, ild.host_gap))
        for family, latency in histograms:  # host_gap: its drift only (ild.py)
            if family is not None and latency.active:  # a source exists (a launch seen, a window opened)
                families.add_histogram(family, (), latency.histogram)
            current = latency.drift.current
            if current is not None:
                ks.add_metric(families.labels(latency.distribution), current[0])
                wasserstein.add_metric(families.labels(latency.distribution), current[1])
            if latency.drift.op_shift is not None:
                op_shift.add_metric(families.labels(latency.distribution), latency.drift.op_shift)
        return [kernel, dispatch, ks, wasserstein, op_shift]
