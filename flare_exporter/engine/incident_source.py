"""A dead run's last words from the incident files its ranks wrote (rank/incident.py), on shared storage.

Each rank writes `<run>-rank<N>.json` into its incident directory when it dies (of an exception or a
signal), hangs, or ends normally. Files are read as untrusted input: bounded in size, parsed as JSON, and
every field checked for its type; a file that is not an incident is one line naming it (IncidentError).
Versions 1 and 2 of the format are read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .. import causes
from .post_mortem import DeadRun, ExceptionWord, LastWord, Termination
from .records import SourceError, one_run
from .rule_types import GroupState, InFlight, PointToPoint

MAX_INCIDENT_BYTES = 16 * 1024 * 1024  # an incident holds every thread's stack; far more is not one
MAX_FILES = 100_000
INCIDENTS_SUBDIRECTORY = "incidents"  # beside the file_sd target files (rank/incident.py)


class IncidentError(ValueError):
    """A file in the incident directory that cannot be read as an incident; the message names it."""


def incident_directory(path: str) -> str:
    """Where the incident files of `path` lie: its `incidents` subdirectory if it has one (a file_sd
    directory), else `path` itself (a file's directory, for a file_sd file)."""
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    nested = os.path.join(directory, INCIDENTS_SUBDIRECTORY)
    return nested if os.path.isdir(nested) else directory


def dead_run_from_incidents(path: str, run: str = "") -> DeadRun:
    """Every rank's last word of `run` (the one run the files are of, if not given) from the incident files
    in `path` (see incident_directory)."""
    directory = incident_directory(path)
    documents = [document for document in read_incidents(directory) if _is_incident(document)]
    where = f"incident directory {directory}"
    if not documents:
        raise SourceError(f"{where}: no flare incident file")
    run = one_run((document["identity"].get("run", "") for document in documents), run, where)
    words: dict[int, LastWord] = {}
    world_size = 0
    for document in documents:
        identity = document["identity"]
        if identity.get("run", "") != run:
            continue
        word = last_word(document)
        world_size = max(world_size, _int(identity.get("world_size")) or 0)
        if word.rank not in words or _newer(word, words[word.rank]):
            words[word.rank] = word
    return DeadRun(run, world_size, words, f"incidents {directory}")


def read_incidents(directory: str) -> list[dict[str, Any]]:
    """The JSON documents of the `*.json` files in `directory`; IncidentError naming a bad one."""
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
    except OSError as error:
        raise IncidentError(f"incident directory {directory}: cannot read it ({error.strerror})") from None
    if len(names) > MAX_FILES:
        raise IncidentError(f"incident directory {directory}: {len(names)} files, more than {MAX_FILES}")
    return [read_incident(os.path.join(directory, name)) for name in names]


def read_incident(path: str) -> dict[str, Any]:
    """One incident file's JSON object; IncidentError naming the file if it is not one."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_INCIDENT_BYTES + 1)
    except OSError as error:
        raise IncidentError(f"incident file {path}: cannot read it ({error.strerror})") from None
    if len(data) > MAX_INCIDENT_BYTES:
        raise IncidentError(f"incident file {path}: larger than {MAX_INCIDENT_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise IncidentError(f"incident file {path}: not JSON ({reason})") from None
    if not isinstance(document, dict):
        raise IncidentError(f"incident file {path}: not a JSON object")
    if not _is_incident(document):
        raise IncidentError(f"incident file {path}: not a flare incident file (no identity with a rank)")
    return document


def _is_incident(document: Mapping[str, Any]) -> bool:
    identity = document.get("identity")
    return isinstance(identity, dict) and _int(identity.get("rank")) is not None


def last_word(document: Mapping[str, Any]) -> LastWord:
    """The LastWord an incident document says (versions 1 and 2); fields of the wrong type are ignored."""
    identity = document["identity"]
    reason = _str(document.get("reason"))
    topology = identity.get("topology") if isinstance(identity.get("topology"), dict) else identity
    return LastWord(
        rank=_int(identity.get("rank")) or 0,
        host=_str(identity.get("host")),
        topology={key: _str(topology.get(key)) for key in ("switch", "rack") if _str(topology.get(key))},
        last_seen=_float(document.get("timestamp_seconds")),
        heartbeat=_float(document.get("heartbeat_timestamp_seconds")),
        steps=_float(document.get("steps")),
        groups=_groups(document.get("groups")),
        exception=_exception(document.get("exception"), document.get("timestamp_seconds")),
        terminated=_terminated(document.get("terminated"), reason, document.get("timestamp_seconds")),
        exited=reason == "exit",
        frames=" < ".join(map(_str, _list(_dict(document.get("training_thread")).get("frames")))),
        sources=("incident",),
    )


def _exception(found: Any, written_at: Any) -> ExceptionWord | None:
    if not isinstance(found, dict) or not _str(found.get("type")):
        return None
    kind, message = _str(found.get("type")), _str(found.get("message"))
    root = _dict(found.get("root_cause"))
    root_type, root_message = _str(root.get("type")), _str(root.get("message"))
    cause = _str(found.get("cause"))
    if not causes.is_cause(cause, causes.EXCEPTION_CAUSES):  # version 1, or one no rank writes: classify it
        raised = causes.Raised(root_type or kind, root_message or message, _int(root.get("errno")))
        cause = causes.exception_cause(raised)
    at = _float(found.get("timestamp_seconds")) or _float(written_at)
    return ExceptionWord(kind, cause, at, root_type, root_message[: causes.MAX_MESSAGE_CHARS])


def _terminated(found: Any, reason: str, written_at: Any) -> Termination | None:
    if isinstance(found, dict) and _str(found.get("signal")):
        at = _float(found.get("timestamp_seconds")) or _float(written_at)
        return Termination(_str(found.get("signal")), _str(found.get("sender")) or "unknown", at)
    if reason.startswith("signal "):  # version 1: "signal SIGTERM"
        return Termination(reason.split(" ", 1)[1], "unknown", _float(written_at))
    return None


def _groups(found: Any) -> dict[str, GroupState]:
    groups = {}
    for name, group in list(_dict(found).items())[:4096]:
        if isinstance(group, dict):
            issued, completed = _count(group.get("last_issued_seq")), _count(group.get("last_completed_seq"))
            flight = _in_flight(_dict(group.get("in_flight")))
            groups[str(name)[:256]] = GroupState(issued, completed, flight, p2p=_p2p(group.get("p2p")))
    return groups


def _p2p(found: Any) -> PointToPoint | None:
    """A group's sends and receives as the rank wrote them (rank/incident.py), bounded; None if absent."""
    if not isinstance(found, dict):
        return None

    def counts(rows: Any) -> dict[tuple[str, int], int]:
        kept = {}
        for row in rows[:4096] if isinstance(rows, list) else []:
            if isinstance(row, list) and len(row) == 3 and row[0] in ("send", "recv"):
                peer, count = _int(row[1]), _int(row[2])
                if peer is not None and count is not None and peer >= -1 and count >= 0:
                    kept[(row[0], peer)] = count
        return kept

    flights = found.get("in_flight")
    if not isinstance(flights, list):  # written by a flare that kept only the oldest
        flights = [flights]
    in_flight = []
    for flight in (_dict(flight) for flight in flights[:4096]):
        direction, peer, at = (
            flight.get("direction"),
            _int(flight.get("peer")),
            _float(flight.get("issued_timestamp_seconds")),
        )
        if direction in ("send", "recv") and peer is not None and at is not None:
            in_flight.append((str(direction), peer, at))
    in_flight.sort(key=lambda flight: flight[2])
    return PointToPoint(counts(found.get("issued")), counts(found.get("completed")), tuple(in_flight))


def _in_flight(flight: Mapping[str, Any]) -> InFlight | None:
    if not _str(flight.get("op")):
        return None
    state = "started" if flight.get("state") == "started" else "issued"
    started = _float(flight.get("issued_timestamp_seconds")) or 0.0
    return InFlight(
        _str(flight.get("op")), _count(flight.get("seq")), _count(flight.get("bytes")), state, started
    )


def _count(value: Any) -> int:
    return _int(value) or 0


def _newer(word: LastWord, other: LastWord) -> bool:
    return (word.last_seen or 0.0) > (other.last_seen or 0.0)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value[:64] if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value[:4096] if isinstance(value, str) else ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
