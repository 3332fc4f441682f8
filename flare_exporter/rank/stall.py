"""When the training thread stops making progress: where it is, what it waits on, and the incident file.

A StallWatcher thread compares the time of the rank's last progress (an optimizer step or a collective
issued) with `stall_seconds` and `hang_seconds`. It wakes when the first of them could have passed since
the last progress it saw (a training rank: once every `stall_seconds`, not every second; each wake of a
thread cost about 0.1 ms of CPU on the virtual machine it was measured on), and every second or so while
the rank is stalled:

- stalled for `stall_seconds`: it samples the training thread's innermost Python frames and says what the
  thread is doing (`collective`: a collective of its own is unfinished, or it sits in torch.distributed;
  `data`: it is inside torch.utils.data; else `compute`). flare_rank_stack_info shows the sample; it is
  withdrawn as soon as progress resumes.
- stalled for `hang_seconds` after the rank's first progress (start-up is not a hang): it writes the rank's
  incident file once per stall (see incident.py).

Sampling reads `sys._current_frames()`; the training thread is never stopped, locked or signalled.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

FRAMES_KEPT = 3
FRAMES_MAX_CHARS = 240
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flare_exporter/
_WORKLOADS_DIR = os.path.join(_PACKAGE_DIR, "local", "workloads")  # training scripts: their frames count


@dataclass(frozen=True)
class StackSample:
    """What the training thread was doing when sampled; `frames` innermost first."""

    activity: str
    frames: tuple[str, ...]

    def frames_label(self) -> str:
        """The frames as one bounded label value: `file:line function < caller < ...`."""
        text = " < ".join(self.frames)
        return text if len(text) <= FRAMES_MAX_CHARS else text[: FRAMES_MAX_CHARS - 3] + "..."


def describe_frame(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


def innermost_frames(frame: FrameType | None, kept: int = FRAMES_KEPT) -> list[FrameType]:
    """The `kept` innermost frames of a stack, leaving out flare-exporter's own."""
    frames: list[FrameType] = []
    while frame is not None and len(frames) < kept:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR) or path.startswith(_WORKLOADS_DIR):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _in(frame: FrameType, path_part: str) -> bool:
    return path_part in frame.f_code.co_filename.replace(os.sep, "/")


def sample_thread(thread_id: int, waiting_on_collective: bool) -> StackSample | None:
    """The stack sample of thread `thread_id`, or None if the thread is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    stack: list[FrameType] = []
    walker: FrameType | None = frame
    while walker is not None and len(stack) < 64:  # what the thread is inside, beyond the frames shown
        stack.append(walker)
        walker = walker.f_back
    if any(_in(f, "torch/utils/data/") for f in stack):
        activity = "data"
    elif waiting_on_collective or any(_in(f, "torch/distributed/") for f in stack[:8]):
        activity = "collective"
    else:
        activity = "compute"
    return StackSample(activity, tuple(describe_frame(f) for f in innermost_frames(frame)))


def last_progress(state: Any) -> float:
    """perf_counter time of the rank's last progress: a step or a collective issued (0 if none yet)."""
    return max([state.steps.last_step_at] + [group.progress_at() for group in list(state.groups.values())])


class StallWatcher:
    """Background thread that samples a stalled training thread and writes the incident of a hang."""

    def __init__(self, state: Any, training_thread_id: int, on_hang: Any) -> None:
        self.state = state
        self.training_thread_id = training_thread_id
        self.on_hang = on_hang  # called once per stall that lasts hang_seconds (writes the incident file)
        self.started_at = time.perf_counter()
        config = state.config
        # frames are sampled by the time a hang can be declared: by half the hang threshold at the latest
        self.stall_seconds = min(config.stall_seconds, config.hang_seconds / 2)
        self.interval = min(1.0, self.stall_seconds / 2)
        self._reported_stall_since = -1.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flare-stall", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            try:
                now = time.perf_counter()
                self.check(now)
                wait = self.seconds_to_next_check(now)
            except Exception as error:  # the watcher must outlive anything it reads
                self.state.health.error("stall_watcher", error)
                wait = self.interval

    def seconds_to_next_check(self, now: float) -> float:
        """Until the first threshold could pass since the last progress; `interval` while stalled."""
        config = self.state.config
        threshold = min(self.stall_seconds, config.hang_seconds)
        idle = now - (last_progress(self.state) or self.started_at)
        return self.interval if idle >= threshold else max(self.interval, threshold - idle)

    def check(self, now: float) -> None:
        state = self.state
        since = last_progress(state) or self.started_at
        idle = now - since
        if idle < self.stall_seconds:
            state.stack = None
        else:
            state.manager.drain()  # in-flight collectives as of now
            state.stack = sample_thread(self.training_thread_id, self._waiting_on_collective(now))
        if last_progress(state) and idle >= state.config.hang_seconds and since != self._reported_stall_since:
            self._reported_stall_since = since
            self.on_hang(f"no progress for {idle:.0f} s (hang_seconds={state.config.hang_seconds:g})")

    def _waiting_on_collective(self, now: float) -> bool:
        stall = self.stall_seconds
        return any(
            group.in_flight is not None and now - group.in_flight.issued_at >= stall
            for group in list(self.state.groups.values())
        )
