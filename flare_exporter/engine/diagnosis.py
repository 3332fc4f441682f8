"""The rules engine: a snapshot of every rank's state in, verdicts out. Pure functions, no I/O.

A Snapshot comes from Prometheus or from scraping the ranks (sources.py); the rules follow DESIGN.md's
"Attribution", most severe first:

1. Ranks that are gone (endpoint down or missing, or an exception recorded) -> `rank_down`.
2. A group is hung when one of its ranks has had a collective unfinished for `hang_seconds`. Then:
   ranks behind the group's highest issued sequence number never reached the collective -> `hang` with
   them as culprits; a culprit that itself waits in another group is followed into that group, until the
   chain ends at a rank that waits on nobody. If most ranks are "behind" one rank, that rank issued a
   collective the others never will -> `mismatch`. A rank is judged behind only on a number scraped since
   its group's newest issue: Prometheus, behind on its scrapes at thousands of ranks, can hold a rank's
   number from before the hang (GroupState.seen_before_stall).
3. Every rank at the same sequence number, but with different ops or sizes in flight -> `mismatch`, the
   odd ones out by majority.
4. Every rank inside the collective: ranks whose collective has not started on the device while others'
   has -> `hang` with them as culprits; otherwise a communication fault in the group (`hang`, domain group).
5. Several culprits of one verdict on one host -> `host_fault`, domain host.
Straggler: with no hang, the rank that waits least in collectives per step, far below the median
(median/MAD) -> `straggler`.
ILD regression: with no hang, a rank whose issue-latency distribution (kernel issue, host dispatch) shifted
from its own baseline (KS over a threshold) while most ranks' did not -> `ild_regression`, domain rank (or
host); shifted on most or all ranks -> `ild_regression`, domain job.
Canary: whatever else is found, a live rank that failed a check of the hardware canary (its preflight, an
in-flight check, a drift) -> `canary`, naming the rank, its host (several of its ranks failed the same
check) or a link (bus bandwidth within or across hosts) with the measurement and its baseline (canary.py).
After hangs and deaths, beside stragglers: it masks neither.

No rank is presumed healthy: decisions go by the evidence and by majority.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from ..group_roles import group_role
from ..policies import HostLoadPolicy, IldPolicy, StragglerPolicy
from ..spec import GPU_SLOWDOWN_REASONS
from .canary import CanaryState, canary_faults
from .canary import evidence as canary_evidence
from .canary import summary as canary_summary
from .host_load import WARNING, HostLoadState, judged_with_host_load
from .verdict_causes import cause_of
from .wait_for import WaitGraph, point_to_point_edges, wait_graph

# Verdict kinds, most severe first.
KINDS = ("host_fault", "rank_down", "mismatch", "hang", "straggler", "canary", "ild_regression")
DOMAINS = ("rank", "host", "link", "switch", "rack", "group", "job")


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
    # fresh). A number scraped before its group was hung is not judged either (GroupHang.hung_since).
    seen_at: float | None = None
    p2p: PointToPoint | None = None  # its sends and receives, where it made any


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
    LEAVE_ONE_OUT_RANKS) and no rank is `job_slowdown` slower than its own best in every window (the
    job-wide verdict lists every rank)."""

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
        """Group -> its ranks (see members_of), indexed once: rules ask per group; groups grow with ranks."""
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
    kind: str
    ranks: tuple[int, ...]
    domain: str
    summary: str
    evidence: dict[str, Any]
    group: str | None = None
    cause: str = "unknown"  # one of flare_exporter.causes.CAUSES (verdict_causes.py sets it)
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


@dataclass(frozen=True)
class GroupHang:
    """A hung group: its members and the numbers that say so."""

    name: str
    members: tuple[int, ...]
    oldest_age: float
    max_issued: int
    # When the group became hung: its oldest collective in flight had been for the hang threshold. A rank's
    # number scraped before then predates the evidence against it and is not judged (GroupState.seen_at).
    hung_since: float = -math.inf

    def judges(self, state: GroupState) -> bool:
        """Whether a member's number was scraped after the evidence against it: after the group's newest
        issue and once the group was hung (as the alerts' run_group_rank:...:behind_since_stall)."""
        return not state.seen_before_stall and (state.seen_at is None or state.seen_at >= self.hung_since)

    def behind(self, live: Iterable[tuple[int, GroupState]]) -> list[int]:
        """The live members (Snapshot.live_states) behind the group's top issued number, judged on numbers
        scraped once the group was hung (judges); where none is yet (a scrape interval after the hang
        began), on those scraped since its newest issue, as before the hang (behind_in): never "no one is
        behind" for want of a scrape."""
        below = [(rank, state) for rank, state in live if state.last_issued < self.max_issued]
        return [rank for rank, state in below if self.judges(state)] or behind_in(below, self.max_issued)


def diagnose(
    snapshot: Snapshot,
    hang_seconds: float,
    stragglers: StragglerPolicy = StragglerPolicy(),
    ild: IldPolicy | None = None,
    host_load: HostLoadPolicy | None = None,
) -> list[Verdict]:
    """All verdicts for the snapshot, most severe first (a warning after the pages of its kind)."""
    hangs = hung_groups(snapshot, hang_seconds)
    verdicts: list[Verdict] = []
    down = gone_ranks(snapshot)
    if down:
        verdicts.append(rank_down_verdict(snapshot, down, hangs))
    down_set = set(down)
    for hang in hangs:
        if waits_on_gone(hang, down_set):
            continue
        verdicts.append(explain_hang(snapshot, hang))
    verdicts.extend(point_to_point_verdicts(snapshot, hang_seconds, down_set))
    verdicts = one_verdict_per_culprit(snapshot, verdicts)
    if not verdicts:
        verdicts.extend(straggler_verdicts(snapshot, stragglers))
        verdicts.extend(ild_verdicts(snapshot, ild or IldPolicy()))
        verdicts = judged_with_host_load(snapshot, verdicts, host_load or HostLoadPolicy())
    verdicts.extend(canary_verdicts(snapshot))
    verdicts = [host_verdict(snapshot, with_cause(snapshot, verdict)) for verdict in verdicts]
    return sorted(
        _unique(verdicts), key=lambda verdict: (KINDS.index(verdict.kind), verdict.severity == WARNING)
    )


def with_cause(snapshot: Snapshot, verdict: Verdict) -> Verdict:
    """`verdict` with its cause set, where it has none yet (verdict_causes.py)."""
    if verdict.cause != "unknown":
        return verdict
    culprits = [snapshot.ranks[rank] for rank in verdict.ranks if rank in snapshot.ranks]
    cause = cause_of(verdict.kind, verdict.domain, culprits, verdict.evidence)
    return dataclasses.replace(verdict, cause=cause)


def _unique(verdicts: list[Verdict]) -> list[Verdict]:
    seen: set[tuple[str, tuple[int, ...], str | None]] = set()
    kept = []
    for verdict in verdicts:
        key = (verdict.kind, verdict.ranks, verdict.group)
        if key not in seen:
            seen.add(key)
            kept.append(verdict)
    return kept


# ---------------------------------------------------------------------------------------------------------
# gone ranks


def gone_ranks(snapshot: Snapshot) -> list[int]:
    """Ranks that are gone, the likeliest origin first.

    A rank that vanished without a word (killed, frozen, its host lost) comes before ranks that died of
    an exception, which on a collective backend is what the survivors of a lost peer raise; among those,
    the earliest exception first.
    """
    gone = [record for record in snapshot.ranks.values() if record.gone]
    return [
        record.rank
        for record in sorted(
            gone, key=lambda r: (bool(r.exception), r.exception_at or 0.0, r.heartbeat or 0.0, r.rank)
        )
    ]


def rank_down_verdict(snapshot: Snapshot, down: list[int], hangs: list[GroupHang]) -> Verdict:
    """Culprits: the ranks that vanished without a word, else the first to raise; the rest followed."""
    vanished = [rank for rank in down if not snapshot.ranks[rank].exception]
    culprits = vanished or down[:1]
    followers = [rank for rank in down if rank not in culprits]
    evidence: dict[str, Any] = {"ranks": {}}
    for rank in down:
        record = snapshot.ranks[rank]
        evidence["ranks"][str(rank)] = {
            "reason": _gone_reason(record),
            "host": record.host or None,
            "heartbeat_age_seconds": age_of(snapshot, record.heartbeat),
            "exception_age_seconds": age_of(snapshot, record.exception_at),
            "steps": record.steps,
        }
    evidence["followed_by"] = followers
    evidence["hung_groups"] = [hang.name for hang in hangs if set(down) & set(hang.members)]
    if len(culprits) == 1:
        summary = f"rank {culprits[0]} is gone ({_gone_reason(snapshot.ranks[culprits[0]])})"
    else:
        reasons = "; ".join(f"{rank}: {_gone_reason(snapshot.ranks[rank])}" for rank in culprits)
        summary = f"ranks {_names(culprits)} are gone ({reasons})"
    if followers:
        summary += f"; rank {_names(followers)} failed after it"
    if evidence["hung_groups"]:
        summary += f"; group {', '.join(evidence['hung_groups'])} waits on it"
    return Verdict("rank_down", tuple(culprits), "rank", summary, evidence)


def _gone_reason(record: RankRecord) -> str:
    if record.exception:
        return f"raised {record.exception}"
    return record.down_reason or "not answering"


# ---------------------------------------------------------------------------------------------------------
# hangs


def members_of(snapshot: Snapshot, group: str) -> tuple[int, ...]:
    """Ranks in `group`: those that report it, and gone ranks we know nothing of if it is the world."""
    return snapshot.members.get(group, ())


def hung_groups(snapshot: Snapshot, hang_seconds: float) -> list[GroupHang]:
    """Groups in which some live rank has had a collective unfinished for at least `hang_seconds`."""
    oldest = snapshot.oldest_in_flight
    hangs = []
    for name in sorted(oldest):
        if oldest[name] < hang_seconds and not (snapshot.dumped and below_top(snapshot, name)):
            continue
        max_issued = top_issued(snapshot.live_states[name])
        hung_since = snapshot.now - oldest[name] + hang_seconds
        hangs.append(GroupHang(name, members_of(snapshot, name), oldest[name], max_issued, hung_since))
    return hangs


def explain_hang(snapshot: Snapshot, hang: GroupHang) -> Verdict:
    """The verdict on a hung group, by the first hang rule that fits (the module docstring's 2 to 4): most
    live members behind one rank's number, a mismatch; some behind, a hang of the ranks their chains end
    at; none behind, a mismatch where the members have different collectives in flight, else a hang inside
    the collective."""
    live = snapshot.live_states[hang.name]
    behind = hang.behind(live)
    ahead = [rank for rank, state in live if state.last_issued == hang.max_issued]
    evidence = _hang_evidence(hang, live, len(ahead), behind)
    if behind and len(behind) * 2 > len(live):
        return _issued_alone_verdict(snapshot, hang, ahead, behind, evidence)
    if behind:
        return _chain_verdict(snapshot, hang, behind, evidence)
    inside = {
        rank: state.in_flight
        for rank, state in live
        if state.in_flight is not None and state.in_flight.seq == hang.max_issued
    }
    evidence["in_flight"] = _in_flight_evidence(snapshot, sorted(inside), hang.name)
    signatures = Counter((flight.op, flight.nbytes) for flight in inside.values())
    if len(signatures) > 1:
        return _differing_collectives_verdict(hang, inside, signatures, evidence)
    return _inside_collective_verdict(hang, inside, evidence)


def _hang_evidence(
    hang: GroupHang, live: tuple[tuple[int, GroupState], ...], at_top: int, behind: list[int]
) -> dict[str, Any]:
    """What every verdict on a hung group shows: how long it has waited, its top issued number, the live
    members' numbers below it and how many (`at_top`) are at it, and which members below it were not judged
    (`behind` are those judged: their number scraped late)."""
    evidence: dict[str, Any] = {
        "oldest_in_flight_seconds": round(hang.oldest_age, 3),
        "max_issued_seq": hang.max_issued,
        # the live members' numbers below it (bounded by who is behind, not by the group's size)
        "last_issued_seq": {
            str(rank): state.last_issued for rank, state in live if state.last_issued != hang.max_issued
        },
        "ranks_at_max_issued_seq": at_top,
    }
    judged = set(behind)
    unjudged = [rank for rank, state in live if state.last_issued < hang.max_issued and rank not in judged]
    if unjudged:
        evidence["seen_before_stall"] = unjudged
    return evidence


def _issued_alone_verdict(
    snapshot: Snapshot, hang: GroupHang, ahead: list[int], behind: list[int], evidence: dict[str, Any]
) -> Verdict:
    """Most live members `behind` the ranks `ahead`: those issued a collective the others never will ->
    `mismatch`, with them as culprits."""
    evidence["in_flight"] = _in_flight_evidence(snapshot, ahead, hang.name)
    return Verdict(
        "mismatch",
        tuple(ahead),
        "rank",
        f"rank {_names(ahead)} issued collective {hang.max_issued} in group {hang.name}, which the "
        f"other {len(behind)} ranks never issued",
        evidence,
        hang.name,
    )


def _chain_verdict(
    snapshot: Snapshot, hang: GroupHang, behind: list[int], evidence: dict[str, Any]
) -> Verdict:
    """Some live members `behind` the group's top number never reached the collective -> `hang`, with the
    ranks their chains end at as culprits (follow_chain), or every rank of the chain where each waits on
    another (a deadlock across groups)."""
    culprits, chain = follow_chain(snapshot, hang.name, behind)
    evidence["chain"] = chain
    if not culprits:  # every hop waits on another: a deadlock across groups; all of them are suspects
        culprits = sorted({hop["rank"] for hop in chain})
        evidence["deadlock"] = True
    evidence["culprits"] = {str(rank): _rank_evidence(snapshot, rank) for rank in culprits}
    where = _where(snapshot, culprits[0])
    never_issued = f"rank {_names(culprits)} never issued it"
    if not set(culprits) <= set(hang.members):  # the chain left the group: say who waits for whom
        never_issued = f"rank {_names(behind)} never issued it, waiting for rank {_names(culprits)}"
    return Verdict(
        "hang",
        tuple(culprits),
        "rank",
        f"group {hang.name} has waited {hang.oldest_age:.0f} s for collective {hang.max_issued}; "
        f"{never_issued}{where}",
        evidence,
        hang.name,
    )


def _differing_collectives_verdict(
    hang: GroupHang,
    inside: Mapping[int, InFlight],
    signatures: Counter[tuple[str, int]],
    evidence: dict[str, Any],
) -> Verdict:
    """No live member behind, but the collectives in flight at the top number (`inside`: rank -> its
    collective) differ in op or size (`signatures`: how many ranks have each) -> `mismatch`, with the odd
    ones out by majority as culprits; where no op and size has a majority, every rank, domain group."""
    (majority, count), (_, runner_up) = signatures.most_common(2)
    odd = sorted(rank for rank, flight in inside.items() if (flight.op, flight.nbytes) != majority)
    if count == runner_up:
        odd = sorted(inside)  # no majority: every rank is a suspect
    issued_by_odd = ", ".join(
        f"rank {rank}: {inside[rank].op} of {inside[rank].nbytes} bytes" for rank in odd
    )
    return Verdict(
        "mismatch",
        tuple(odd),
        "rank" if count != runner_up else "group",
        f"collective {hang.max_issued} in group {hang.name} differs across ranks: {count} ranks issued "
        f"{majority[0]} of {majority[1]} bytes, but {issued_by_odd}",
        evidence,
        hang.name,
    )


def _inside_collective_verdict(
    hang: GroupHang, inside: Mapping[int, InFlight], evidence: dict[str, Any]
) -> Verdict:
    """No live member behind, and the same collective in flight at the top number on each (`inside`: rank ->
    its collective): where it has started on the device on some and not on others -> `hang`, with those it
    has not started on as culprits (their stream blocked by their own earlier work); otherwise a
    communication fault in the group -> `hang`, domain group, no culprit."""
    states = {rank: flight.state for rank, flight in inside.items()}
    not_started = sorted(rank for rank, state in states.items() if state == "issued")
    if "started" in states.values() and not_started:
        return Verdict(
            "hang",
            tuple(not_started),
            "rank",
            f"collective {hang.max_issued} in group {hang.name} has not started on rank "
            f"{_names(not_started)} (its stream is blocked by its own earlier work), the others wait in it",
            evidence,
            hang.name,
        )
    return Verdict(
        "hang",
        (),
        "group",
        f"every rank of group {hang.name} is inside collective {hang.max_issued} for "
        f"{hang.oldest_age:.0f} s: a communication fault in the group",
        evidence,
        hang.name,
    )


def waits_on_gone(hang: GroupHang, gone: set[int]) -> bool:
    """A hung group with a gone member (of `gone`, gone_ranks): the rank_down verdict explains it."""
    return not gone.isdisjoint(hang.members)


class HangReads(NamedTuple):
    """What the hang rules read of every member of a group (what_hang_rules_read)."""

    numbers: set[str]  # the groups of which they read each member's issued number
    flights: set[str]  # the groups of which they read which collective each member has in flight


def what_hang_rules_read(snapshot: Snapshot, hang_seconds: float) -> HangReads:
    """The groups whose members' issued numbers the hang rules read: each hung group, and every group a
    rank on a hang's chain waits in (follow_chain). A source that reads every member's number in each of
    these, and only these, gives the hang verdicts of the whole snapshot; on less, the chains found name the
    groups to read next.

    And the hung groups whose verdicts weigh which collective each member has in flight (InFlight's op,
    number, bytes and state; its start decides whether the group is hung): those with no chain, where no
    live member is behind or most are (a mismatch). A chain starts at the ranks behind and names them from
    the issued numbers alone; a group with a gone member is the rank_down verdict's. Elsewhere a source may
    leave them unread: at a hang of thousands of ranks, those of every rank that waits in the group."""
    gone = set(gone_ranks(snapshot))
    reads = HangReads(set(), set())
    for hang in hung_groups(snapshot, hang_seconds):
        reads.numbers.add(hang.name)
        chain = explain_hang(snapshot, hang).evidence.get("chain")
        for hop in chain or ():
            reads.numbers.update(hop["waits_in"])
        if chain is None and not waits_on_gone(hang, gone):
            reads.flights.add(hang.name)
    return reads


def behind_in(live: Iterable[tuple[int, GroupState]], top: int) -> list[int]:
    """The ranks of `live` (a group's live members and their states, Snapshot.live_states) whose last
    issued number is below `top`, of those scraped since the group's newest issue: a rank whose number was
    scraped before (a late scrape) cannot tell whether it issued the collective the group waits in, and is
    not judged (of a hung group, GroupHang.behind also leaves out those scraped before it was hung)."""
    return [rank for rank, state in live if state.last_issued < top and not state.seen_before_stall]


def below_top(snapshot: Snapshot, group: str) -> list[int]:
    """The live members of `group` whose last issued number is below the group's top (the highest of its live
    members): behind it, or, where their number was scraped before the group's newest issue, unjudged."""
    live = snapshot.live_states.get(group, ())
    top = top_issued(live)
    return [rank for rank, state in live if state.last_issued < top]


def top_issued(live: Iterable[tuple[int, GroupState]]) -> int:
    """The highest last issued number of a group's live members (Snapshot.live_states); 0 for none."""
    return max((state.last_issued for _, state in live), default=0)


def follow_chain(snapshot: Snapshot, group: str, behind: list[int]) -> tuple[list[int], list[dict[str, Any]]]:
    """From ranks behind in `group`, follow each that waits in another group; return the chain ends.

    A rank behind in G that has a collective in flight in H waits on H's laggards, and so on, until a
    rank waits on nobody. Returns (culprits, the hops [{group, rank, waits_in}]).
    """
    culprits: list[int] = []
    chain: list[dict[str, Any]] = []
    visited: set[tuple[str, int]] = set()
    todo = [(group, rank) for rank in behind]
    while todo:
        from_group, rank = todo.pop(0)
        if (from_group, rank) in visited:
            continue
        visited.add((from_group, rank))
        record = snapshot.ranks[rank]
        waits_in = [
            name
            for name, state in sorted(record.groups.items())
            if name != from_group and state.in_flight is not None
        ]
        laggards = []
        for name in waits_in:
            live = snapshot.live_states.get(name, ())
            laggards += [(name, behind) for behind in behind_in(live, top_issued(live))]
            laggards += [(name, r) for r in members_of(snapshot, name) if snapshot.ranks[r].gone]
        for name in sorted(record.groups):  # a send or receive whose peer never issued its side
            for edge in point_to_point_edges(snapshot, record, name):
                laggards.append((name, edge.waits_on))
                if name not in waits_in:
                    waits_in.append(name)
        chain.append({"group": from_group, "rank": rank, "waits_in": waits_in})
        if not laggards:
            if rank not in culprits:
                culprits.append(rank)
            continue
        todo.extend(laggards)
    return sorted(culprits), chain


def point_to_point_verdicts(snapshot: Snapshot, hang_seconds: float, gone: set[int]) -> list[Verdict]:
    """Ranks whose send or receive has been in flight for `hang_seconds`: follow the wait-for graph
    (wait_for.py) to where it ends. A live rank that waits for nobody -> `hang`, with it as culprit; ranks
    that wait only for each other -> `hang` (a deadlock), with every member of the cycle. A chain that ends
    at a gone rank is the rank_down verdict's."""
    waiting = [
        record.rank
        for record in snapshot.ranks.values()
        if record.up
        and not record.exception
        and any(
            state.p2p is not None
            and state.p2p.in_flight
            and (
                snapshot.now - state.p2p.in_flight[0][2] >= hang_seconds
                or (snapshot.dumped and point_to_point_edges(snapshot, record, name))
            )
            for name, state in record.groups.items()
        )
    ]
    if not waiting:
        return []
    graph = wait_graph(snapshot, waiting)
    verdicts = [_held_up_verdict(snapshot, graph, rank) for rank in graph.ends if rank not in gone]
    verdicts += [_deadlock_verdict(snapshot, graph, cycle) for cycle in graph.cycles]
    return verdicts


def _held_up_verdict(snapshot: Snapshot, graph: WaitGraph, culprit: int) -> Verdict:
    """`culprit` waits for nobody, and the ranks of `graph` whose chains end at it wait for it."""
    edges = graph.held_up_by([culprit])
    groups = sorted({edge.group for edge in edges})
    direct = [edge for edge in edges if edge.waits_on == culprit]
    longest = max(snapshot.now - edge.since for edge in edges)
    waits = ", ".join(f"rank {edge.rank} in a {edge.how} in {edge.group}" for edge in direct)
    held_up = sorted({edge.rank for edge in edges})
    evidence = {
        "wait_for": [edge.to_json(snapshot.now) for edge in edges],
        "groups": groups,
        "roles": roles_of(groups),
        "held_up": held_up,
        "culprits": {str(culprit): _rank_evidence(snapshot, culprit)},
    }
    return Verdict(
        "hang",
        (culprit,),
        "rank",
        f"rank {culprit} waits for nobody and holds up {len(held_up)} ranks for "
        f"{longest:.0f} s ({waits}): it never issued the matching op{_where(snapshot, culprit)}",
        evidence,
        groups[0],
    )


def _deadlock_verdict(snapshot: Snapshot, graph: WaitGraph, cycle: tuple[int, ...]) -> Verdict:
    """The ranks of `cycle` wait only for each other: a deadlock, naming every member."""
    inside = [edge for edge in graph.edges if edge.rank in cycle and edge.waits_on in cycle]
    edges = graph.held_up_by(cycle)
    groups = sorted({edge.group for edge in edges})
    how = "; ".join(f"{edge.rank} waits for {edge.waits_on} ({edge.how} in {edge.group})" for edge in inside)
    held_up = sorted({edge.rank for edge in edges} - set(cycle))
    evidence = {
        "deadlock": True,
        "cycle": list(cycle),
        "wait_for": [edge.to_json(snapshot.now) for edge in edges],
        "groups": groups,
        "roles": roles_of(groups),
        "held_up": held_up,
        "culprits": {str(rank): _rank_evidence(snapshot, rank) for rank in cycle},
    }
    behind_it = f"; rank {_names(held_up)} wait for them" if held_up else ""
    return Verdict(
        "hang",
        cycle,
        "rank",
        f"deadlock: ranks {_names(cycle)} wait for each other ({how}){behind_it}",
        evidence,
        groups[0],
        cause="deadlock",
    )


def one_verdict_per_culprit(snapshot: Snapshot, verdicts: list[Verdict]) -> list[Verdict]:
    """Hang verdicts that name the same culprits, one per group they hold up, as one verdict listing every
    group: the summary of the verdict on the largest group (the most ranks held up), the others' groups and
    evidence under `groups` and `also`."""
    merged: list[Verdict] = []
    first: dict[tuple[int, ...], int] = {}
    for verdict in verdicts:
        index = first.get(verdict.ranks) if verdict.kind == "hang" and verdict.ranks else None
        if index is None:
            if verdict.kind == "hang" and verdict.ranks:
                first[verdict.ranks] = len(merged)
            merged.append(verdict)
            continue
        kept = merged[index]
        if _reach(snapshot, verdict) > _reach(snapshot, kept):
            kept, verdict = verdict, kept
        groups = sorted({*_groups_of(kept), *_groups_of(verdict)})
        evidence = {**kept.evidence, "groups": groups, "roles": roles_of(groups)}
        evidence["also"] = [*kept.evidence.get("also", []), {"group": verdict.group, **verdict.evidence}]
        summary = kept.summary.split("; it holds up groups ")[0] + f"; it holds up groups {', '.join(groups)}"
        cause = kept.cause if kept.cause != "unknown" else verdict.cause
        merged[index] = dataclasses.replace(kept, evidence=evidence, summary=summary, cause=cause)
    return merged


def _reach(snapshot: Snapshot, verdict: Verdict) -> tuple[int, int]:
    """How much a hang verdict explains: its group's members, then the hops of its chain."""
    return len(members_of(snapshot, verdict.group or "")), len(verdict.evidence.get("chain") or ())


def roles_of(groups: Iterable[str]) -> dict[str, str]:
    """Each group's role (dp, tp, pp, ...: a DeviceMesh dimension's name), as evidence lists it."""
    return {name: group_role(name) for name in groups}


def _groups_of(verdict: Verdict) -> list[str]:
    return list(verdict.evidence.get("groups") or ([verdict.group] if verdict.group else []))


def _in_flight_evidence(snapshot: Snapshot, ranks: list[int], group: str) -> dict[str, Any]:
    out = {}
    for rank in ranks:
        flight = snapshot.ranks[rank].groups[group].in_flight
        if flight is not None:
            out[str(rank)] = {
                "op": flight.op,
                "seq": flight.seq,
                "bytes": flight.nbytes,
                "state": flight.state,
                "age_seconds": round(snapshot.now - flight.started_at, 3),
            }
    return out


def _rank_evidence(snapshot: Snapshot, rank: int) -> dict[str, Any]:
    record = snapshot.ranks[rank]
    return {
        "host": record.host or None,
        "activity": record.activity or None,
        "frames": record.frames or None,
        "heartbeat_age_seconds": age_of(snapshot, record.heartbeat),
        "steps": record.steps,
    }


def _where(snapshot: Snapshot, rank: int) -> str:
    record = snapshot.ranks[rank]
    if record.frames:
        return f"; rank {rank} is in {record.activity or 'compute'} at {record.frames.split(' < ')[0]}"
    return ""


# ---------------------------------------------------------------------------------------------------------
# stragglers


def straggler_scores(snapshot: Snapshot) -> dict[int, dict[str, float]]:
    """Per live rank with data: step time and collective wait per step, and the wait's robust z-score
    below the ranks' median (positive: waits less than the others, as a straggler does)."""
    rows = {
        record.rank: (record.step_seconds / record.step_count, record.collective_seconds / record.step_count)
        for record in snapshot.ranks.values()
        if record.up
        and record.step_count
        and record.step_seconds is not None
        and record.collective_seconds is not None
    }
    if not rows:
        return {}
    waits = [wait for _, wait in rows.values()]
    median_wait = statistics.median(waits)
    spread = 1.4826 * statistics.median(abs(wait - median_wait) for wait in waits) or 1e-9
    return {
        rank: {
            "step_seconds": step,
            "wait_seconds_per_step": wait,
            "score": (median_wait - wait) / spread,
        }
        for rank, (step, wait) in sorted(rows.items())
    }


def judged_by_windows(snapshot: Snapshot) -> bool:
    """Whether stragglers are judged from the exported windows (every live rank with data has them), not
    from the cumulative step and collective times (older exporters, or before the first window closed).
    A summary of every rank's windows says they do."""
    if snapshot.window_summary is not None:
        return True
    live = [record for record in snapshot.ranks.values() if record.up and record.step_count]
    return bool(live) and all(record.step_windows for record in live)


def decided_by_last_windows(snapshot: Snapshot, policy: StragglerPolicy) -> bool:
    """Whether the straggler rules weigh no window older than each live rank's last `hold_windows`, so that
    older ones would change no verdict: every live rank has the same last window and the `hold_windows - 1`
    before it, and exports its best step time (else its fastest window, however old, stands in for it). A
    source can leave the older windows unread then (sources.from_prometheus)."""
    live = [record for record in snapshot.ranks.values() if record.up]
    if policy.hold_windows < 1 or not live:
        return False
    if not all(record.step_windows and record.best_step_seconds for record in live):
        return False
    newest = max(live[0].step_windows)
    needed = range(newest - policy.hold_windows + 1, newest + 1)
    return all(
        max(record.step_windows) == newest and all(window in record.step_windows for window in needed)
        for record in live
    )


def straggler_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """Stragglers from the exported windows, else from the cumulative step and collective times (see
    judged_by_windows); a straggler's verdict carries its GPU's hardware reasons."""
    if judged_by_windows(snapshot):
        verdicts = window_verdicts(snapshot, policy)
    else:
        verdicts = cumulative_verdicts(snapshot, policy)
    return [with_hardware_reasons(snapshot, verdict, policy) for verdict in verdicts]


def _robust(values: list[float]) -> tuple[float, float]:
    """Median and MAD scaled to a standard deviation (never 0, so that scores stay finite)."""
    median = statistics.median(values)
    return median, 1.4826 * statistics.median(abs(value - median) for value in values) or 1e-9


LEAVE_ONE_OUT_RANKS = 64  # up to this many ranks, each is scored against the others only
MIN_SHARE_SPREAD = 0.005  # ranks that agree closer than 0.5 % of the step do not make a gap of 1 % a score


def _scores_below_median(shares: Mapping[int, float]) -> dict[int, tuple[float, float, float]]:
    """Per rank: (median of the others' shares, robust z of its share below it, the gap).

    In a small group one straggler moves the median and the MAD it is measured with, so each rank is
    compared with the others only; in a large one its own weight is negligible and one median serves all.
    """
    if len(shares) > LEAVE_ONE_OUT_RANKS:
        return _scores_against(shares, *_robust(list(shares.values())))
    out = {}
    for rank, share in shares.items():
        median, spread = _robust([other for key, other in shares.items() if key != rank])
        out[rank] = (median, (median - share) / max(spread, MIN_SHARE_SPREAD), median - share)
    return out


def _scores_against(
    shares: Mapping[int, float], median: float, spread: float
) -> dict[int, tuple[float, float, float]]:
    """Per rank: (median, robust z of its share below it, the gap), against one median and spread."""
    scale = max(spread, MIN_SHARE_SPREAD)
    return {rank: (median, (median - share) / scale, median - share) for rank, share in shares.items()}


def window_scores(snapshot: Snapshot, policy: StragglerPolicy) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """The last `hold_windows` windows that every live rank has closed, and each rank's scores over them.

    A rank's wait share of a window is its time in collectives over its step time. Per window, its score
    is how far its share lies below the other ranks' median, in robust sigmas (median/MAD); pooled, the
    same over the windows together, and `gap` that distance as a share of the step. `slowdown_ratio` is its
    step time in each window over its own best window's.
    """
    scored = WindowScores(snapshot, policy)
    return scored.windows, {rank: scored.row(rank) for rank in scored.ranks}


class WindowScores:
    """window_scores's numbers, each rank's row of them (rounded, as a verdict carries it) built only when
    asked: a verdict reads a few rows, and rounding every rank's took most of the rules' time at thousands
    of ranks (twice per `flare diagnose`)."""

    def __init__(self, snapshot: Snapshot, policy: StragglerPolicy) -> None:
        self.windows: list[int] = []
        self.ranks: list[int] = []  # the scored ones, in order; none when too few ranks or windows
        self.count = 0  # the ranks weighed: the scored ones, or with a summary every rank it stands for
        rows = {
            record.rank: record for record in snapshot.ranks.values() if record.up and record.step_windows
        }
        summary = snapshot.window_summary
        if summary is None:
            self.count = len(rows)
            if self.count < policy.min_ranks:  # a rank is scored against the others: too few to compare
                return
            common = set.intersection(*(set(record.step_windows) for record in rows.values()))
            self.windows = sorted(common)[-policy.hold_windows :]
        else:  # its windows, of the ranks that have them all
            self.count = summary.ranks
            self.windows = list(summary.windows)
            rows = {
                rank: record
                for rank, record in rows.items()
                if set(summary.windows) <= record.step_windows.keys()
            }
        if self.count < policy.min_ranks or len(self.windows) < policy.hold_windows:
            return
        self.records = rows
        # each rank's (step, wait) in each of the windows, in their order; the scores per window, then pooled
        self.weighed = {
            rank: [rows[rank].step_windows[window] for window in self.windows] for rank in sorted(rows)
        }
        self.ranks = list(self.weighed)
        shares = [
            {rank: _share(*found[index]) for rank, found in self.weighed.items()}
            for index in range(len(self.windows))
        ]
        self.pooled = {
            rank: _share(sum(step for step, _ in found), sum(wait for _, wait in found))
            for rank, found in self.weighed.items()
        }
        if summary is None:
            self.per_window = [_scores_below_median(found) for found in shares]
            self.pooled_scores = _scores_below_median(self.pooled)
        else:
            self.per_window = [
                _scores_against(found, *figures)
                for found, figures in zip(shares, summary.per_window, strict=True)
            ]
            self.pooled_scores = _scores_against(self.pooled, *summary.pooled)

    def stands_out(self, rank: int, policy: StragglerPolicy) -> bool:
        """Whether the rank's wait share over the windows together lies `pooled_z` robust sigmas and
        `min_wait_gap` of its step below the median (as its row rounds them)."""
        _, z, gap = self.pooled_scores[rank]
        return round(z, 3) >= policy.pooled_z and round(gap, 6) >= policy.min_wait_gap

    def slowdown_ratio(self, rank: int) -> list[float]:
        """The rank's step time in each window over its own best window's (as its row rounds it)."""
        best = self._best(rank)
        return [round(step / best, 4) if best > 0 else 1.0 for step, _ in self.weighed[rank]]

    def _best(self, rank: int) -> float:
        record = self.records[rank]
        return record.best_step_seconds or min(step for step, _ in record.step_windows.values())

    def row(self, rank: int) -> dict[str, Any]:
        """The rank's scores as window_scores gives them and a verdict's evidence carries them."""
        median, z, gap = self.pooled_scores[rank]
        return {
            "window_z": [round(scored[rank][1], 3) for scored in self.per_window],
            "window_gap": [round(scored[rank][2], 6) for scored in self.per_window],
            "wait_share": round(self.pooled[rank], 6),
            "median_wait_share": round(median, 6),
            "pooled_z": round(z, 3),
            "gap": round(gap, 6),
            "best_step_seconds": self._best(rank),
            "step_seconds": self.weighed[rank][-1][0],
            "slowdown_ratio": self.slowdown_ratio(rank),
        }


def _share(step_seconds: float, wait_seconds: float) -> float:
    return wait_seconds / step_seconds if step_seconds > 0 else 0.0


def window_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """A straggler is named when its score holds over the last `hold_windows` shared windows: in each, it
    waits `window_z` robust sigmas and `window_gap` of its step below the median wait share; over all of
    them, `pooled_z` sigmas and
    `min_wait_gap` of its step. Fewer than half the ranks may be named. With no straggler, every rank
    `job_slowdown` slower than its own best window in each of them is the job-wide case: kind straggler,
    domain job, no culprit rank (every rank slowed alike: software, data, the network, the cluster), as
    long as no rank's wait share stands out over the windows together (else it is a straggler that did
    not hold in every window yet, and no verdict is better than the wrong one)."""
    scored = WindowScores(snapshot, policy)
    windows = scored.windows
    if scored.count < policy.min_ranks or not scored.ranks:
        return []
    stands_out = [rank for rank in scored.ranks if scored.stands_out(rank, policy)]
    scores = {rank: scored.row(rank) for rank in stands_out}
    slow = [
        rank
        for rank in stands_out
        if min(scores[rank]["window_z"]) >= policy.window_z
        and min(scores[rank]["window_gap"]) >= policy.window_gap
    ]
    if slow and len(slow) * 2 < scored.count:
        first = scores[slow[0]]
        evidence = {"windows": windows, "ranks": {str(rank): scores[rank] for rank in slow}}
        return [
            Verdict(
                "straggler",
                tuple(slow),
                "rank",
                f"rank {_names(slow)} waits least in collectives over the last {len(windows)} windows "
                f"({first['wait_share']:.1%} of its step against a median of "
                f"{first['median_wait_share']:.1%}, "
                f"robust z {first['pooled_z']:.1f}): the others wait for it; its step time is "
                f"{first['slowdown_ratio'][-1]:.2f}x its own best",
                evidence,
            )
        ]
    if snapshot.window_summary is not None:  # given only where no rank is job_slowdown slower in every window
        return []
    threshold = 1 + policy.job_slowdown
    if not stands_out and all(min(scored.slowdown_ratio(rank)) >= threshold for rank in scored.ranks):
        scores = {rank: scored.row(rank) for rank in scored.ranks}
        ratios = [row["slowdown_ratio"][-1] for row in scores.values()]
        evidence = {
            "windows": windows,
            "slowdown_ratio": {str(rank): row["slowdown_ratio"] for rank, row in scores.items()},
            "step_seconds": {str(rank): row["step_seconds"] for rank, row in scores.items()},
            "best_step_seconds": {str(rank): row["best_step_seconds"] for rank, row in scores.items()},
            "wait_share": {str(rank): row["wait_share"] for rank, row in scores.items()},
        }
        return [
            Verdict(
                "straggler",
                (),
                "job",
                f"every rank is slower than its own best, {min(ratios):.2f}x to {max(ratios):.2f}x over the "
                f"last {len(windows)} windows, and none waits markedly less than the others: a job-wide "
                "slowdown, not one rank",
                evidence,
            )
        ]
    return []


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


def hardware_reasons(gpu: GpuState | None, policy: StragglerPolicy = StragglerPolicy()) -> list[str]:
    """What in a rank's GPU health explains it being slow: throttling, a low clock, a degraded link."""
    if gpu is None or not gpu.up:
        return []
    reasons = [reason for reason in GPU_SLOWDOWN_REASONS if reason in gpu.clock_events]
    clock, clock_max = gpu.sm_clock_hertz, gpu.sm_clock_max_hertz
    if clock is not None and clock_max and clock < policy.clock_below_max * clock_max:
        reasons.append(f"SM clock {clock / 1e6:.0f} MHz of {clock_max / 1e6:.0f} MHz max")
    generation, width = gpu.pcie_link_generation, gpu.pcie_link_width
    generation_max, width_max = gpu.pcie_link_generation_max, gpu.pcie_link_width_max
    if None not in (generation, width, generation_max, width_max) and (
        generation < generation_max or width < width_max  # type: ignore[operator]
    ):
        reasons.append(
            f"PCIe link Gen{generation:.0f} x{width:.0f} (max Gen{generation_max:.0f} x{width_max:.0f})"
        )
    if gpu.xid_events:
        reasons.append(f"{gpu.xid_events:.0f} XID events (last XID {gpu.last_xid or 0:.0f})")
    if gpu.row_remap_failed:
        reasons.append("row remapping failed")
    return reasons


def with_hardware_reasons(snapshot: Snapshot, verdict: Verdict, policy: StragglerPolicy) -> Verdict:
    """The verdict with each culprit's GPU health reasons in its evidence and summary (if any)."""
    found = {rank: hardware_reasons(snapshot.ranks[rank].gpu, policy) for rank in verdict.ranks}
    found = {rank: reasons for rank, reasons in found.items() if reasons}
    if not found:
        return verdict
    evidence = dict(verdict.evidence)
    evidence["hardware"] = {str(rank): reasons for rank, reasons in found.items()}
    said = "; ".join(f"rank {rank}'s GPU shows {', '.join(reasons)}" for rank, reasons in found.items())
    return dataclasses.replace(verdict, summary=f"{verdict.summary}; {said}", evidence=evidence)


def cumulative_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """Stragglers from step and collective time summed over the source's window (older exporters)."""
    scores = straggler_scores(snapshot)
    if len(scores) < policy.min_ranks:
        return []
    if any((snapshot.ranks[rank].step_count or 0) < policy.min_steps for rank in scores):
        return []
    median_step = statistics.median(row["step_seconds"] for row in scores.values())
    median_wait = statistics.median(row["wait_seconds_per_step"] for row in scores.values())
    slow = [
        rank
        for rank, row in scores.items()
        if row["score"] >= policy.robust_z
        and median_wait - row["wait_seconds_per_step"] >= policy.min_share_of_step * median_step
    ]
    if not slow or len(slow) * 2 >= len(scores):
        return []
    evidence = {
        "median_step_seconds": median_step,
        "median_wait_seconds_per_step": median_wait,
        "ranks": {str(rank): scores[rank] for rank in slow},
    }
    return [
        Verdict(
            "straggler",
            tuple(slow),
            "rank",
            f"rank {_names(slow)} waits least in collectives ({scores[slow[0]]['wait_seconds_per_step']:.4f} "
            f"s per step against a median of {median_wait:.4f} s): the others wait for it",
            evidence,
        )
    ]


# ---------------------------------------------------------------------------------------------------------
# issue latency


class IldDrift(NamedTuple):
    """One rank's drift of one distribution from its baseline."""

    ks: float
    wasserstein: float  # seconds
    op_shift: float | None  # seconds; host dispatch by the native timer only


class IldPeers(NamedTuple):
    """The ranks' medians of one distribution's drift, where 3 or more ranks export it (else None)."""

    wasserstein: float | None
    op_shift: float | None

    @classmethod
    def of(cls, drifts: Iterable[IldDrift]) -> IldPeers:
        drifts = list(drifts)
        shifts = [d.op_shift for d in drifts if d.op_shift is not None]
        return cls(
            statistics.median(d.wasserstein for d in drifts) if len(drifts) >= 3 else None,
            statistics.median(shifts) if len(shifts) >= 3 else None,
        )


def ild_shifted(drift: IldDrift, peers: IldPeers, policy: IldPolicy) -> bool:
    """Whether one rank's drift counts as a shift, given its peers' medians.

    The per-op shift counts beyond the peers' median (when that is positive), and only with one (3+ ranks,
    as the partial shift): a machine-wide slowdown that moves every rank alike is not one rank's, and a
    rank's own per-op shift also moves with the machine (a vCPU slower for a while), which only peers tell.
    """
    if drift.op_shift is not None and peers.op_shift is not None:
        if drift.op_shift - max(peers.op_shift, 0.0) >= policy.op_shift_seconds:
            return True
    if drift.wasserstein < policy.min_wasserstein_seconds:
        return False
    if drift.ks >= policy.ks:
        return True
    far = peers.wasserstein is not None and drift.wasserstein >= policy.far_factor * max(
        peers.wasserstein, policy.min_wasserstein_seconds
    )
    return drift.ks >= policy.partial_ks and far


def ild_drifts(snapshot: Snapshot) -> dict[str, dict[int, IldDrift]]:
    """Distribution -> live rank -> its drift, for the ranks that export one."""
    found: dict[str, dict[int, IldDrift]] = {}
    for record in sorted(snapshot.ranks.values(), key=lambda r: r.rank):
        if not record.up:
            continue
        for distribution, ks in sorted(record.ild_ks.items()):
            found.setdefault(distribution, {})[record.rank] = IldDrift(
                ks,
                record.ild_wasserstein.get(distribution, 0.0),
                record.ild_op_shift.get(distribution),
            )
    return found


def ild_verdicts(snapshot: Snapshot, policy: IldPolicy) -> list[Verdict]:
    """Shifted on a minority of ranks -> those ranks (their host); on most or all -> the job."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    job_wide: dict[str, tuple[tuple[int, ...], int]] = {}
    drifts = ild_drifts(snapshot)
    for distribution, per_rank in drifts.items():
        peers = IldPeers.of(per_rank.values())
        shifted = tuple(rank for rank, d in per_rank.items() if ild_shifted(d, peers, policy))
        if not shifted:
            continue
        if len(shifted) * 2 < len(per_rank):
            by_ranks.setdefault(shifted, []).append(distribution)
        else:
            job_wide[distribution] = (shifted, len(per_rank))
    verdicts = []
    for ranks, distributions in by_ranks.items():
        evidence = _ild_evidence(drifts, ranks, distributions, policy)
        first = drifts[distributions[0]][ranks[0]]
        verdicts.append(
            Verdict(
                "ild_regression",
                ranks,
                "rank",
                f"rank {_names(ranks)}: {' and '.join(_ild_name(d) for d in distributions)} shifted from "
                f"its baseline (KS {first.ks:.2f}, W1 {_seconds(first.wasserstein)}"
                + (f", every op +{_seconds(first.op_shift)}" if first.op_shift is not None else "")
                + f") while the other "
                f"{len(drifts[distributions[0]]) - len(ranks)} ranks' did not: a host-side slowdown there",
                evidence,
            )
        )
    for distribution, (ranks, count) in job_wide.items():
        evidence = _ild_evidence(drifts, ranks, [distribution], policy)
        evidence["ranks_with_data"] = count
        which = "every rank" if len(ranks) == count else f"{len(ranks)} of {count} ranks"
        verdicts.append(
            Verdict(
                "ild_regression",
                (),
                "job",
                f"{_ild_name(distribution)} shifted from the baseline on {which}: a job-wide change "
                "(software, driver, configuration, input)",
                evidence,
            )
        )
    return verdicts


def _ild_evidence(
    drifts: dict[str, dict[int, IldDrift]],
    ranks: tuple[int, ...],
    distributions: list[str],
    policy: IldPolicy,
) -> dict[str, Any]:
    return {
        "distributions": list(distributions),
        "ks_threshold": policy.ks,
        "op_shift_threshold_seconds": policy.op_shift_seconds,
        "shifted": {
            str(rank): {
                distribution: {
                    "ks": round(drifts[distribution][rank].ks, 4),
                    "wasserstein_seconds": drifts[distribution][rank].wasserstein,
                    "op_shift_seconds": drifts[distribution][rank].op_shift,
                }
                for distribution in distributions
            }
            for rank in ranks
        },
        "median_ks": {
            distribution: round(statistics.median(d.ks for d in drifts[distribution].values()), 4)
            for distribution in distributions
        },
        "median_wasserstein_seconds": {
            distribution: statistics.median(d.wasserstein for d in drifts[distribution].values())
            for distribution in distributions
        },
        "median_op_shift_seconds": {
            distribution: IldPeers.of(drifts[distribution].values()).op_shift
            for distribution in distributions
        },
    }


def _ild_name(distribution: str) -> str:
    if distribution == "host_gap":
        return "the training thread's time between ops (host gaps)"
    return distribution.replace("_", " ") + " latency"


def _seconds(value: float) -> str:
    return f"{value * 1e6:.1f} µs" if value < 1e-3 else f"{value * 1e3:.2f} ms"


# ---------------------------------------------------------------------------------------------------------
# the hardware canary


def canary_verdicts(snapshot: Snapshot) -> list[Verdict]:
    """The checks of the hardware canary that live ranks failed (canary.canary_faults): a verdict per rank
    set, host or link, naming the measurement, its value and its baseline (the job's median, or the rank's
    own preflight value)."""
    live = (
        (record.rank, record.host, record.canary)
        for record in sorted(snapshot.ranks.values(), key=lambda r: r.rank)
        if record.canary is not None and not record.gone
    )
    return [
        Verdict("canary", fault.ranks, fault.domain, canary_summary(fault), canary_evidence(fault))
        for fault in canary_faults(live)
    ]


# ---------------------------------------------------------------------------------------------------------
# hosts


def host_verdict(snapshot: Snapshot, verdict: Verdict) -> Verdict:
    """A verdict whose several culprits all share one host becomes a host_fault verdict (but a canary's,
    which names its host or link itself, below the hangs it must not mask, and a deadlock's, whose ranks wait
    for each other wherever they run)."""
    if len(verdict.ranks) < 2 or verdict.kind == "canary" or verdict.evidence.get("deadlock"):
        return verdict
    if verdict.severity == WARNING:  # already the host's (host_load.py)
        return verdict
    hosts = {snapshot.ranks[rank].host for rank in verdict.ranks}
    if len(hosts) != 1 or "" in hosts:
        return verdict
    host = hosts.pop()
    on_host = sorted(record.rank for record in snapshot.ranks.values() if record.host == host)
    return Verdict(
        "host_fault",
        verdict.ranks,
        "host",
        f"host {host}: {verdict.summary}",
        {"host": host, "ranks_on_host": on_host, "kind": verdict.kind, "because": verdict.evidence},
        verdict.group,
        verdict.cause,
    )


def _names(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))


def age_of(snapshot: Snapshot, timestamp: float | None) -> float | None:
    """Seconds from `timestamp` (Unix time) to the snapshot's time, or None."""
    return None if timestamp is None else round(snapshot.now - timestamp, 3)
