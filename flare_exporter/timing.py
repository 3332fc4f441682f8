"""Collective timing: hooks record, backends notice completion, a manager thread turns both into metrics.

The training thread only creates a CollectiveRecord and hands the work to a timing backend, which
never waits. Backends behind one interface:

- FutureTiming (CPU, gloo): the work's future calls back on the backend's own thread when the
  collective completes; duration = completion time - issue time.
- CudaEventTiming (GPU, NCCL): ProcessGroupNCCL records CUDA start/end events on the collective's own
  stream when TORCH_NCCL_ENABLE_TIMING=1; the manager polls `is_completed()` and reads the event
  duration, so no thread ever synchronizes with the device.

The TimingManager drains completions into per-(group, op) statistics: on its own thread every
`interval_seconds`, and on every scrape so that what a scrape shows is current. The two never drain at
once (a lock that only they take; the training thread never touches it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from . import spec
from .health import ExporterHealth
from .histogram import Histogram


class CollectiveRecord:
    """One collective as the training thread issued it; `duration` is filled in when it completes."""

    __slots__ = ("group", "op", "nbytes", "seq", "issued_at", "duration", "started")

    def __init__(self, group: Any, op: str, nbytes: int, seq: int, issued_at: float) -> None:
        self.group = group
        self.op = op
        self.nbytes = nbytes
        self.seq = seq  # 0 for point-to-point ops, which have no group-wide sequence
        self.issued_at = issued_at
        self.duration: float | None = None
        self.started = False  # set by a backend that sees the collective start on the device


class CollectiveStats:
    """Completed collectives of one (group, op): durations and bytes. Written by the manager only."""

    __slots__ = ("durations", "bytes_total")

    def __init__(self) -> None:
        self.durations = Histogram(spec.COLLECTIVE_DURATION_BUCKETS)
        self.bytes_total = 0


# Once a backend that is polled (NCCL) is in use, the manager wakes this often, so that it holds a completed
# collective's work, and so its tensors, only briefly; otherwise it wakes every `interval_seconds`.
POLL_INTERVAL_SECONDS = 0.02


class TimingManager:
    """Background thread that resolves collective completions into statistics."""

    def __init__(self, health: ExporterHealth, queue_size: int, interval_seconds: float) -> None:
        self.health = health
        self.queue_size = queue_size
        self.interval_seconds = interval_seconds
        self.completed: deque[CollectiveRecord] = deque()  # appended by backend threads
        self.polled: deque[tuple[CollectiveRecord, Any, TimingBackend]] = deque()  # appended by hooks
        self.stats: dict[tuple[str, str], CollectiveStats] = {}
        self.groups: list[Any] = []  # GroupTrackers, whose in-flight collectives each drain updates
        self.polls_often = False
        self._stop = threading.Event()
        self._draining = threading.Lock()  # manager thread vs scrape threads; never the training thread
        self._thread = threading.Thread(target=self._run, name="flare-timing", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.drain()
        except Exception as error:
            self.health.error("timing_manager", error)

    def add_group(self, group: Any) -> None:
        """Keep `group`'s in-flight collective current at every drain (a GroupTracker)."""
        self.groups.append(group)

    def complete(self, record: CollectiveRecord) -> None:
        """Hand over a record whose duration is known (any thread; never blocks)."""
        if len(self.completed) >= self.queue_size:
            self.health.drop("completed_collectives")
            return
        self.completed.append(record)

    def poll_later(self, record: CollectiveRecord, work: Any, backend: TimingBackend) -> None:
        """Ask the manager to poll `work` until it completes (any thread; never blocks)."""
        if len(self.polled) >= self.queue_size:
            self.health.drop("polled_collectives")
            return
        self.polled.append((record, work, backend))

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_SECONDS if self.polls_often else self.interval_seconds):
            try:
                self.drain()
            except Exception as error:  # the manager must outlive any bad record
                self.health.error("timing_manager", error)

    def drain(self, timeout: float = -1) -> None:
        """Resolve what has completed so far (manager thread, scrapes, and once at stop).

        With a `timeout`, give up (without draining) if another drain holds the lock that long.
        """
        if not self._draining.acquire(timeout=timeout):
            return
        try:
            self._drain()
        finally:
            self._draining.release()

    def _drain(self) -> None:
        for _ in range(len(self.polled)):
            record, work, backend = self.polled.popleft()
            duration = backend.poll(work, record)
            if duration is None:
                self.polled.append((record, work, backend))
            else:  # polled works are not checked for failure: a failed NCCL collective aborts the job
                record.duration = duration
                self.completed.append(record)
        while self.completed:
            self._account(self.completed.popleft())
        for group in list(self.groups):
            group.forget_finished()

    def _account(self, record: CollectiveRecord) -> None:
        key = (record.group.name, record.op)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = CollectiveStats()
        stats.durations.observe(record.duration or 0.0)
        stats.bytes_total += record.nbytes
        if record.seq > record.group.last_completed_seq:
            record.group.last_completed_seq = record.seq


class TimingBackend:
    """How one kind of process group tells the manager that a collective finished."""

    def __init__(self, manager: TimingManager) -> None:
        self.manager = manager

    def track(self, record: CollectiveRecord, work: Any) -> None:
        """Called on the training thread right after the collective was issued; must not wait."""
        self.manager.poll_later(record, work, self)

    def poll(self, work: Any, record: CollectiveRecord) -> float | None:
        """Duration in seconds if `work` has completed, else None; called on the manager thread."""
        if not work.is_completed():
            return None
        return time.perf_counter() - record.issued_at


class FutureTiming(TimingBackend):
    """CPU collectives: the work's future calls back on completion (gloo's own thread)."""

    def track(self, record: CollectiveRecord, work: Any) -> None:
        try:
            future = work.get_future()
        except RuntimeError:  # some works (gloo send/recv) have no future: poll them instead
            super().track(record, work)
            return
        manager = self.manager

        def on_done(done: Any) -> None:
            try:
                done.value()
            except Exception:  # a failed collective did not complete: it stays in flight
                manager.health.drop("failed_collectives")
                return
            record.duration = time.perf_counter() - record.issued_at
            manager.complete(record)

        future.add_done_callback(on_done)


class CudaEventTiming(TimingBackend):
    """NCCL collectives: device duration from the CUDA events NCCL records on the collective's stream."""

    def __init__(self, manager: TimingManager) -> None:
        super().__init__(manager)
        manager.polls_often = True

    def poll(self, work: Any, record: CollectiveRecord) -> float | None:
        if not work.is_completed():
            return None
        try:
            milliseconds = work._get_duration()
        except RuntimeError:  # timing not enabled for this group: fall back to host-observed completion
            return time.perf_counter() - record.issued_at
        return milliseconds / 1000.0
