"""Straggler windows: each rank's mean step time and collective wait per step over its last few windows.

A synchronous job makes every rank wait for the slowest, so the straggler is the rank that waits least in
collectives. One window is too noisy to name it, so the engine asks for the score to hold over several;
and a single Prometheus query or a single direct scrape must be able to show several. So each rank keeps
its own last `straggler_windows` closed windows of `straggler_window_steps` steps and exports them (label
`ago`), with the number of the last one so that the engine lines up the same steps on every rank:
window n holds steps n*W+2 .. n*W+W+1 (step 1 has no start, as in flare_step_duration_seconds).

Where the numbers come from, without touching the training thread beyond the step hook:

- step boundaries: the optimizer step hook appends (step number, perf_counter time) to
  `StepTracker.boundaries_after`; step n spans (boundary n-1, boundary n];
- collective wait: every collective's issue time, duration (issue to completion, as in
  flare_collective_duration_seconds) and its group's role, from the groups' pending queues, and for the
  collectives the recording backend completed between two drains, from the manager's `finished` list
  (timing.NativeTiming). A collective belongs to the step in which it was issued; a step is complete once
  every collective issued before its end has finished. Each complete step goes to the step listeners
  (rank/perf.py) with its collective time not overlapped by compute, by group role (exposed_by_role).

StepWindows registers with the timing manager like a group, so `forget_finished()` runs at the end of
every drain (every scrape, and the manager's thread once timing_interval_seconds passed without one), under
the drain lock: it never runs on the training thread and never concurrently with itself. A collective is in
its group's pending queue from its issue until a drain after it finished, so every drain that looks at the
queue sees it at least once; StepWindows keeps a reference to each unfinished one it has seen and accounts
it once it has a duration.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .exporter_health import ExporterHealth
from .host_load import cpu_pressure


@dataclass(frozen=True)
class Window:
    """One closed window: its number and, per step, the mean step time and time in collectives."""

    number: int
    step_seconds: float
    wait_seconds: float


def window_of(step: int, steps_per_window: int) -> int:
    """The window that holds `step` (steps from 2 on; step 1 has no start)."""
    return (step - 2) // steps_per_window


class WindowRing:
    """Steps in, closed windows out: the last `kept` consecutive windows and the best one so far.

    Pure: `add_step` is fed in step order. A window with a missing step (boundaries lost) is never closed,
    and the ring restarts after such a gap, so the windows it holds are always consecutive. Readers get
    `windows` (a tuple, oldest first) and `best_step_seconds`, each replaced whole.
    """

    def __init__(self, steps_per_window: int, kept: int) -> None:
        self.steps_per_window = steps_per_window
        self.kept = kept
        self.windows: tuple[Window, ...] = ()
        self.best_step_seconds: float | None = None
        self._number = -1  # window being filled
        self._steps = 0
        self._step_total = 0.0
        self._wait_total = 0.0
        self._last_step = 0

    def add_step(self, step: int, step_seconds: float, wait_seconds: float) -> Window | None:
        """Account one step; returns the window it closed, if any."""
        if step < 2:
            return None
        number = window_of(step, self.steps_per_window)
        if number != self._number:
            self._number, self._steps, self._step_total, self._wait_total = number, 0, 0.0, 0.0
            if step != number * self.steps_per_window + 2:
                self._steps = -1  # the window's first steps are missing: never close it
        elif step != self._last_step + 1:
            self._steps = -1  # a step of this window is missing
        self._last_step = step
        if self._steps < 0:
            return None
        self._steps += 1
        self._step_total += step_seconds
        self._wait_total += wait_seconds
        if self._steps < self.steps_per_window:
            return None
        window = Window(number, self._step_total / self._steps, self._wait_total / self._steps)
        kept = self.windows if self.windows and self.windows[-1].number == number - 1 else ()
        self.windows = (kept + (window,))[-self.kept :]
        if self.best_step_seconds is None or window.step_seconds < self.best_step_seconds:
            self.best_step_seconds = window.step_seconds
        self._steps = -1  # closed
        return window

    @property
    def slowdown_ratio(self) -> float | None:
        """Last window's mean step time over the best window's (None before the first window)."""
        if not self.windows or not self.best_step_seconds:
            return None
        return self.windows[-1].step_seconds / self.best_step_seconds


UNKNOWN_ROLE = "other"  # a wait that names no role (a bare (issued_at, duration) pair)


def role_of(wait: tuple) -> str:
    """The role of the group of a wait (issued_at, duration, role)."""
    return wait[2] if len(wait) > 2 else UNKNOWN_ROLE


def exposed_by_role(waits: Sequence[tuple], start: float, end: float) -> dict[str, float]:
    """Seconds of [start, end] in which the rank waited for collectives with none newer issued, by the role
    of the group it waited on (only roles with such seconds).

    `waits`: (issued_at, duration, role) sorted by issue time. Collectives whose lifetimes overlap form one
    busy period; the thread that issued a newer collective inside it was not blocked before that issue (it
    was computing, as DDP does while earlier buckets reduce), so a period counts from its last issue to its
    end: the collective time not overlapped by compute. It was the last-issued collective that the thread
    waited for: the period's seconds are its group's role's.
    """
    exposed: dict[str, float] = {}
    last_issue = period_end = -math.inf
    last_role = UNKNOWN_ROLE
    for wait in waits:
        issued_at, duration = wait[0], wait[1]
        if issued_at > period_end:
            seconds = min(period_end, end) - max(last_issue, start)
            if seconds > 0.0:
                exposed[last_role] = exposed.get(last_role, 0.0) + seconds
            period_end = issued_at + duration
        else:
            period_end = max(period_end, issued_at + duration)
        last_issue, last_role = issued_at, role_of(wait)
    seconds = min(period_end, end) - max(last_issue, start)
    if seconds > 0.0:
        exposed[last_role] = exposed.get(last_role, 0.0) + seconds
    return exposed


def exposed_seconds(waits: Sequence[tuple], start: float, end: float) -> float:
    """Seconds of [start, end] in which the rank waited for collectives with none newer issued, all roles."""
    return sum(exposed_by_role(waits, start, end).values())


StepListener = Callable[[int, float, float, Mapping[str, float]], None]
MAX_WAITING = 4096  # finished collectives kept apart until their step ends; beyond it they are summed


class StepWindows:
    """Feeds a WindowRing from step boundaries and finished collectives; see the module docstring."""

    def __init__(
        self,
        steps: Any,  # StepTracker: .boundaries_after()
        groups: Mapping[str, Any],  # GroupTrackers by name: .pending
        health: ExporterHealth,
        steps_per_window: int,
        kept: int,
        finished: list[tuple],  # TimingManager.finished: (issued_at, duration, ...), not in a pending queue
    ) -> None:
        self.steps = steps
        self.groups = groups
        self.finished = finished
        self.health = health
        self.ring = WindowRing(steps_per_window, kept)
        self._unfinished: list[Any] = []  # CollectiveRecords seen in a pending queue without a duration
        self._newest: dict[str, Any] = {}  # per group, the newest record seen in its pending queue
        self._waits: list[tuple] = []  # (issued_at, duration, ...) of collectives of steps not complete yet
        self._last_step = 0
        self._last_boundary: float | None = None
        # the lowest host_load.cpu_pressure() read when windows closed: the host at its quietest while the job
        # ran (a job that crowds its own cores sets it; other load on the host raises the pressure above it)
        self.host_pressure_floor: float | None = None
        # listener(step, step seconds, exposed collective seconds, the same by group role) for every
        # complete step (rank/perf.py)
        self.step_listeners: list[StepListener] = []

    def forget_finished(self) -> None:
        """Called by the timing manager at the end of every drain (it registers us as a group)."""
        try:
            self._advance()
        except Exception as error:  # never fail a drain, which also serves scrapes
            self.health.error("straggler_windows", error)

    def _advance(self) -> None:
        # Boundaries first: a collective issued before a boundary we read was queued before it (one thread).
        boundaries = self.steps.boundaries_after(self._last_step)
        self._see_new_collectives()
        self._waits.extend(self.finished)
        still = []
        for record in self._unfinished:
            if record.duration is None:
                still.append(record)
            else:
                self._waits.append((record.issued_at, record.duration, record.group.role))
        self._unfinished = still
        if len(self._waits) > MAX_WAITING:  # a long stretch without steps (evaluation): one sum for it
            newest = max(self._waits)
            self._waits = [(newest[0], sum(wait[1] for wait in self._waits), role_of(newest))]
        oldest_unfinished = min((record.issued_at for record in still), default=math.inf)
        waits = sorted(self._waits)  # by issue time: each boundary takes the ones issued before it
        taken = 0
        closed = None
        for step, at in boundaries:
            if step <= self._last_step:
                continue
            if at >= oldest_unfinished:
                break  # a collective of this step is still running
            wait = 0.0
            first = taken
            while taken < len(waits) and waits[taken][0] <= at:
                wait += waits[taken][1]
                taken += 1
            if step == self._last_step + 1 and self._last_boundary is not None:
                closed = self.ring.add_step(step, at - self._last_boundary, wait) or closed
                if self.step_listeners:
                    by_role = exposed_by_role(waits[first:taken], self._last_boundary, at)
                    exposed = sum(by_role.values())
                    for listener in self.step_listeners:
                        listener(step, at - self._last_boundary, exposed, by_role)
            self._last_step, self._last_boundary = step, at
        self._waits = waits[taken:]
        if closed is not None:  # once a drain, where windows closed
            self._lower_pressure_floor()

    def _lower_pressure_floor(self) -> None:
        pressure = cpu_pressure()
        if pressure is not None and (self.host_pressure_floor is None or pressure < self.host_pressure_floor):
            self.host_pressure_floor = pressure

    def _see_new_collectives(self) -> None:
        """Add the records queued since the last drain (pending only grows at the right between drains)."""
        for group in list(self.groups.values()):
            pending: deque[Any] = group.pending
            newest = self._newest.get(group.name)
            new = []
            for index in range(len(pending) - 1, -1, -1):
                record = pending[index]
                if record is newest:
                    break
                new.append(record)
            if new:
                self._newest[group.name] = new[0]
            self._unfinished.extend(reversed(new))
