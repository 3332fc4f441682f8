"""The incident file: a rank's last word, written where it survives the job's teardown.

One JSON file per rank, `<directory>/<run>-rank<N>.json`, written atomically when the rank dies of an
exception or of a termination signal (SIGTERM: what torchrun and Slurm send the survivors; SIGHUP and SIGINT
where their default action would end the rank), once per stall that lasts `hang_seconds`, and at a normal
exit, so that a report over the directory can tell the ranks that ended normally from those that left no
word (killed, frozen, host lost). A later incident of the same rank replaces the earlier one: the last is
the most telling. The directory: `Config.incident_directory` (incident_dir, else `<file_sd_dir>/incidents`).

Version 2 holds: `reason` (exception, signal, hang, exit) and a `detail` line; the rank's identity (with
its switch and rack); steps, heartbeat, every process group's sequence numbers and oldest in-flight
collective; the training thread's sample and every thread's stack; the exception with its cause, root
cause and chain (flare_exporter/causes.py); the termination signal and its sender; the last GPU readings;
when the last scrape completed; PyTorch's flight recorder entries where it is on. See docs/reliability.md.

A dying rank writes its incident, then waits for its last word to be scraped (last_word.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from types import FrameType, TracebackType
from typing import Any

from .. import causes, label_values
from . import progress, stall
from .atomic_files import file_name_part, write_json_atomically
from .last_word import RaisedException, Termination, signal_sender, wait_for_last_word

INCIDENT_VERSION = 2
REASONS = ("exception", "signal", "hang", "exit")
MAX_TRACEBACK_LINES = 200  # the innermost entries of traceback.format_exception's
FLIGHT_RECORDER_ENTRIES = 64  # the last this many entries of PyTorch's flight recorder
FLIGHT_RECORDER_FRAMES = 32  # stack frames kept per flight recorder entry (NCCL records them)
FLIGHT_RECORDER_GROUPS = 64  # process groups kept of its pg_config (their members: NCCL lists them)
FLIGHT_RECORDER_RANKS_CHARS = 65_536  # a group's member list longer than this is left out
FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def incident_path(directory: str, run: str, rank: int) -> str:
    return os.path.join(directory, f"{file_name_part(run)}-rank{rank}.json")


def in_flight_document(record: Any, now_perf: float) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "op": record.op,
        "seq": record.seq,
        "bytes": record.nbytes,
        "state": "started" if record.started else "issued",
        "issued_timestamp_seconds": round(progress.wall_time(record.issued_at), 6),
        "age_seconds": round(now_perf - record.issued_at, 6),
    }


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, outermost frame first, keyed `name (ident)`."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {
        f"{names.get(ident, 'unknown')} ({ident})": [
            line.rstrip("\n") for line in traceback.format_stack(frame)
        ]
        for ident, frame in sys._current_frames().items()
    }


def _message(exception: BaseException) -> str:
    try:
        return str(exception)[: causes.MAX_MESSAGE_CHARS]
    except Exception:  # a __str__ of its own that fails
        return ""


def raised_document(raised: causes.Raised) -> dict[str, Any]:
    return {"type": raised.type, "message": raised.message[: causes.MAX_MESSAGE_CHARS], "errno": raised.errno}


def exception_document(exception: BaseException) -> dict[str, Any]:
    """The exception, its cause, its root cause and chain (outermost first), and its traceback."""
    try:
        classified: causes.Classified | None = causes.classify(exception)
    except Exception:
        classified = None
    try:
        lines = traceback.format_exception(type(exception), exception, exception.__traceback__)
    except Exception:
        lines = []
    return {
        "type": type(exception).__name__,
        "message": _message(exception),
        "cause": classified.cause if classified else "software_exception",
        "root_cause": raised_document(classified.root) if classified else None,
        "chain": [raised_document(raised) for raised in classified.chain] if classified else [],
        "traceback": lines[-MAX_TRACEBACK_LINES:],
    }


def flight_recorder_enabled(environ: Mapping[str, str]) -> bool:
    """Whether the job turned PyTorch's flight recorder on (a buffer size above 0)."""
    for name in FLIGHT_RECORDER_VARIABLES:
        try:
            if int(environ.get(name, "0").strip() or 0) > 0:
                return True
        except ValueError:
            continue
    return False


def flight_recorder_document(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The last FLIGHT_RECORDER_ENTRIES entries of PyTorch's flight recorder, as its JSON dump writes them,
    with its version, each group's status and members (pg_config, bounded); None when it is off, absent
    from this torch, or fails."""
    if not flight_recorder_enabled(environ) or "torch" not in sys.modules:
        return None
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        if dump is None:
            return None
        trace = json.loads(dump())
        entries = list(trace.get("entries") or [])
        kept = entries[-FLIGHT_RECORDER_ENTRIES:]
        for entry in kept:
            if isinstance(entry, dict) and isinstance(entry.get("frames"), list):
                entry["frames"] = entry["frames"][:FLIGHT_RECORDER_FRAMES]
        return {
            "version": trace.get("version"),
            "pg_status": trace.get("pg_status", {}),
            "pg_config": _bounded_groups(trace.get("pg_config")),
            "entries_total": len(entries),
            "entries": kept,
        }
    except Exception:
        return None


def _bounded_groups(config: Any) -> dict[str, Any]:
    """The first FLIGHT_RECORDER_GROUPS groups of the recorder's pg_config, each member list that is longer
    than FLIGHT_RECORDER_RANKS_CHARS left out (at thousands of ranks, the world's)."""
    if not isinstance(config, dict):
        return {}
    kept = {}
    for name, group in list(config.items())[:FLIGHT_RECORDER_GROUPS]:
        if isinstance(group, dict):
            ranks = group.get("ranks")
            too_long = isinstance(ranks, str) and len(ranks) > FLIGHT_RECORDER_RANKS_CHARS
            kept[str(name)] = {
                key: value for key, value in group.items() if not (key == "ranks" and too_long)
            }
    return kept


def _groups_document(state: Any, now_perf: float) -> dict[str, Any]:
    return {
        group.name: {
            "role": group.role,
            "size": group.size,
            "last_issued_seq": group.last_issued_seq,
            "last_completed_seq": group.last_completed_seq,
            "in_flight": in_flight_document(group.in_flight, now_perf),
            "p2p": _point_to_point_document(state, group),
        }
        for group in list(state.groups.values())
    }


def _point_to_point_document(state: Any, group: Any) -> dict[str, Any] | None:
    """The group's sends and receives: [direction, peer, count] issued and completed per peer, and the
    oldest in flight per direction and peer, oldest first (the wait-for graph's edges, post-mortem); None
    where it made none."""
    flights = list(group.p2p_in_flight)
    completed = {
        (direction, peer): counts.completed
        for (name, peer, direction), counts in list(state.manager.point_to_point.peers.items())
        if name == group.name
    }
    if not flights and not completed:
        return None
    issued = dict(completed)
    oldest: dict[tuple[str, int], Any] = {}  # the oldest per (direction, peer)
    for record in flights:
        key = (label_values.point_to_point_direction(record.op), record.peer)
        issued[key] = issued.get(key, 0) + 1
        oldest.setdefault(key, record)
    return {
        "issued": [[direction, peer, count] for (direction, peer), count in sorted(issued.items())],
        "completed": [[direction, peer, count] for (direction, peer), count in sorted(completed.items())],
        "in_flight": [
            {
                "direction": direction,
                "peer": peer,
                "bytes": record.nbytes,
                "issued_timestamp_seconds": round(progress.wall_time(record.issued_at), 6),
            }
            for (direction, peer), record in oldest.items()
        ],
    }


def _termination_document(termination: Termination | None) -> dict[str, Any] | None:
    if termination is None:
        return None
    return {
        "signal": termination.signal,
        "sender": termination.sender,
        "timestamp_seconds": round(termination.timestamp_seconds, 6),
    }


def _gpu_readings(state: Any) -> list[dict[str, Any]]:
    try:
        return state.gpu.recent_readings() if state.gpu is not None else []
    except Exception as error:
        state.health.error("incident", error)
        return []


def incident_document(
    state: Any,
    reason: str,
    detail: str = "",
    exception: BaseException | None = None,
    exit_code: int | None = None,
) -> dict[str, Any]:
    """Everything the incident file says about this rank, as of now."""
    try:
        state.manager.drain(timeout=1.0)
    except Exception as error:
        state.health.error("incident", error)
    now_perf = time.perf_counter()
    last = stall.last_progress(state)
    sample = state.stack
    last_scrape = state.scrapes.last_completed_timestamp_seconds
    return {
        "version": INCIDENT_VERSION,
        "reason": reason,
        "detail": detail or reason,
        "timestamp_seconds": round(time.time(), 6),
        "identity": dataclasses.asdict(state.identity),
        "steps": state.steps.steps,
        "heartbeat_timestamp_seconds": round(progress.wall_time(last), 6) if last else None,
        "groups": _groups_document(state, now_perf),
        "training_thread": None if sample is None else {"activity": sample.activity, "frames": sample.frames},
        "threads": thread_stacks(),
        "exception": None if exception is None else exception_document(exception),
        "terminated": _termination_document(state.terminated),
        "exit_code": exit_code,
        "gpu_readings": _gpu_readings(state),
        "last_scrape_timestamp_seconds": None if last_scrape is None else round(last_scrape, 6),
        "flight_recorder": flight_recorder_document(),
    }


def _hooked(number: int, handler: Any) -> bool:
    """Whether flare may hook a signal whose handler is `handler`: its default action ends the rank (SIGINT:
    Python's own handler, raising KeyboardInterrupt). A handler of the script's own is never replaced."""
    return handler == signal.SIG_DFL or (number == signal.SIGINT and handler is signal.default_int_handler)


class IncidentWriter:
    """Writes this rank's incident file; hooks the ways a rank dies. Never raises."""

    def __init__(self, state: Any, environ: Mapping[str, str] = os.environ) -> None:
        self.state = state
        self.directory = state.config.incident_directory
        self.sender = signal_sender(environ)
        self.pid = os.getpid()  # a forked child (a DataLoader worker) inherits the hooks: quiet there
        self._previous_excepthook = sys.excepthook
        self._previous_handlers: dict[int, Any] = {}
        self._interrupted_at: float | None = None  # Unix time of a SIGINT turned into KeyboardInterrupt
        self.exception: BaseException | None = None  # the exception ending the rank
        self.exit_code: int | None = None  # set by the launcher when the script returned or exited
        self.written: str | None = None
        self.last_word_seen: bool | None = None  # after a last-word wait: whether a scrape took the word

    def write(self, reason: str, exception: BaseException | None = None, detail: str = "") -> str | None:
        """Write the incident now; its path, or None if none is configured or it could not be written.

        `reason` is one of REASONS; a free-form text (version 1's reason, e.g. "exception ValueError")
        becomes the detail, and the reason its first word (else exception, or hang without one).
        """
        if not self.directory or os.getpid() != self.pid:
            return None
        if reason not in REASONS:
            first = reason.split(" ", 1)[0]
            detail = detail or reason
            reason = first if first in REASONS else "exception" if exception is not None else "hang"
        try:
            identity = self.state.identity
            path = incident_path(self.directory, identity.run, identity.rank)
            document = incident_document(
                self.state, reason, detail, exception or self.exception, self.exit_code
            )
            write_json_atomically(path, document)
            self.written = path
            return path
        except Exception as error:
            self.state.health.error("incident", error)
            return None

    def on_hang(self, detail: str) -> None:
        """The stall watcher's callback: no progress for hang_seconds."""
        self.write("hang", detail=detail)

    def on_exit(self) -> None:
        """At interpreter exit (atexit): the word of a rank that ended normally, unless something else
        (an exception, a signal) ended it."""
        if self.state.exception is None and self.state.terminated is None:
            self.write("exit", detail="exit" if self.exit_code is None else f"exit code {self.exit_code}")

    def install(self) -> None:
        """Record the exception or the signal that ends the rank, and write the incident on it."""
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            return
        for name in label_values.TERMINATION_SIGNALS:
            number = getattr(signal, name, None)
            if number is None:  # no SIGHUP on Windows
                continue
            handler = signal.getsignal(number)
            if _hooked(number, handler):
                self._previous_handlers[number] = handler
                signal.signal(number, self._on_signal)

    def last_word(self, event: float) -> None:
        """Wait (bounded) until a scrape that started after monotonic time `event` has completed."""
        self.last_word_seen = wait_for_last_word(
            self.state.scrapes, event, self.state.config.last_word_seconds
        )

    def _excepthook(
        self, kind: type[BaseException], exception: BaseException, trace: TracebackType | None
    ) -> None:
        event = time.monotonic()
        interrupted = issubclass(kind, KeyboardInterrupt)
        try:
            if os.getpid() == self.pid:
                if interrupted and self._interrupted_at is not None:
                    self.state.terminated = Termination("SIGINT", self.sender, self._interrupted_at)
                self.state.exception = RaisedException.of(exception, time.time())
                event = time.monotonic()
                self.exception = exception
                if interrupted and self.state.terminated is not None:
                    self.write("signal", exception, f"signal {self.state.terminated.signal}")
                else:
                    self.write("exception", exception, f"exception {kind.__name__}")
        except Exception as error:
            self.state.health.error("incident", error)
        finally:
            self._previous_excepthook(kind, exception, trace)
        if interrupted or os.getpid() != self.pid:
            return  # Ctrl-C: the user wants it to end now
        self.last_word(event)
        linger = self.state.config.linger_seconds
        if linger:
            time.sleep(linger)  # the endpoint's threads still serve: the rank says why it is dying

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(number, signal.SIG_DFL)
        if previous is signal.default_int_handler:
            self._interrupted_at = time.time()  # recorded by the excepthook if the KeyboardInterrupt ends it
            previous(number, frame)  # raises KeyboardInterrupt, as without flare
            return
        try:
            signal.signal(number, signal.SIG_DFL)  # a second signal ends the rank at once
            if os.getpid() == self.pid:
                self._terminated(number)
        finally:
            os.kill(os.getpid(), number)  # the default action: the rank ends of this signal

    def _terminated(self, number: int) -> None:
        try:
            name = signal.Signals(number).name
            self.state.terminated = Termination(name, self.sender, time.time())
            event = time.monotonic()
            if self.state.exception is None:
                self.write("signal", detail=f"signal {name}")
            else:  # signalled during its last word: the exception is what ended it
                self.write("exception", detail=f"exception {self.state.exception.type}; then signal {name}")
        except Exception as error:
            self.state.health.error("incident", error)
            return
        self.last_word(event)
