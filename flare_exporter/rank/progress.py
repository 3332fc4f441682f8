"""Training progress: optimizer steps, step duration and the heartbeat, from a global optimizer hook."""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import label_values
from . import cpp_recorder
from .exporter_health import ExporterHealth
from .histogram import Histogram

# Step boundaries kept for the straggler windows (straggler_windows.py), which consume them within a
# drain or two.
STEP_BOUNDARIES_KEPT = 4096


def wall_time(perf_time: float) -> float:
    """Unix time of a `time.perf_counter()` reading; hooks read one clock, scrapes convert."""
    return time.time() - (time.perf_counter() - perf_time)


class StepTracker:
    """Counts the steps of the first optimizer that steps, their durations, and recent step boundaries.

    With flare's extension built (cpp_recorder.py), the hook is a C function and the counts live in its
    StepCounter (csrc/steps.cpp): a step runs no Python. Without it, `on_step` below is the hook. Either
    way the training thread is the only writer, and the readers below take no lock.
    """

    def __init__(self, health: ExporterHealth) -> None:
        self.health = health
        self.counter: Any = None  # the extension's StepCounter, once installed with it
        self._steps = 0
        self._durations = Histogram(label_values.STEP_DURATION_BUCKETS)
        self._last_step_at = 0.0  # perf_counter time of the last step: step durations and the heartbeat
        self._boundaries: deque[tuple[int, float]] = deque(maxlen=STEP_BOUNDARIES_KEPT)
        self._listener: Callable[[int], Any] | None = None
        self._every = 0
        self._call_next = False
        self._listener_errors = 0
        self._optimizer: weakref.ref[Any] | None = None
        self._handle: Any = None

    def install(self, native: bool = True) -> None:
        """Hook every optimizer's step(), present and future, without touching user code."""
        self._handle = register_optimizer_step_post_hook(self.hook(native))

    def hook(self, native: bool = True) -> Callable[[Any, Any, Any], None]:
        """The step hook: the extension's C function where it is built (and `native`), else `on_step`."""
        extension = cpp_recorder.load() if native and self.counter is None else None
        if extension is not None:
            self.counter = extension.StepCounter(
                list(label_values.STEP_DURATION_BUCKETS), STEP_BOUNDARIES_KEPT
            )
            self.counter.set_listener(self._listener, self._every)
        return self.counter.hook if self.counter is not None else self.on_step  # type: ignore[no-any-return]

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def set_listener(self, listener: Callable[[int], Any] | None, every: int) -> None:
        """Call `listener(steps)` on the training thread after every `every`-th step (0: none) and after
        the step that follows any call that returned true; None removes it."""
        self._listener, self._every, self._call_next = listener, every, False
        if self.counter is not None:
            self.counter.set_listener(listener, every)

    @property
    def steps(self) -> int:
        return self.counter.steps if self.counter is not None else self._steps

    @steps.setter
    def steps(self, steps: int) -> None:  # the synthetic ranks of benchmarks/scale.py
        self._steps = steps

    @property
    def last_step_at(self) -> float:
        return self.counter.last_step_at if self.counter is not None else self._last_step_at

    @last_step_at.setter
    def last_step_at(self, at: float) -> None:
        self._last_step_at = at

    @property
    def durations(self) -> Histogram:
        if self.counter is None:
            return self._durations
        counts, total = self.counter.durations()
        return Histogram(label_values.STEP_DURATION_BUCKETS, counts, total)

    def boundaries_after(self, step: int) -> list[tuple[int, float]]:
        """(step, perf_counter time) of the kept steps (the last STEP_BOUNDARIES_KEPT) after `step`,
        oldest first: each reader reads from the last boundary it has seen."""
        if self.counter is not None:
            return self.counter.boundaries(step)  # type: ignore[no-any-return]
        return [boundary for boundary in list(self._boundaries) if boundary[0] > step]

    def report_errors(self) -> None:
        """Count the listener's exceptions that the native hook caught (the timing manager's thread)."""
        errors = self.counter.listener_errors if self.counter is not None else 0
        if errors > self._listener_errors:
            self.health.error("step_hook", None, errors - self._listener_errors)
            self._listener_errors = errors

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            counted = self._optimizer() if self._optimizer is not None else None
            if counted is None:
                self._optimizer = weakref.ref(optimizer)
            elif counted is not optimizer:
                return  # a second optimizer in the same iteration: one step is counted once
            now = time.perf_counter()
            if self._last_step_at:
                self._durations.observe(now - self._last_step_at)
            self._last_step_at = now
            self._steps += 1
            self._boundaries.append((self._steps, now))
            every, listener = self._every, self._listener
            if listener is not None and (self._call_next or (every and self._steps % every == 0)):
                self._call_next = bool(listener(self._steps))
        except Exception as error:
            self.health.error("step_hook", error)
