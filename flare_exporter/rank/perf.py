"""Where a rank's step time goes: phases per step, model FLOPs, achieved FLOP/s and MFU (inside the rank).

Two halves, like the rest of the rank side:

- PhaseClock, on the training thread: the time in the DataLoader iterator's `__next__` (patched on the class,
  no user code) and in `optimizer.step` (torch's global optimizer pre- and post-step hooks), as running
  totals, and the host gaps' running total (dispatch.py's host_gaps(): the training thread's time outside
  top-level ops in the host dispatch windows, and the windows measured whole), read at the same hooks so
  that the gaps inside the data loader and the optimizer step stay theirs; at every step's end it appends a
  StepMark to a bounded queue. With flare's extension built the step counter keeps the clock in C
  (csrc/steps.cpp: the pre hook is a C function too, the marks are its own), so a step runs no Python
  for it; without, the hooks below. On one
  sampled step (`perf_flops_step`) it counts the model's FLOPs with torch.utils.flop_counter, from the end
  of the step before to the end of that step: forward, backward and optimizer, every op through one
  Python dispatch mode for that step only.
- PerfMonitor, on the timing manager's thread: the straggler windows (straggler_windows.py) hand it each
  complete step with its duration and its collective time not overlapped by compute (exposed_by_role: in
  total and by the role of the group waited on); it takes the clock's marks, and adds the step's seconds
  per phase to its totals (compute: the rest), and its collective phase by role, scaled to the phase
  where the phase was cut to what the step left, so that the roles add up to the phase. The
  host phase of a step that a window covered whole is its gaps outside the data loader and the optimizer
  step (the gaps in which a collective completed, waits for it, are not host gaps: dispatch.py), within
  what is left of the step once data, optimizer and exposed collective time are taken out; a step
  without a window gets the last HOST_SHARE_STEPS measured steps' share of what is left (a window opens on
  one step in `ild_dispatch_every_steps`). Not on GPUs: there the backward pass runs on autograd's device
  threads while the training thread waits between ops, and the device, not the gaps, says whether the host
  held it. From
  the FLOPs per step and the mean of the last `perf_window_steps` step times: achieved FLOP/s, and MFU
  against `peak_flops` or the dense BF16 peak of the GPU model (PEAK_FLOPS, by NVML name).

What no single rank can know - which rank the others waited for - is left to the engine and the rules
(engine/perf.py: the badput ledger), from every rank's exposed collective time per step.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from time import perf_counter
from types import MappingProxyType
from typing import Any, NamedTuple

from .. import label_values
from ..config import Config
from .exporter_health import ExporterHealth

STEP_MARKS_KEPT = 4096  # marks the manager has not taken yet (it takes them at every drain)
HOST_SHARE_STEPS = 8  # measured steps whose host share a step without a window gets (sum over sum)
NO_ROLES: Mapping[str, float] = MappingProxyType({})  # a step handed over without its wait by group role

# Dense BF16/FP16 tensor-core peak FLOP/s by GPU model, matched as a substring of the NVML name (longest
# first, so that "H100 PCIe" wins over "H100"). Vendor data sheets; sparsity not counted.
PEAK_FLOPS = {
    "B200": 2.25e15,
    "B100": 1.75e15,
    "GH200": 989e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}


class StepMark(NamedTuple):
    """The phase clock's running totals at a step's end (seconds; windows: host dispatch windows measured
    whole, -1 where the host gaps are not measured)."""

    step: int
    data: float
    optimizer: float
    gaps: float  # the host gaps so far
    phase_gaps: float  # of them, those inside the data loader's next and optimizer.step
    windows: int


HostGaps = Callable[[], tuple[float, int]]  # dispatch.DispatchSampler.host_gaps: (seconds, windows)


def peak_flops_of(device_name: str) -> float | None:
    """The table's peak FLOP/s for a GPU named `device_name` (NVML's name), None if it is not in the table."""
    for model in sorted(PEAK_FLOPS, key=len, reverse=True):
        if model in device_name:
            return PEAK_FLOPS[model]
    return None


class PhaseClock:
    """The training thread's hooks: data-loader and optimizer time, and FLOPs on the sampled step."""

    def __init__(
        self,
        steps: Any,
        health: ExporterHealth,
        flops_step: int,
        host_gaps: HostGaps | None = None,
        window_every: int = 0,
    ) -> None:
        self.steps = (
            steps  # StepTracker: its count includes the step whose post hook runs (its hook is first)
        )
        self.health = health
        self.flops_step = flops_step
        # None: not measured (no windows, or a GPU process). The windows open on every `window_every`-th step
        # boundary and close at the next (dispatch.py): the gaps move only then, and are read only then.
        self.host_gaps = host_gaps if window_every > 0 else None
        self.window_every = window_every
        self.windowed = False  # the step running now is in a window
        self.data_seconds = 0.0  # running totals, written by the training thread only
        self.optimizer_seconds = 0.0
        self.phase_gap_seconds = 0.0  # host gaps inside the data loader's next and optimizer.step
        self._optimizer_gaps = 0.0
        self._gaps = (0.0, 0 if self.host_gaps is not None else -1)  # the last reading
        self.marks: deque[tuple[int, float, float, float, float, int]] = deque(maxlen=STEP_MARKS_KEPT)
        self.counter: Any = None  # the step counter's C phase clock (csrc/steps.cpp), where it keeps it
        self.counted_flops: float | None = None  # FLOPs of the sampled step, once counted
        self._flop_counter: Any = None
        self._optimizer: weakref.ref[Any] | None = None
        self._optimizer_started = 0.0
        self._training_thread = threading.get_ident()
        self._handles: list[Any] = []
        self._original_next: Any = None

    def install(self) -> None:
        """Hook every optimizer's step and DataLoader iterator, present and future (training thread)."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        from torch.utils.data import dataloader

        self._training_thread = threading.get_ident()
        counter = getattr(self.steps, "counter", None)  # the step counter's C hook, where it is built
        if counter is not None:
            self.counter = counter
            counter.set_phases(True, self.host_gaps is not None)
            if self.flops_step:
                counter.set_phase_listener(self.on_flops_step, self.flops_step - 1)
            self._handles = [register_optimizer_step_pre_hook(counter.start_hook)]
        else:
            self._handles = [
                register_optimizer_step_pre_hook(self.before_optimizer_step),
                register_optimizer_step_post_hook(self.after_optimizer_step),
            ]
        iterator_class = dataloader._BaseDataLoaderIter
        original = self._original_next = iterator_class.__next__
        clock = self

        def timed_next(iterator: Any) -> Any:
            if threading.get_ident() != clock._training_thread:
                return original(iterator)
            started = perf_counter()
            gaps = clock.gap_seconds() if clock.in_window() else None
            try:
                return original(iterator)
            finally:
                gap_seconds = clock.gap_seconds() - gaps if gaps is not None else 0.0
                clock.add_data(perf_counter() - started, gap_seconds)

        timed_next.__wrapped__ = original  # type: ignore[attr-defined]
        iterator_class.__next__ = timed_next  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.counter is not None:
            self.counter.set_phases(False, False)
            self.counter.set_phase_listener(None, 0)
            self.counter = None
        if self._original_next is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self._original_next  # type: ignore[method-assign]
            self._original_next = None

    def _counts(self, optimizer: Any) -> bool:
        """Whether `optimizer` is the one whose steps count (the first to step, as StepTracker counts)."""
        counted = self._optimizer() if self._optimizer is not None else None
        if counted is None:
            self._optimizer = weakref.ref(optimizer)
            return True
        return counted is optimizer

    def in_window(self) -> bool:
        """The step running now is in a host dispatch window whose gaps the clock reads."""
        if self.counter is not None:
            return self.counter.window_open and self.counter.phase_gaps  # type: ignore[no-any-return]
        return self.windowed

    def add_data(self, seconds: float, gap_seconds: float) -> None:
        """The data loader's next took `seconds`, of which `gap_seconds` host gaps (the training thread)."""
        if self.counter is not None:
            self.counter.add_data(seconds, gap_seconds)
        else:
            self.data_seconds += seconds
            self.phase_gap_seconds += gap_seconds

    def take_marks(self) -> list[tuple[int, float, float, float, float, int]]:
        """The marks since the last take, oldest first (the timing manager's thread)."""
        if self.counter is not None:
            return self.counter.take_marks()  # type: ignore[no-any-return]
        marks = self.marks
        return [marks.popleft() for _ in range(len(marks))]

    @property
    def measures_gaps(self) -> bool:
        return self.host_gaps is not None

    def stop_gaps(self) -> None:
        """Read the host gaps no more (a GPU process: module docstring); any thread."""
        self.host_gaps = None
        self._gaps = (0.0, -1)
        if self.counter is not None:
            self.counter.set_phases(True, False)

    def gap_seconds(self) -> float:
        """The host gaps so far (0 where not measured); never raises."""
        return self._host_gaps()[0]

    def _host_gaps(self) -> tuple[float, int]:
        if self.host_gaps is None:
            return 0.0, -1
        try:
            return self.host_gaps()
        except Exception as error:  # never into training
            self.health.error("perf_hook", error)
            self.host_gaps = None
            return 0.0, -1

    def _read_gaps(self) -> None:
        """Read the host gaps where a window closes or opens (they move only inside windows): `_gaps`."""
        reading = self._host_gaps()
        if self.host_gaps is not None:  # not stopped meanwhile
            self._gaps = reading

    def before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_started = perf_counter()
        if self.windowed:
            self._optimizer_gaps = self.gap_seconds()

    def after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step's end: its mark. Runs at every step on the training thread, so the common path is kept
        to a few attribute reads (the optimizer's weak reference, the step count, one clock reading)."""
        try:
            counted = self._optimizer
            if (counted is None or counted() is not optimizer) and not self._counts(optimizer):
                return
            step = self.steps.steps
            every = self.window_every
            if self.host_gaps is not None and (every == 1 or step % every < 2):  # a window closes or opens
                self._read_gaps()
            gaps, windows = self._gaps
            started = self._optimizer_started
            if started:
                self.optimizer_seconds += perf_counter() - started
                if self.windowed:
                    self.phase_gap_seconds += gaps - self._optimizer_gaps
                self._optimizer_started = 0.0
            self.windowed = self.host_gaps is not None and step % every == 0
            self.marks.append(
                (step, self.data_seconds, self.optimizer_seconds, gaps, self.phase_gap_seconds, windows)
            )
            if self._flop_counter is not None or (self.flops_step and step == self.flops_step - 1):
                self.on_flops_step(step)
        except Exception as error:  # never into training
            self.health.error("perf_hook", error)

    def on_flops_step(self, step: int) -> bool:
        """Start counting FLOPs at the end of step `perf_flops_step` - 1, stop at the next step's end: whether
        to be called at the next step too (the C counter's phase listener; never raises)."""
        try:
            if self._flop_counter is None:
                self._start_counting()
                return True
            return not self._stop_counting()
        except Exception as error:  # never into training
            self.health.error("perf_hook", error)
            return False

    def _start_counting(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        counter.__enter__()
        self._flop_counter = counter

    def _stop_counting(self) -> bool:
        """Stop counting, unless a mode pushed after ours is still active (then: again at the next step)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        counter = self._flop_counter
        if _get_current_dispatch_mode() is not counter.mode:
            return False
        self._flop_counter = None
        counter.__exit__(None, None, None)
        self.counted_flops = float(counter.get_total_flops())
        return True


class PerfMonitor:
    """The manager's side: seconds per phase over complete steps, achieved FLOP/s and MFU."""

    def __init__(
        self, clock: PhaseClock | None, config: Config, device_name: Callable[[], str] = lambda: ""
    ) -> None:
        self.clock = clock
        self.configured_flops = config.model_flops_per_step or None
        self.configured_peak = config.peak_flops or None
        self.flops_step = config.perf_flops_step
        self.device_name = device_name
        self.phase_seconds = dict.fromkeys(
            label_values.STEP_PHASES, 0.0
        )  # replaced whole at every step: readers copy
        self.collective_by_role: dict[str, float] = {}  # the collective phase by group role; replaced whole
        self.steps = 0
        self.host_measured = False  # a step's host gaps were measured: the host phase is exported
        self.recent: deque[float] = deque(maxlen=config.perf_window_steps)
        self._pending: deque[tuple[int, float, float, Mapping[str, float]]] = deque(maxlen=STEP_MARKS_KEPT)
        self._marks: dict[int, StepMark] = {}
        self._host_measured: deque[tuple[float, float]] = deque(maxlen=HOST_SHARE_STEPS)  # (host, rest)
        self._newest_mark = 0
        self._peak: float | None = None
        self._peak_checked = False
        self._gaps_measured = clock is not None and clock.measures_gaps  # not in a GPU process: _take_marks

    @property
    def flops_per_step(self) -> float | None:
        if self.configured_flops is not None:
            return self.configured_flops
        return self.clock.counted_flops if self.clock is not None else None

    @property
    def achieved_flops(self) -> float | None:
        flops, recent = self.flops_per_step, list(self.recent)
        if flops is None or not recent or sum(recent) <= 0:
            return None
        return flops * len(recent) / sum(recent)

    @property
    def peak_flops(self) -> float | None:
        if self.configured_peak is not None:
            return self.configured_peak
        if not self._peak_checked:
            name = self.device_name()
            if name:
                self._peak, self._peak_checked = peak_flops_of(name), True
        return self._peak

    @property
    def mfu(self) -> float | None:
        achieved, peak = self.achieved_flops, self.peak_flops
        return achieved / peak if achieved is not None and peak else None

    def on_step(
        self, step: int, step_seconds: float, exposed: float, by_role: Mapping[str, float] = NO_ROLES
    ) -> None:
        """A complete step (the straggler windows' listener, under the drain lock); `by_role`: `exposed` by
        the role of the group waited on."""
        self._pending.append((step, step_seconds, exposed, by_role))
        self._take_marks()
        while self._pending:
            step, step_seconds, exposed, by_role = self._pending[0]
            if self.clock is not None and step > self._newest_mark:
                return  # its end's mark is not there yet: the hook after the step counter's has not run
            self._pending.popleft()
            bubble = by_role.get(label_values.P2P_ROLE, 0.0)  # waits in sends and receives: the bubble phase
            roles = {role: seconds for role, seconds in by_role.items() if role != label_values.P2P_ROLE}
            collective = self._account(step, step_seconds, exposed - bubble, bubble)
            self._account_roles(roles, exposed - bubble, collective)

    def _take_marks(self) -> None:
        if self.clock is None:
            return
        if self._gaps_measured and torch_cuda_initialized():  # a GPU process: no host phase (docstring)
            self._gaps_measured = False
            self.clock.stop_gaps()
        for taken in self.clock.take_marks():
            mark = StepMark(*taken)
            self._marks[mark.step] = mark
            self._newest_mark = max(self._newest_mark, mark.step)
        for old in [step for step in self._marks if step < self._newest_mark - STEP_MARKS_KEPT]:
            del self._marks[old]

    def _account(self, step: int, step_seconds: float, exposed: float, bubble: float = 0.0) -> float:
        """Add the step's seconds per phase (`exposed`: its collective waits, `bubble`: its waits in sends
        and receives); its collective phase's seconds."""
        end, start = self._marks.get(step), self._marks.pop(step - 1, None)  # step's end: the next's start
        data = optimizer = 0.0
        gaps: float | None = None  # the step's host gaps outside data and optimizer, if a window covered it
        if end is not None and start is not None:
            data, optimizer = max(0.0, end.data - start.data), max(0.0, end.optimizer - start.optimizer)
            gaps = step_gaps(start, end)
        waits = min(exposed + bubble, max(0.0, step_seconds - data - optimizer))
        collective = waits * exposed / (exposed + bubble) if exposed + bubble > 0 else 0.0
        rest = max(0.0, step_seconds - data - optimizer - waits)
        host = self._host(gaps, rest, measuring=self._gaps_measured and end is not None and end.windows >= 0)
        seconds = dict(self.phase_seconds)
        seconds["data"] += data
        seconds["optimizer"] += optimizer
        seconds["collective"] += collective
        seconds["bubble"] += waits - collective
        seconds["host"] += host
        seconds["compute"] += rest - host
        self.phase_seconds = seconds
        self.steps += 1
        if step != self.flops_step:  # the counted step ran every op through Python: not a step to average
            self.recent.append(step_seconds)
        return collective

    def _account_roles(self, by_role: Mapping[str, float], exposed: float, collective: float) -> None:
        """Add the step's collective phase by role: each role's exposed seconds, scaled by the share of the
        exposed time the phase kept (all of it, unless the step's data and optimizer time cut it)."""
        if not by_role or exposed <= 0.0:
            return
        kept = collective / exposed
        seconds = dict(self.collective_by_role)
        for role, exposed_seconds in by_role.items():
            seconds[role] = seconds.get(role, 0.0) + exposed_seconds * kept
        self.collective_by_role = seconds

    def _host(self, gaps: float | None, rest: float, measuring: bool) -> float:
        """The step's host phase: its host gaps, within the rest of the step; unmeasured, the last measured
        steps' share of their rest (none while nothing measures)."""
        measured = self._host_measured
        if not measuring:
            measured.clear()
            return 0.0
        if gaps is None:
            total_rest = sum(rest for _, rest in measured)
            return sum(host for host, _ in measured) / total_rest * rest if total_rest > 0 else 0.0
        host = min(gaps, rest)
        measured.append((host, rest))
        self.host_measured = True
        return host


def step_gaps(start: StepMark, end: StepMark) -> float | None:
    """The host gaps of the step between two marks outside the data loader and the optimizer step, if one
    window covered it whole (it opened at the start's step hook and closed at the end's); else None."""
    if start.windows < 0 or end.windows - start.windows != 1:
        return None
    return max(0.0, (end.gaps - start.gaps) - (end.phase_gaps - start.phase_gaps))


def torch_cuda_initialized() -> bool:
    """This process has initialised CUDA (a Python flag; no device query)."""
    import torch

    return torch.cuda.is_initialized()
