"""GPU health: the real collector and NVML reader, fed by the fake NVML module (no GPU here)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from prometheus_client import generate_latest

from flare_exporter import label_values, spec
from flare_exporter.config import Config
from flare_exporter.engine.scrape import parse
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing import fake_nvml
from flare_exporter.local.testing.fake_nvml import FakeNvml, make_device
from flare_exporter.rank import gpu_health
from flare_exporter.rank.attach import build_registry, start_gpu_health
from flare_exporter.rank.collectors import Families
from flare_exporter.rank.collectors.gpu_health import GpuHealthCollector
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.state import FlareState

IDENTITY = RankIdentity(rank=1, local_rank=1, world_size=2, run="gpu", host="h", pid=1)


def scrape(state: FlareState) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(build_registry(state)).decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("rank", "run")))): s.value
        for s in parse(text)
        if s.name.startswith("flare_gpu_") or s.name == "flare_rank_info"
    }


def gpu_series(samples: dict) -> dict:
    return {key: value for key, value in samples.items() if key[0].startswith("flare_gpu_")}


def monitored(nvml: FakeNvml, selector: int | str = 0) -> tuple[FlareState, gpu_health.GpuHealthMonitor]:
    state = FlareState.create(Config(), IDENTITY)
    monitor = gpu_health.GpuHealthMonitor(nvml, selector, state.health, interval_seconds=0.05)
    state.gpu = monitor
    assert monitor.open()
    monitor.poll()
    return state, monitor


def degraded_device() -> fake_nvml.FakeDevice:
    device = make_device(0)
    device.clock_events = 0x40 | 0x4  # hw_thermal_slowdown, sw_power_cap
    device.sm_clock_mhz = 1100
    device.temperature = 91
    device.power_mw = 690_500
    device.pcie_generation, device.pcie_width = 3, 8
    device.pcie_replays = 12
    device.ecc_errors = {0: 5, 1: 1}
    device.nvlink_links = 4
    device.nvlink_errors = {(0, 0): 2, (3, 0): 3, (1, 2): 7, (2, 3): 1}
    device.remapped_rows = (3, 1, True, False)
    return device


# ---------------------------------------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize(
    ("mask", "active"),
    [
        (0, set()),
        (0x1, {"gpu_idle"}),
        (0x40, {"hw_thermal_slowdown"}),
        (0x20 | 0x80, {"sw_thermal_slowdown", "hw_power_brake_slowdown"}),
        (0x1FF, {name for name, _ in gpu_health.CLOCK_EVENT_REASONS}),
        (0x200 | 0x8, {"hw_slowdown"}),  # bits beyond the fixed list are not series
    ],
)
def test_clock_event_mask_decodes_to_one_flag_per_reason(mask, active):
    decoded = gpu_health.decode_clock_events(mask)
    assert list(decoded) == [name for name, _ in gpu_health.CLOCK_EVENT_REASONS]
    assert {name for name, flag in decoded.items() if flag} == active


def test_reason_bits_are_nvml_constants():
    for name, bit in gpu_health.CLOCK_EVENT_REASONS:
        camel = "".join(part.capitalize() for part in name.split("_"))
        constant = {
            "GpuIdle": "nvmlClocksEventReasonGpuIdle",
            "ApplicationsClocksSetting": "nvmlClocksEventReasonApplicationsClocksSetting",
        }.get(camel, f"nvmlClocksEventReason{camel}")
        assert getattr(fake_nvml, constant) == bit, name


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [
        (3, None, 3),
        (3, "4,5,6,7", 7),
        (0, "GPU-abc,GPU-def", "GPU-abc"),
        (3, "2", 2),  # one GPU per process: its only entry
        (1, "", 1),
    ],
)
def test_device_selector_follows_local_rank_and_visible_devices(local_rank, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert gpu_health.device_selector(local_rank, environ) == expected


# ---------------------------------------------------------------------------------------------------------
# the collector over the fake


def test_every_gpu_series_from_a_degraded_device():
    state, _ = monitored(FakeNvml([degraded_device()]))
    series = gpu_series(scrape(state))
    assert series[("flare_gpu_health_up", ())] == 1
    for name, _ in gpu_health.CLOCK_EVENT_REASONS:
        expected = 1 if name in ("hw_thermal_slowdown", "sw_power_cap") else 0
        assert series[("flare_gpu_clock_event_active", (("reason", name),))] == expected
    assert series[("flare_gpu_sm_clock_hertz", ())] == 1100e6
    assert series[("flare_gpu_sm_clock_max_hertz", ())] == 1980e6
    assert series[("flare_gpu_temperature_celsius", ())] == 91
    assert series[("flare_gpu_power_watts", ())] == 690.5
    assert series[("flare_gpu_power_limit_watts", ())] == 700
    assert series[("flare_gpu_pcie_link_generation", ())] == 3
    assert series[("flare_gpu_pcie_link_generation_max", ())] == 5
    assert series[("flare_gpu_pcie_link_width", ())] == 8
    assert series[("flare_gpu_pcie_link_width_max", ())] == 16
    assert series[("flare_gpu_pcie_replays_total", ())] == 12
    assert series[("flare_gpu_ecc_errors_total", (("type", "corrected"),))] == 5
    assert series[("flare_gpu_ecc_errors_total", (("type", "uncorrected"),))] == 1
    nvlink = {
        dict(labels)["counter"]: v
        for (n, labels), v in series.items()
        if n == "flare_gpu_nvlink_errors_total"
    }
    assert nvlink == {"replay": 5, "recovery": 0, "crc_flit": 7, "crc_data": 1}  # summed over links
    assert series[("flare_gpu_remapped_rows", (("cause", "correctable"),))] == 3
    assert series[("flare_gpu_remapped_rows", (("cause", "uncorrectable"),))] == 1
    assert series[("flare_gpu_row_remap_pending", ())] == 1
    assert series[("flare_gpu_row_remap_failed", ())] == 0
    assert series[("flare_gpu_xid_events_total", ())] == 0
    exported = {name for name, _ in series} | {"flare_gpu_last_xid"}  # the last XID appears with one
    assert exported == {metric.name for metric in spec.METRICS if metric.name.startswith("flare_gpu_")}


def test_series_count_stays_bounded_with_every_nvlink():
    device = degraded_device()
    device.nvlink_links = 18
    device.nvlink_errors = {(link, counter): 1 for link in range(18) for counter in range(4)}
    state, _ = monitored(FakeNvml([device]))
    series = gpu_series(scrape(state))
    assert len(series) <= 40
    assert series[("flare_gpu_nvlink_errors_total", (("counter", "replay"),))] == 18


def test_xid_events_arrive_through_the_event_set_on_the_background_thread():
    nvml = FakeNvml([make_device(0), make_device(1)])
    state, monitor = monitored(nvml, 1)
    assert nvml.registered == [(1, fake_nvml.nvmlEventTypeXidCriticalError)]
    monitor.start()
    try:
        nvml.raise_xid(nvml.devices[1], 79)
        wait_for(lambda: monitor.xid_events == 1, 10, "the XID event")
        nvml.raise_xid(nvml.devices[1], 48)
        wait_for(lambda: monitor.xid_events == 2, 10, "the second XID event")
    finally:
        monitor.stop()
    series = gpu_series(scrape(state))
    assert series[("flare_gpu_xid_events_total", ())] == 2
    assert series[("flare_gpu_last_xid", ())] == 48


def test_an_idle_reader_waits_for_events_until_its_next_read_and_stop_does_not_wait_for_it():
    nvml = FakeNvml([make_device(0)])
    monitor = gpu_health.GpuHealthMonitor(nvml, 0, FlareState.create(Config(), IDENTITY).health, 60)
    assert monitor.open()
    monitor.start()
    wait_for(lambda: nvml.event_waits, 10, "the reader's first wait for events")
    reads = nvml.calls["nvmlDeviceGetCurrentClocksEventReasons"]
    assert reads == 1 and len(nvml.event_waits) == 1
    assert nvml.event_waits[0] > 50_000  # one wait until the next read, a minute away: not slices of it
    stopping = time.monotonic()
    monitor.stop()
    assert time.monotonic() - stopping < 30  # it did not wait for the minute's event wait
    nvml.raise_xid(nvml.devices[0], 79)  # the wait returns: the reader ends, without another read
    monitor._thread.join(10)
    assert not monitor._thread.is_alive()
    assert nvml.calls["nvmlDeviceGetCurrentClocksEventReasons"] == reads and len(nvml.event_waits) == 1


def test_background_reads_follow_the_device():
    nvml = FakeNvml([make_device(0)])
    state, monitor = monitored(nvml)
    monitor.start()
    try:
        nvml.devices[0].clock_events = 0x20
        wait_for(
            lambda: monitor.reading is not None and monitor.reading.clock_events["sw_thermal_slowdown"] == 1,
            10,
            "a read that sees the thermal slowdown",
        )
    finally:
        monitor.stop()
    series = gpu_series(scrape(state))
    assert series[("flare_gpu_clock_event_active", (("reason", "sw_thermal_slowdown"),))] == 1


def test_unsupported_queries_are_left_out_and_the_rest_reported():
    device = make_device(0)
    device.unsupported = {
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceRegisterEvents",
    }
    device.nvlink_links = 0
    state, monitor = monitored(FakeNvml([device]))
    series = gpu_series(scrape(state))
    names = {name for name, _ in series}
    assert series[("flare_gpu_health_up", ())] == 1
    assert "flare_gpu_pcie_replays_total" not in names and "flare_gpu_remapped_rows" not in names
    assert "flare_gpu_nvlink_errors_total" not in names
    assert "flare_gpu_xid_events_total" not in names  # no event set: no claim that there were none
    assert "flare_gpu_temperature_celsius" in names
    assert not monitor.listens_for_xid and state.health.errors == {}


def test_a_lost_gpu_reports_down_and_counts_the_error():
    nvml = FakeNvml([make_device(0)])
    state, monitor = monitored(nvml)
    nvml.devices[0].lost = True
    monitor.poll()
    assert gpu_series(scrape(state)) == {("flare_gpu_health_up", ()): 0}
    assert state.health.errors["gpu_health"] == 1
    nvml.devices[0].lost = False
    monitor.poll()
    assert gpu_series(scrape(state))[("flare_gpu_health_up", ())] == 1


def test_without_nvml_only_health_up_zero():
    state = FlareState.create(Config(nvml_module="flare_exporter_no_such_nvml"), IDENTITY)
    start_gpu_health(state)
    assert state.gpu is not None and not state.gpu.up
    samples = scrape(state)
    assert gpu_series(samples) == {("flare_gpu_health_up", ()): 0}
    info = next(labels for (name, labels), _ in samples.items() if name == "flare_rank_info")
    assert dict(info)["gpu_uuid"] == "" and dict(info)["pci_bus_id"] == ""
    assert state.health.errors == {}  # no NVML is not an error


def test_disabled_gpu_health_reports_zero():
    state = FlareState.create(
        Config(gpu_health=False, nvml_module="flare_exporter.local.testing.fake_nvml"), IDENTITY
    )
    start_gpu_health(state)
    assert state.gpu is None
    assert gpu_series(scrape(state)) == {("flare_gpu_health_up", ()): 0}


def test_the_fake_module_by_name_fills_rank_info_with_the_ranks_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    state = FlareState.create(Config(nvml_module="flare_exporter.local.testing.fake_nvml"), IDENTITY)
    start_gpu_health(state)
    assert state.gpu is not None
    try:
        wait_for(lambda: state.gpu is not None and state.gpu.up, 10, "the first read")
        samples = scrape(state)
    finally:
        state.gpu.stop()
    info = dict(next(labels for (name, labels), _ in samples.items() if name == "flare_rank_info"))
    device = make_device(1)  # local rank 1 -> CUDA_VISIBLE_DEVICES entry 1 -> NVML index 1
    assert (info["gpu_uuid"], info["pci_bus_id"]) == (device.uuid, device.pci_bus_id)
    assert gpu_series(samples)[("flare_gpu_health_up", ())] == 1


def test_the_collector_never_calls_nvml():
    nvml = FakeNvml([make_device(0)])
    state, _ = monitored(nvml)
    calls = nvml.calls.total()
    collector = GpuHealthCollector(state)
    list(collector.collect(Families(("1", "gpu"))))
    assert nvml.calls.total() == calls


def test_the_slowdown_reasons_the_rules_report_are_clock_event_reasons():
    assert set(label_values.GPU_SLOWDOWN_REASONS) < {name for name, _ in gpu_health.CLOCK_EVENT_REASONS}


def test_one_endpoint_shows_each_new_reading_and_event_and_builds_nothing_in_between():
    nvml = FakeNvml([make_device(0)])
    state, monitor = monitored(nvml)
    collector = GpuHealthCollector(state)
    families = Families(("1", "gpu"))

    def values() -> dict[tuple[str, tuple[str, ...]], float]:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in collector.collect(families)
            for sample in family.samples
        }

    first = collector.collect(families)
    assert collector.collect(families) is first  # the same reading: the same families, nothing built
    nvml.devices[0].temperature = 88
    monitor.poll()
    assert values()[("flare_gpu_temperature_celsius", (("rank", "1"), ("run", "gpu")))] == 88
    monitor.xid_events, monitor.last_xid = 1, 79  # as the event thread counts one
    assert values()[("flare_gpu_last_xid", (("rank", "1"), ("run", "gpu")))] == 79
    assert collector.collect(Families(("2", "gpu"))) is not collector.collect(families)  # a new identity
    monitor.up = False
    assert values() == {("flare_gpu_health_up", (("rank", "1"), ("run", "gpu"))): 0}


def test_a_preferred_uuid_switches_the_device():
    nvml = FakeNvml([make_device(0), make_device(1)])
    state, monitor = monitored(nvml, 0)
    monitor.preferred_uuid = nvml.devices[1].uuid
    monitor.poll()
    assert monitor.reading is not None
    assert dataclasses.astuple(monitor.reading)[:2] == (nvml.devices[1].uuid, nvml.devices[1].pci_bus_id)
