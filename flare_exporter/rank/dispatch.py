"""Host dispatch latency: every framework op of one step in N, timed from its dispatch to its return.

The step hook opens a sampling window on one step in `ild_dispatch_every_steps` and closes it at the next
step. Two timers, the same samples (one per op, tagged with the window's step):

- the native timer (cpp_recorder.py, csrc/dispatch_timer.cpp), when built: a torch RecordFunction observer,
  present
  only in windows, that times each aten op (nested ones too) in C++ for ~0.3 µs per op and leaves the
  samples in a bounded ring that the timing manager takes (collect()); nothing is handed over at close.
  Where the step hook is the extension's C function (progress.py), the sampler's first window hands the
  windows over to it: it opens and closes them itself, and no step runs Python. Should CUDA come up later
  (without the native shim), the timing manager's thread takes them back for the dispatch mode below;
- otherwise, and in processes that use CUDA without the native shim (cuda_hooks/, which samples kernel
  launches below Python; without it the window does, below), a TorchDispatchMode that sees each aten op
  after autograd and appends its duration to a bounded list, handed to the timing manager at the window's
  close. It costs several µs per op.

On a GPU an op returns once its kernel is launched, so this is dispatch plus launch; on CPU there is no
launch and the op runs to completion before it returns, so what is measured is the op's dispatch plus its
execution on the host. Either grows when the host is slowed (CPU contention, a busy interpreter, a noisy
neighbour). On GPUs the dispatch-mode window also times kernel issue latency: every op counts as a launch for
the kernel sampler, which records a CUDA event on the current stream for one in N.

Both timers also time the host gaps of the window's thread (the one that opened it: the training thread):
each stretch of its time outside top-level ops, from the window's open to its first op, from each op's
return to the next op's dispatch, and from its last op to the window's close. There the interpreter runs the
script, the thread waits for the GIL (an op releases it, and another Python thread may keep it for a switch
interval), the garbage collector runs, and the thread waits where no op runs (the data loader's queue, a
collective's wait, a sleep). A gap in which one of the process's collectives completed (the completion
callbacks note when: timing.LAST_COMPLETION, csrc/dispatch_timer.cpp) was a wait for it (DDP's at the end of
the backward pass, a work's wait()): it is left out, its time the collective phase's. With the native timer
the GIL wait after an op lies outside the op's timed interval, so only the gaps see it. The gaps are
samples of the host_gap distribution (ild.py), and their running total (host_gaps(): seconds, windows
measured whole) is what rank/perf.py reads at its phase hooks.
The dispatch mode times the gaps between its own calls (ops after autograd; inside an op it sees none).

Caveats: the mode is pushed and popped from the optimizer step hook, so ops between the last step and the
exporter's shutdown run through it (bounded: at most `MAX_SAMPLES` are kept); a mode pushed by user code
that is still active when a window ends stays under ours, and ours is then disabled and popped later.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from . import cpp_recorder
from .device_events import EventBackend
from .exporter_health import ExporterHealth
from .timing import LAST_COMPLETION, TimingManager

MAX_SAMPLES = 16384  # per window; beyond it ops are counted as dropped (ild_dispatch_samples)
WAIT_CHECKED_FROM_SECONDS = 20e-6  # shorter gaps are not checked for a collective's completion (a wait)


class DispatchWindow(TorchDispatchMode):
    """The mode of one sampling window: appends each op's dispatch-to-return time to `samples`, and on the
    thread that opened it, each gap between its ops (from the open, to the close) to `gaps`."""

    def __init__(self, kernels: Any = None, cuda_events: EventBackend | None = None) -> None:
        super().__init__()
        self.samples: list[float] = []
        self.dropped = 0
        self.enabled = True
        self.kernels = kernels if cuda_events is not None else None
        self.cuda_events = cuda_events
        self.thread = threading.get_ident()
        self.gaps: list[float] = []
        self.gap_seconds = 0.0
        self.gap_from = time.perf_counter()  # when the window thread's current gap began

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.enabled:
            return func(*args, **(kwargs or {}))
        if self.kernels is not None:
            self.kernels.on_launch(self.cuda_events)  # samples one in N itself; never raises
        started = time.perf_counter()
        own = threading.get_ident() == self.thread
        if own:
            self._end_gap(started)
        result = func(*args, **(kwargs or {}))
        ended = time.perf_counter()
        if own:
            self.gap_from = ended
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(ended - started)
        else:
            self.dropped += 1
        return result

    def _end_gap(self, now: float) -> None:
        gap = now - self.gap_from
        if gap >= WAIT_CHECKED_FROM_SECONDS and LAST_COMPLETION.last() >= self.gap_from:
            return  # a collective completed in it: a wait for that collective, not host time
        self.gap_seconds += gap
        if len(self.gaps) < MAX_SAMPLES:
            self.gaps.append(gap)
        else:
            self.dropped += 1

    def current_gap_seconds(self) -> float:
        """Its gaps so far, the current one included (on the window's thread, between ops)."""
        return self.gap_seconds + time.perf_counter() - self.gap_from

    def end(self) -> bool:
        """The window closes: on its own thread, its last gap ends now (True: its gaps are whole)."""
        if threading.get_ident() != self.thread:
            return False
        self._end_gap(time.perf_counter())
        return True


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
        steps: Any = None,
        gaps: Any = None,
    ) -> None:
        self.latency = latency
        self.gaps = gaps  # the host_gap IssueLatency (ild.py), None: gaps not kept
        self.kernels = kernels
        self.manager = manager
        self.every = every
        self.event_pool_size = event_pool_size
        self.health = health
        self.window: DispatchWindow | None = None
        self.window_step = 0
        self.steps = steps  # the StepTracker: its C hook can open and close the native timer's windows itself
        self.handed_over = False  # it does: the windows cost the training thread no Python
        self._windows_closed = 0
        self.stale: list[DispatchWindow] = []  # disabled windows that another mode kept us from popping
        self.native = cpp_recorder.load() if every else None  # None: dispatch-mode windows only
        if self.native is not None:  # each op's fastest time per step, compared with its baseline in C++
            latency.drift.keep_op_shift(self.native)
            LAST_COMPLETION.extension = self.native  # Python callbacks' completions, for its host gaps
        self.native_window_open = False
        self.launches_from_shim = False  # the native shim samples kernel launches: no need for the mode
        self._native_dropped = 0
        self._cuda_events: EventBackend | None = None
        self._cuda_checked = False
        self._mode_gap_seconds = 0.0  # the dispatch mode's windows' gaps, closed ones
        self._mode_gap_windows = 0

    def host_gaps(self) -> tuple[float, int]:
        """(seconds, windows): the window thread's host gaps in every window so far, the current gap included
        when called on that thread between ops, and the windows measured whole (both timers' together)."""
        seconds, windows = self._mode_gap_seconds, self._mode_gap_windows
        window = self.window
        if window is not None and window.enabled and threading.get_ident() == window.thread:
            seconds += window.current_gap_seconds()
        if self.native is not None:
            native_seconds, native_windows = self.native.host_gaps()
            return seconds + native_seconds, windows + native_windows
        return seconds, windows

    def on_step(self, steps: int) -> bool:
        """`steps` optimizer steps are done: close the open window; open one if step `steps` is sampled.

        The step tracker calls it on every `every`-th step and on the step after a call that returned true
        (a window to close, or a stale one to pop): the other steps run no Python (progress.py)."""
        try:
            if self.native_window_open or self.window is not None or self.stale:
                self._close()
            if self.every and steps % self.every == 0:
                self._open(steps)
        except Exception as error:
            self.health.error("dispatch_sampler", error)
        return self.native_window_open or self.window is not None or bool(self.stale)

    def close(self) -> None:
        """Close the open window, if any (at the exporter's shutdown); never raises."""
        try:
            if self.handed_over:
                self.handed_over = False
                self._counter().set_windows(0)  # closes its open window
            self._close()
        except Exception as error:
            self.health.error("dispatch_sampler", error)

    def cuda_events(self) -> EventBackend | None:
        """torch CUDA events once this process has initialised CUDA, else None (checked until then)."""
        if self._cuda_events is None and not self._cuda_checked:
            if _cuda_initialized():
                from .device_events import TorchCudaEvents

                self._cuda_events = TorchCudaEvents(self.health, self.event_pool_size)
                self._cuda_checked = True
        return self._cuda_events

    @property
    def window_open(self) -> bool:
        counter = self._counter()
        return self.native_window_open or self.window is not None or bool(counter and counter.window_open)

    @property
    def windows(self) -> int:
        """Windows opened and closed so far."""
        counter = self._counter()
        return self._windows_closed + (counter.windows_closed if counter is not None else 0)

    def collect(self) -> None:
        """Move the native timer's samples into the histogram (the timing manager's thread)."""
        if self.native is None:
            return
        if self.handed_over and not self.launches_from_shim and _cuda_initialized():
            self._take_back()
        op_shifts = self.latency.drift.op_shifts
        gaps = self.gaps
        for taken in self.native.take(self.latency.histogram.bounds):
            buckets = taken.buckets
            if buckets:  # a take may find only a window's last gap
                self.latency.add_counts(taken.step, buckets, taken.seconds)
                op_shifts.add(taken)
            if gaps is not None and (gap_buckets := taken.gap_buckets):
                gaps.add_counts(taken.step, gap_buckets, taken.gap_seconds)
        dropped = self.native.dropped_samples()
        if dropped > self._native_dropped:
            self.health.drop("ild_dispatch_samples", dropped - self._native_dropped)
            self._native_dropped = dropped

    def _open(self, step: int) -> None:
        self.latency.active = True
        if self.gaps is not None:
            self.gaps.active = True
        self.window_step = step
        cuda_events = self.cuda_events()
        if self.native is not None and (cuda_events is None or self.launches_from_shim):
            if self._hand_over():
                return
            self.native.open_window(step)
            self.native_window_open = True
            return
        window = DispatchWindow(self.kernels, cuda_events)
        window.__enter__()
        self.window = window

    def _counter(self) -> Any:
        """The step hook's C counter (csrc/steps.cpp), if the hook is the C function."""
        return getattr(self.steps, "counter", None)

    def _hand_over(self) -> bool:
        """Give the windows to the C step hook, which opens this step's window and every `every`-th step's
        after it, and closes each at the next step, with no Python; False where the hook is Python's."""
        counter = self._counter()
        if counter is None:
            return False
        self.steps.set_listener(None, 0)
        counter.set_windows(self.every)
        self.handed_over = True
        return True

    def _take_back(self) -> None:
        """CUDA came up after the hand-over: windows need the dispatch mode, whose ops record CUDA events."""
        self.handed_over = False
        self._counter().set_windows(0)  # closes its open window
        self.steps.set_listener(self.on_step, self.every)

    def _close(self) -> None:
        self._pop_stale()
        if self.native_window_open:
            self.native_window_open = False
            self.native.close_window()  # type: ignore[union-attr]  # open only with a native timer
            self._windows_closed += 1
            return
        window = self.window
        if window is None:
            return
        self.window = None
        if window.end():
            self._mode_gap_seconds += window.gap_seconds
            self._mode_gap_windows += 1
        window.enabled = False
        if _get_current_dispatch_mode() is window:
            window.__exit__(None, None, None)
        else:  # a mode pushed after ours is still active: ours stays under it, disabled, until it leaves
            self.stale.append(window)
        self._windows_closed += 1
        if window.dropped:
            self.health.drop("ild_dispatch_samples", window.dropped)
        if window.samples:
            self.manager.submit(partial(self.latency.add_many, self.window_step, window.samples))
        if window.gaps and self.gaps is not None:
            self.manager.submit(partial(self.gaps.add_many, self.window_step, window.gaps))

    def _pop_stale(self) -> None:
        while self.stale and _get_current_dispatch_mode() is self.stale[-1]:
            self.stale.pop().__exit__(None, None, None)


def _cuda_initialized() -> bool:
    """This process has initialised CUDA: a Python flag, no device query on a drain or a step."""
    return torch.cuda.is_initialized()
