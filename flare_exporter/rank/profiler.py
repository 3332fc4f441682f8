"""The profiler: a capture of a few optimizer steps with torch.profiler, asked for from outside the script and
reduced on the node to a summary and a bottleneck class (inside the rank; `profile: on` only).

Three threads, none waiting for another:

- the endpoint's (http_server.py): `request(steps)` arms a capture, or refuses it (one at a time, then a
  cooldown) with an answer, never a queue; `status()` says what runs and what the last capture found;
- the training thread: an optimizer post-step hook, installed only when profiling is on, checks one attribute
  a step. Armed, it starts torch.profiler at that step boundary (every thread of the rank where torch allows:
  `profile_all_threads`), marks each step (`ProfilerStep#N`) and stops the profiler at the boundary N steps
  later; stopping is the one part torch does on the thread that started it;
- the capture's own thread: exports the trace, reduces it (profile_summary.py), keeps the summary and, bounded
  in count and size, the raw trace in `<incident directory>/profiles`, and ends the capture: the training
  thread never exports, parses or writes.

A hook's error never reaches training: it abandons the capture (its outcome `failed`, with the error) and is
counted in the exporter's health.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import label_values
from .atomic_files import file_name_part, write_json_atomically
from .exporter_health import ExporterHealth

PROFILES_SUBDIRECTORY = "profiles"


@dataclass(frozen=True)
class Capture:
    """One capture: asked for at `requested_at` (Unix time), run over `steps` steps, and what it found."""

    id: int
    steps: int
    requested_at: float
    state: str = "armed"  # armed | capturing | reducing | captured | failed
    trigger: str = "asked"  # label_values.PROFILE_TRIGGERS: what asked for it
    peer_of: int | None = None  # trigger peer: the rank whose own capture this one stands beside
    reason: Mapping[str, Any] = field(default_factory=dict)  # a trigger's evidence (the signal that fired)
    started_at: float | None = None
    finished_at: float | None = None
    bottleneck: str = ""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    summary: Mapping[str, Any] = field(default_factory=dict)
    summary_bytes: int = 0
    trace_path: str = ""
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Reducer = Callable[[Mapping[str, Any], int], tuple[dict[str, Any], str, dict[str, Any]]]


def reduce_trace(trace: Mapping[str, Any], steps: int) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The summary of a Chrome trace of `steps` steps, its bottleneck class and the evidence for it."""
    from ..policies import ProfilePolicy
    from .profile_summary import classify, summarize

    summary = summarize(trace, steps)
    bottleneck, evidence = classify(summary, ProfilePolicy())
    return summary, bottleneck, evidence


class Profiler:
    """Captures of this rank, armed by `request` and run by the optimizer step hook (`install`)."""

    def __init__(
        self,
        health: ExporterHealth,
        max_steps: int,
        cooldown_seconds: float,
        directory: str,
        run: str,
        rank: int,
        keep: int = 4,
        max_trace_bytes: int = 64 * 1024 * 1024,
        reducer: Reducer = reduce_trace,
    ) -> None:
        self.health = health
        self.max_steps = max_steps
        self.cooldown_seconds = cooldown_seconds
        self.directory = os.path.join(directory, PROFILES_SUBDIRECTORY) if directory else ""
        self.name = f"{file_name_part(run)}-rank{rank}"
        self.keep = keep
        self.max_trace_bytes = max_trace_bytes
        self.reducer = reducer
        self.outcomes = dict.fromkeys(label_values.PROFILE_OUTCOMES, 0)
        self.armed = dict.fromkeys(label_values.PROFILE_TRIGGERS, 0)
        self.refused = 0
        self.running: Capture | None = None
        self.last: Capture | None = None
        self.cooldown_until = 0.0
        self._armed = 0  # steps asked for: written by the endpoint, taken by the training thread
        self._active: list[Any] | None = None  # [profile, steps left]: the training thread's only
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the endpoint and the capture's thread; never the training thread
        self._handle: Any = None

    def install(self) -> None:
        """Hook optimizer steps (profiling on only: off, no hook runs)."""
        self.remove_stale_scratch()
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self.on_step)

    def uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ---------------------------------------------------------------------------------------------------
    # the endpoint's thread

    def request(
        self,
        steps: int,
        trigger: str = "asked",
        peer_of: int | None = None,
        reason: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Arm a capture of `steps` steps for `trigger` (label_values.PROFILE_TRIGGERS): (HTTP status,
        answer). 202 armed; 400 a bad step count or trigger; 409 one runs; 429 in the cooldown after the
        last."""
        if not 1 <= steps <= self.max_steps:
            return 400, {"error": f"steps must be between 1 and {self.max_steps} (profile_max_steps)"}
        if trigger not in label_values.PROFILE_TRIGGERS:
            return 400, {"error": f"trigger must be one of {', '.join(label_values.PROFILE_TRIGGERS)}"}
        with self._lock:
            now = time.time()
            if self.running is not None:
                self.refused += 1
                return 409, {"error": "a capture is running", "capture": self.running.to_json()}
            if now < self.cooldown_until:
                self.refused += 1
                wait = round(self.cooldown_until - now, 3)
                return 429, {
                    "error": f"in the cooldown after the last capture for {wait} s",
                    "retry_after": wait,
                }
            self.running = Capture(
                next(self._ids), steps, now, trigger=trigger, peer_of=peer_of, reason=dict(reason or {})
            )
            self.armed[trigger] += 1
            self._armed = steps  # the training thread's next step boundary starts it
            return 202, {"capture": self.running.to_json()}

    def status(self) -> dict[str, Any]:
        """What runs now and what the last capture found."""
        with self._lock:
            running, last = self.running, self.last
        return {
            "running": running.to_json() if running else None,
            "last": last.to_json() if last else None,
            "cooldown_until": self.cooldown_until or None,
        }

    # ---------------------------------------------------------------------------------------------------
    # the training thread

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer post-step hook: one check a step while nothing is armed; never raises."""
        if not self._armed and self._active is None:
            return
        try:
            self._at_boundary()
        except Exception as error:  # never into training: the capture is abandoned
            self.health.error("profiler", error)
            self._abandon(error)

    def _at_boundary(self) -> None:
        active = self._active
        if active is None:
            steps, self._armed = self._armed, 0
            profile = torch.profiler.profile(
                activities=_activities(),
                schedule=_always_record,  # a schedule: torch marks each step (ProfilerStep#N) only with one
                profile_memory=True,
                experimental_config=_all_threads(),
            )
            self._active = [profile, steps]
            self._set_running(state="capturing", started_at=time.time())
            profile.start()
            return
        profile, left = active
        if left > 1:
            profile.step()  # ends ProfilerStep#N, begins N+1: the step boundaries in the trace
            active[1] = left - 1
            return
        self._active = None
        profile.stop()
        self._set_running(state="reducing")
        threading.Thread(target=self._reduce, args=(profile,), name="flare-profile", daemon=True).start()

    def _abandon(self, error: Exception) -> None:
        active, self._active, self._armed = self._active, None, 0
        if active is not None:
            try:
                active[0].stop()
            except Exception as stop_error:
                self.health.error("profiler", stop_error)
        self._end(state="failed", error=f"{type(error).__name__}: {error}"[:300])

    # ---------------------------------------------------------------------------------------------------
    # the capture's thread

    def _reduce(self, profile: Any) -> None:
        running = self.running
        if running is None:
            return
        try:
            with tempfile.TemporaryDirectory(
                prefix=self._scratch_prefix(), dir=self._scratch_parent()
            ) as scratch:
                path = os.path.join(scratch, "trace.json")
                profile.export_chrome_trace(path)
                with open(path) as handle:
                    trace = json.load(handle)
                summary, bottleneck, evidence = self.reducer(trace, running.steps)
                kept = self._keep(path, running.id, summary)
            summary_bytes = len(json.dumps(summary, separators=(",", ":")))
            self._end(
                state="captured",
                bottleneck=bottleneck,
                evidence=evidence,
                summary=summary,
                summary_bytes=summary_bytes,
                trace_path=kept,
            )
        except Exception as error:
            self.health.error("profiler", error)
            self._end(state="failed", error=f"{type(error).__name__}: {error}"[:300])

    def _scratch_parent(self) -> str | None:
        """Where a trace is exported before it is reduced: beside the kept ones (a rank killed while it
        exports leaves its scratch there, removed when the same rank starts again), else the temp dir."""
        if not self.directory:
            return None
        os.makedirs(self.directory, exist_ok=True)
        return self.directory

    def _scratch_prefix(self) -> str:
        return f".{self.name}-scratch-"

    def remove_stale_scratch(self) -> None:
        """Remove what a killed predecessor of this rank (same run and rank) left half-exported."""
        if self.directory and os.path.isdir(self.directory):
            for stale in Path(self.directory).glob(self._scratch_prefix() + "*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _keep(self, trace: str, capture: int, summary: Mapping[str, Any]) -> str:
        """Write the summary beside the incident files, and the raw trace if small enough; remove the
        oldest traces beyond `keep`. Returns the kept trace's path ('' for none)."""
        if not self.directory:
            return ""
        os.makedirs(self.directory, exist_ok=True)
        base = os.path.join(self.directory, f"{self.name}-capture{capture}")
        write_json_atomically(base + ".summary.json", dict(summary))
        if self.keep == 0 or os.path.getsize(trace) > self.max_trace_bytes:
            return ""
        kept = base + ".trace.json"
        if _same_device(trace, self.directory):
            os.replace(trace, kept)
        else:
            _copy(trace, kept)
        traces = sorted(Path(self.directory).glob(f"{self.name}-capture*.trace.json"), key=os.path.getmtime)
        for old in traces[: max(0, len(traces) - self.keep)]:
            old.unlink(missing_ok=True)
        return kept

    # ---------------------------------------------------------------------------------------------------

    def _set_running(self, **changes: Any) -> None:
        with self._lock:
            if self.running is not None:
                self.running = replace(self.running, **changes)

    def _end(self, **changes: Any) -> None:
        with self._lock:
            if self.running is None:
                return
            ended = replace(self.running, finished_at=time.time(), **changes)
            self.outcomes[ended.state] = self.outcomes.get(ended.state, 0) + 1
            self.last, self.running = ended, None
            self.cooldown_until = time.time() + self.cooldown_seconds


def _always_record(step: int) -> Any:
    return torch.profiler.ProfilerAction.RECORD


def _activities() -> list[Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _all_threads() -> Any:
    """Every thread of the rank (torch's `profile_all_threads`), where this torch offers it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def _same_device(path: str, directory: str) -> bool:
    return os.stat(path).st_dev == os.stat(directory).st_dev


def _copy(source: str, target: str) -> None:
    partial = target + ".partial"
    with open(source, "rb") as reading, open(partial, "wb") as writing:
        while chunk := reading.read(1 << 20):
            writing.write(chunk)
    os.replace(partial, target)  # whole or not at all: `flare report` never meets half a trace
