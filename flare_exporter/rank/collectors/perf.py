"""Where the step time goes: seconds per phase over the accounted steps (the collective phase also by group
role), model FLOPs, achieved FLOP/s, MFU (inside the rank)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import Metric

from ... import label_values
from ..state import FlareState
from . import Families


class PerfCollector:
    name = "perf"
    metrics = (
        "flare_step_phase_seconds_total",
        "flare_step_phase_steps_total",
        "flare_step_collective_seconds_total",
        "flare_model_flops_per_step",
        "flare_achieved_flops",
        "flare_mfu_ratio",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        families_out = [families.new(name) for name in self.metrics]
        phases, steps, by_role, flops, achieved, mfu = families_out
        monitor = self.state.perf
        if monitor is None:
            return families_out
        for phase, seconds in monitor.phase_seconds.items():
            if phase == "transfer" or (phase == "host" and not monitor.host_measured):
                continue  # not measured (yet): absent rather than a zero that says "none"
            phases.add_metric(families.labels(phase), seconds)
        steps.add_metric(families.labels(), monitor.steps)
        self._add_roles(families, by_role, monitor.collective_by_role)
        for family, value in (
            (flops, monitor.flops_per_step),
            (achieved, monitor.achieved_flops),
            (mfu, monitor.mfu),
        ):
            if value is not None:
                family.add_metric(families.labels(), value)
        return families_out

    def _add_roles(self, families: Families, by_role: Any, waited: Mapping[str, float]) -> None:
        """The collective phase by group role: the roles of this rank's process groups (never the shim's
        `native`), at 0 until waited on, as the phases start at 0, so that Prometheus's increase() of a role
        spans the same samples as the phase's."""
        roles = {group.role for group in list(self.state.groups.values())} | set(waited)
        for role in label_values.GROUP_ROLES:
            if role in roles:
                by_role.add_metric(families.labels(role), waited.get(role, 0.0))
