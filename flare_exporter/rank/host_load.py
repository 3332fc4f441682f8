"""What the rank's host is doing to it, read at scrape time (never on the training thread).

A loaded host slows every rank on it: data-loader workers, checkpoint writers, log shippers and other jobs'
processes take the cores. The engine reads a slowdown together with these figures (engine/host_load.py):

- CPU pressure: the share of the last 10 s in which some runnable task waited for a CPU (Linux PSI,
  /proc/pressure/cpu "some avg10"); None where the kernel has no PSI (before 4.20, or turned off). Its
  floor, the lowest read as the rank closed its straggler windows, is kept by straggler_windows.py;
- runnable tasks: the host's run queue now (/proc/stat procs_running), beside the CPUs this rank may use
  (its affinity): the fallback where there is no PSI;
- the training thread's share of a CPU (its CPU time over wall time) since the previous reading at least
  MIN_INTERVAL_SECONDS old: a rank crowded out of the cores runs for a small share of its step.

Every reader returns None rather than raise: a host without /proc (macOS) exports none of these.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

PRESSURE_PATH = "/proc/pressure/cpu"
STAT_PATH = "/proc/stat"
MIN_INTERVAL_SECONDS = 1.0  # the training thread's CPU share is over at least this long


@dataclass(frozen=True)
class HostLoad:
    """One reading of the host's load and of the training thread's share of a CPU."""

    cpu_pressure: float | None  # 0..1
    runnable_tasks: int | None
    cpus: int
    thread_cpu_ratio: float | None  # 0..1 (a little more where the clock reads drift)


def cpu_pressure(path: str = PRESSURE_PATH) -> float | None:
    """PSI's "some avg10" for the CPU as a share (0..1), or None where the file is absent or unreadable."""
    try:
        with open(path) as handle:
            for line in handle:
                fields = line.split()
                if fields and fields[0] == "some":
                    values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
                    return min(1.0, max(0.0, float(values["avg10"]) / 100))
    except (OSError, ValueError, KeyError):
        return None
    return None


def runnable_tasks(path: str = STAT_PATH) -> int | None:
    """The host's runnable tasks now (procs_running, this reader's own thread included), or None."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith("procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadCpuShare:
    """A thread's CPU time over wall time since the last reading at least MIN_INTERVAL_SECONDS old.

    Read from the scrape threads (a lock of its own, which the training thread never takes): a second
    scraper soon after the first sees the share over the same, longer interval instead of a noisy short one.
    """

    def __init__(self, thread_id: int | None = None) -> None:
        thread = thread_id if thread_id is not None else threading.main_thread().ident
        self._clock = _cpu_clock(thread)
        self._lock = threading.Lock()
        self._since: tuple[float, float] | None = None
        self._share: float | None = None

    def read(self) -> float | None:
        if self._clock is None:
            return None
        try:
            cpu, wall = time.clock_gettime(self._clock), time.perf_counter()
        except OSError:  # the thread ended
            self._clock = None
            return None
        with self._lock:
            if self._since is None:
                self._since = (wall, cpu)
            elif wall - self._since[0] >= MIN_INTERVAL_SECONDS:
                self._share = max(0.0, (cpu - self._since[1]) / (wall - self._since[0]))
                self._since = (wall, cpu)
            return self._share


def _cpu_clock(thread_id: int | None) -> int | None:
    try:
        return time.pthread_getcpuclockid(thread_id) if thread_id is not None else None
    except (AttributeError, OSError):
        return None


def read_host_load(thread: ThreadCpuShare | None = None) -> HostLoad:
    """The host's load now, and the thread's CPU share (None without `thread`)."""
    return HostLoad(
        cpu_pressure(), runnable_tasks(), usable_cpus(), None if thread is None else thread.read()
    )
