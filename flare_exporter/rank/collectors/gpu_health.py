"""GPU health of the rank's own device, as the background NVML reader last saw it (never NVML itself)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import Metric

from ..gpu_health import GpuHealthMonitor, GpuReading
from ..state import FlareState
from . import Families

# (metric, GpuReading attribute) of the single-value series
SCALARS = (
    ("flare_gpu_sm_clock_hertz", "sm_clock_hertz"),
    ("flare_gpu_sm_clock_max_hertz", "sm_clock_max_hertz"),
    ("flare_gpu_temperature_celsius", "temperature_celsius"),
    ("flare_gpu_power_watts", "power_watts"),
    ("flare_gpu_power_limit_watts", "power_limit_watts"),
    ("flare_gpu_pcie_link_generation", "pcie_link_generation"),
    ("flare_gpu_pcie_link_generation_max", "pcie_link_generation_max"),
    ("flare_gpu_pcie_link_width", "pcie_link_width"),
    ("flare_gpu_pcie_link_width_max", "pcie_link_width_max"),
    ("flare_gpu_pcie_replays_total", "pcie_replays"),
    ("flare_gpu_row_remap_pending", "row_remap_pending"),
    ("flare_gpu_row_remap_failed", "row_remap_failed"),
)
# (metric, GpuReading attribute) of the series with one label from a fixed list
LABELLED = (
    ("flare_gpu_clock_event_active", "clock_events"),
    ("flare_gpu_ecc_errors_total", "ecc_errors"),
    ("flare_gpu_nvlink_errors_total", "nvlink_errors"),
    ("flare_gpu_remapped_rows", "remapped_rows"),
)


class GpuHealthCollector:
    name = "gpu_health"
    metrics = (
        "flare_gpu_health_up",
        *(metric for metric, _ in SCALARS),
        *(metric for metric, _ in LABELLED),
        "flare_gpu_xid_events_total",
        "flare_gpu_last_xid",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state
        self._last: tuple[tuple[Any, ...], list[Metric]] = ((), [])

    def collect(self, families: Families) -> Iterable[Metric]:
        """The reader's last reading as families; the same families again while nothing they show changed
        (the reader reads every few seconds, a scrape may come every second)."""
        monitor = self.state.gpu
        up = monitor is not None and monitor.up
        reading: GpuReading | None = monitor.reading if monitor is not None else None
        events = (
            (monitor.xid_events, monitor.listens_for_xid, monitor.last_xid) if monitor is not None else ()
        )
        shown = (families.common_values, up, reading, events)
        if shown != self._last[0]:
            self._last = (shown, self._families(families, monitor, up, reading))
        return self._last[1]

    def _families(
        self, families: Families, monitor: GpuHealthMonitor | None, up: bool, reading: GpuReading | None
    ) -> list[Metric]:
        health_up = families.new("flare_gpu_health_up")
        health_up.add_metric(families.labels(), 1 if up else 0)
        output = [health_up]
        if not up or monitor is None or reading is None:
            return output
        for metric, attribute in SCALARS:
            family = families.new(metric)
            value = getattr(reading, attribute)
            if value is not None:
                family.add_metric(families.labels(), value)
            output.append(family)
        for metric, attribute in LABELLED:
            family = families.new(metric)
            for label, value in getattr(reading, attribute).items():
                family.add_metric(families.labels(label), value)
            output.append(family)
        xid_events = families.new("flare_gpu_xid_events_total")
        if monitor.xid_events or monitor.listens_for_xid:
            xid_events.add_metric(families.labels(), monitor.xid_events)
        last_xid = families.new("flare_gpu_last_xid")
        if monitor.last_xid is not None:
            last_xid.add_metric(families.labels(), monitor.last_xid)
        return output + [xid_events, last_xid]
