"""A fake NVML: the subset of pynvml that flare-exporter uses, same names, signatures and constants.

Tests build a `FakeNvml` with the devices they want and hand it to GpuHealthMonitor as its `nvml`. As a
module (`nvml_module: flare_exporter.local.testing.fake_nvml`, dcgm-exporter's "fake GPU" idea), it serves one
device per rank configured from the environment, so that a real job's ranks report GPU health without a
GPU:

    FLARE_FAKE_NVML_CLOCK_EVENTS   clock-event reason bitmask, e.g. 0x40 (hw_thermal_slowdown); default 0
    FLARE_FAKE_NVML_SM_CLOCK_MHZ   current SM clock; default the max, 1980
    FLARE_FAKE_NVML_PCIE           current PCIe link as GEN,WIDTH, e.g. 3,8; default the max, 5,16
    FLARE_FAKE_NVML_DEVICES        how many devices there are; default 8
"""

from __future__ import annotations

import os
import queue
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_UNINITIALIZED = 1

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
nvmlEventTypeXidCriticalError = 0x8

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100

nvmlNvLinkErrorDlReplay = 0
nvmlNvLinkErrorDlRecovery = 1
nvmlNvLinkErrorDlCrcFlit = 2
nvmlNvLinkErrorDlCrcData = 3


class NVMLError(Exception):
    """pynvml's exception: `value` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class PciInfo:
    busId: str  # noqa: N815 - pynvml's field name


@dataclass
class EventData:
    device: Any
    eventType: int  # noqa: N815 - pynvml's field names
    eventData: int  # noqa: N815


@dataclass
class FakeDevice:
    """One GPU's readings, as NVML would report them (clocks in MHz, power in mW)."""

    index: int = 0
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:00:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    clock_events: int = 0
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    temperature: int = 45
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    pcie_generation: int = 5
    pcie_generation_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    pcie_replays: int = 0
    ecc_errors: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})  # by error type
    nvlink_links: int = 18  # links present and enabled
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    remapped_rows: tuple[int, int, bool, bool] = (0, 0, False, False)
    unsupported: set[str] = field(default_factory=set)  # NVML function names that answer NOT_SUPPORTED
    lost: bool = False  # every query fails as if the GPU fell off the bus


def make_device(index: int) -> FakeDevice:
    return FakeDevice(
        index=index,
        uuid=f"GPU-fa4e0000-0000-0000-0000-{index:012d}",
        pci_bus_id=f"00000000:{0x18 + index * 0x10:02X}:00.0",
    )


class FakeNvml:
    """The fake library: devices, an event queue, and pynvml's functions as methods."""

    NVMLError = NVMLError

    def __init__(self, devices: list[FakeDevice] | None = None) -> None:
        self.devices = devices if devices is not None else [make_device(0)]
        self.initialized = 0
        self.events: queue.Queue[EventData] = queue.Queue()
        self.registered: list[tuple[int, int]] = []  # (device index, event types)
        # counted, not listed: a GPU health reader polls it for as long as the rank lives
        self.calls: Counter[str] = Counter()  # pynvml calls made, by function name
        self.event_waits: deque[int] = deque(maxlen=1024)  # the last nvmlEventSetWait timeouts, in ms

    # -- what tests use to drive it

    def raise_xid(self, device: FakeDevice, xid: int) -> None:
        """Deliver a critical XID event to whoever registered for the device."""
        self.events.put(EventData(device, nvmlEventTypeXidCriticalError, xid))

    # -- pynvml's API

    def _device(self, handle: Any, name: str) -> FakeDevice:
        self.calls[name] += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeDevice):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        if name in handle.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.initialized += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialized = max(0, self.initialized - 1)

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:  # noqa: N802
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:  # noqa: N802
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        for device in self.devices:
            if device.uuid == uuid:
                return device
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> PciInfo:  # noqa: N802
        return PciInfo(self._device(handle, "nvmlDeviceGetPciInfo").pci_bus_id.encode())  # type: ignore[arg-type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_events

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_events

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetClockInfo")
        if clock != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.sm_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetMaxClockInfo")
        if clock != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.sm_clock_max_mhz

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.temperature

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetCurrPcieLinkGeneration").pcie_generation

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetMaxPcieLinkGeneration").pcie_generation_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetCurrPcieLinkWidth").pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetMaxPcieLinkWidth").pcie_width_max

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        if counter_type not in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC) or error_type not in (0, 1):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.ecc_errors.get(error_type, 0)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetNvLinkState")
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if link >= device.nvlink_links:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetNvLinkErrorCounter")
        if link >= device.nvlink_links:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:  # noqa: N802
        device = self._device(handle, "nvmlDeviceGetRemappedRows")
        correctable, uncorrectable, pending, failure = device.remapped_rows
        return correctable, uncorrectable, int(pending), int(failure)

    def nvmlEventSetCreate(self) -> list[int]:  # noqa: N802
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return []

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: list[int]) -> None:  # noqa: N802
        device = self._device(handle, "nvmlDeviceRegisterEvents")
        event_set.append(device.index)
        self.registered.append((device.index, event_types))

    def nvmlEventSetWait(self, event_set: list[int], timeout_ms: int) -> EventData:  # noqa: N802
        self.event_waits.append(timeout_ms)
        try:
            event = self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        if event.device.index not in event_set:
            raise NVMLError(NVML_ERROR_TIMEOUT)  # not for this set: NVML would not have woken us
        return event

    def nvmlEventSetFree(self, event_set: list[int]) -> None:  # noqa: N802
        event_set.clear()


def from_environment(environ: Mapping[str, str]) -> FakeNvml:
    """A FakeNvml whose devices all report what the FLARE_FAKE_NVML_* variables say."""
    devices = [make_device(index) for index in range(int(environ.get("FLARE_FAKE_NVML_DEVICES", "8")))]
    for device in devices:
        device.clock_events = int(environ.get("FLARE_FAKE_NVML_CLOCK_EVENTS", "0"), 0)
        device.sm_clock_mhz = int(environ.get("FLARE_FAKE_NVML_SM_CLOCK_MHZ", str(device.sm_clock_max_mhz)))
        if environ.get("FLARE_FAKE_NVML_PCIE"):
            generation, width = environ["FLARE_FAKE_NVML_PCIE"].split(",")
            device.pcie_generation, device.pcie_width = int(generation), int(width)
    return FakeNvml(devices)


# As a module: one library configured from this process's environment, its functions at module level.
_library = from_environment(os.environ)
for _name in dir(_library):
    if _name.startswith("nvml"):
        globals()[_name] = getattr(_library, _name)
