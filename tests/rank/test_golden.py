"""Golden exposition: a rank's /metrics for a fixed state, byte for byte (timings that vary are skipped).

Regenerate after an intended change with: FLARE_UPDATE_GOLDEN=1 pytest tests/rank/test_golden.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from flare_exporter import spec
from flare_exporter.config import Config
from flare_exporter.engine.scrape import parse
from flare_exporter.local.testing.fake_nvml import FakeNvml, make_device
from flare_exporter.rank import progress
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.canary import Canary, CanarySnapshot
from flare_exporter.rank.collectors import host_load as host_load_collector
from flare_exporter.rank.collectors import identity as identity_collector
from flare_exporter.rank.gpu_health import GpuHealthMonitor
from flare_exporter.rank.groups import GroupTracker
from flare_exporter.rank.host_load import HostLoad
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.last_word import RaisedException, Termination
from flare_exporter.rank.perf import PerfMonitor
from flare_exporter.rank.profiler import Capture, Profiler
from flare_exporter.rank.shim import RingReader, ShimFeed
from flare_exporter.rank.stall import StackSample
from flare_exporter.rank.state import FlareState
from flare_exporter.rank.timing import CollectiveRecord, CollectiveStats, FutureTiming

GOLDEN = Path(__file__).parent / "golden" / "rank3.prom"
UNSTABLE = ("flare_exporter_collector_duration_seconds",)


def fixed_state() -> FlareState:
    identity = RankIdentity(
        rank=3,
        local_rank=1,
        world_size=8,
        run="golden",
        host="node-a",
        pid=4242,
        backend="gloo",
        gpu_uuid="GPU-0000",
        pci_bus_id="00000000:3B:00.0",
        switch="leaf-07",
        rack="r12",
    )
    state = FlareState.create(Config(profile=True), identity)
    for name, size in (("world", 8), ("data_parallel-0a1b2c3d", 2)):
        tracker = GroupTracker(name, size, "gloo", FutureTiming(state.manager), state.health)
        state.groups[name] = tracker
        state.manager.add_group(tracker)
    world = state.groups["world"]
    for seq, duration in enumerate((0.0004, 0.002, 0.05), start=1):
        world.last_issued_seq = seq
        record = CollectiveRecord(world, "allreduce", 4096, seq, 0.0)
        record.duration = duration
        state.manager.complete(record)
    world.last_issued_seq = 4  # one still in flight
    world.pending.append(CollectiveRecord(world, "broadcast", 1024, 4, 1_700_000_000.25))
    for op, peer, duration in (("send", 4, 0.003), ("recv", 2, 0.0015)):  # a pipeline stage's exchanges
        record = CollectiveRecord(world, op, 2048, 0, 0.0, peer)
        record.duration = duration
        state.manager.complete(record)
    # in flight, oldest first: a send to 4 (waited for at the end of the step), then two receives from 2; the
    # oldest per peer and direction is exposed: the send and the first receive
    for op, issued_at, peer in (("send", 0.125, 4), ("recv", 0.375, 2), ("recv", 0.5, 2)):
        world.p2p_pending.append(CollectiveRecord(world, op, 2048, 0, 1_700_000_000 + issued_at, peer))
    state.manager.drain()
    state.profiler = Profiler(state.health, 5, 0.0, "", "golden", 3)
    state.profiler.outcomes.update(captured=2, failed=1)
    state.profiler.refused = 1
    shares = {"compute": 0.75, "communication": 0.25, "exposed_communication": 0.125, "copy": 0.0}
    state.profiler.last = Capture(
        3,
        3,
        1_700_000_001.0,
        state="captured",
        finished_at=1_700_000_001.5,
        bottleneck="compute_bound",
        summary={"step_seconds": 0.125, "shares": {**shares, "idle": 0.0625, "data": 0.0}},
    )
    state.stack = StackSample(
        "compute", ("train.py:42 forward", "module.py:1 _call_impl", "train.py:90 main")
    )
    state.exception = RaisedException("RuntimeError", "software_exception", 1_700_000_002.0)
    state.terminated = Termination("SIGTERM", "launcher", 1_700_000_003.0)
    world.last_progress_at = 1_700_000_000.5
    for gap in (0.0, 0.1, 0.12):
        state.steps.steps += 1
        if gap:
            state.steps.durations.observe(gap)
    state.steps.last_step_at = 1_700_000_001.0
    state.health.error("step_hook")
    state.health.drop("completed_collectives", 2)
    # issue latency: a few samples in each distribution, and a drift from the baseline
    assert state.ild is not None
    ild = state.ild
    for latency, samples in ((ild.kernel_issue, (2e-6, 4e-4)), (ild.host_dispatch, (5e-6, 1.2e-5))):
        latency.active = True
        latency.add_many(0, samples)
        latency.drift.current = (0.25, 1.5e-6)
    ild.host_dispatch.drift.op_shift = 2.5e-7
    # the launch shim preloaded: two NCCL all-reduces it sampled (its ring is not read here)
    state.shim_feed = ShimFeed(RingReader(Path("/nonexistent/ring"), state.health), ild.kernel_issue)
    allreduce = state.shim_feed.collectives["allreduce"] = CollectiveStats()
    for duration in (0.0015, 0.004):
        allreduce.durations.observe(duration)
    allreduce.bytes_total = 8192
    # straggler windows: two closed windows of 5 steps; the rank's GPU through the fake NVML, one XID seen
    for step in range(2, 12):
        state.windows.ring.add_step(step, 0.125, 0.03125 if step < 7 else 0.0625)
    nvml = FakeNvml([make_device(1)])
    state.gpu = GpuHealthMonitor(nvml, 0, state.health)
    state.gpu.open()
    state.gpu.poll()
    nvml.raise_xid(nvml.devices[0], 79)
    state.gpu.wait_for_events(5.0)
    # the hardware canary: a preflight this rank failed at compute, and two in-flight runs drifting
    state.canary = Canary(Config(canary="warn"), lambda: identity, state.health, lambda: 0)
    state.canary.snapshot = CanarySnapshot(
        preflight={("gemm_flops", "device"): 2.5e10, ("allreduce_busbw", "intra_host"): 7.5e8},
        relative={("gemm_flops", "device"): 0.25, ("allreduce_busbw", "intra_host"): 1.0},
        failed=frozenset({("gemm_flops", "device", "preflight")}),
        passed=False,
        in_flight={("gemm_flops", "device"): 1.5e10},
        ewma_ratio={("gemm_flops", "device"): 0.75},
        drift={("gemm_flops", "device"): True},
        runs={"preflight": 1, "in_flight": 2},
        durations={"preflight": 1.5, "in_flight": 0.0625},
    )
    # the step breakdown: three steps of 0.125 s (40 ms in collectives: 30 ms world, 10 ms tp), 1 GFLOP each,
    # a 100 GFLOP/s peak
    state.perf = PerfMonitor(None, Config(model_flops_per_step=1e9, peak_flops=1e11))
    for step in (2, 3, 4):
        state.perf.on_step(step, 0.125, 0.04, {"world": 0.03, "tp": 0.01})
    state.windows.host_pressure_floor = 0.08
    return state


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch):
    """Hooks record perf_counter readings; pin their conversion to Unix time so the heartbeat is fixed."""
    monkeypatch.setattr(progress, "wall_time", lambda perf_time: perf_time)


@pytest.fixture(autouse=True)
def pinned_build(monkeypatch):
    """flare_exporter_build_info names this machine's versions and whether the C++ recorder is built: pin
    them."""
    pinned = ("0.1.0", "2.5.1", "3.12.3", "python")
    monkeypatch.setattr(identity_collector, "build_values", lambda torch_version, cpp_recorder: pinned)


@pytest.fixture(autouse=True)
def fixed_host_load(monkeypatch):
    """The host's load as a fixed reading: the real one changes from one render to the next, and a host
    without PSI (or a first read of the training thread's CPU share) would leave a series out."""
    reading = HostLoad(cpu_pressure=0.42, runnable_tasks=9, cpus=8, thread_cpu_ratio=0.61)
    monkeypatch.setattr(host_load_collector, "read_host_load", lambda thread=None: reading)


def stable_exposition() -> str:
    text = generate_latest(build_registry(fixed_state())).decode()
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith(UNSTABLE))


def test_exposition_matches_golden_file():
    text = stable_exposition()
    if os.environ.get("FLARE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_golden_exposition():
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=stable_exposition(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_exposition_names_exactly_the_spec_metrics():
    text = generate_latest(build_registry(fixed_state())).decode()
    exposed = {sample.name for sample in parse(text)}
    assert exposed <= spec.all_series_names()
    # the fixed state exercises every metric the spec declares
    for metric in spec.METRICS:
        assert set(spec.exposed_series_names(metric)) & exposed, metric.name


def test_a_scrape_shows_collectives_completed_since_the_last_drain():
    state = fixed_state()
    world = state.groups["world"]
    record = CollectiveRecord(world, "allreduce", 4096, 4, 0.0)
    record.duration = 0.001
    state.manager.complete(record)  # the manager thread has not run: the scrape itself resolves it
    samples = parse(generate_latest(build_registry(state)).decode())
    count = [s.value for s in samples if s.name == "flare_collective_duration_seconds_count"]
    assert count == [4]
    completed = [s.value for s in samples if s.name == "flare_collective_last_completed_seq"]
    assert completed[0] == 4
