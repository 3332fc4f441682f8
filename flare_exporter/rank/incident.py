"""The incident file: a rank's last word, written where it survives the job's teardown.

One JSON file per rank, `<incident_dir>/<run>-rank<N>.json`, written atomically when the rank dies of an
exception or of SIGTERM (what torchrun sends the survivors), and when it has made no progress for
`hang_seconds`. A later incident of the same rank replaces the earlier one: the last is the most telling.
It holds the rank's identity, why it was written, steps and heartbeat, every process group's sequence
numbers and oldest in-flight collective, the training thread's sample, every thread's stack, and the
exception if there was one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from . import progress, stall
from .atomic_files import file_name_part, write_json_atomically

INCIDENT_VERSION = 1


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


def incident_document(state: Any, reason: str, exception: BaseException | None = None) -> dict[str, Any]:
    """Everything the incident file says about this rank, as of now."""
    try:
        state.manager.drain(timeout=1.0)
    except Exception as error:
        state.health.error("incident", error)
    now_perf = time.perf_counter()
    last = stall.last_progress(state)
    sample = state.stack
    document: dict[str, Any] = {
        "version": INCIDENT_VERSION,
        "reason": reason,
        "timestamp_seconds": round(time.time(), 6),
        "identity": dataclasses.asdict(state.identity),
        "steps": state.steps.steps,
        "heartbeat_timestamp_seconds": round(progress.wall_time(last), 6) if last else None,
        "groups": {
            group.name: {
                "role": group.role,
                "size": group.size,
                "last_issued_seq": group.last_issued_seq,
                "last_completed_seq": group.last_completed_seq,
                "in_flight": in_flight_document(group.in_flight, now_perf),
            }
            for group in list(state.groups.values())
        },
        "training_thread": None if sample is None else {"activity": sample.activity, "frames": sample.frames},
        "threads": thread_stacks(),
        "exception": None,
    }
    if exception is not None:
        document["exception"] = {
            "type": type(exception).__name__,
            "message": str(exception)[:2000],
            "traceback": traceback.format_exception(type(exception), exception, exception.__traceback__),
        }
    return document


class IncidentWriter:
    """Writes this rank's incident file; hooks the ways a rank dies. Never raises."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.directory = state.config.incident_dir
        self._previous_excepthook = sys.excepthook
        self.written: str | None = None

    def write(self, reason: str, exception: BaseException | None = None) -> str | None:
        if not self.directory:
            return None
        try:
            identity = self.state.identity
            path = incident_path(self.directory, identity.run, identity.rank)
            write_json_atomically(path, incident_document(self.state, reason, exception))
            self.written = path
            return path
        except Exception as error:
            self.state.health.error("incident", error)
            return None

    def install(self) -> None:
        """Record the exception that ends the rank, and write the incident on it and on SIGTERM."""
        sys.excepthook = self._excepthook
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # never replace the user's own handler
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def _excepthook(
        self, kind: type[BaseException], exception: BaseException, trace: TracebackType | None
    ) -> None:
        try:
            self.state.exception = (kind.__name__[:64], time.time())
            self.write(f"exception {kind.__name__}", exception)
        finally:
            self._previous_excepthook(kind, exception, trace)
        linger = self.state.config.linger_seconds
        if linger and not issubclass(kind, KeyboardInterrupt):
            time.sleep(linger)  # the endpoint's threads still serve: the rank says why it is dying

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.write("signal SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
