"""Collective timing: hooks record, backends notice completion, a manager thread turns both into metrics.

The training thread only creates a CollectiveRecord and hands the work to a timing backend, which
never waits. Backends behind one interface:

- FutureTiming (CPU, gloo): the work's future marks the completion, on the backend's own thread;
  duration = completion time - issue time. With flare's C++ recorder (cpp_recorder.py) a C++ callback
  stamps the time there without taking the GIL, and the manager reads the stamp at its next drain;
  without it, a Python callback does (the GIL taken from training for every collective).
- CudaEventTiming (GPU, NCCL): ProcessGroupNCCL records CUDA start/end events on the collective's own
  stream when TORCH_NCCL_ENABLE_TIMING=1; the manager polls `is_completed()` and reads the event
  duration, so no thread ever synchronizes with the device.
- NativeTiming (CPU, gloo, with flare's torch extension): no Python hook at all. The extension's recording
  backend (csrc/collectives.cpp) wraps the real gloo backend in C++, stamps issue and completion times
  into the group's CollectiveLog, and the manager takes the log at every drain.

Device events (kernel issue latency, ILD) go through a second interface (device_events.py); the manager
resolves them like collectives (watch).

The TimingManager drains completions into per-(group, op) statistics: on every scrape so that what a scrape
shows is current, and on its own thread once `interval_seconds` passed without a drain (a rank scraped
more often than that costs its thread one wake an interval, no drain). The two never drain at
once (a lock that only they take; the training thread never touches it). A scrape's render holds the GIL
for about a millisecond, which a training thread taking the GIL back after every op would wait for (and, in
a synchronous job, every rank with it): so before it drains, a scrape first waits for the next collective of
a recording backend (`scrape_drain`), and renders while the training thread waits for that collective.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .. import label_values
from .device_events import EventBackend, EventSink
from .exporter_health import ExporterHealth
from .histogram import Histogram


class LastCompletion:
    """When one of this process's collectives last completed (perf_counter), as its completion callback saw
    it: a host gap of the training thread in which one completed was a wait for it (dispatch.py)."""

    def __init__(self) -> None:
        self.at = 0.0  # a Python callback's
        self.extension: Any = None  # flare's C++ recorder, whose callbacks note theirs there

    def note(self, at: float) -> None:
        self.at = at
        if self.extension is not None:
            self.extension.note_completion(at)  # for the native timer's windows

    def last(self) -> float:
        native = self.extension.last_completion() if self.extension is not None else 0.0
        return max(self.at, native)


LAST_COMPLETION = LastCompletion()


class UpdatedAtDrain(Protocol):
    """Something whose finished collectives each drain lets go of (a GroupTracker, the straggler windows)."""

    def forget_finished(self) -> None: ...


class TrackedGroup(UpdatedAtDrain, Protocol):
    """What the timing manager reads and writes of a process group it times (groups.GroupTracker)."""

    name: str
    role: str  # dp, tp, ... (groups.group_role): the straggler windows split the exposed wait by it
    last_issued_seq: int
    last_completed_seq: int  # written by the timing manager only
    last_progress_at: float
    in_flight: CollectiveRecord | None

    def remember(self, record: CollectiveRecord) -> None: ...

    def peer_rank(self, group_rank: int) -> int: ...

    def point_to_point_in_flight(self, records: list[CollectiveRecord]) -> None: ...


class CollectiveRecord:
    """One collective as the training thread issued it; `duration` is filled in when it completes."""

    __slots__ = ("group", "op", "nbytes", "seq", "issued_at", "duration", "started", "peer")

    def __init__(
        self, group: TrackedGroup, op: str, nbytes: int, seq: int, issued_at: float, peer: int = -1
    ) -> None:
        self.group = group
        self.op = op
        self.nbytes = nbytes
        self.seq = seq  # 0 for point-to-point ops, which have no group-wide sequence
        self.issued_at = issued_at
        self.duration: float | None = None
        self.started = False  # set by a backend that sees the collective start on the device
        self.peer = peer  # a point-to-point op's peer, a global rank (-1: any source, or a collective)

    @property
    def point_to_point(self) -> bool:
        return self.op in label_values.POINT_TO_POINT_OPS


class CollectiveFailed(Exception):
    """A polled collective completed with an error (a backend's poll raises it)."""


class CollectiveStats:
    """Completed collectives of one (group, op): durations and bytes. Written by the manager only."""

    __slots__ = ("durations", "bytes_total")

    def __init__(self) -> None:
        self.durations = Histogram(label_values.COLLECTIVE_DURATION_BUCKETS)
        self.bytes_total = 0


class PeerCounts:
    """Completed point-to-point ops of one (group, peer, direction): how many, and their bytes."""

    __slots__ = ("completed", "bytes_total")

    def __init__(self) -> None:
        self.completed = 0
        self.bytes_total = 0


class PointToPointStats:
    """Completed sends and receives, apart from the collectives (they have no group-wide sequence): durations
    per (group, direction), counts and bytes per (group, peer, direction). Written by the manager only; the
    peers are those a rank actually exchanged with, so the series stay bounded by the peers used."""

    def __init__(self) -> None:
        self.durations: dict[tuple[str, str], Histogram] = {}
        self.peers: dict[tuple[str, int, str], PeerCounts] = {}

    def add(self, group: str, op: str, peer: int, nbytes: int, duration: float) -> None:
        direction = label_values.point_to_point_direction(op)
        histogram = self.durations.get((group, direction))
        if histogram is None:
            histogram = self.durations[(group, direction)] = Histogram(
                label_values.COLLECTIVE_DURATION_BUCKETS
            )
        histogram.observe(duration)
        counts = self.peers.get((group, peer, direction))
        if counts is None:
            counts = self.peers[(group, peer, direction)] = PeerCounts()
        counts.completed += 1
        counts.bytes_total += nbytes


# Once a backend that is polled (NCCL) is in use, the manager wakes this often, so that it holds a completed
# collective's work, and so its tensors, only briefly; otherwise `interval_seconds` after the last drain.
POLL_INTERVAL_SECONDS = 0.02
# A scrape waits for the next collective only on a rank that issued one this recently: one that issued none
# (its training done, hung, or between phases) is rendered at once.
RECENT_COLLECTIVE_SECONDS = 1.0


class TimingManager:
    """Background thread that resolves collective completions into statistics."""

    def __init__(self, health: ExporterHealth, queue_size: int, interval_seconds: float) -> None:
        self.health = health
        self.queue_size = queue_size
        self.interval_seconds = interval_seconds
        self.completed: deque[CollectiveRecord] = deque()  # appended by backend threads
        self.polled: deque[tuple[CollectiveRecord, Any, TimingBackend]] = deque()  # appended by hooks
        self.stats: dict[tuple[str, str], CollectiveStats] = {}
        self.point_to_point = PointToPointStats()
        self.groups: list[
            UpdatedAtDrain
        ] = []  # GroupTrackers, whose in-flight collectives each drain updates
        # Device events awaiting the device (appended by launch hooks): (backend, event, host time, tag, sink)
        self.events: deque[tuple[EventBackend, Any, float, int, EventSink]] = deque()
        self.tasks: deque[Callable[[], None]] = deque()  # work handed over by hooks, run at the next drain
        self.after_drain: list[Callable[[], None]] = []  # run at the end of every drain (ILD drift)
        self.logs: list[
            tuple[NativeTiming, TrackedGroup]
        ] = []  # recording backends' logs, with their GroupTrackers
        # (issued_at, duration, role) of the collectives a drain accounted without a record in a pending queue
        # (the recording backends'): the straggler windows take them in the same drain, which then clears them
        self.finished: list[tuple] = []
        self.polls_often = False
        self.drained_at = time.monotonic()  # when the last drain ended, by any thread
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

    def add_group(self, group: UpdatedAtDrain) -> None:
        """Keep `group`'s in-flight collective current at every drain (a GroupTracker)."""
        self.groups.append(group)

    def add_log(self, timing: NativeTiming, group: TrackedGroup) -> None:
        """Take `timing`'s log into `group` (a GroupTracker, also added as a group) at every drain's start."""
        self.logs.append((timing, group))

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

    def watch(self, backend: EventBackend, event: Any, host_time: float, tag: int, sink: EventSink) -> None:
        """Resolve `event` when the device reaches it: sink(tag, device time - host_time). Never blocks."""
        if len(self.events) >= self.queue_size:
            self.health.drop("device_events")
            backend.release(event)
            return
        self.polls_often = True
        self.events.append((backend, event, host_time, tag, sink))

    def submit(self, task: Callable[[], None]) -> None:
        """Run `task` on the manager at its next drain (any thread; never blocks)."""
        if len(self.tasks) >= self.queue_size:
            self.health.drop("timing_tasks")
            return
        self.tasks.append(task)

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self.drain_due_in())):
            if self.drain_due_in() > 0:
                continue  # another drain (a scrape's) came in between: the next is due later
            try:
                self.drain()
            except Exception as error:  # the manager must outlive any bad record
                self.health.error("timing_manager", error)

    def drain_due_in(self) -> float:
        """Seconds until the manager's own drain is due: `interval_seconds` (POLL_INTERVAL_SECONDS once a
        polled backend is in use) after the last drain by any thread."""
        interval = POLL_INTERVAL_SECONDS if self.polls_often else self.interval_seconds
        return self.drained_at + interval - time.monotonic()

    def drain(self, timeout: float = -1) -> None:
        """Resolve what has completed so far (manager thread, scrapes, and once at stop).

        With a `timeout`, give up (without draining) if another drain holds the lock that long.
        """
        if not self._draining.acquire(timeout=timeout):
            return
        try:
            self._drain()
        finally:
            self.drained_at = time.monotonic()
            self._draining.release()

    def scrape_drain(self, wait_seconds: float) -> None:
        """A scrape's drain: first await_collective(wait_seconds), then drain."""
        self.await_collective(wait_seconds)
        self.drain()

    def await_collective(self, timeout: float) -> str:
        """Wait up to `timeout` seconds, without the GIL, for a recording backend's next collective, so that
        what follows runs while the training thread waits for that collective instead of delaying it.

        Returns "issued", "timeout", or "at once": no wait without a recording backend (NCCL groups, the
        Python hooks: nothing to wake us), with `timeout` 0, or when no collective was issued in the last
        RECENT_COLLECTIVE_SECONDS.
        """
        logs = list(self.logs)
        if timeout <= 0 or not logs:
            return "at once"
        newest = max(timing.log.last_issued_at for timing, _ in logs)
        if time.perf_counter() - newest > RECENT_COLLECTIVE_SECONDS:
            return "at once"
        return "issued" if logs[0][0].extension.wait_for_collective(timeout) else "timeout"

    def _drain(self) -> None:
        for timing, group in list(self.logs):  # what the recording backend recorded since the last drain
            timing.take(group)
        for _ in range(len(self.polled)):
            record, work, backend = self.polled.popleft()
            try:
                duration = backend.poll(work, record)
            except CollectiveFailed:  # it did not complete: it stays in flight
                self.health.drop("failed_collectives")
                continue
            if duration is None:
                self.polled.append((record, work, backend))
            else:  # NCCL works are not checked for failure: a failed NCCL collective aborts the job
                record.duration = duration
                self.completed.append(record)
        while self.completed:
            self._account(self.completed.popleft())
        for drained in list(self.groups):
            drained.forget_finished()
        while self.tasks:
            self._guarded("timing_tasks", self.tasks.popleft())
        if self.events:
            self._resolve_events()
        self.finished.clear()
        for hook in list(self.after_drain):
            self._guarded("timing_after_drain", hook)

    def _guarded(self, component: str, task: Callable[[], None]) -> None:
        try:
            task()
        except Exception as error:  # one bad task must not stop the rest of the drain
            self.health.error(component, error)

    def _resolve_events(self) -> None:
        for _ in range(len(self.events)):
            item = self.events.popleft()
            backend, event, host_time, tag, sink = item
            try:
                if not backend.query(event):
                    self.events.append(item)
                    continue
                sink(tag, backend.timestamp(event) - host_time)
            except Exception as error:
                self.health.error("device_events", error)
            backend.release(event)

    def _account(self, record: CollectiveRecord) -> None:
        if record.point_to_point:
            self.point_to_point.add(
                record.group.name, record.op, record.peer, record.nbytes, record.duration or 0.0
            )
            # the bubble
            self.finished.append((record.issued_at, record.duration or 0.0, label_values.P2P_ROLE))
            return
        self.account(record.group, record.op, record.nbytes, record.seq, record.duration or 0.0)

    def account(self, group: TrackedGroup, op: str, nbytes: int, seq: int, duration: float) -> None:
        """Count a completed collective of `group` (a GroupTracker); under the drain lock."""
        stats = self._stats(group, op)
        stats.durations.observe(duration)
        stats.bytes_total += nbytes
        if seq > group.last_completed_seq:
            group.last_completed_seq = seq

    def account_counted(self, group: TrackedGroup, counted: list[tuple]) -> None:
        """Count `group`'s collectives that the recording backend counted per op (CollectiveLog.take's
        `counted`); under the drain lock."""
        for op, _, nbytes, seconds, buckets, last_seq in counted:
            if op in label_values.POINT_TO_POINT_OPS:  # counted per peer from the completed records
                continue
            stats = self._stats(group, op)
            durations = stats.durations
            for index, collectives in buckets:
                durations.counts[index] += collectives
            durations.sum += seconds
            stats.bytes_total += nbytes
            if last_seq > group.last_completed_seq:
                group.last_completed_seq = last_seq

    def _stats(self, group: TrackedGroup, op: str) -> CollectiveStats:
        key = (group.name, op)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = CollectiveStats()
        return stats


class TimingBackend:
    """How one kind of process group tells the manager that a collective finished."""

    recorder = "python"  # what records the collectives (label of flare_process_group_info): hooks in Python

    def __init__(self, manager: TimingManager) -> None:
        self.manager = manager

    def track(self, record: CollectiveRecord, work: Any) -> Any:
        """Called on the training thread right after the collective was issued; must not wait. Returns the
        work to hand to the caller."""
        self.manager.poll_later(record, work, self)
        return work

    def poll(self, work: Any, record: CollectiveRecord) -> float | None:
        """Duration in seconds if `work` has completed, else None; called on the manager thread."""
        if not work.is_completed():
            return None
        return time.perf_counter() - record.issued_at

    def last_issued_at(self, group: TrackedGroup) -> float:
        """perf_counter time of `group`'s newest collective issued (0: none yet); any thread."""
        return float(group.last_progress_at)


class FutureTiming(TimingBackend):
    """CPU collectives: the work's future marks the completion time (gloo's own thread).

    `extension` is flare's C++ recorder (cpp_recorder.load()): its completion stamps are filled in from C++,
    without the GIL; None: a Python callback on the future. A work without a future is polled (gloo's send
    and recv), or handed back wrapped by `waited` (process_group.WaitedWork) when its completion only its
    wait() shows (gloo's reduce_scatter).
    """

    def __init__(
        self,
        manager: TimingManager,
        extension: Any = None,
        waited: Callable[[Any, Callable[[bool], None]], Any] | None = None,
    ) -> None:
        super().__init__(manager)
        if extension is not None and hasattr(extension, "note_completion"):
            LAST_COMPLETION.extension = extension
        self.stamp_completion = getattr(extension, "stamp_completion", None)
        self.stamps = CompletionStamps(manager)
        self.waited = waited  # waited(work, on_waited(failed)): a work that calls on_waited once waited for

    def track(self, record: CollectiveRecord, work: Any) -> Any:
        try:
            future = work.get_future()
        except RuntimeError:  # no future: gloo's send, recv and reduce_scatter show completion to wait()
            if self.waited is None:
                return super().track(record, work)
            return self.waited(work, lambda failed: self._completed(record, failed))
        if self.stamp_completion is not None:
            try:
                stamp = self.stamp_completion(future)
            except TypeError:  # not a torch Future (a custom backend's): a Python callback, below
                pass
            else:
                self.manager.poll_later(record, stamp, self.stamps)
                return work

        def on_done(done: Any) -> None:
            try:
                done.value()
            except Exception:
                self._completed(record, failed=True)
            else:
                self._completed(record, failed=False)

        future.add_done_callback(on_done)
        return work

    def _completed(self, record: CollectiveRecord, failed: bool) -> None:
        if failed:  # a failed collective did not complete: it stays in flight
            self.manager.health.drop("failed_collectives")
            return
        now = time.perf_counter()
        LAST_COMPLETION.note(now)
        record.duration = now - record.issued_at
        self.manager.complete(record)


class CompletionStamps(TimingBackend):
    """The manager's side of FutureTiming's completion stamps: polled at every drain, they hold no tensors."""

    def poll(self, stamp: Any, record: CollectiveRecord) -> float | None:
        completed_at = stamp.completed_at
        if completed_at is None:
            return None
        if stamp.failed:
            raise CollectiveFailed
        return completed_at - record.issued_at


MAX_LOG_CAPACITY = 16384  # collectives a recording backend holds between two drains (48 bytes each)


class NativeTiming(TimingBackend):
    """gloo groups recorded by the extension's backend (csrc/collectives.cpp): no hook on the training thread.

    The backend records each collective in `log` (a CollectiveLog) from C++. At the start of every drain the
    manager takes the log: the collectives completed since are counted at once, without a record (their
    issue times and durations go to the straggler windows through `TimingManager.finished`), and the oldest
    one still in flight goes into the group's `pending` queue, as a hook would have queued it. That record
    stays the same object until it completes, so the group's `in_flight` and the straggler windows follow it
    as they follow a hook's record; the newer collectives in flight behind it are seen once they complete.
    """

    recorder = "cpp"

    def __init__(self, manager: TimingManager, extension: Any) -> None:
        super().__init__(manager)
        self.extension = extension
        self.log = extension.CollectiveLog(min(manager.queue_size, MAX_LOG_CAPACITY))

    def wrap(self, inner: Any) -> Any:
        """The recording backend around `inner` (a c10d Backend), recording into this log."""
        return self.extension.wrap_backend(inner, self.log)

    def track(self, record: CollectiveRecord, work: Any) -> Any:
        raise TypeError("the recording backend records its collectives itself")

    def take(self, group: TrackedGroup) -> None:
        """Under the drain lock: hand over what the log recorded since the last take (a GroupTracker's).

        The log counts the collectives per op itself, so a drain does the same work however many collectives
        completed; only the straggler windows see each one, in `finished`: (issued_at, seconds, role) tuples,
        built here, on the manager's thread.
        """
        taken = self.log.take(label_values.COLLECTIVE_DURATION_BUCKETS)
        completed, counted, oldest, point_to_point, last_issued_seq, last_issued_at, dropped, failed = taken
        in_flight = group.in_flight  # the oldest record in flight at the last drain, at the front of pending
        seen = (in_flight.seq, in_flight.issued_at) if in_flight is not None else None
        manager = self.manager
        # Every collective older than the one in flight was taken: if it completed, it is the first completed
        # collective (sends and receives issued before it may precede it).
        followed = -1
        if in_flight is not None:
            for index, done in enumerate(completed):
                if done[0] > in_flight.issued_at:
                    break
                if seen == (done[4], done[0]):
                    in_flight.duration = done[1]  # the straggler windows follow it: they see its duration
                    followed = index
                    break
        role = group.role
        windowed = completed if followed < 0 else completed[:followed] + completed[followed + 1 :]
        # a send's or receive's wait: the bubble
        p2p_ops, p2p_role = label_values.POINT_TO_POINT_OPS, label_values.P2P_ROLE
        manager.finished.extend([(d[0], d[1], p2p_role if d[2] in p2p_ops else role) for d in windowed])
        manager.account_counted(group, counted)
        self._take_point_to_point(group, completed, point_to_point)
        if oldest is not None and oldest[2:] != seen:
            group.remember(CollectiveRecord(group, *oldest))
        group.last_issued_seq = last_issued_seq
        group.last_progress_at = last_issued_at
        if dropped:
            self.manager.health.drop("in_flight_collectives", dropped)
        if failed:
            self.manager.health.drop("failed_collectives", failed)

    def _take_point_to_point(
        self, group: TrackedGroup, completed: list[tuple], in_flight: list[tuple]
    ) -> None:
        """Count the sends and receives among `completed` per peer; publish those `in_flight`."""
        stats = self.manager.point_to_point
        for _, seconds, op, nbytes, _, peer in completed:
            if op in label_values.POINT_TO_POINT_OPS:
                stats.add(group.name, op, group.peer_rank(peer), nbytes, seconds)
        group.point_to_point_in_flight(
            [
                CollectiveRecord(group, op, nbytes, 0, issued_at, group.peer_rank(peer))
                for op, nbytes, peer, issued_at in in_flight
            ]
        )

    def last_issued_at(self, group: TrackedGroup) -> float:
        return float(self.log.last_issued_at)  # live: the stall watcher reads it between drains


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
