"""The types the rules engine reads and writes: a Snapshot of every rank's RankRecord in, Verdicts out.

The rules (diagnosis.py, hang_verdicts.py, straggler_verdicts.py, ild_verdicts.py) read these and nothing
else; a source (sources.py) builds them. Plain data, no rules: this module imports none of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from .. import causes
from .canary import CanaryState
from .host_load import HostLoadState
from .verdict_terms import Domain, VerdictKind


# InFlight and GroupState are NamedTuples, not frozen dataclasses: a source builds one of each per rank and
# group (at a hang of 6,144 ranks, 12,288 a round): 0.5 µs each to build, against 1.5–1.9 µs.
class InFlight(NamedTuple):
    """A group's oldest unfinished collective on one rank."""

    op: str
    seq: int
    nbytes: int
    state: str  # issued | started
    started_at: float  # Unix time it was issued


class PointToPoint(NamedTuple):
    """One rank's sends and receives in one group: counted per (direction, peer), as the flight recorder's
    p2p_seq_id (the n-th send from A to B matches B's n-th receive from A), and the oldest in flight per
    (direction, peer): a rank waits in a receive from one peer while its send to another is unfinished."""

    issued: Mapping[tuple[str, int], int]  # (send | recv, peer's global rank) -> ops issued
    completed: Mapping[tuple[str, int], int]
    # (direction, peer (-1: any source), Unix time issued), oldest first
    in_flight: tuple[tuple[str, int, float], ...] = ()


class GroupState(NamedTuple):
    """One rank's view of one process group."""

    last_issued: int = 0
    last_completed: int = 0
    in_flight: InFlight | None = None
    # Its issued number was scraped before the group's newest issue (Prometheus's scrapes of the rank late):
    # it shows where the rank was then, not whether it issued the collective the group waits in.
    seen_before_stall: bool = False
    # When its issued number was scraped (Unix seconds; None where the source says not: a direct scrape is
    # fresh). A number scraped before its group was hung is not judged either
    # (hang_verdicts.GroupHang.hung_since).
    seen_at: float | None = None
    p2p: PointToPoint | None = None  # its sends and receives, where it made any


@dataclass(frozen=True)
class GpuState:
    """A rank's own GPU as its exporter last read it (flare_gpu_*); None where not reported."""

    up: bool = False
    clock_events: tuple[str, ...] = ()  # the clock-event reasons active now
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    pcie_link_generation: float | None = None
    pcie_link_generation_max: float | None = None
    pcie_link_width: float | None = None
    pcie_link_width_max: float | None = None
    temperature_celsius: float | None = None
    xid_events: float | None = None
    last_xid: float | None = None
    row_remap_failed: float | None = None


@dataclass(frozen=True)
class RankRecord:
    """Everything the rules know of one rank. Absent numbers are None."""

    rank: int
    up: bool = True
    down_reason: str = ""
    host: str = ""
    steps: float | None = None
    heartbeat: float | None = None  # Unix time of the last progress
    groups: Mapping[str, GroupState] = field(default_factory=dict)
    activity: str = ""  # collective | data | compute, while stalled
    frames: str = ""
    exception: str = ""  # type of the exception that ended the rank
    exception_at: float | None = None
    exception_cause: str = ""  # its cause, as the rank classified it (flare_exporter.causes)
    collective_seconds: float | None = None  # time in collectives over the window (stragglers)
    step_seconds: float | None = None  # time in steps over the window
    step_count: float | None = None  # steps over the window
    # straggler windows the rank exported: window number -> (mean step seconds, mean wait seconds per step)
    step_windows: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    best_step_seconds: float | None = None  # the rank's own best window mean step time
    gpu: GpuState | None = None  # the rank's own GPU health (None: not reported)
    # ILD drift from the rank's baseline, by distribution (kernel_issue, host_dispatch): KS and W1 seconds
    ild_ks: Mapping[str, float] = field(default_factory=dict)
    ild_wasserstein: Mapping[str, float] = field(default_factory=dict)
    ild_op_shift: Mapping[str, float] = field(default_factory=dict)  # host dispatch's per-op shift, seconds
    canary: CanaryState | None = None  # the hardware canary's readings (None: not exported, or not read)
    host_load: HostLoadState | None = None  # its host's CPU load, as the rank read it (None: not exported)

    @property
    def gone(self) -> bool:
        return not self.up or bool(self.exception)


@dataclass(frozen=True)
class WindowSummary:
    """What the straggler rules need of the ranks a source did not read the windows of: the same windows
    closed by every live rank, how many ranks, and the median and spread (MAD scaled to a standard
    deviation) of their wait shares in each window and over the windows together. The ranks that could be
    named (whose wait share over the windows lies far enough below the median) come with their windows.
    It stands for every live rank's windows only where one median serves every rank (more than
    straggler_verdicts.LEAVE_ONE_OUT_RANKS) and no rank is `job_slowdown` slower than its own best in every
    window (the job-wide verdict lists every rank)."""

    windows: tuple[int, ...]  # oldest first
    ranks: int
    per_window: tuple[tuple[float, float], ...]  # (median, spread) of the shares in each window
    pooled: tuple[float, float]  # (median, spread) of the shares over the windows together
    at: float  # Unix time the figures were taken


@dataclass(frozen=True)
class Snapshot:
    """Every rank of one run at one moment (`now`, Unix time), from one source."""

    ranks: Mapping[int, RankRecord]
    now: float
    run: str = ""
    world_size: int = 0
    group_sizes: Mapping[str, int] = field(default_factory=dict)
    # Every rank's straggler windows in figures (from Prometheus's recording rules, at thousands of ranks),
    # with the windows of the ranks that could be named in the records; None: the records hold every rank's.
    window_summary: WindowSummary | None = None
    # The hang threshold the run's ranks export (flare_hang_threshold_seconds, the largest of them), where a
    # source read it (a direct scrape); None otherwise.
    hang_seconds: float | None = None
    # Flight-recorder dumps, written because something timed out: a group where some ranks wait in a
    # collective (or a send or receive) that others never issued is judged whatever the wait's age.
    dumped: bool = False

    @cached_property
    def members(self) -> dict[str, tuple[int, ...]]:
        """Group -> its ranks (see hang_verdicts.members_of), indexed once: rules ask per group; groups grow
        with ranks."""
        found: dict[str, list[int]] = {}
        for record in sorted(self.ranks.values(), key=lambda r: r.rank):
            names = set(record.groups) or ({"world"} if record.gone else set())
            for name in names:
                found.setdefault(name, []).append(record.rank)
        return {name: tuple(ranks) for name, ranks in found.items()}

    @cached_property
    def live_states(self) -> dict[str, tuple[tuple[int, GroupState], ...]]:
        """Group -> (rank, its GroupState) of each live rank that reports it, by rank: what the hang rules
        weigh of a group, indexed once (at a hang of thousands of ranks, every rule reads the hung group)."""
        found: dict[str, list[tuple[int, GroupState]]] = {}
        for record in sorted(self.ranks.values(), key=lambda r: r.rank):
            if record.up:
                for name, state in record.groups.items():
                    found.setdefault(name, []).append((record.rank, state))
        return {name: tuple(states) for name, states in found.items()}

    @cached_property
    def oldest_in_flight(self) -> dict[str, float]:
        """Group -> the age of the oldest collective in flight in it on a live rank (groups with one only).

        One pass over the ranks, once: at thousands of ranks there are thousands of groups, and most have
        nothing in flight for long; each rule that asks whether a group is hung reads it."""
        earliest: dict[str, float] = {}
        for record in self.ranks.values():
            if not record.up:
                continue
            for name, state in record.groups.items():
                flight = state.in_flight
                if flight is not None and flight.started_at < earliest.get(name, math.inf):
                    earliest[name] = flight.started_at
        return {name: self.now - started for name, started in earliest.items()}

    @property
    def ranks_seen(self) -> int:
        return sum(1 for record in self.ranks.values() if record.up)

    def replaced(self, groups_kept: bool, **changes: Any) -> Snapshot:
        """dataclasses.replace(self, **changes); where `groups_kept` (no record's groups, up or exception
        changed: GROUP_INDEX_FIELDS), with this snapshot's indexes of its groups (members, live_states,
        oldest_in_flight) as they are built, not built again: a source that reads its fields in rounds adds
        each round's to the same ranks in the same groups, and at thousands of ranks each index is a pass."""
        snapshot = dataclasses.replace(self, **changes)
        if groups_kept:
            snapshot.__dict__.update((name, vars(self)[name]) for name in GROUP_INDEXES if name in vars(self))
        return snapshot


# The Snapshot indexes built from its records' groups, up and exception, and those RankRecord fields.
GROUP_INDEXES = ("members", "live_states", "oldest_in_flight")
GROUP_INDEX_FIELDS = frozenset({"groups", "up", "exception"})


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    ranks: tuple[int, ...]
    domain: Domain
    summary: str
    evidence: dict[str, Any]
    group: str | None = None
    cause: causes.Cause = "unknown"  # verdict_causes.py sets it
    severity: str = "page"  # or host_load.WARNING: no rank's fault (a busy host), exit 0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "cause": self.cause,
            "ranks": list(self.ranks),
            "domain": self.domain,
            "group": self.group,
            "summary": self.summary,
            "evidence": self.evidence,
        }


def rank_list(ranks: list[int] | tuple[int, ...]) -> str:
    """Ranks as a verdict's summary names them: "3, 7"."""
    return ", ".join(map(str, ranks))


def age_of(snapshot: Snapshot, timestamp: float | None) -> float | None:
    """Seconds from `timestamp` (Unix time) to the snapshot's time, or None."""
    return None if timestamp is None else round(snapshot.now - timestamp, 3)
