"""The profiler's captures: how many ended and how, and what the last one found (profile: on only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import Metric

from ... import label_values
from ..state import FlareState
from . import Families


class ProfileCollector:
    name = "profile"
    metrics = (
        "flare_profile_captures_total",
        "flare_profile_armed_total",
        "flare_profile_refused_total",
        "flare_profile_last_end_timestamp_seconds",
        "flare_profile_bottleneck_info",
        "flare_profile_step_seconds",
        "flare_profile_share_ratio",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        found = [families.new(name) for name in self.metrics]
        profiler = self.state.profiler
        if profiler is None:
            return found
        captures, armed, refused, ended, bottleneck, step, shares = found
        for outcome in label_values.PROFILE_OUTCOMES:
            captures.add_metric(families.labels(outcome), profiler.outcomes.get(outcome, 0))
        for trigger in label_values.PROFILE_TRIGGERS:
            armed.add_metric(families.labels(trigger), profiler.armed.get(trigger, 0))
        refused.add_metric(families.labels(), profiler.refused)
        last = profiler.last
        if last is None or last.finished_at is None:
            return found
        ended.add_metric(families.labels(), last.finished_at)
        if last.state != "captured":
            return found
        bottleneck.add_metric(families.labels(last.bottleneck), 1)
        if (seconds := _number(last.summary.get("step_seconds"))) is not None:
            step.add_metric(families.labels(), seconds)
        for part, share in shares_of(last.summary).items():
            shares.add_metric(families.labels(part), share)
        return found


def shares_of(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's shares of the step time by part (label_values.PROFILE_PARTS), where it has them."""
    found = summary.get("shares")
    if not isinstance(found, Mapping):
        return {}
    return {
        part: value for part in label_values.PROFILE_PARTS if (value := _number(found.get(part))) is not None
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
