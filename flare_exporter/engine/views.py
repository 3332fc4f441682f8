"""The views of `flare ranks`, `flare hang` and `flare stragglers`: each turns a snapshot (and its verdicts)
into rows for JSON and lines for people; the verdict lines under them are cli.format_verdicts'. Runs in the
`flare` command.

At thousands of ranks `flare ranks` lists what matters first: --problems keeps the ranks that are down,
dying, behind in a hung group, stalled (their stack sampled after stall_seconds without progress, outside a
collective) or named by a verdict; --sort orders them (steps: fewest first; heartbeat and in-flight: oldest
first); --top N keeps the first N.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..group_roles import group_role
from . import hang_verdicts, straggler_verdicts, wait_for
from .rule_types import InFlight, RankRecord, Snapshot, Verdict, age_of


@dataclass(frozen=True)
class RankSelection:
    """Which rows `flare ranks` shows, in which order: --problems, --sort, --top (None: all)."""

    problems: bool = False
    sort: str = "rank"
    top: int | None = None


# --sort: the key of a row, smallest first (None last)
SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "rank": lambda row: row["rank"],
    "steps": lambda row: (row["steps"] is None, row["steps"] or 0.0, row["rank"]),
    "heartbeat": lambda row: (row["heartbeat_age_seconds"] is None, -(row["heartbeat_age_seconds"] or 0.0)),
    "in-flight": lambda row: (
        row["in_flight"] is None,
        -((row["in_flight"] or {}).get("age_seconds") or 0.0),
    ),
}


def ranks_view(
    snapshot: Snapshot,
    verdicts: Sequence[Verdict] = (),
    hang_seconds: float = math.inf,
    selection: RankSelection = RankSelection(),
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per rank (those `selection` keeps, in its order), each with the problems it has: down,
    dying, behind:GROUP (in a group hung by `hang_seconds`), stalled, named:KIND (by one of `verdicts`)."""
    found = rank_problems(snapshot, verdicts, hang_seconds)
    rows = [_rank_row(snapshot, record, found.get(record.rank, [])) for record in snapshot.ranks.values()]
    if selection.problems:
        rows = [row for row in rows if row["problems"]]
    rows.sort(key=SORTS[selection.sort])
    rows = rows[: selection.top]
    lines = [f"{'rank':>5} {'host':<14} {'steps':>7} {'heartbeat':>10}  {'in flight':<34} {'state':<8} doing"]
    for row in rows:
        if not row["up"]:
            lines.append(
                f"{row['rank']:>5} {row['host'] or '-':<14} {'-':>7} {'-':>10}  DOWN: {row['down_reason']}"
            )
            continue
        flight = row["in_flight"]
        in_flight = (
            "-"
            if flight is None
            else f"{flight['group']} {flight['op']} #{flight['seq']} {flight['age_seconds']:.1f}s"
        )
        doing = "-" if not row["activity"] else f"{row['activity']}: {row['frames']}"
        if row["down_reason"]:
            doing = f"DYING: {row['down_reason']}"
        lines.append(
            f"{row['rank']:>5} {row['host'] or '-':<14} {_int(row['steps']):>7} "
            f"{_seconds(row['heartbeat_age_seconds']):>10}  {in_flight:<34} "
            f"{'-' if flight is None else flight['state']:<8} {doing}"
        )
    return rows, lines


def _rank_row(snapshot: Snapshot, record: RankRecord, problems: list[str]) -> dict[str, Any]:
    flight_group, flight = _oldest_in_flight(record)
    return {
        "rank": record.rank,
        "host": record.host or None,
        "up": record.up,
        "down_reason": record.down_reason or (f"exception {record.exception}" if record.exception else None),
        "steps": record.steps,
        "heartbeat_age_seconds": age_of(snapshot, record.heartbeat),
        "in_flight": None
        if flight is None
        else {
            "group": flight_group,
            "op": flight.op,
            "seq": flight.seq,
            "state": flight.state,
            "age_seconds": age_of(snapshot, flight.started_at),
        },
        "activity": record.activity or None,
        "frames": record.frames or None,
        "problems": problems,
    }


def rank_problems(
    snapshot: Snapshot, verdicts: Iterable[Verdict], hang_seconds: float
) -> dict[int, list[str]]:
    """Rank -> what is wrong with it: down, dying (down with a reason while it answers), behind:GROUP in a
    hung group, stalled (it sampled its stack, no progress for stall_seconds, and is not waiting in a
    collective), named:KIND by a verdict."""
    found: dict[int, list[str]] = defaultdict(list)
    for record in snapshot.ranks.values():
        if not record.up:
            found[record.rank].append("down")
        elif record.down_reason or record.exception:
            found[record.rank].append("dying")
        if record.activity and record.activity != "collective":  # one waiting in a collective waits on others
            found[record.rank].append("stalled")
    for hang in hang_verdicts.hung_groups(snapshot, hang_seconds):
        for rank in hang_verdicts.below_top(snapshot, hang.name):
            found[rank].append(f"behind:{hang.name}")
    for verdict in verdicts:
        for rank in verdict.ranks:
            if f"named:{verdict.kind}" not in found[rank]:
                found[rank].append(f"named:{verdict.kind}")
    return found


def hang_view(snapshot: Snapshot, hang_seconds: float) -> tuple[list[dict[str, Any]], list[str]]:
    hung = {hang.name for hang in hang_verdicts.hung_groups(snapshot, hang_seconds)}
    names = sorted({name for record in snapshot.ranks.values() for name in record.groups})
    rows: list[dict[str, Any]] = []
    for name in names:
        members = hang_verdicts.members_of(snapshot, name)
        live = [
            snapshot.ranks[r] for r in members if snapshot.ranks[r].up and name in snapshot.ranks[r].groups
        ]
        issued = {record.rank: record.groups[name].last_issued for record in live}
        top = max(issued.values(), default=0)
        ages = [
            snapshot.now - flight.started_at
            for record in live
            if (flight := record.groups[name].in_flight) is not None
        ]
        rows.append(
            {
                "group": name,
                "role": group_role(name),
                "members": len(members),
                "down": [r for r in members if snapshot.ranks[r].gone],
                "max_issued_seq": top,
                "min_completed_seq": min((record.groups[name].last_completed for record in live), default=0),
                "oldest_in_flight_seconds": round(max(ages), 3) if ages else None,
                "behind": sorted(rank for rank, seq in issued.items() if seq < top),
                "hung": name in hung,
                "p2p_in_flight": _point_to_point_rows(snapshot, name, live),
            }
        )
    lines = [
        f"{'group':<36} {'role':<5} {'ranks':>5} {'issued':>7} {'completed':>9} {'in flight':>10}  state"
    ]
    for row in rows:
        state = "HUNG" if row["hung"] else "ok"
        if row["behind"]:
            state += f", behind: {_ranks(row['behind'])}"
        if row["down"]:
            state += f", down: {_ranks(row['down'])}"
        lines.append(
            f"{row['group']:<36} {row['role']:<5} {row['members']:>5} {row['max_issued_seq']:>7} "
            f"{row['min_completed_seq']:>9} {_seconds(row['oldest_in_flight_seconds']):>10}  {state}"
        )
        for flight in row["p2p_in_flight"]:
            waits = f"waits for rank {flight['peer']}" if flight["waits_for_peer"] else "inside the transfer"
            towards = "to" if flight["direction"] == "send" else "from"
            if flight["age_seconds"] >= hang_seconds:
                lines.append(
                    f"  rank {flight['rank']}: {flight['direction']} {towards} rank {flight['peer']} for "
                    f"{_seconds(flight['age_seconds'])}, {waits}"
                )
    return rows, lines


def _point_to_point_rows(snapshot: Snapshot, group: str, live: list[RankRecord]) -> list[dict[str, Any]]:
    """Each live member's oldest send or receive in flight in `group` per direction and peer, and whether
    it waits for its peer (the peer has not issued the matching op: wait_for.point_to_point_edges)."""
    rows = []
    for record in live:
        state = record.groups[group]
        if state.p2p is None:
            continue
        waits = {(edge.how, edge.waits_on) for edge in wait_for.point_to_point_edges(snapshot, record, group)}
        rows += [
            {
                "rank": record.rank,
                "direction": direction,
                "peer": peer,
                "age_seconds": round(snapshot.now - started, 3),
                "waits_for_peer": (direction, peer) in waits,
            }
            for direction, peer, started in state.p2p.in_flight
        ]
    return rows


def stragglers_view(snapshot: Snapshot) -> tuple[list[dict[str, Any]], list[str]]:
    scores = straggler_verdicts.straggler_scores(snapshot)
    rows = [
        {"rank": rank, **{key: round(value, 6) for key, value in row.items()}} for rank, row in scores.items()
    ]
    lines = [f"{'rank':>5} {'step':>10} {'wait/step':>10} {'score':>7}"]
    lines += [
        f"{row['rank']:>5} {row['step_seconds'] * 1000:>8.2f}ms "
        f"{row['wait_seconds_per_step'] * 1000:>8.2f}ms {row['score']:>7.1f}"
        for row in rows
    ]
    if not rows:
        lines.append("(no step and collective timings yet)")
    return rows, lines


def _oldest_in_flight(record: RankRecord) -> tuple[str, InFlight | None]:
    flights = [
        (state.in_flight.started_at, name, state.in_flight)
        for name, state in record.groups.items()
        if state.in_flight
    ]
    if not flights:
        return "", None
    _, name, flight = min(flights, key=lambda item: item[:2])
    return name, flight


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _int(value: float | None) -> str:
    return "-" if value is None else str(int(value))


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
