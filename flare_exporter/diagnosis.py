"""The rules engine: a snapshot of every rank's state in, verdicts out. Pure functions, no I/O.

A Snapshot comes from Prometheus or from scraping the ranks (sources.py); the rules follow DESIGN.md's
"Attribution", most severe first:

1. Ranks that are gone (endpoint down or missing, or an exception recorded) -> `rank_down`.
2. A group is hung when one of its ranks has had a collective unfinished for `hang_seconds`. Then:
   ranks behind the group's highest issued sequence number never reached the collective -> `hang` with
   them as culprits; a culprit that itself waits in another group is followed into that group, until the
   chain ends at a rank that waits on nobody. If most ranks are "behind" one rank, that rank issued a
   collective the others never will -> `mismatch`.
3. Every rank at the same sequence number, but with different ops or sizes in flight -> `mismatch`, the
   odd ones out by majority.
4. Every rank inside the collective: ranks whose collective has not started on the device while others'
   has -> `hang` with them as culprits; otherwise a communication fault in the group (`hang`, domain group).
5. Several culprits of one verdict on one host -> `host_fault`, domain host.
Straggler: with no hang, the rank that waits least in collectives per step, far below the median
(median/MAD) -> `straggler`.

No rank is presumed healthy: decisions go by the evidence and by majority.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

# Verdict kinds, most severe first. ild_regression is produced once the ILD signals exist (issue 6).
KINDS = ("host_fault", "rank_down", "mismatch", "hang", "straggler", "ild_regression")
DOMAINS = ("rank", "host", "group", "job")


@dataclass(frozen=True)
class InFlight:
    """A group's oldest unfinished collective on one rank."""

    op: str
    seq: int
    nbytes: int
    state: str  # issued | started
    started_at: float  # Unix time it was issued


@dataclass(frozen=True)
class GroupState:
    """One rank's view of one process group."""

    last_issued: int = 0
    last_completed: int = 0
    in_flight: InFlight | None = None


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
    collective_seconds: float | None = None  # time in collectives over the window (stragglers)
    step_seconds: float | None = None  # time in steps over the window
    step_count: float | None = None  # steps over the window

    @property
    def gone(self) -> bool:
        return not self.up or bool(self.exception)


@dataclass(frozen=True)
class Snapshot:
    """Every rank of one run at one moment (`now`, Unix time), from one source."""

    ranks: Mapping[int, RankRecord]
    now: float
    run: str = ""
    world_size: int = 0
    group_sizes: Mapping[str, int] = field(default_factory=dict)

    @cached_property
    def members(self) -> dict[str, tuple[int, ...]]:
        """Group -> its ranks (see members_of), indexed once: rules ask per group; groups grow with ranks."""
        found: dict[str, list[int]] = {}
        for record in sorted(self.ranks.values(), key=lambda r: r.rank):
            names = set(record.groups) or ({"world"} if record.gone else set())
            for name in names:
                found.setdefault(name, []).append(record.rank)
        return {name: tuple(ranks) for name, ranks in found.items()}

    @property
    def ranks_seen(self) -> int:
        return sum(1 for record in self.ranks.values() if record.up)


@dataclass(frozen=True)
class Verdict:
    kind: str
    ranks: tuple[int, ...]
    domain: str
    summary: str
    evidence: dict[str, Any]
    group: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "domain": self.domain,
            "group": self.group,
            "summary": self.summary,
            "evidence": self.evidence,
        }


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank that waits least counts as a straggler."""

    min_ranks: int = 3
    min_steps: float = 10
    robust_z: float = 5.0  # distance below the median wait, in MADs (scaled to a standard deviation)
    min_share_of_step: float = 0.25  # ... and at least this share of the median step time


@dataclass(frozen=True)
class GroupHang:
    """A hung group: its members and the numbers that say so."""

    name: str
    members: tuple[int, ...]
    oldest_age: float
    max_issued: int


def diagnose(
    snapshot: Snapshot, hang_seconds: float, stragglers: StragglerPolicy = StragglerPolicy()
) -> list[Verdict]:
    """All verdicts for the snapshot, most severe first."""
    hangs = hung_groups(snapshot, hang_seconds)
    verdicts: list[Verdict] = []
    down = gone_ranks(snapshot)
    if down:
        verdicts.append(rank_down_verdict(snapshot, down, hangs))
    down_set = set(down)
    for hang in hangs:
        if down_set & set(hang.members):
            continue  # the rank_down verdict explains it
        verdicts.append(explain_hang(snapshot, hang))
    if not verdicts:
        verdicts.extend(straggler_verdicts(snapshot, stragglers))
    verdicts = [host_verdict(snapshot, verdict) for verdict in verdicts]
    return sorted(_unique(verdicts), key=lambda verdict: KINDS.index(verdict.kind))


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
    names = sorted({name for record in snapshot.ranks.values() if record.up for name in record.groups})
    hangs = []
    for name in names:
        members = members_of(snapshot, name)
        live = [snapshot.ranks[rank] for rank in members if snapshot.ranks[rank].up]
        ages = [
            snapshot.now - state.in_flight.started_at
            for record in live
            if (state := record.groups.get(name)) is not None and state.in_flight is not None
        ]
        if ages and max(ages) >= hang_seconds:
            max_issued = max(record.groups[name].last_issued for record in live if name in record.groups)
            hangs.append(GroupHang(name, members, max(ages), max_issued))
    return hangs


def explain_hang(snapshot: Snapshot, hang: GroupHang) -> Verdict:
    live = [snapshot.ranks[rank] for rank in hang.members if snapshot.ranks[rank].up]
    live = [record for record in live if hang.name in record.groups]
    issued = {record.rank: record.groups[hang.name].last_issued for record in live}
    behind = sorted(rank for rank, seq in issued.items() if seq < hang.max_issued)
    evidence: dict[str, Any] = {
        "oldest_in_flight_seconds": round(hang.oldest_age, 3),
        "max_issued_seq": hang.max_issued,
        "last_issued_seq": {str(rank): seq for rank, seq in sorted(issued.items())},
    }
    if behind and len(behind) * 2 > len(live):
        ahead = sorted(set(issued) - set(behind))
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
    if behind:
        culprits, chain = follow_chain(snapshot, hang.name, behind)
        evidence["chain"] = chain
        if not culprits:  # every hop waits on another: a deadlock across groups; all of them are suspects
            culprits = sorted({hop["rank"] for hop in chain})
            evidence["deadlock"] = True
        evidence["culprits"] = {str(rank): _rank_evidence(snapshot, rank) for rank in culprits}
        where = _where(snapshot, culprits[0])
        return Verdict(
            "hang",
            tuple(culprits),
            "rank",
            f"group {hang.name} has waited {hang.oldest_age:.0f} s for collective {hang.max_issued}; "
            f"rank {_names(culprits)} never issued it{where}",
            evidence,
            hang.name,
        )
    at_seq = {
        record.rank: state.in_flight
        for record in live
        if (state := record.groups[hang.name]).in_flight is not None
        and state.in_flight.seq == hang.max_issued
    }
    evidence["in_flight"] = _in_flight_evidence(snapshot, sorted(at_seq), hang.name)
    signatures = Counter((flight.op, flight.nbytes) for flight in at_seq.values())
    if len(signatures) > 1:
        (majority, count), (_, runner_up) = signatures.most_common(2)
        odd = sorted(rank for rank, flight in at_seq.items() if (flight.op, flight.nbytes) != majority)
        if count == runner_up:
            odd = sorted(at_seq)  # no majority: every rank is a suspect
        issued_by_odd = ", ".join(
            f"rank {rank}: {at_seq[rank].op} of {at_seq[rank].nbytes} bytes" for rank in odd
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
    states = {rank: flight.state for rank, flight in at_seq.items()}
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
        chain.append({"group": from_group, "rank": rank, "waits_in": waits_in})
        laggards = []
        for name in waits_in:
            members = [snapshot.ranks[r] for r in members_of(snapshot, name)]
            live = [m for m in members if m.up and name in m.groups]
            top = max(m.groups[name].last_issued for m in live)
            laggards += [(name, m.rank) for m in live if m.groups[name].last_issued < top]
            laggards += [(name, m.rank) for m in members if m.gone]
        if not laggards:
            if rank not in culprits:
                culprits.append(rank)
            continue
        todo.extend(laggards)
    return sorted(culprits), chain


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


def straggler_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
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
# hosts


def host_verdict(snapshot: Snapshot, verdict: Verdict) -> Verdict:
    """A verdict whose several culprits all share one host becomes a host_fault verdict."""
    if len(verdict.ranks) < 2:
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
    )


def _names(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))


def age_of(snapshot: Snapshot, timestamp: float | None) -> float | None:
    """Seconds from `timestamp` (Unix time) to the snapshot's time, or None."""
    return None if timestamp is None else round(snapshot.now - timestamp, 3)
