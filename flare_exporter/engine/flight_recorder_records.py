"""PyTorch flight-recorder dumps as flare's records: what each rank's recorder held, per process group.

Pure functions, no I/O (flight_recorder.py reads the files). A dump is what
`torch._C._distributed_c10d._dump_fr_trace()` pickles (and `_dump_fr_trace_json()` writes as JSON): a
mapping with `version`, `pg_config` (group name -> description and member ranks; empty on gloo), `pg_status`
(the recorder's group id -> last enqueued, started and completed collective numbers) and `entries`, one per
collective the rank issued (`process_group` (name, description), `collective_seq_id`, `profiling_name`
`gloo:all_reduce`, `input_sizes`, `input_dtypes`, `state` scheduled|started|completed, `retired`,
`time_created_ns`, `timeout_ms`). Versions 2.0 to 2.10 are read; older ones name the number `seq_id` and
the group by its id alone. Every field is checked for its type; one of the wrong type is left out.

Per group, a rank's record holds the last collective it issued and completed and its oldest unfinished one
(rule_types.GroupState), as flare's own ranks export them; the rules in diagnosis.py decide. A group is named
as flare's ranks name it: `world`, else its description and a hash of its members where the dump lists them,
else its description and the recorder's group name (gloo's dumps list no members).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .post_mortem import LastWord
from .rule_types import GroupState, InFlight, PointToPoint, RankRecord, Snapshot

WORLD = "world"
MAX_ENTRIES = 100_000  # per dump, the newest: a recorder keeps 2,000 by default
MAX_GROUPS = 4096
POINT_TO_POINT = frozenset({"send", "recv", "recv_anysource"})
NO_DUMP = "no flight-recorder dump for this rank (frozen, killed or its host lost)"

# bytes per element of the dtypes the recorder names (c10's ScalarType names)
DTYPE_BYTES = {
    "Byte": 1, "Char": 1, "Bool": 1, "QInt8": 1, "QUInt8": 1, "QUInt4x2": 1, "QUInt2x4": 1,
    "Float8_e5m2": 1, "Float8_e4m3fn": 1, "Float8_e5m2fnuz": 1, "Float8_e4m3fnuz": 1, "Float8_e8m0fnu": 1,
    "Short": 2, "Half": 2, "BFloat16": 2, "UInt16": 2, "ComplexHalf": 4,
    "Int": 4, "Float": 4, "QInt32": 4, "UInt32": 4,
    "Long": 8, "Double": 8, "ComplexFloat": 8, "UInt64": 8, "ComplexDouble": 16,
}  # fmt: skip


class DumpError(ValueError):
    """A file that cannot be read as a flight-recorder dump; the message names it."""


class FlightEntry(NamedTuple):
    """One collective (or point-to-point op) a rank's recorder holds."""

    group: str  # flare's name of its process group
    group_id: str  # the recorder's id of the group on this rank (pg_status's key)
    seq: int  # its collective number in the group (0 for send/recv)
    op: str  # all_reduce, broadcast, send, ...
    nbytes: int
    state: str  # scheduled | started | completed
    done: bool  # completed, or retired (gloo retires what it completed or failed)
    created_at: float  # Unix time it was issued
    timeout_seconds: float | None
    peer: int = (
        -1
    )  # a send's or receive's peer, its rank in the group (profiling_name `send 0->1`, `recv 1<-0`)


class GroupStatus(NamedTuple):
    """The recorder's numbers of one group on one rank (pg_status)."""

    last_enqueued: int
    last_completed: int


class Dump(NamedTuple):
    """One rank's flight-recorder dump, parsed: what the rules weigh of its entries (at thousands of ranks
    of 2,000 entries each, not every entry is kept)."""

    rank: int
    where: str  # the file it came from
    version: str
    written_at: float | None  # Unix time it was written (the file's mtime; an incident's timestamp)
    unfinished: tuple[FlightEntry, ...]  # the entries of collectives that had not completed, oldest first
    issued: Mapping[str, int]  # by group name: the highest collective number among its entries
    completed: Mapping[str, int]  # by group name: the highest among its completed entries
    last_issue: float | None  # when the newest entry was issued
    status: Mapping[str, GroupStatus]  # by group name
    members: Mapping[str, tuple[int, ...]]  # by group name, where the dump lists them (pg_config)
    world_size: int = 0  # where known (pg_config's world, an incident's identity)
    host: str = ""


# ---------------------------------------------------------------------------------------------------------
# parsing one dump


def parse_dump(
    document: Any, rank: int, where: str, written_at: float | None, world_size: int = 0, host: str = ""
) -> Dump:
    """The Dump of one rank's unpickled (or JSON) dump; DumpError naming `where` if it is not one."""
    if not isinstance(document, dict):
        raise DumpError(f"flight-recorder dump {where}: not a flight-recorder dump (a {_kind(document)})")
    entries = document.get("entries", [])  # absent from a dump asked for no collectives
    recorded = "entries" in document or isinstance(document.get("pg_status"), dict)
    if not (recorded and isinstance(entries, list) and isinstance(document.get("version"), str)):
        raise DumpError(
            f"flight-recorder dump {where}: not a flight-recorder dump "
            "(no 'version' string with an 'entries' list or a 'pg_status')"
        )
    config = _members_by_group(document.get("pg_config"))
    names: dict[tuple[str, str], str] = {(name, ""): group for name, (group, _) in config.items()}
    parsed = [_entry(raw, names) for raw in entries[-MAX_ENTRIES:] if isinstance(raw, dict)]
    found = [entry for entry in parsed if entry is not None]
    world = max((len(ranks) for group, ranks in config.values() if group == WORLD), default=0)
    issued: dict[str, int] = defaultdict(int)
    completed: dict[str, int] = defaultdict(int)
    for entry in found:
        issued[entry.group] = max(issued[entry.group], entry.seq)
        if entry.done:
            completed[entry.group] = max(completed[entry.group], entry.seq)
    return Dump(
        rank=rank,
        where=where,
        version=document["version"][:32],
        written_at=written_at,
        unfinished=tuple(entry for entry in found if not entry.done),
        issued=dict(issued),
        completed=dict(completed),
        last_issue=max((entry.created_at for entry in found), default=None),
        status=_status(document.get("pg_status"), found),
        members={group: ranks for group, ranks in config.values() if ranks},
        world_size=max(world_size, world),
        host=host,
    )


def group_name(pg_name: str, description: str, members: tuple[int, ...] = ()) -> str:
    """The name flare's ranks give the group (rank/groups.py): `world` for the default group, else its
    description (`group` where it has none) and a hash of its sorted members, or, where the dump lists no
    members (gloo), the recorder's name of the group: the same on every member."""
    if description == "default_pg" or (not description and pg_name == "0"):
        return WORLD
    words = re.sub(r"[^a-z0-9]+", "_", description.lower()).strip("_")[:32]
    if not words or words == "undefined":
        words = "group"
    if members:
        return f"{words}-{hashlib.sha1(','.join(map(str, sorted(members))).encode()).hexdigest()[:8]}"
    return f"{words}-pg{re.sub(r'[^A-Za-z0-9_.]+', '_', pg_name)[:64]}"


def _members_by_group(config: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """pg_config: the recorder's group name -> (flare's name of it, its members where listed)."""
    found = {}
    for pg_name, group in list(_dict(config).items())[:MAX_GROUPS]:
        group = _dict(group)
        name = _str(group.get("name")) or str(pg_name)
        members = _ranks(group.get("ranks"))
        if name:
            found[name] = (group_name(name, _str(group.get("desc")), members), members)
    return found


def _ranks(text: Any) -> tuple[int, ...]:
    """The member ranks pg_config lists, as the text of a list ('[0, 1]'); () where it lists none."""
    if isinstance(text, list):
        numbers = text
    elif isinstance(text, str) and len(text) < 1_000_000 and re.fullmatch(r"\[[\d,\s]*\]", text):
        numbers = [int(number) for number in re.findall(r"\d+", text)]
    else:
        return ()
    return tuple(sorted({n for n in numbers if isinstance(n, int) and 0 <= n < 2**31}))


def _entry(raw: Mapping[str, Any], names: dict[tuple[str, str], str]) -> FlightEntry | None:
    """One entry; None where it names no op or no time (not a collective the rules can weigh). `names`:
    flare's name of each group (recorder's name, description) met so far, pg_config's first (under an empty
    description); the bytes only of a collective that has not completed (the rules weigh no other's)."""
    op = _str(raw.get("profiling_name")).split(":", 1)[-1].split(" ", 1)[0][:64]
    created = _number(raw.get("time_created_ns"))
    if not op or created is None:
        return None
    pg_name, description = _process_group(raw.get("process_group"), raw.get("pg_id"))
    point_to_point = raw.get("is_p2p") is True or op in POINT_TO_POINT
    seq = 0 if point_to_point else _count(raw.get("collective_seq_id", raw.get("seq_id")))
    timeout = _number(raw.get("timeout_ms"))
    state = _str(raw.get("state"))
    done = state == "completed" or raw.get("retired") is True
    group = names.get((pg_name, description)) or names.get((pg_name, ""))
    if group is None:
        group = names[pg_name, description] = group_name(pg_name, description)
    return FlightEntry(
        group=group,
        group_id=str(_count(raw.get("pg_id"))),
        seq=seq,
        op=op,
        nbytes=0 if done else _nbytes(raw.get("input_sizes"), raw.get("input_dtypes")),
        state=state,
        done=done,
        created_at=created / 1e9,
        timeout_seconds=timeout / 1000 if timeout and timeout > 0 else None,
        peer=_peer(op, _str(raw.get("profiling_name"))) if point_to_point else -1,
    )


def _peer(op: str, profiling_name: str) -> int:
    """A send's or receive's peer (its rank in the group) from its profiling name, as fr_trace reads it:
    `nccl:send 0->1` (to 1), `nccl:recv 1<-0` (from 0); -1 where the name says none."""
    found = re.fullmatch(r"\S+ (\d{1,9})(->|<-)(\d{1,9})", profiling_name.split(":", 1)[-1])
    if found is None or (op, found.group(2)) not in (("send", "->"), ("recv", "<-")):
        return -1
    return int(found.group(3))


def _process_group(found: Any, pg_id: Any) -> tuple[str, str]:
    """(the recorder's group name, its description); from its id alone in dumps before 2.2."""
    if isinstance(found, (list, tuple)) and len(found) == 2:
        return _str(found[0])[:256], _str(found[1])[:256]
    number = _count(pg_id)
    return str(number), "default_pg" if number == 0 else ""


def _nbytes(sizes: Any, dtypes: Any) -> int:
    """Bytes of the input tensors (shapes `sizes`, one dtype name each); elements where a dtype is unknown."""
    if not isinstance(sizes, list):
        return 0
    names = dtypes if isinstance(dtypes, list) else []
    total = 0
    for index, shape in enumerate(sizes[:4096]):
        if not isinstance(shape, list) or len(shape) > 64:
            continue
        if not all(_int(dim) is not None and dim >= 0 for dim in shape):
            continue
        dtype = names[index] if index < len(names) else names[0] if names else ""
        total += math.prod(shape) * DTYPE_BYTES.get(dtype if isinstance(dtype, str) else "", 1)
    return min(total, 2**63 - 1)


def _status(found: Any, entries: list[FlightEntry]) -> dict[str, GroupStatus]:
    """pg_status by flare's group name: the recorder keys it by its id of the group on the rank, which only
    the rank's own entries name (the ids differ from rank to rank)."""
    names = {entry.group_id: entry.group for entry in entries}
    status = {}
    for group_id, numbers in list(_dict(found).items())[:MAX_GROUPS]:
        numbers = _dict(numbers)
        if str(group_id) in names:
            status[names[str(group_id)]] = GroupStatus(
                _count(numbers.get("last_enqueued_collective")),
                _count(numbers.get("last_completed_collective")),
            )
    return status


# ---------------------------------------------------------------------------------------------------------
# records


def group_states(dump: Dump) -> dict[str, GroupState]:
    """Per group of the rank: the last collective it issued and completed, and its oldest unfinished one."""
    states = {}
    for name in dump.issued.keys() | dump.status.keys():
        status = dump.status.get(name)
        issued = max(dump.issued.get(name, 0), status.last_enqueued if status else 0)
        completed = status.last_completed if status else dump.completed.get(name, 0)
        unfinished = [
            entry
            for entry in dump.unfinished
            if entry.group == name
            and entry.op not in POINT_TO_POINT
            and not (entry.seq and entry.seq <= completed)
        ]
        oldest = min(unfinished, key=lambda entry: entry.created_at, default=None)
        p2p = _point_to_point(dump, name)
        states[name] = GroupState(issued, completed, _in_flight(oldest), p2p=p2p)
    return states


def _point_to_point(dump: Dump, group: str) -> PointToPoint | None:
    """The group's sends and receives the dump holds unfinished, counted per (direction, peer's global
    rank), and the oldest per direction and peer. A ring of entries holds no count since the start, so none
    is complete: the wait-for graph's rule (wait_for.point_to_point_edges) then asks whether the peer has an
    unfinished op of its own toward this rank, the other side of the same transfer."""
    unfinished = [entry for entry in dump.unfinished if entry.group == group and entry.op in POINT_TO_POINT]
    if not unfinished:
        return None
    members = sorted(dump.members.get(group, ()))
    issued: dict[tuple[str, int], int] = defaultdict(int)
    oldest: dict[tuple[str, int], float] = {}
    for entry in sorted(unfinished, key=lambda entry: entry.created_at):
        direction = "send" if entry.op == "send" else "recv"
        peer = members[entry.peer] if 0 <= entry.peer < len(members) else entry.peer
        issued[(direction, peer)] += 1
        oldest.setdefault((direction, peer), entry.created_at)
    return PointToPoint(dict(issued), {}, tuple((*key, at) for key, at in oldest.items()))


def _in_flight(entry: FlightEntry | None) -> InFlight | None:
    if entry is None:
        return None
    return InFlight(
        entry.op,
        entry.seq,
        entry.nbytes,
        "started" if entry.state == "started" else "issued",
        entry.created_at,
    )


def dumped_at(dumps: Iterable[Dump]) -> float:
    """The moment the dumps show: the latest written, or the newest entry where that is later (a copy that
    lost its files' times, a clock behind); 0 where they say no time at all."""
    times = [time for dump in dumps for time in (dump.written_at, dump.last_issue) if time is not None]
    return max(times, default=0.0)


def run_threshold(dumps: Iterable[Dump]) -> float | None:
    """The run's own hang threshold: the shortest timeout of a collective in flight (what the process group
    was created with); None where nothing is in flight or no entry says its timeout."""
    found = [
        entry.timeout_seconds
        for dump in dumps
        for entry in dump.unfinished
        if entry.timeout_seconds is not None
    ]
    return min(found, default=None)


def world_size_of(dumps: Mapping[int, Dump]) -> int:
    """The world's size: what a dump lists of it, else one past the highest rank dumped."""
    listed = max((dump.world_size for dump in dumps.values()), default=0)
    return max(listed, max(dumps, default=-1) + 1)


def snapshot_of(dumps: Mapping[int, Dump], run: str = "", world_size: int = 0) -> Snapshot:
    """Every rank of the world (of `world_size` ranks, or as the dumps say: world_size_of) at the moment the
    dumps show (dumped_at): each dumped rank up with its groups; each rank with no dump down (NO_DUMP).

    A rank is in the groups whose members a dump lists (NCCL's), even those it recorded nothing of (it never
    issued their first collective). Where no dump lists a group's members (gloo), a rank with no dump is
    counted in every such group in which a dumped rank has a collective in flight: it may be the member
    they wait on."""
    states = {rank: group_states(dump) for rank, dump in dumps.items()}
    listed: dict[str, set[int]] = defaultdict(set)
    for found in dumps.values():
        for group, ranks in found.members.items():
            listed[group].update(ranks)
    waiting = {
        group
        for groups in states.values()
        for group, state in groups.items()
        if state.in_flight is not None and group not in listed and group != WORLD
    }
    records = {}
    size = max(world_size, world_size_of(dumps))
    for rank in range(size):
        member_of = {group: GroupState() for group, ranks in sorted(listed.items()) if rank in ranks}
        dump = dumps.get(rank)
        if dump is None:
            unlisted = {group: GroupState() for group in sorted(waiting | {WORLD})}
            records[rank] = RankRecord(rank, up=False, down_reason=NO_DUMP, groups=member_of | unlisted)
            continue
        groups = member_of | states[rank]
        records[rank] = RankRecord(rank, host=dump.host, heartbeat=dump.last_issue, groups=groups)
    now = dumped_at(dumps.values())
    return Snapshot(records, now, run, size, hang_seconds=run_threshold(dumps.values()), dumped=True)


def last_words(dumps: Mapping[int, Dump]) -> dict[int, LastWord]:
    """Each dumped rank's last word: its groups when it was dumped (post_mortem.py weighs them)."""
    return {
        rank: LastWord(
            rank,
            host=dump.host,
            last_seen=dump.written_at,
            heartbeat=dump.last_issue,
            groups=group_states(dump),
            sources=("flight-recorder",),
        )
        for rank, dump in dumps.items()
    }


# ---------------------------------------------------------------------------------------------------------
# checked fields


def _kind(value: Any) -> str:
    return type(value).__name__


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value[:4096] if isinstance(value, str) else ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


def _count(value: Any) -> int:
    """A non-negative number, given as a number or as its text (the JSON dump's pg_status); else 0."""
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value.strip()):
        value = int(value)
    number = _int(value)
    return number if number is not None and number > 0 else 0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
