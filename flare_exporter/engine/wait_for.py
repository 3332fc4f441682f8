"""The wait-for graph of a stalled job: each waiting rank points at the ranks it waits for. Pure functions.

A rank waits for:
- in a collective of group G: the members of G that have not issued it (their last issued number is below
  its number), and the members of G that are gone;
- in a receive from a peer: the peer, if the peer has not issued the matching send; in a send, the peer, if
  it has not issued the matching receive (gloo's and NCCL's sends complete only once the peer receives).
  Sends and receives match by count, as the flight recorder's p2p_seq_id: a rank's n-th send to a peer
  meets the peer's n-th receive from it. Where the peer issued its side, both are inside the transfer, and
  the rank waits for nobody it could name.

Following the edges from the ranks that have waited longest ends either at a rank that waits for nobody
(computing, stuck in its own code, stopped, gone): the culprit; or in a cycle whose ranks wait for each
other and for nobody outside it: a deadlock, named by its members.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

# rule_types.py defines what it reads (hang_verdicts.py uses this module): a Snapshot (its ranks, live_states
# and members) and a RankRecord (its rank, gone and groups: GroupState with in_flight and p2p, a
# PointToPoint).
Snapshot = Any
RankRecord = Any

OPPOSITE = {"send": "recv", "recv": "send"}


class Edge(NamedTuple):
    """`rank` waits for `waits_on`, in `group`, in a `how` (collective, send or recv) issued at `since`."""

    rank: int
    waits_on: int
    group: str
    how: str
    since: float

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "rank": self.rank,
            "waits_on": self.waits_on,
            "group": self.group,
            "in": self.how,
            "age_seconds": round(now - self.since, 3),
        }


def edges_of(snapshot: Snapshot, rank: int) -> list[Edge]:
    """Whom `rank` waits for now: in its collectives and its oldest sends and receives in flight."""
    record = snapshot.ranks.get(rank)
    if record is None or record.gone:
        return []
    edges = []
    for name, state in sorted(record.groups.items()):
        flight = state.in_flight
        if flight is not None:
            edges += [
                Edge(rank, other, name, "collective", flight.started_at)
                for other in _not_issued(snapshot, name, flight.seq)
            ]
        edges += point_to_point_edges(snapshot, record, name)
    return edges


def point_to_point_edges(snapshot: Snapshot, record: RankRecord, group: str) -> list[Edge]:
    """Whom `record`'s sends and receives in flight in `group` wait for: for the oldest to or from each
    peer, the peer, where it is gone or has not issued the matching op."""
    state = record.groups.get(group)
    if state is None or state.p2p is None:
        return []
    return [
        Edge(record.rank, peer, group, direction, since)
        for direction, peer, since in state.p2p.in_flight
        if _waits_for_peer(snapshot, record, group, direction, peer)
    ]


def _waits_for_peer(snapshot: Snapshot, record: RankRecord, group: str, direction: str, peer: int) -> bool:
    """Whether `record`'s oldest op of `direction` in flight with `peer` waits for it: the peer is gone or
    has not issued the matching op (a receive from any source waits for whoever sends first: no one)."""
    if peer < 0 or peer == record.rank:
        return False
    other = snapshot.ranks.get(peer)
    if other is None or other.gone:
        return True
    theirs = other.groups.get(group)
    mine = record.groups[group].p2p
    if theirs is None or theirs.p2p is None or mine is None:
        return True
    number = mine.completed.get((direction, peer), 0) + 1  # the op in flight: the next after those done
    return theirs.p2p.issued.get((OPPOSITE.get(direction, ""), record.rank), 0) < number


def _not_issued(snapshot: Snapshot, group: str, seq: int) -> list[int]:
    """The members of `group` gone, or live and judged (scraped since the group's newest issue) with a last
    issued number below `seq` (0: below the group's top)."""
    live = snapshot.live_states.get(group, ())
    top = seq or max((state.last_issued for _, state in live), default=0)
    behind = [rank for rank, state in live if state.last_issued < top and not state.seen_before_stall]
    gone = [rank for rank in snapshot.members.get(group, ()) if snapshot.ranks[rank].gone]
    return sorted(set(behind) | set(gone))


class WaitGraph(NamedTuple):
    """The edges reachable from the waiting ranks, where their chains end, and the cycles among them."""

    edges: list[Edge]
    ends: list[int]  # ranks that wait for nobody, reached from a waiting rank
    cycles: list[tuple[int, ...]]  # sets of ranks that wait only for each other (deadlocks), sorted

    def held_up_by(self, ranks: Iterable[int]) -> list[Edge]:
        """The edges of every rank whose chain leads to `ranks` (theirs included)."""
        targets = set(ranks)
        reaching = set(targets)
        grew = True
        while grew:
            grew = False
            for edge in self.edges:
                if edge.waits_on in reaching and edge.rank not in reaching:
                    reaching.add(edge.rank)
                    grew = True
        return [edge for edge in self.edges if edge.waits_on in reaching]


def wait_graph(snapshot: Snapshot, waiting: Iterable[int]) -> WaitGraph:
    """Follow the edges from the `waiting` ranks to where they end: ranks that wait for nobody, and
    cycles (strongly connected sets with no edge out of them)."""
    edges: list[Edge] = []
    out: dict[int, set[int]] = {}
    todo = sorted(set(waiting))
    while todo:
        rank = todo.pop()
        if rank in out:
            continue
        found = edges_of(snapshot, rank)
        edges += found
        out[rank] = {edge.waits_on for edge in found}
        todo += [other for other in out[rank] if other not in out]
    components = _strongly_connected(out)
    ends, cycles = [], []
    for component in components:
        leaves = any(out[rank] - component for rank in component)
        if leaves:
            continue
        if len(component) == 1 and not out[next(iter(component))]:
            ends.append(next(iter(component)))
        else:
            cycles.append(tuple(sorted(component)))
    return WaitGraph(edges, sorted(ends), sorted(cycles))


def _strongly_connected(out: dict[int, set[int]]) -> list[set[int]]:
    """Tarjan's strongly connected components of the graph `out` (rank -> ranks it waits for), iteratively:
    a chain may be thousands of ranks long."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    components: list[set[int]] = []
    for root in sorted(out):
        if root in index:
            continue
        work = [(root, iter(sorted(out[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(out.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components
