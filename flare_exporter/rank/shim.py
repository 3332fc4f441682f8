"""The launch shim (cuda_hooks/, LD_PRELOAD): find its library, read its ring buffer, feed the histograms.

libflare_hooks.so, preloaded into a rank, samples kernel launches and NCCL calls below Python and
publishes one record per sampled call into a shared-memory ring (format: cuda_hooks/flare_ring.h,
docs/shim.md). Here:

- `parse_header` / `parse_records`: pure functions from the ring's bytes to typed records;
- `RingReader`: the thin I/O edge (an mmap of the ring file) that remembers its position, counts records
  lost to overwrite and passes on the shim's own drop and error counts;
- `ShimFeed`: after every timing-manager drain, kernel records go into the ILD `kernel_issue` distribution
  and NCCL records into per-op statistics of their own (`collectives`, exported as flare_shim_collective_*:
  NCCL calls carry no group name, and they repeat what the wrapped process groups report).

Nothing here runs on the training thread; without the shim, `attach` does nothing.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .exporter_health import ExporterHealth
from .timing import CollectiveStats, TimingManager

if TYPE_CHECKING:  # ild and progress import torch; parsing a ring must not need it
    from .ild import IldState, IssueLatency
    from .progress import StepTracker

LIBRARY_NAME = "libflare_hooks.so"
LIBRARY_ENV = "FLARE_SHIM_LIB"
RING_DIR_ENV = "FLARE_SHIM_RING_DIR"
DEFAULT_RING_DIR = "/dev/shm"
DROPPED_QUEUE = "native_ring"  # sampled calls the shim could not time (pool or queue full, errors)
OVERRUN_QUEUE = "native_ring_overrun"  # records overwritten before this reader got to them
ERROR_COMPONENT = "native_shim"

RING_MAGIC = b"FLRHOOKS"
RING_VERSION = 1
HEADER = struct.Struct("<8sIIIIQQQQQiIIIqiI32x")
RECORD = struct.Struct("<QHHiqqqQQII")
SEQ = struct.Struct("<Q")
EVENTS_STATES = ("not_yet", "ready", "unavailable")
GROUPED = 1  # record flag: an NCCL call inside ncclGroupStart/End, timed as the whole group

KERNEL_APIS = {1: "cudaLaunchKernel", 2: "cudaLaunchKernelExC", 3: "cuLaunchKernel", 4: "cuLaunchKernelEx"}
NCCL_APIS = {
    16: "ncclAllReduce",
    17: "ncclAllGather",
    18: "ncclReduceScatter",
    19: "ncclBroadcast",
    20: "ncclReduce",
    21: "ncclSend",
    22: "ncclRecv",
}
NCCL_OPS = {  # NCCL function -> the op name label_values.COLLECTIVE_OPS uses for it
    "ncclAllReduce": "allreduce",
    "ncclAllGather": "allgather",
    "ncclReduceScatter": "reduce_scatter",
    "ncclBroadcast": "broadcast",
    "ncclReduce": "reduce",
    "ncclSend": "send",
    "ncclRecv": "recv",
}


class RingFormatError(ValueError):
    """The bytes are not a ring this reader understands."""


@dataclass(frozen=True)
class RingHeader:
    """The ring's header: its shape and the shim's counters at the time it was read."""

    capacity: int
    write_index: int
    sampled: int
    dropped: int
    overwritten: int
    errors: int
    pid: int
    events_state: str
    kernel_sample_every: int
    nccl_sample_every: int
    created_ns: int
    device: int


class NativeRecord(NamedTuple):
    """One sampled call; times are CLOCK_MONOTONIC nanoseconds (time.perf_counter's clock on Linux)."""

    number: int  # the record's number in the ring (0, 1, ...), not its slot
    api: str
    flags: int
    result: int
    host_ns: int
    device_start_ns: int
    device_end_ns: int
    nbytes: int
    stream: int
    thread_id: int

    @property
    def is_kernel(self) -> bool:
        return self.api in KERNEL_API_NAMES

    @property
    def issue_latency_seconds(self) -> float:
        """Device start minus host launch."""
        return (self.device_start_ns - self.host_ns) / 1e9

    @property
    def duration_seconds(self) -> float:
        """Device time between the events before and after the call (NCCL)."""
        return (self.device_end_ns - self.device_start_ns) / 1e9


KERNEL_API_NAMES = frozenset(KERNEL_APIS.values())
API_NAMES = {**KERNEL_APIS, **NCCL_APIS}


def parse_header(buffer: Any) -> RingHeader:
    """The header at the start of `buffer` (bytes or a mapping of the ring file)."""
    if len(buffer) < HEADER.size:
        raise RingFormatError(f"ring is {len(buffer)} bytes, shorter than its header")
    fields = HEADER.unpack_from(buffer, 0)
    magic, version, header_size, record_size, capacity = fields[:5]
    if magic != RING_MAGIC:
        raise RingFormatError(f"bad magic {magic!r}")
    if (version, header_size, record_size) != (RING_VERSION, HEADER.size, RECORD.size):
        raise RingFormatError(f"unsupported ring: version {version}, sizes {header_size}/{record_size}")
    if capacity <= 0 or capacity & (capacity - 1) or len(buffer) < HEADER.size + capacity * RECORD.size:
        raise RingFormatError(f"capacity {capacity} does not fit the ring's {len(buffer)} bytes")
    write_index, sampled, dropped, overwritten, errors, pid, state, kernel_every, nccl_every = fields[5:14]
    created_ns, device = fields[14:16]
    return RingHeader(
        capacity=capacity,
        write_index=write_index,
        sampled=sampled,
        dropped=dropped,
        overwritten=overwritten,
        errors=errors,
        pid=pid,
        events_state=EVENTS_STATES[state] if state < len(EVENTS_STATES) else str(state),
        kernel_sample_every=kernel_every,
        nccl_sample_every=nccl_every,
        created_ns=created_ns,
        device=device,
    )


def parse_records(buffer: Any, header: RingHeader, start: int) -> tuple[list[NativeRecord], int, int]:
    """Records `start` .. header.write_index - 1 that are still whole in `buffer`.

    Returns (records, lost, next start). A record is lost when it was overwritten before this read (older
    than the last `capacity`), or when its slot's sequence number is not its own before and after the copy
    (the writer was rewriting it): on a live mapping the second read catches a torn copy.
    """
    stop = header.write_index
    first = max(start, stop - header.capacity)
    lost = first - start if first > start else 0
    records = []
    mask = header.capacity - 1
    for index in range(first, stop):
        offset = HEADER.size + (index & mask) * RECORD.size
        fields = RECORD.unpack_from(buffer, offset)
        if fields[0] != index + 1 or SEQ.unpack_from(buffer, offset)[0] != index + 1:
            lost += 1
            continue
        _, api, flags, result, host_ns, start_ns, end_ns, nbytes, stream, thread_id, _ = fields
        name = API_NAMES.get(api)
        if name is None:  # a newer shim's API this reader does not know: not counted anywhere
            continue
        records.append(
            NativeRecord(index, name, flags, result, host_ns, start_ns, end_ns, nbytes, stream, thread_id)
        )
    return records, lost, stop


def step_at(steps: Sequence[int], times: Sequence[float], seconds: float, current_step: int) -> int:
    """The step a launch at perf_counter time `seconds` was taken in: the steps completed by then.

    `steps` and `times` are StepTracker's boundaries (step number, perf_counter time), in order; a time
    before the oldest kept boundary counts in the step before it.
    """
    if not steps:
        return current_step
    index = bisect_right(times, seconds)
    return steps[index - 1] if index else steps[0] - 1


def library_path(environ: Mapping[str, str] | None = None) -> Path:
    """The shim's library: $FLARE_SHIM_LIB, else cuda_hooks/build/ in the checkout."""
    environ = os.environ if environ is None else environ
    configured = environ.get(LIBRARY_ENV)
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2] / "cuda_hooks" / "build" / LIBRARY_NAME


def ring_path(pid: int | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Where the shim in process `pid` (default: this one) writes its ring."""
    environ = os.environ if environ is None else environ
    directory = environ.get(RING_DIR_ENV) or DEFAULT_RING_DIR
    return Path(directory) / f"flare-hooks-{os.getpid() if pid is None else pid}"


def shim_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether libflare_hooks.so is mapped into this process."""
    return _maps_mention(maps_path, LIBRARY_NAME)


@lru_cache(maxsize=8)
def _maps_mention(maps_path: str, name: str) -> bool:
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            return any(line.rstrip().endswith("/" + name) for line in maps)
    except OSError:
        return False


class RingReader:
    """Reads new records from a ring file, which the shim creates at its first sampled call.

    Remembers its position; records overwritten before it got to them count in `lost`; the shim's drops
    and errors since the last read go to `health` (drop queue `native_ring`, error component `native_shim`).
    """

    def __init__(self, path: Path, health: ExporterHealth) -> None:
        self.path = path
        self.health = health
        self.position = 0
        self.lost = 0
        self.header: RingHeader | None = None
        self._mapping: mmap.mmap | None = None
        self._dropped_seen = 0
        self._errors_seen = 0

    def _open(self) -> bool:
        try:
            with open(self.path, "rb") as ring_file:
                size = os.fstat(ring_file.fileno()).st_size
                if size < HEADER.size:
                    return False  # created but not sized yet
                self._mapping = mmap.mmap(ring_file.fileno(), size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not there yet (or unreadable): tried again at the next drain
            return False
        return True

    def read(self) -> list[NativeRecord]:
        """Records published since the last read; [] while the ring does not exist (yet)."""
        if self._mapping is None and not self._open():
            return []
        assert self._mapping is not None
        try:
            header = parse_header(self._mapping)
        except RingFormatError:
            return []  # the magic is written last: the shim is still creating the ring
        if self.header is not None and header.created_ns != self.header.created_ns:
            # a ring left by a dead process with our pid, recreated in place by our shim: start over
            self.position = self._dropped_seen = self._errors_seen = 0
        self.header = header
        records, lost, self.position = parse_records(self._mapping, header, self.position)
        if lost:
            self.lost += lost
            self.health.drop(OVERRUN_QUEUE, lost)
        if header.dropped > self._dropped_seen:
            self.health.drop(DROPPED_QUEUE, header.dropped - self._dropped_seen)
            self._dropped_seen = header.dropped
        if header.errors > self._errors_seen:
            new_errors = header.errors - self._errors_seen
            self.health.error(
                ERROR_COMPONENT, RuntimeError(f"{new_errors} failed CUDA/NCCL calls in the shim")
            )
            self.health.errors[ERROR_COMPONENT] += new_errors - 1
            self._errors_seen = header.errors
        return records

    def close(self) -> None:
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None


class ShimFeed:
    """Runs after every timing-manager drain: the ring's new records into the rank's histograms."""

    def __init__(
        self, reader: RingReader, kernel_issue: IssueLatency, steps: StepTracker | None = None
    ) -> None:
        self.reader = reader
        self.kernel_issue = kernel_issue
        self.steps = steps
        # the step boundaries the records are tagged by, read from the tracker from the last one on
        self._boundaries: deque[tuple[int, float]] = deque()
        if steps is not None:
            from .progress import STEP_BOUNDARIES_KEPT  # imports torch, as a step tracker does already

            self._boundaries = deque(maxlen=STEP_BOUNDARIES_KEPT)
        self.failed_calls = 0  # records of calls that returned an error: their timing means nothing
        self.collectives: dict[str, CollectiveStats] = {}  # NCCL calls by op
        # step tags need the shim's clock to be perf_counter's (both CLOCK_MONOTONIC on Linux)
        self._same_clock = "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation

    def __call__(self) -> None:
        records = self.reader.read()
        if not records:
            return
        current_step = 0
        if self.steps is not None:
            last = self._boundaries[-1][0] if self._boundaries else 0
            self._boundaries.extend(self.steps.boundaries_after(last))
            current_step = self.steps.steps
        steps = [step for step, _ in self._boundaries]
        times = [at for _, at in self._boundaries]
        for record in records:
            if record.result != 0:
                self.failed_calls += 1
                continue
            if record.is_kernel:
                step = (
                    step_at(steps, times, record.host_ns / 1e9, current_step)
                    if self._same_clock
                    else current_step
                )
                self.kernel_issue.active = True
                self.kernel_issue.add(step, record.issue_latency_seconds)
                continue
            op = NCCL_OPS[record.api]
            collective = self.collectives.get(op)
            if collective is None:
                collective = self.collectives[op] = CollectiveStats()
            collective.durations.observe(record.duration_seconds)
            collective.bytes_total += record.nbytes


def attach(
    ild: IldState,
    manager: TimingManager,
    steps: StepTracker,
    health: ExporterHealth,
    environ: Mapping[str, str] | None = None,
    loaded: bool | None = None,
) -> ShimFeed | None:
    """If the shim is loaded in this process, read its ring at every drain (before the ILD drift refresh)."""
    if not (shim_loaded() if loaded is None else loaded):
        return None
    feed = ShimFeed(RingReader(ring_path(environ=environ), health), ild.kernel_issue, steps)
    hooks = manager.after_drain
    hooks.insert(hooks.index(ild.refresh) if ild.refresh in hooks else len(hooks), feed)
    # kernel launches come from here: windows may use the C++ recorder's timer
    ild.dispatch.launches_from_shim = True
    return feed
