"""Host dispatch latency: a dispatch mode that times every framework op of one step in N.

A TorchDispatchMode sees each aten op after autograd, on the thread that runs it; the time from entering
the op's dispatch to its return is the host issue path. On a GPU the op returns once its kernel is launched,
so this is dispatch plus launch; on CPU there is no launch and the op runs to completion before it returns,
so what is measured is the op's dispatch plus its execution on the host. Either grows when the host is
slowed (CPU contention, a busy interpreter, a noisy neighbour).

Timing every op costs a few microseconds each, so the mode is active only in sampling windows: the step hook
opens a window on one step in `ild_dispatch_every_steps` and closes it at the next step. The mode appends
durations to a bounded list; at the window's close the list is handed to the timing manager, which turns it
into histogram counts off the training thread. On GPUs the window also times kernel issue latency: every op
counts as a launch for the kernel sampler, which records a CUDA event on the current stream for one in N.

Caveats: the mode is pushed and popped from the optimizer step hook, so ops between the last step and the
exporter's shutdown run through it (bounded: at most `MAX_SAMPLES` are kept); a mode pushed by user code
that is still active when a window ends stays under ours, and ours is then disabled and popped later.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from .health import ExporterHealth
from .timing import EventBackend, TimingManager

MAX_SAMPLES = 16384  # per window; beyond it ops are counted as dropped (ild_dispatch_samples)


class DispatchWindow(TorchDispatchMode):
    """The mode of one sampling window: appends each op's dispatch-to-return time to `samples`."""

    def __init__(self, kernels: Any = None, cuda_events: EventBackend | None = None) -> None:
        super().__init__()
        self.samples: list[float] = []
        self.dropped = 0
        self.enabled = True
        self.kernels = kernels if cuda_events is not None else None
        self.cuda_events = cuda_events

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.enabled:
            return func(*args, **(kwargs or {}))
        if self.kernels is not None:
            self.kernels.on_launch(self.cuda_events)  # samples one in N itself; never raises
        started = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - started
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(elapsed)
        else:
            self.dropped += 1
        return result


class DispatchSampler:
    """Opens a DispatchWindow on one step in `every` (0: never), from the step hook on the training thread."""

    def __init__(
        self,
        latency: Any,
        kernels: Any,
        manager: TimingManager,
        every: int,
        event_pool_size: int,
        health: ExporterHealth,
    ) -> None:
        self.latency = latency
        self.kernels = kernels
        self.manager = manager
        self.every = every
        self.event_pool_size = event_pool_size
        self.health = health
        self.window: DispatchWindow | None = None
        self.window_step = 0
        self.windows = 0
        self.stale: list[DispatchWindow] = []  # disabled windows that another mode kept us from popping
        self._cuda_events: EventBackend | None = None
        self._cuda_checked = False

    def on_step(self, steps: int) -> None:
        """`steps` optimizer steps are done: close the open window; open one if step `steps` is sampled."""
        try:
            self._close()
            if self.every and steps % self.every == 0:
                self._open(steps)
        except Exception as error:
            self.health.error("dispatch_sampler", error)

    def close(self) -> None:
        """Close the open window, if any (at the exporter's shutdown); never raises."""
        try:
            self._close()
        except Exception as error:
            self.health.error("dispatch_sampler", error)

    def cuda_events(self) -> EventBackend | None:
        """torch CUDA events once this process has initialised CUDA, else None (checked until then)."""
        if self._cuda_events is None and not self._cuda_checked:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                from .timing import TorchCudaEvents

                self._cuda_events = TorchCudaEvents(self.health, self.event_pool_size)
                self._cuda_checked = True
        return self._cuda_events

    def _open(self, step: int) -> None:
        self.latency.active = True
        window = DispatchWindow(self.kernels, self.cuda_events())
        window.__enter__()
        self.window = window
        self.window_step = step

    def _close(self) -> None:
        self._pop_stale()
        window = self.window
        if window is None:
            return
        self.window = None
        window.enabled = False
        if _get_current_dispatch_mode() is window:
            window.__exit__(None, None, None)
        else:  # a mode pushed after ours is still active: ours stays under it, disabled, until it leaves
            self.stale.append(window)
        self.windows += 1
        if window.dropped:
            self.health.drop("ild_dispatch_samples", window.dropped)
        if window.samples:
            self.manager.submit(partial(self.latency.add_many, self.window_step, window.samples))

    def _pop_stale(self) -> None:
        while self.stale and _get_current_dispatch_mode() is self.stale[-1]:
            self.stale.pop().__exit__(None, None, None)
