"""The rules engine: a snapshot of every rank's state in, verdicts out. Pure functions, no I/O.

A Snapshot comes from Prometheus or from scraping the ranks (prometheus_source, scrape_source); the rules
(docs/diagnosis.md, "The rules") run most severe first:

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

Here: diagnose(), which applies the rules in that order, and the rules on gone ranks, the canary and hosts.
The others by concern: hang_verdicts.py (2 to 4), straggler_verdicts.py, ild_verdicts.py; what they read and
write (Snapshot, RankRecord, Verdict) in rule_types.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..policies import HostLoadPolicy, IldPolicy, StragglerPolicy
from .canary import canary_faults
from .canary import evidence as canary_evidence
from .canary import summary as canary_summary
from .hang_verdicts import (
    GroupHang,
    explain_hang,
    hung_groups,
    one_verdict_per_culprit,
    point_to_point_verdicts,
    waits_on_gone,
)
from .host_load import WARNING, judged_with_host_load
from .ild_verdicts import ild_verdicts
from .rule_types import RankRecord, Snapshot, Verdict, age_of, rank_list
from .straggler_verdicts import straggler_verdicts
from .verdict_causes import cause_of
from .verdict_terms import KINDS


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
        summary = f"ranks {rank_list(culprits)} are gone ({reasons})"
    if followers:
        summary += f"; rank {rank_list(followers)} failed after it"
    if evidence["hung_groups"]:
        summary += f"; group {', '.join(evidence['hung_groups'])} waits on it"
    return Verdict("rank_down", tuple(culprits), "rank", summary, evidence)


def _gone_reason(record: RankRecord) -> str:
    if record.exception:
        return f"raised {record.exception}"
    return record.down_reason or "not answering"


# ---------------------------------------------------------------------------------------------------------
# what the hang rules read (a source's rounds)


class HangReads(NamedTuple):
    """What the hang rules read of every member of a group (what_hang_rules_read)."""

    numbers: set[str]  # the groups of which they read each member's issued number
    flights: set[str]  # the groups of which they read which collective each member has in flight


def what_hang_rules_read(snapshot: Snapshot, hang_seconds: float) -> HangReads:
    """The groups whose members' issued numbers the hang rules read: each hung group, and every group a
    rank on a hang's chain waits in (hang_verdicts.follow_chain). A source that reads every member's number in
    each of these, and only these, gives the hang verdicts of the whole snapshot; on less, the chains found
    name the groups to read next.

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
