"""The hang rules (diagnosis.py's docstring, 2 to 4): hung groups, the ranks behind them and the chains they
start, collectives that differ across ranks, and sends and receives that wait for a peer (wait_for.py). Pure
functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..group_roles import group_role
from .rule_types import GroupState, InFlight, Snapshot, Verdict, age_of, rank_list
from .wait_for import WaitGraph, point_to_point_edges, wait_graph


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
    """The verdict on a hung group, by the first hang rule that fits (diagnosis.py's docstring, 2 to 4): most
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
        f"rank {rank_list(ahead)} issued collective {hang.max_issued} in group {hang.name}, which the "
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
    never_issued = f"rank {rank_list(culprits)} never issued it"
    if not set(culprits) <= set(hang.members):  # the chain left the group: say who waits for whom
        never_issued = f"rank {rank_list(behind)} never issued it, waiting for rank {rank_list(culprits)}"
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
            f"{rank_list(not_started)} (its stream is blocked by its own earlier work), "
            "the others wait in it",
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
    """A hung group with a gone member (of `gone`, diagnosis.gone_ranks): the rank_down verdict explains
    it."""
    return not gone.isdisjoint(hang.members)


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
    behind_it = f"; rank {rank_list(held_up)} wait for them" if held_up else ""
    return Verdict(
        "hang",
        cycle,
        "rank",
        f"deadlock: ranks {rank_list(cycle)} wait for each other ({how}){behind_it}",
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
