"""The fake device and the event backends, driven through the same timing manager as CUDA events."""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest

from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank import fake_device
from flare_exporter.rank.device_events import CupyEvents, EventPool, TorchCudaEvents
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.fake_device import FakeDevice, FakeDeviceEvents, FakeEvent
from flare_exporter.rank.timing import TimingManager


@pytest.fixture
def device():
    device = FakeDevice("test-stream")
    yield device
    device.close()


def test_stream_runs_kernels_in_order_and_timestamps_events_when_reached(device):
    ran = []
    first, second = FakeEvent(), FakeEvent()
    device.stream.record_event(first)
    device.launch(lambda: ran.append("a"))
    device.launch(0.02)
    device.stream.record_event(second)
    device.launch(lambda: ran.append("b"))
    assert device.synchronize(timeout=10)
    assert ran == ["a", "b"]
    assert first.done and second.done
    # the second event waits for the 20 ms kernel before it: the stream's clock says so exactly
    assert second.device_time - first.device_time >= 0.02


def test_queued_kernels_delay_later_events_and_an_idle_stream_does_not(device):
    backend = FakeDeviceEvents(ExporterHealth(), 8, device.stream)
    for _ in range(5):
        device.launch(0.01)
    busy_launch = time.perf_counter()
    busy = backend.record()
    device.synchronize(timeout=10)
    idle_launch = time.perf_counter()
    idle = backend.record()
    device.synchronize(timeout=10)
    assert backend.query(busy) and backend.query(idle)
    # behind 50 ms of queued kernels the device reaches the event late; on an idle stream at once
    assert backend.timestamp(busy) - busy_launch >= 0.04
    assert 0 <= backend.timestamp(idle) - idle_launch < 0.04
    assert backend.elapsed(busy, idle) > 0


def test_launch_hook_sees_every_launch_before_the_kernel(device):
    seen = []
    fake_device.set_launch_hook(lambda stream: seen.append(stream.kernels_run))
    try:
        device.launch(lambda: None)
        device.launch(lambda: None)
        device.synchronize(timeout=10)
    finally:
        fake_device.set_launch_hook(None)
    assert len(seen) == 2


def imports_the_fake_device(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        named = [alias.name for alias in node.names]
        return (node.module or "").endswith("fake_device") or "fake_device" in named
    return isinstance(node, ast.Import) and any(a.name.endswith(".fake_device") for a in node.names)


def test_no_module_a_rank_runs_imports_the_fake_device():
    """Test scaffolding: only the tests and the local wing's workloads load it, never a real rank."""
    package = Path(fake_device.__file__).resolve().parents[1]
    importers = {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if imports_the_fake_device(node)
    }
    assert importers == {"local/workloads/train_ddp.py"}


def test_a_failing_kernel_does_not_stop_the_stream(device):
    def broken() -> None:
        raise RuntimeError("kernel fault")

    device.launch(broken)
    device.launch(0.001)
    assert device.synchronize(timeout=10)
    assert device.stream.kernels_run == 2


def test_manager_resolves_fake_events_into_issue_latencies(device):
    health = ExporterHealth()
    manager = TimingManager(health, queue_size=64, interval_seconds=0.01)
    backend = FakeDeviceEvents(health, 16, device.stream)
    latencies: list[tuple[int, float]] = []
    device.launch(0.05)  # the queue the sampled kernel waits behind
    launched_at = time.perf_counter()
    event = backend.record()
    manager.watch(backend, event, launched_at, 7, lambda tag, seconds: latencies.append((tag, seconds)))
    assert manager.polls_often
    manager.start()
    try:
        wait_for(lambda: latencies, 10, "the event to resolve")
    finally:
        manager.stop()
    [(tag, seconds)] = latencies
    assert tag == 7 and 0.04 <= seconds < 5
    assert len(backend.pool.free) == 1  # released to the pool for reuse


def test_event_pool_is_bounded_and_counts_drops():
    health = ExporterHealth()
    pool = EventPool(FakeEvent, 2, health)
    first, second = pool.acquire(), pool.acquire()
    assert first is not None and second is not None
    assert pool.acquire() is None
    assert health.dropped["ild_events"] == 1
    pool.release(first)
    assert pool.acquire() is first


def test_event_queue_full_drops_and_returns_the_event():
    health = ExporterHealth()
    manager = TimingManager(health, queue_size=1, interval_seconds=1)
    backend = FakeDeviceEvents(health, 4, fake_device.FakeStream("full"))
    for _ in range(3):
        manager.watch(backend, backend.record(), 0.0, 0, lambda tag, seconds: None)
    assert len(manager.events) == 1
    assert health.dropped["device_events"] == 2
    assert backend.pool.created == 2 and len(backend.pool.free) == 1  # the dropped one was reused


def test_record_without_a_stream_returns_the_event_to_the_pool():
    backend = FakeDeviceEvents(ExporterHealth(), 1)
    with pytest.raises(ValueError):
        backend.record()
    assert len(backend.pool.free) == 1


def test_a_failing_event_is_counted_and_does_not_stop_the_drain():
    class Broken(FakeDeviceEvents):
        def timestamp(self, event):
            raise RuntimeError("device lost")

    health = ExporterHealth()
    manager = TimingManager(health, queue_size=8, interval_seconds=1)
    backend = Broken(health, 2)
    event = FakeEvent()
    event.done = True
    manager.watch(backend, event, 0.0, 0, lambda tag, seconds: None)
    manager.drain()
    assert health.errors["device_events"] == 1 and not manager.events


# ---------------------------------------------------------------------------------------------------------
# CUDA backends, with fake torch.cuda and cupy modules (no GPU here)


class FakeCudaEvent:
    """Stands for a CUDA event: `at` is its device time in ms once recorded and reached."""

    clock = [0.0]

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.at: float | None = None
        self.stream = None
        self.synchronized = False

    def record(self, stream=None):
        self.stream = stream
        FakeCudaEvent.clock[0] += 1.5
        self.at = FakeCudaEvent.clock[0]

    def query(self):
        return self.at is not None

    @property
    def done(self):
        return self.query()

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, other):
        return other.at - self.at


class FakeTorchCuda:
    Event = FakeCudaEvent

    class Stream:
        pass

    @staticmethod
    def current_stream():
        return "current"


class FakeCupy:
    class cuda:  # noqa: N801 - mirrors cupy.cuda
        Event = FakeCudaEvent

        class Stream:
            def __init__(self, non_blocking=False):
                self.non_blocking = non_blocking

        @staticmethod
        def get_current_stream():
            return "cupy-current"

        @staticmethod
        def get_elapsed_time(start, end):
            return end.at - start.at


@pytest.mark.parametrize(
    "make", [lambda h: TorchCudaEvents(h, 4, cuda=FakeTorchCuda), lambda h: CupyEvents(h, 4, cupy=FakeCupy)]
)
def test_cuda_backends_anchor_events_on_the_host_clock(make):
    health = ExporterHealth()
    backend = make(health)
    event = backend.record()
    assert event.stream in ("current", "cupy-current")
    assert backend.query(event)
    before = event.at
    later = backend.record()
    assert backend.elapsed(event, later) == pytest.approx((later.at - before) / 1000)
    stamp = backend.timestamp(later)  # first call anchors: an event on a private stream, synchronized
    anchor_host, anchor = backend._anchor
    assert anchor.synchronized and anchor.stream not in ("current", "cupy-current")
    assert stamp == pytest.approx(anchor_host + (later.at - anchor.at) / 1000)
    backend.release(event)
    assert backend.record() is event  # pooled


def test_cuda_backends_import_lazily():
    import flare_exporter.rank.device_events  # noqa: F401

    assert "cupy" not in sys.modules
    with pytest.raises(ImportError):
        CupyEvents(ExporterHealth(), 4)  # the optional extra is not installed here
