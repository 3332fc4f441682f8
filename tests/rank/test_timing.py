"""The timing manager and its backends, driven by fake works on CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import torch_extension

from flare_exporter import label_values
from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.timing import (
    CollectiveRecord,
    CudaEventTiming,
    FutureTiming,
    TimingBackend,
    TimingManager,
)


class FakeGroup:
    """What the manager reads from a group tracker: its name and last completed sequence number."""

    def __init__(self, name: str = "dp-0123abcd") -> None:
        self.name = name
        self.last_completed_seq = 0


class FakeWork:
    """A c10d Work whose completion the test controls."""

    def __init__(self, with_future: bool = True, duration_ms: float | None = None) -> None:
        self.completed = False
        self.future: torch.futures.Future | None = torch.futures.Future() if with_future else None
        self.duration_ms = duration_ms  # None: timing not enabled, _get_duration raises

    def is_completed(self) -> bool:
        return self.completed

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            raise RuntimeError("this work has no future")
        return self.future

    def _get_duration(self) -> float:
        if self.duration_ms is None:
            raise RuntimeError("timing is not enabled")
        return self.duration_ms

    def finish(self) -> None:
        self.completed = True
        if self.future is not None:
            self.future.set_result([])


def make_manager(queue_size: int = 16) -> TimingManager:
    return TimingManager(ExporterHealth(), queue_size=queue_size, interval_seconds=0.001)


def make_record(group: FakeGroup, op: str = "allreduce", nbytes: int = 64, seq: int = 1, age: float = 0.0):
    return CollectiveRecord(group, op, nbytes, seq, time.perf_counter() - age)


def bucket_counts(manager: TimingManager, group: str, op: str) -> dict[str, int]:
    return dict(manager.stats[(group, op)].durations.snapshot()[0])


def test_future_timing_records_duration_on_completion(completion_extension):
    manager = make_manager()
    group = FakeGroup()
    record = make_record(group, age=0.5)
    work = FakeWork()
    FutureTiming(manager, completion_extension).track(record, work)
    manager.drain()
    assert record.duration is None
    assert manager.stats == {}
    # with the extension the manager polls a stamp; without it, nothing waits there for the callback
    assert len(manager.polled) == (0 if completion_extension is None else 1)

    work.finish()
    finished_at = time.perf_counter()
    time.sleep(0.05)  # the drain comes later than the completion: the duration is the completion's
    manager.drain()
    assert record.duration is not None
    assert 0.5 <= record.duration <= finished_at - record.issued_at
    stats = manager.stats[(group.name, "allreduce")]
    assert stats.bytes_total == 64
    assert stats.durations.snapshot()[0][-1] == ("+Inf", 1)
    assert stats.durations.snapshot()[1] == pytest.approx(record.duration)
    assert group.last_completed_seq == 1


def test_future_timing_of_an_already_completed_work(completion_extension):
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork()
    work.finish()
    FutureTiming(manager, completion_extension).track(make_record(group), work)
    manager.drain()
    assert bucket_counts(manager, group.name, "allreduce")["+Inf"] == 1


def test_stats_accumulate_per_group_and_op(completion_extension):
    manager = make_manager()
    dp, tp = FakeGroup("dp-1"), FakeGroup("tp-2")
    backend = FutureTiming(manager, completion_extension)
    works = []
    for group, op, seq in [
        (dp, "allreduce", 1),
        (dp, "allreduce", 2),
        (dp, "broadcast", 3),
        (tp, "allreduce", 1),
    ]:
        work = FakeWork()
        backend.track(make_record(group, op, nbytes=100, seq=seq), work)
        works.append(work)
    for work in reversed(works):  # completion order need not follow issue order
        work.finish()
    manager.drain()
    assert set(manager.stats) == {("dp-1", "allreduce"), ("dp-1", "broadcast"), ("tp-2", "allreduce")}
    assert manager.stats[("dp-1", "allreduce")].bytes_total == 200
    assert bucket_counts(manager, "dp-1", "allreduce")["+Inf"] == 2
    assert dp.last_completed_seq == 3  # the highest, although seq 1 completed last
    assert tp.last_completed_seq == 1


def test_point_to_point_is_counted_per_peer_apart_from_the_collectives():
    manager = make_manager()
    group = FakeGroup()
    group.last_completed_seq = 4
    work = FakeWork()
    record = make_record(group, "send", seq=0, age=0.25)
    record.peer = 3
    FutureTiming(manager).track(record, work)
    work.finish()
    manager.drain()
    assert manager.stats == {}  # not a collective: no collective histogram, no sequence number moved
    assert group.last_completed_seq == 4
    peer = manager.point_to_point.peers[(group.name, 3, "send")]
    assert (peer.completed, peer.bytes_total) == (1, 64)
    durations = manager.point_to_point.durations[(group.name, "send")]
    assert 0.25 <= durations.sum < 1.0


def test_work_without_future_is_polled_until_completed():
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork(with_future=False)
    FutureTiming(manager).track(make_record(group, "recv", seq=0, age=0.25), work)
    manager.drain()
    manager.drain()
    assert manager.stats == {}
    assert len(manager.polled) == 1

    work.finish()
    manager.drain()
    assert len(manager.polled) == 0
    assert manager.point_to_point.peers[(group.name, -1, "recv")].completed == 1
    assert manager.point_to_point.durations[(group.name, "recv")].sum >= 0.25


def test_base_backend_polls():
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork()  # a future exists, but the base backend does not use it
    TimingBackend(manager).track(make_record(group), work)
    work.future.set_result([])
    manager.drain()
    assert manager.stats == {}
    work.completed = True
    manager.drain()
    assert group.last_completed_seq == 1


def test_cuda_event_timing_uses_device_duration():
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork(with_future=False, duration_ms=2.5)
    CudaEventTiming(manager).track(make_record(group, age=100.0), work)
    manager.drain()
    assert manager.stats == {}

    work.completed = True
    manager.drain()
    stats = manager.stats[(group.name, "allreduce")]
    assert stats.durations.snapshot()[1] == pytest.approx(0.0025)
    assert group.last_completed_seq == 1


def test_cuda_event_timing_falls_back_to_host_completion():
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork(with_future=False, duration_ms=None)
    CudaEventTiming(manager).track(make_record(group, age=0.5), work)
    work.completed = True
    manager.drain()
    total = manager.stats[(group.name, "allreduce")].durations.snapshot()[1]
    assert 0.5 <= total < 60


def test_completed_queue_is_bounded():
    manager = make_manager(queue_size=2)
    group = FakeGroup()
    for seq in range(1, 6):
        record = make_record(group, seq=seq)
        record.duration = 0.001
        manager.complete(record)
    assert manager.health.dropped["completed_collectives"] == 3
    manager.drain()
    assert bucket_counts(manager, group.name, "allreduce")["+Inf"] == 2
    assert group.last_completed_seq == 2


def test_polled_queue_is_bounded():
    manager = make_manager(queue_size=2)
    backend = CudaEventTiming(manager)
    group = FakeGroup()
    for seq in range(1, 5):
        backend.track(make_record(group, seq=seq), FakeWork(with_future=False))
    assert len(manager.polled) == 2
    assert manager.health.dropped["polled_collectives"] == 2


def test_manager_thread_drains_in_the_background(completion_extension):
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork()
    FutureTiming(manager, completion_extension).track(make_record(group, seq=7), work)
    manager.start()
    try:
        work.finish()
        deadline = time.monotonic() + 10
        while group.last_completed_seq != 7 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert group.last_completed_seq == 7
        assert (group.name, "allreduce") in manager.stats
    finally:
        manager.stop()
    assert not manager._thread.is_alive()


def test_manager_thread_survives_a_failing_work():
    class BrokenWork(FakeWork):
        def is_completed(self) -> bool:
            raise RuntimeError("broken")

    manager = make_manager()
    CudaEventTiming(manager).track(make_record(FakeGroup()), BrokenWork(with_future=False))
    manager.start()
    try:
        deadline = time.monotonic() + 10
        while manager.health.errors["timing_manager"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert manager.health.errors["timing_manager"] == 1
        assert manager._thread.is_alive()
    finally:
        manager.stop()


def test_durations_use_the_spec_buckets():
    manager = make_manager()
    record = make_record(FakeGroup())
    record.duration = 0.001
    manager.complete(record)
    manager.drain()
    assert (
        manager.stats[(record.group.name, "allreduce")].durations.bounds
        == label_values.COLLECTIVE_DURATION_BUCKETS
    )


class FailingWork(FakeWork):
    """A work whose future completes with an error, as gloo's does when a peer dies."""

    def __init__(self) -> None:
        super().__init__()
        self.cause: torch.futures.Future = torch.futures.Future()

        def raise_peer_died(_: torch.futures.Future) -> None:
            raise RuntimeError("peer died")

        self.future = self.cause.then(raise_peer_died)  # completed with the error set, not a value

    def fail(self) -> None:
        self.cause.set_result(None)


def test_failed_collective_stays_in_flight_and_is_counted(completion_extension):
    manager = make_manager()
    health = manager.health
    group = FakeGroup()
    backend = FutureTiming(manager, completion_extension)
    record = CollectiveRecord(group, "allreduce", 8, 1, time.perf_counter())
    work = FailingWork()
    backend.track(record, work)
    work.fail()
    manager.drain()
    manager.drain()
    assert manager.stats == {}
    assert record.duration is None
    assert group.last_completed_seq == 0
    assert health.dropped["failed_collectives"] == 1


class DuckFuture:
    """A future that is not torch's (a custom backend's work may hand one back): callbacks, a value."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def value(self) -> None:
        return None

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(self)


def test_a_future_that_is_not_torchs_is_called_back(completion_extension):
    manager = make_manager()
    group = FakeGroup()
    work = FakeWork()
    work.future = DuckFuture()  # type: ignore[assignment]
    FutureTiming(manager, completion_extension).track(make_record(group), work)
    work.future.finish()  # type: ignore[attr-defined]
    manager.drain()
    assert group.last_completed_seq == 1
    assert manager.health.errors == {}


def test_completion_stamps_are_filled_in_by_the_extension_without_python():
    extension = torch_extension()
    future: torch.futures.Future = torch.futures.Future()
    stamp = extension.stamp_completion(future)
    assert stamp.completed_at is None and not stamp.failed
    before = time.perf_counter()
    future.set_result(None)
    assert before <= stamp.completed_at <= time.perf_counter()  # on perf_counter's clock
    assert not stamp.failed


def test_manager_drains_only_once_its_interval_passed_without_a_scrapes_drain():
    manager = TimingManager(ExporterHealth(), queue_size=16, interval_seconds=2.0)
    drains_by: list[str] = []
    drain = manager._drain

    def counted_drain() -> None:
        drains_by.append(threading.current_thread().name)
        drain()

    manager._drain = counted_drain  # type: ignore[method-assign]
    manager.start()
    try:
        scraping_until = time.monotonic() + 3.0  # more than its interval, drained 20 times a second
        while time.monotonic() < scraping_until:
            manager.drain()
            time.sleep(0.05)
        assert "flare-timing" not in drains_by and len(drains_by) > 20
        assert 1.0 < manager.drain_due_in() <= 2.0  # an interval after the last of them
        wait_for(lambda: "flare-timing" in drains_by, 10, "the manager's own drain once scrapes stopped")
        assert manager.drain_due_in() > 1.0  # its drain counts as one: the next is an interval away
    finally:
        manager.stop()


def test_manager_polls_often_once_a_polled_backend_exists():
    manager = TimingManager(ExporterHealth(), queue_size=16, interval_seconds=10.0)
    assert not manager.polls_often
    FutureTiming(manager)
    assert not manager.polls_often
    backend = CudaEventTiming(manager)
    assert manager.polls_often
    group = FakeGroup()
    work = FakeWork(with_future=False, duration_ms=2.0)
    backend.track(make_record(group, seq=1), work)
    manager.start()
    try:
        work.finish()
        # with a 10 s interval this would time out; polling every 20 ms resolves it at once
        deadline = time.monotonic() + 5
        while group.last_completed_seq != 1:
            assert time.monotonic() < deadline, "the manager did not poll the completed work"
            time.sleep(0.01)
    finally:
        manager.stop()
