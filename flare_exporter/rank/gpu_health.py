"""GPU health of the rank's own device, from NVML: one background reader, and the decoding it needs.

pynvml (nvidia-ml-py, the `nvml` extra) is imported lazily, by name (`nvml_module`), so a fake module
with the same functions and constants runs this very code without a GPU
(flare_exporter.local.testing.fake_nvml).
Without NVML, without a GPU, or with `gpu_health: false`, the monitor stays down: flare_gpu_health_up 0 and
nothing else.

A GpuHealthMonitor thread reads the device every `interval` seconds into an immutable GpuReading that
scrapes only read, so a slow or wedged NVML call never holds a scrape, and never runs on the training
thread; it keeps the last RECENT_READINGS of them, with their times, for the incident file (incident.py).
Between reads the same thread waits on an NVML event set for critical XID events (as they happen, not by
polling the last one), until its next read: an idle reader wakes once a read (each wake of a thread cost
about 0.1 ms of CPU on the virtual machine it was measured on). stop() does not wait for a reader blocked
in NVML's event wait, which cannot be interrupted: the reader is a daemon thread that holds nothing and
ends when the wait returns.

The rank's device: entry LOCAL_RANK of CUDA_VISIBLE_DEVICES when it has that many entries (all GPUs
visible, torch.cuda.set_device(local_rank)), else its only/first entry (one GPU per process); an entry is
an index or a GPU UUID. Without CUDA_VISIBLE_DEVICES, NVML index LOCAL_RANK. On NCCL jobs attach.py passes
the UUID of torch's current device when the world group is created, and the monitor follows it.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .exporter_health import ExporterHealth

# NVML's clock-event ("throttle") reason bits, a stable ABI; one flare_gpu_clock_event_active series each.
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
NVLINK_ERROR_COUNTERS: tuple[tuple[str, int], ...] = (
    ("replay", 0),
    ("recovery", 1),
    ("crc_flit", 2),
    ("crc_data", 3),
)
ECC_ERROR_TYPES: tuple[tuple[str, int], ...] = (("corrected", 0), ("uncorrected", 1))
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
STOP_JOIN_SECONDS = 2.0  # stop() waits this long for a read in progress
# Readings kept for the incident file (the last few minutes: ten at the default 5 s interval), each with the
# Unix time it was read.
RECENT_READINGS = 120


def decode_clock_events(mask: int) -> dict[str, int]:
    """Every reason of the fixed list, 1 if its bit is set in NVML's bitmask, else 0."""
    return {name: int(bool(mask & bit)) for name, bit in CLOCK_EVENT_REASONS}


@dataclass(frozen=True)
class GpuReading:
    """One read of the device; None where NVML says the device does not support the query."""

    uuid: str = ""
    pci_bus_id: str = ""
    clock_events: Mapping[str, int] = field(default_factory=dict)
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    pcie_link_generation: float | None = None
    pcie_link_generation_max: float | None = None
    pcie_link_width: float | None = None
    pcie_link_width_max: float | None = None
    pcie_replays: float | None = None
    ecc_errors: Mapping[str, float] = field(default_factory=dict)
    nvlink_errors: Mapping[str, float] = field(default_factory=dict)
    remapped_rows: Mapping[str, float] = field(default_factory=dict)
    row_remap_pending: float | None = None
    row_remap_failed: float | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_code(error: BaseException) -> int | None:
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def _optional(read: Any, *args: Any) -> Any:
    """NVML's answer, or None if the device does not support the query; other errors propagate."""
    try:
        return read(*args)
    except Exception as error:
        if _error_code(error) == NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def _const(nvml: Any, name: str, default: int) -> int:
    return int(getattr(nvml, name, default))


def device_identity(nvml: Any, handle: Any) -> tuple[str, str]:
    """(UUID, PCI bus id) of a device as NVML writes them (dcgm-exporter's labels use the same)."""
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    bus_id = _text(getattr(nvml.nvmlDeviceGetPciInfo(handle), "busId", ""))
    if len(bus_id) == 16 and bus_id.count(":") == 2:  # NVML's 16-character form, 00000000:3B:00.0
        bus_id = bus_id.upper()
    return uuid, bus_id


def read_device(nvml: Any, handle: Any, uuid: str = "", pci_bus_id: str = "") -> GpuReading:
    """Read every health value of one device (a fixed, bounded set of NVML calls)."""
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if reasons is None:  # pynvml before 12.535 names it by throttling
        reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = _optional(reasons, handle)
    clock_sm = _const(nvml, "NVML_CLOCK_SM", 1)
    sm_mhz = _optional(nvml.nvmlDeviceGetClockInfo, handle, clock_sm)
    sm_max_mhz = _optional(nvml.nvmlDeviceGetMaxClockInfo, handle, clock_sm)
    power_mw = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    volatile = _const(nvml, "NVML_VOLATILE_ECC", 0)
    ecc = {}
    for name, error_type in ECC_ERROR_TYPES:
        count = _optional(nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, volatile)
        if count is not None:
            ecc[name] = float(count)
    remapped: dict[str, float] = {}
    pending = failed = None
    rows = _optional(getattr(nvml, "nvmlDeviceGetRemappedRows", lambda _: None), handle)
    if rows is not None:
        correctable, uncorrectable, is_pending, failure = rows
        remapped = {"correctable": float(correctable), "uncorrectable": float(uncorrectable)}
        pending, failed = float(bool(is_pending)), float(bool(failure))
    return GpuReading(
        uuid=uuid,
        pci_bus_id=pci_bus_id,
        clock_events=decode_clock_events(int(mask)) if mask is not None else {},
        sm_clock_hertz=None if sm_mhz is None else sm_mhz * 1e6,
        sm_clock_max_hertz=None if sm_max_mhz is None else sm_max_mhz * 1e6,
        temperature_celsius=_optional(
            nvml.nvmlDeviceGetTemperature, handle, _const(nvml, "NVML_TEMPERATURE_GPU", 0)
        ),
        power_watts=None if power_mw is None else power_mw / 1000.0,
        power_limit_watts=None if limit_mw is None else limit_mw / 1000.0,
        pcie_link_generation=_optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_link_generation_max=_optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_link_width=_optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_link_width_max=_optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        pcie_replays=_optional(nvml.nvmlDeviceGetPcieReplayCounter, handle),
        ecc_errors=ecc,
        nvlink_errors=nvlink_errors(nvml, handle),
        remapped_rows=remapped,
        row_remap_pending=pending,
        row_remap_failed=failed,
    )


def nvlink_errors(nvml: Any, handle: Any) -> dict[str, float]:
    """Each NVLink error counter summed over the device's active links (empty without NVLink)."""
    totals: dict[str, float] = {}
    enabled = _const(nvml, "NVML_FEATURE_ENABLED", 1)
    for link in range(_const(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                continue
        except Exception as error:
            if _error_code(error) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                continue  # no such link on this device
            raise
        for name, counter in NVLINK_ERROR_COUNTERS:
            count = _optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
            if count is not None:
                totals[name] = totals.get(name, 0.0) + float(count)
    return totals


def device_selector(local_rank: int, environ: Mapping[str, str]) -> int | str:
    """The rank's device as an NVML index or a UUID (see the module docstring)."""
    visible = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    if "CUDA_VISIBLE_DEVICES" not in environ or not visible:
        return local_rank
    entry = visible[local_rank] if local_rank < len(visible) else visible[0]
    return int(entry) if entry.isdigit() else entry


def load_nvml(module_name: str) -> Any | None:
    """The NVML module, or None if it cannot be imported (no nvidia-ml-py installed)."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


class GpuHealthMonitor:
    """Reads the rank's own GPU in the background; scrapes read `up`, `reading` and the XID counts."""

    def __init__(
        self,
        nvml: Any | None,
        selector: int | str,
        health: ExporterHealth,
        interval_seconds: float = 5.0,
    ) -> None:
        self.nvml: Any = nvml
        self.selector = selector
        self.health = health
        self.interval_seconds = interval_seconds
        self.up = False
        self.reading: GpuReading | None = None
        self.recent: deque[tuple[float, GpuReading]] = deque(maxlen=RECENT_READINGS)  # appended by the reader
        self.xid_events = 0
        self.last_xid: int | None = None
        self.uuid = ""
        self.pci_bus_id = ""
        self.preferred_uuid = ""  # set by attach.py from torch's current device; followed on the next read
        self._handle: Any = None
        self._events: Any = None
        self._initialized = False
        self._waiting_for_events = False  # in NVML's event wait, which stop() cannot interrupt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flare-gpu-health", daemon=True)

    @property
    def listens_for_xid(self) -> bool:
        """True once XID events of the device are delivered to this monitor."""
        return self._events is not None

    def open(self) -> bool:
        """Initialise NVML and find the rank's device; False (and up stays 0) without one."""
        if self.nvml is None:
            return False
        try:
            if not self._initialized:
                self.nvml.nvmlInit()
                self._initialized = True
            self._select(self.selector)
        except Exception as error:
            self.health.error("gpu_health", error)
            self._handle = None
            return False
        return True

    def _select(self, selector: int | str) -> None:
        nvml = self.nvml
        if isinstance(selector, int):
            handle = nvml.nvmlDeviceGetHandleByIndex(selector)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(selector)
        self._handle = handle
        self.uuid, self.pci_bus_id = device_identity(nvml, handle)
        self._register_xid_events()

    def device_name(self) -> str:
        """NVML's name of the rank's GPU ("NVIDIA H100 80GB HBM3"); "" without one (rank/perf.py's peak)."""
        if self._handle is None:
            return ""
        try:
            return _text(self.nvml.nvmlDeviceGetName(self._handle))
        except Exception as error:
            self.health.error("gpu_health", error)
            return ""

    def _register_xid_events(self) -> None:
        nvml = self.nvml
        self._events = None
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(
                self._handle, _const(nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL_ERROR), events
            )
            self._events = events
        except Exception as error:  # not supported (some VMs, MIG): the other readings still work
            if _error_code(error) != NVML_ERROR_NOT_SUPPORTED:
                self.health.error("gpu_health_events", error)

    def poll(self) -> None:
        """Read the device once; on failure the GPU is reported down until a read succeeds."""
        if self._handle is None:
            self.up = False
            return
        try:
            if self.preferred_uuid and self.preferred_uuid != self.uuid:
                self._select(self.preferred_uuid)
            self.reading = read_device(self.nvml, self._handle, self.uuid, self.pci_bus_id)
            self.recent.append((time.time(), self.reading))
            self.up = True
        except Exception as error:
            self.health.error("gpu_health", error)
            self.up = False

    def recent_readings(self) -> list[dict[str, Any]]:
        """The last readings (at most RECENT_READINGS), oldest first, as JSON: each reading's fields and
        `timestamp_seconds`, the Unix time it was read."""
        return [
            {"timestamp_seconds": round(at, 3), **dataclasses.asdict(reading)}
            for at, reading in self.recent.copy()
        ]

    def wait_for_events(self, timeout_seconds: float) -> None:
        """Wait up to `timeout_seconds` for an XID event on the device and count it."""
        if self._events is None:
            self._stop.wait(timeout_seconds)
            return
        nvml = self.nvml
        self._waiting_for_events = True
        try:
            data = nvml.nvmlEventSetWait(self._events, max(1, int(timeout_seconds * 1000)))
        except Exception as error:
            if _error_code(error) != NVML_ERROR_TIMEOUT:
                self.health.error("gpu_health_events", error)
                self._stop.wait(timeout_seconds)
            return
        finally:
            self._waiting_for_events = False
        if int(getattr(data, "eventType", 0)) & XID_CRITICAL_ERROR:
            self.last_xid = int(getattr(data, "eventData", 0))
            self.xid_events += 1

    def start(self) -> None:
        if self._handle is not None:
            self._thread.start()

    def stop(self) -> None:
        """The reader reads no more; a read in progress is waited for, an event wait is not."""
        self._stop.set()
        if self._thread.is_alive() and not self._waiting_for_events:
            self._thread.join(timeout=STOP_JOIN_SECONDS)

    def _run(self) -> None:
        next_read = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_read:
                    self.poll()
                    next_read = time.monotonic() + self.interval_seconds
                self.wait_for_events(max(0.0, next_read - time.monotonic()))
            except Exception as error:  # the reader must outlive anything NVML does
                self.health.error("gpu_health", error)
                self._stop.wait(self.interval_seconds)
