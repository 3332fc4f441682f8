"""Training progress: optimizer steps, step duration and the heartbeat, from a global optimizer hook."""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from . import spec
from .health import ExporterHealth
from .histogram import Histogram

# Step boundaries kept for the straggler windows (stragglers.py), which consume them within a drain or two.
STEP_BOUNDARIES_KEPT = 4096


def wall_time(perf_time: float) -> float:
    """Unix time of a `time.perf_counter()` reading; hooks read one clock, scrapes convert."""
    return time.time() - (time.perf_counter() - perf_time)


class StepTracker:
    """Counts the steps of the first optimizer that steps; written by the training thread only."""

    def __init__(self, health: ExporterHealth) -> None:
        self.health = health
        self.steps = 0
        self.durations = Histogram(spec.STEP_DURATION_BUCKETS)
        self.last_step_at = 0.0  # perf_counter time of the last step: step durations and the heartbeat
        # (step number, perf_counter time) of recent steps; appended here, read by the straggler windows
        self.boundaries: deque[tuple[int, float]] = deque(maxlen=STEP_BOUNDARIES_KEPT)
        # Called with the step count after each counted step, on the training thread (ILD sampling windows)
        self.step_listeners: list[Callable[[int], None]] = []
        self._optimizer: weakref.ref[Any] | None = None
        self._handle: Any = None

    def install(self) -> None:
        """Hook every optimizer's step(), present and future, without touching user code."""
        self._handle = register_optimizer_step_post_hook(self.on_step)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            counted = self._optimizer() if self._optimizer is not None else None
            if counted is None:
                self._optimizer = weakref.ref(optimizer)
            elif counted is not optimizer:
                return  # a second optimizer in the same iteration: one step is counted once
            now = time.perf_counter()
            if self.last_step_at:
                self.durations.observe(now - self.last_step_at)
            self.last_step_at = now
            self.steps += 1
            self.boundaries.append((self.steps, now))
            for listener in self.step_listeners:
                listener(self.steps)
        except Exception as error:
            self.health.error("step_hook", error)
