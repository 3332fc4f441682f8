"""PyTorch flight-recorder dumps on disk: a source of a snapshot (`flare diagnose --flight-recorder`) and
of an incident report (`flare report --flight-recorder`). Runs in the `flare` command.

A directory holds one dump per rank, named `<prefix><rank>` as PyTorch names them (TORCH_FR_DUMP_TEMP_FILE
or TORCH_NCCL_DEBUG_INFO_TEMP_FILE plus the rank: `/tmp/nccl_trace_rank_3`); a path that is not a directory
is that prefix. Each is a pickle (what `_dump_fr_trace()` and the NCCL dump on timeout write) or its JSON
form (`_dump_fr_trace_json()`, the control plane's `fr_trace_json`). The directory may also hold the ranks'
incident files (rank/incident.py), which carry their recorder's last entries: a rank with no dump of its own
is read from its incident file's, and `flare report` merges their last words.

Dumps are untrusted input: bounded in size, pickles loaded by an unpickler that refuses every class and
function a pickle may name (a dump holds only dicts, lists, tuples, strings and numbers, which pickle builds
without naming any), and every field checked (flight_recorder_records.py). A file that is not a dump is one
line naming it (DumpError, exit code 2). Ranks with no dump are tolerated (they are judged gone), and so
are dumps of different versions.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..config import HangThreshold, hang_of_run
from . import diagnosis, incident_source, post_mortem, report
from .flight_recorder_records import (
    Dump,
    DumpError,
    dumped_at,
    last_words,
    parse_dump,
    snapshot_of,
    world_size_of,
)
from .records import SourceError, one_run
from .rule_types import Snapshot

__all__ = ["DumpError", "FlightRecorder", "incident_report", "read_flight_recorder", "snapshot_from"]

MAX_DUMP_BYTES = 256 * 1024 * 1024  # an NCCL dump of 2,000 entries with stacks is a few MB
MAX_FILES = 100_000
DUMP_NAME = re.compile(r"(?P<prefix>.*?)(?P<rank>[0-9]{1,9})")
PICKLE_PROTOCOL_2_AND_LATER = b"\x80"


class FlightRecorder(NamedTuple):
    """What a flight-recorder directory holds of one run: each rank's dump, the world's size, the ranks'
    last words from their incident files (if any lie there), and where it was read."""

    dumps: dict[int, Dump]
    world_size: int
    incident_words: dict[int, post_mortem.LastWord]
    run: str
    where: str

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.dumps, self.run, self.world_size)


class _DumpUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes make (dicts, lists, tuples, str, bytes, numbers, booleans,
    None). A pickle runs code only through a class or function it names (GLOBAL, STACK_GLOBAL, INST, OBJ
    and the extension registry all ask find_class) or a persistent id: both are refused."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        asked = f"{str(module)[:80]}.{str(name)[:80]}"
        raise DumpError(
            f"flight-recorder dump {self.where}: refused: it asks for {asked!r}, and a dump holds only "
            "plain data (a pickle that names a class or function could run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise DumpError(f"flight-recorder dump {self.where}: refused: it asks for a persistent object")


def load_pickle(data: bytes, where: str) -> Any:
    """The plain data a dump's pickle holds; DumpError naming `where` if it is not one, or names anything."""
    try:
        return _DumpUnpickler(data, where).load()
    except DumpError:
        raise
    except Exception as error:  # whatever a malformed pickle makes the unpickler raise
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise DumpError(f"flight-recorder dump {where}: not a readable pickle ({reason})") from None


def decode(data: bytes, where: str) -> Any:
    """A dump's document: a pickle (protocol 2 or later, as PyTorch writes) or JSON."""
    if data.startswith(PICKLE_PROTOCOL_2_AND_LATER):
        return load_pickle(data, where)
    if data.lstrip()[:1] == b"{":
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as error:
            reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise DumpError(f"flight-recorder dump {where}: not readable JSON ({reason})") from None
    raise DumpError(f"flight-recorder dump {where}: neither a pickle nor JSON (it starts with {data[:8]!r})")


def read_dump(path: str, rank: int) -> Dump:
    """Rank `rank`'s dump in the file `path`, written when the file was; DumpError naming it if not one."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_DUMP_BYTES + 1)
            written_at = os.fstat(handle.fileno()).st_mtime
    except OSError as error:
        raise DumpError(f"flight-recorder dump {path}: cannot read it ({error.strerror})") from None
    if len(data) > MAX_DUMP_BYTES:
        raise DumpError(f"flight-recorder dump {path}: larger than {MAX_DUMP_BYTES} bytes")
    if not data:
        raise DumpError(f"flight-recorder dump {path}: empty")
    return parse_dump(decode(data, path), rank, path, written_at)


def dump_files(path: str) -> dict[int, str]:
    """Rank -> its dump file: the files `<prefix><rank>` of the directory `path` (one prefix; hidden files
    left out), or those whose name is the prefix `path` ends in followed by a rank."""
    if os.path.isdir(path):
        directory, prefix = path, None
    else:
        directory, prefix = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        names = sorted(os.listdir(directory))
    except OSError as error:
        raise DumpError(f"flight-recorder path {path}: cannot read {directory} ({error.strerror})") from None
    if len(names) > MAX_FILES:
        raise DumpError(f"flight-recorder directory {directory}: {len(names)} files, more than {MAX_FILES}")
    found = {}
    for name in names:
        match = DUMP_NAME.fullmatch(name)
        if match and not name.startswith(".") and (prefix is None or match["prefix"] == prefix):
            if os.path.isfile(os.path.join(directory, name)):
                found[name] = match
    prefixes = sorted({match["prefix"] for match in found.values()})
    if len(prefixes) > 1:
        raise DumpError(
            f"flight-recorder directory {path}: dumps of several prefixes "
            f"({', '.join(map(repr, prefixes))}); name one as {os.path.join(path, prefixes[0])}"
        )
    files: dict[int, str] = {}
    for name, match in found.items():
        rank = int(match["rank"])
        if rank in files:
            raise DumpError(
                f"flight-recorder path {path}: two dumps of rank {rank}: {files[rank]} and {name}"
            )
        files[rank] = os.path.join(directory, name)
    return files


def read_flight_recorder(path: str, run: str = "") -> FlightRecorder:
    """Every rank's dump of `run` under `path` (see dump_files), and, where `path` is a directory, the
    incident files of the run there (incident_source.incident_directory): a rank with no dump file is read
    from its incident's recorder entries. SourceError where there is no dump at all."""
    files = dump_files(path)
    dumps = {rank: read_dump(name, rank) for rank, name in files.items()}
    documents = _incidents(path)
    if documents:
        run = one_run(
            (document["identity"].get("run", "") for document in documents), run, f"flight-recorder {path}"
        )
        documents = [document for document in documents if document["identity"].get("run", "") == run]
    words = {}
    world_size = 0
    for document in documents:
        word = incident_source.last_word(document)
        world_size = max(world_size, _count(document["identity"].get("world_size")))
        words[word.rank] = word
        if word.rank not in files:
            found = _incident_dump(document, word)
            if found is not None:
                dumps[word.rank] = found
    if not dumps:
        raise SourceError(f"flight-recorder {path}: no flight-recorder dump (files named <prefix><rank>)")
    return FlightRecorder(dumps, max(world_size, world_size_of(dumps)), words, run, f"flight-recorder {path}")


def snapshot_from(path: str, run: str = "") -> Snapshot:
    """The snapshot the dumps under `path` show (flight_recorder_records.snapshot_of)."""
    return read_flight_recorder(path, run).snapshot()


def _incidents(path: str) -> list[dict[str, Any]]:
    """The incident documents beside the dumps of the directory `path` (none for a prefix)."""
    if not os.path.isdir(path):
        return []
    directory = incident_source.incident_directory(path)
    return incident_source.read_incidents(directory) if os.path.isdir(directory) else []


def _incident_dump(document: dict[str, Any], word: post_mortem.LastWord) -> Dump | None:
    """The recorder's entries the rank wrote into its incident file (rank/incident.py), as its dump."""
    section = document.get("flight_recorder")
    if not isinstance(section, dict):
        return None
    identity = document["identity"]
    where = f"incident file of rank {word.rank} ({identity.get('run', '')})"
    return parse_dump(
        section, word.rank, where, word.last_seen, _count(identity.get("world_size")), word.host
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else 0


# ---------------------------------------------------------------------------------------------------------
# the incident report


def incident_report(
    path: str, run: str, hang: HangThreshold, also: Sequence[post_mortem.DeadRun] = ()
) -> dict[str, Any]:
    """`flare report --flight-recorder`: the report (report.incident_report) over every rank's last word:
    its dump's groups, and its incident file's (and those of `also`, other sources) where there is one.
    Where those name no culprit (the dumps alone: no rank raised or was stopped), the verdicts are the live
    rules' over the moment the dumps show, judged by `hang` (else the run's own threshold)."""
    recorder = read_flight_recorder(path, run)
    runs = [
        post_mortem.DeadRun(recorder.run, recorder.world_size, last_words(recorder.dumps), recorder.where)
    ]
    if recorder.incident_words:
        where = f"incidents {incident_source.incident_directory(path)}"
        runs.append(post_mortem.DeadRun(recorder.run, recorder.world_size, recorder.incident_words, where))
    found = report.incident_report(post_mortem.merge_runs([*runs, *also]))
    snapshot = recorder.snapshot()
    threshold = hang_of_run(snapshot.hang_seconds, hang)
    found["verdicts_from"] = "post_mortem"
    if not found["verdicts"]:
        found["verdicts"] = [verdict.to_json() for verdict in diagnosis.diagnose(snapshot, threshold.seconds)]
        found["verdicts_from"] = "flight_recorder"
    found["flight_recorder"] = {
        "timestamp_seconds": round(dumped_at(recorder.dumps.values()), 3),
        "hang_seconds": threshold.seconds,
        "hang_seconds_from": threshold.source,
        "dumps": {str(rank): dump.where for rank, dump in sorted(recorder.dumps.items())},
        "versions": {str(rank): dump.version for rank, dump in sorted(recorder.dumps.items())},
        "ranks_without_dump": [rank for rank in range(recorder.world_size) if rank not in recorder.dumps],
    }
    return found
