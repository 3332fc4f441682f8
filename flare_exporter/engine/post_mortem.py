"""Post-mortem: which rank ended a run that is gone, and why. Pure functions over each rank's last word.

When every rank of a run is gone, nothing answers; what is left is each rank's last word: the last values
Prometheus scraped of it (history_source.py), or the incident file it wrote (incident_source.py). The rules
(docs/diagnosis.md, "A run that is gone"), most telling first:

1. A rank that raised an exception of its own (not what a survivor of a lost peer raises: a connection reset,
   a collective timeout; see flare_exporter.causes) -> `rank_down`, its cause from the exception's root
   cause (out_of_memory, storage, data_stall, software_exception); the earliest of them first.
2. Else the ranks gone without a word (no exception, no termination signal, no normal exit) while others
   left one -> `rank_down`, cause node_failure (killed, frozen, host lost). Several of them on one host (or
   switch, rack) -> `host_fault`, the shared domain.
3. Else the collectives each rank had in flight at the end, judged as a live hang is (hang_verdicts.py): ranks
   behind their group's highest issued number, or the same number with another op or size ->
   `hang` or `mismatch` (collective_mismatch).
   Only where some rank failed (a timeout, a reset): a run that ended normally was last scraped at
   different moments of its last collectives.
4. Else, if ranks failed in their collectives with no origin in sight -> `hang`, cause communication,
   domain job. A run whose ranks all ended normally, or were all stopped by their launcher, has no verdict.

Secondary failures (a peer's connection reset, a timeout, the launcher's SIGTERM to the survivors) are
evidence in the timeline, never the culprit.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import causes
from ..causes import Cause
from .hang_verdicts import explain_hang, hung_groups, point_to_point_verdicts
from .rule_types import GroupState, InFlight, RankRecord, Snapshot, Verdict
from .verdict_terms import Domain

TOPOLOGY_DOMAINS: tuple[Domain, ...] = ("host", "switch", "rack")  # the shared fault domains, narrowest first


@dataclass(frozen=True)
class ExceptionWord:
    """The exception that ended a rank: its type, cause, Unix time, and root cause where one is known."""

    type: str
    cause: Cause
    at: float | None = None
    root_type: str = ""
    root_message: str = ""

    @property
    def secondary(self) -> bool:
        return causes.is_secondary(self.cause)


@dataclass(frozen=True)
class Termination:
    """A signal that ended a rank: which, who sent it (`launcher` or `unknown`), and when."""

    signal: str
    sender: str = "unknown"
    at: float | None = None


@dataclass(frozen=True)
class LastWord:
    """What one rank left behind. Absent numbers are None; `last_seen` is when it was last heard of."""

    rank: int
    host: str = ""
    topology: Mapping[str, str] = field(default_factory=dict)  # switch, rack
    last_seen: float | None = None
    heartbeat: float | None = None
    steps: float | None = None
    groups: Mapping[str, GroupState] = field(default_factory=dict)
    exception: ExceptionWord | None = None
    terminated: Termination | None = None
    exited: bool = False  # it ended normally (its incident file says so)
    frames: str = ""
    sources: tuple[str, ...] = ()  # where the word was read: prometheus, incident

    @property
    def silent(self) -> bool:
        """Gone without a word: no exception, no termination signal, no normal exit."""
        return self.exception is None and self.terminated is None and not self.exited

    def domain(self, name: str) -> str:
        return self.host if name == "host" else self.topology.get(name, "")


@dataclass(frozen=True)
class DeadRun:
    """Every rank's last word of one run; `world_size` ranks were in it (a rank with no word at all is
    absent from `ranks`)."""

    run: str
    world_size: int
    ranks: Mapping[int, LastWord]
    source: str = ""

    def every_rank(self) -> dict[int, LastWord]:
        """Every rank of the world, a rank nothing was read of as a silent LastWord."""
        size = max(self.world_size, max(self.ranks, default=-1) + 1)
        return {rank: self.ranks.get(rank, LastWord(rank)) for rank in range(size)}

    @property
    def ended_at(self) -> float | None:
        times = [time for word in self.ranks.values() for time in _times(word)]
        return max(times) if times else None


def post_mortem(run: DeadRun) -> list[Verdict]:
    """The verdicts over a dead run's last words: at most one, with its cause and timeline (see above)."""
    words = run.every_rank()
    if not words:
        return []
    verdict = _first_exception(words) or _gone_silent(words) or _mismatched_collective(words)
    verdict = verdict or _in_flight_at_the_end(run, words) or _failed_in_collectives(words)
    if verdict is None:
        return []
    verdict = _shared_domain(verdict, words)
    evidence = {**verdict.evidence, "timeline": timeline(words), "behind_at_the_end": behind_at(words)}
    return [dataclasses.replace(verdict, evidence=evidence)]


def _first_exception(words: Mapping[int, LastWord]) -> Verdict | None:
    """Rule 1: the earliest rank to raise an exception of its own (not a survivor's), and its cause."""
    primaries = [word for word in words.values() if word.exception and not word.exception.secondary]
    if not primaries:
        return None
    first = min(primaries, key=_raised_first)
    raised = first.exception
    assert raised is not None
    root = f": {raised.root_type}: {raised.root_message}" if raised.root_type else ""
    followers = sorted(rank for rank in words if rank != first.rank)
    summary = f"rank {first.rank} raised {raised.type} ({raised.cause}){root}"
    if followers:
        summary += f"; ranks {_names(followers)} ended after it"
    evidence = {
        "exception": {"type": raised.type, "cause": raised.cause, "at": raised.at},
        "root_cause": {"type": raised.root_type, "message": raised.root_message}
        if raised.root_type
        else None,
        "also_raised": {str(word.rank): _raised(word) for word in primaries if word is not first},
        "followed_by": followers,
    }
    return Verdict("rank_down", (first.rank,), "rank", summary, evidence, cause=raised.cause)


def _gone_silent(words: Mapping[int, LastWord]) -> Verdict | None:
    """Rule 2: the ranks that vanished without a word while others left one (killed, frozen, host lost)."""
    silent = sorted(rank for rank, word in words.items() if word.silent)
    spoke = [word for word in words.values() if word.exception is not None or word.terminated is not None]
    if not silent or not spoke:
        return None
    followers = sorted(rank for rank in words if rank not in silent)
    noun = "rank" if len(silent) == 1 else "ranks"
    summary = f"{noun} {_names(silent)} vanished without a word (killed, frozen or its host lost)"
    summary += f"; ranks {_names(followers)} failed or were stopped after it" if followers else ""
    evidence = {
        "last_seen": {str(rank): words[rank].last_seen for rank in silent},
        "followed_by": followers,
    }
    return Verdict("rank_down", tuple(silent), "rank", summary, evidence, cause="node_failure")


def _mismatched_collective(words: Mapping[int, LastWord]) -> Verdict | None:
    """Rule 3, first: ranks that failed with different collectives in flight at the same number of a group
    -> `mismatch`, the odd ones out by majority. A mismatched pair may still complete on some ranks (gloo
    pairs what it can), which then run ahead: the number they differ at names the culprit, not the lead."""
    if not any(word.exception for word in words.values()):
        return None
    for group in sorted({name for word in words.values() for name in word.groups}):
        by_number: dict[int, dict[int, InFlight]] = defaultdict(dict)
        for rank, word in words.items():
            flight = word.groups[group].in_flight if group in word.groups else None
            if flight is not None and flight.seq:
                by_number[flight.seq][rank] = flight
        for number, inside in sorted(by_number.items()):
            odd = _odd_ones_out(inside)
            if odd:
                return _mismatch_verdict(group, number, inside, odd)
    return None


def _odd_ones_out(inside: Mapping[int, InFlight]) -> list[int]:
    """The ranks whose (op, size) differs from a strict majority's; none without one."""
    signatures = Counter((flight.op, flight.nbytes) for flight in inside.values())
    if len(signatures) < 2:
        return []
    (majority, count), (_, runner_up) = signatures.most_common(2)
    if count == runner_up:
        return []
    return sorted(rank for rank, flight in inside.items() if (flight.op, flight.nbytes) != majority)


def _mismatch_verdict(group: str, number: int, inside: Mapping[int, InFlight], odd: list[int]) -> Verdict:
    majority = next(flight for rank, flight in sorted(inside.items()) if rank not in odd)
    others = "; ".join(f"rank {rank}: {inside[rank].op} of {inside[rank].nbytes} bytes" for rank in odd)
    summary = (
        f"collective {number} in group {group} differed when the run failed: "
        f"{len(inside) - len(odd)} ranks had {majority.op} of {majority.nbytes} bytes in flight, but {others}"
    )
    evidence = {
        "in_flight": {str(rank): {"op": f.op, "seq": f.seq, "bytes": f.nbytes} for rank, f in inside.items()}
    }
    return Verdict("mismatch", tuple(odd), "rank", summary, evidence, group, cause="collective_mismatch")


def _in_flight_at_the_end(run: DeadRun, words: Mapping[int, LastWord]) -> Verdict | None:
    """Rule 3: the live hang rules over the collectives each rank had in flight when it was last heard of:
    a rank behind its group, or a mismatched collective."""
    at = run.ended_at
    if at is None or not any(word.exception for word in words.values()):
        return None  # no rank failed: what ranks had in flight when last scraped is no evidence
    records = {
        rank: RankRecord(rank, host=word.host, steps=word.steps, heartbeat=word.heartbeat, groups=word.groups)
        for rank, word in words.items()
        if word.groups
    }
    snapshot = Snapshot(records, at, run.run, run.world_size)
    for hang in hung_groups(snapshot, 0.0):
        verdict = explain_hang(snapshot, hang)
        if verdict.kind in ("hang", "mismatch") and verdict.domain == "rank":
            cause: Cause = "collective_mismatch" if verdict.kind == "mismatch" else "deadlock"
            return dataclasses.replace(verdict, cause=cause)
    for verdict in point_to_point_verdicts(snapshot, 0.0, set()):  # a send or receive its peer never met
        return dataclasses.replace(verdict, cause="deadlock")
    return None


def _failed_in_collectives(words: Mapping[int, LastWord]) -> Verdict | None:
    """Rule 4: every exception a survivor's (a timeout, a reset), no origin in sight: communication."""
    raised = [word for word in words.values() if word.exception is not None]
    if not raised:
        return None
    first = min(raised, key=_raised_first)
    ranks = tuple(sorted(word.rank for word in raised))
    summary = (
        f"ranks {_names(list(ranks))} failed in their collectives "
        f"(first: rank {first.rank}, {_raised(first)}); no rank went first"
    )
    evidence = {"raised": {str(word.rank): _raised(word) for word in raised}}
    return Verdict("hang", ranks, "job", summary, evidence, cause="communication")


def _shared_domain(verdict: Verdict, words: Mapping[int, LastWord]) -> Verdict:
    """Several culprits on one host (or switch, rack): the shared domain is the verdict."""
    if len(verdict.ranks) < 2:
        return verdict
    for domain in TOPOLOGY_DOMAINS:
        shared = {words[rank].domain(domain) for rank in verdict.ranks}
        if len(shared) == 1 and "" not in shared:
            (name,) = shared
            summary = f"{domain} {name}: {verdict.summary}"
            evidence = {**verdict.evidence, domain: name}
            kind = "host_fault" if verdict.kind == "rank_down" else verdict.kind
            return dataclasses.replace(verdict, kind=kind, domain=domain, summary=summary, evidence=evidence)
    return verdict


def timeline(words: Mapping[int, LastWord]) -> list[dict[str, Any]]:
    """Who stopped when: each rank's exception, termination, normal exit and last sighting, by time."""
    events = []
    for rank, word in words.items():
        if word.exception is not None:
            events.append((word.exception.at, rank, f"raised {word.exception.type} ({word.exception.cause})"))
        if word.terminated is not None:
            by = " from its launcher" if word.terminated.sender == "launcher" else ""
            events.append((word.terminated.at, rank, f"got {word.terminated.signal}{by}"))
        if word.exited:
            events.append((word.last_seen, rank, "ended normally"))
        elif word.silent:
            events.append((word.last_seen, rank, "last heard of" if word.sources else "never heard of"))
    ordered = sorted(events, key=lambda event: (_or_inf(event[0]), event[1]))
    return [{"timestamp_seconds": at, "rank": rank, "event": text} for at, rank, text in ordered]


def behind_at(words: Mapping[int, LastWord]) -> dict[str, list[int]]:
    """Per group, the ranks whose last issued number is below the group's highest at the end."""
    issued: dict[str, dict[int, int]] = {}
    for rank, word in words.items():
        for name, state in word.groups.items():
            issued.setdefault(name, {})[rank] = state.last_issued
    behind = {
        name: sorted(rank for rank, number in numbers.items() if number < max(numbers.values()))
        for name, numbers in sorted(issued.items())
    }
    return {name: ranks for name, ranks in behind.items() if ranks}


def _times(word: LastWord) -> list[float]:
    found = [word.last_seen, word.heartbeat]
    found += [word.exception.at if word.exception else None, word.terminated.at if word.terminated else None]
    return [time for time in found if time is not None]


def _raised_first(word: LastWord) -> tuple[float, int]:
    """Sort key: the earliest exception first (one of unknown time last), then by rank."""
    return (_or_inf(word.exception.at if word.exception else None), word.rank)


def _raised(word: LastWord) -> str:
    return word.exception.type if word.exception else ""


def _or_inf(value: float | None) -> float:
    return math.inf if value is None else value


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def merge_runs(runs: list[DeadRun]) -> DeadRun:
    """One run's last words from several sources (Prometheus's history, incident files): per rank, what a
    rank wrote itself (an incident file: root cause, normal exit) over what was scraped of it, the latest
    sighting of either."""
    first = runs[0]
    words: dict[int, LastWord] = {}
    for run in sorted(runs, key=lambda run: "incidents" in run.source):  # incident files last: they win
        for rank, word in run.ranks.items():
            words[rank] = _merged(words[rank], word) if rank in words else word
    world_size = max(run.world_size for run in runs)
    return DeadRun(first.run, world_size, words, " and ".join(run.source for run in runs))


def _merged(scraped: LastWord, written: LastWord) -> LastWord:
    """`written`'s fields where it has them, else `scraped`'s; the later sighting; both sources."""
    sightings = [time for time in (scraped.last_seen, written.last_seen) if time is not None]
    exception = written.exception or scraped.exception
    if written.exception and scraped.exception and not written.exception.at:
        exception = dataclasses.replace(written.exception, at=scraped.exception.at)
    return dataclasses.replace(
        written,
        host=written.host or scraped.host,
        topology=written.topology or scraped.topology,
        last_seen=max(sightings) if sightings else None,
        heartbeat=written.heartbeat or scraped.heartbeat,
        steps=written.steps if written.steps is not None else scraped.steps,
        groups=written.groups or scraped.groups,
        exception=exception,
        terminated=written.terminated or scraped.terminated,
        sources=tuple(dict.fromkeys(scraped.sources + written.sources)),
    )
