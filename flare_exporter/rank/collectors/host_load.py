"""The host's CPU load, as now and at its lowest while the job ran, and the training thread's share
of a CPU (rank/host_load.py), read at each scrape."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..host_load import ThreadCpuShare, read_host_load
from ..state import FlareState
from . import Families


class HostLoadCollector:
    name = "host_load"
    metrics = (
        "flare_host_cpu_pressure_ratio",
        "flare_host_cpu_pressure_floor_ratio",
        "flare_host_runnable_tasks",
        "flare_host_cpus",
        "flare_training_thread_cpu_ratio",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state
        self.thread = ThreadCpuShare()

    def collect(self, families: Families) -> Iterable[Metric]:
        load = read_host_load(self.thread)
        floor = self.state.windows.host_pressure_floor
        values = (load.cpu_pressure, floor, load.runnable_tasks, load.cpus, load.thread_cpu_ratio)
        found = []
        for name, value in zip(self.metrics, values, strict=True):
            family = families.new(name)
            if value is not None:
                family.add_metric(families.labels(), value)
            found.append(family)
        return found
