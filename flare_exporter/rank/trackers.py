"""The perf monitor's summary and each capture's verdict, in the experiment tracker the run already uses
(inside the rank; `experiment_trackers: auto`, the default).

No code in the training script: a tracker is used where the script made it active.

- Weights & Biases: `wandb.run` is set (the script called `wandb.init`, on the ranks it chose). flare's
  numbers go into the run's summary (the latest values, on the run's page and in the runs table): its
  history's steps are the script's, which a second writer from another thread would race.
- TensorBoard: the script made a `torch.utils.tensorboard.SummaryWriter`. flare learns its log directory
  when the writer is made (the class's __init__, wrapped once the module is imported: ImportWatch), and
  writes its own event files in `<log dir>/flare-rank<N>`, a run of its own beside the script's in
  TensorBoard's run list; the script's writer is never touched.

What goes there, every `tracker_interval_seconds` (looked at after the timing manager's drains, logged on a
thread of its own: never the training thread, never holding a drain up): flare/step_seconds (mean over the
perf window), flare/mfu where known, flare/share/<phase> and the rank's own bottleneck class
(BottleneckPolicy on its phases; `flare perf` weighs the ranks together); and once per capture:
flare/profile/step_seconds, flare/profile/share/<part>, its bottleneck class and
evidence as text. An error stops that tracker, counted in the exporter's health; training never sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import label_values
from ..policies import BottleneckPolicy
from .exporter_health import ExporterHealth

TENSORBOARD_MODULE = "torch.utils.tensorboard.writer"


def perf_numbers(perf: Any) -> tuple[dict[str, float], str]:
    """The perf monitor's numbers to log (flare/...) and the rank's own class ('' before a step)."""
    recent = list(perf.recent)
    phases = dict(perf.phase_seconds)
    total = sum(phases.values())
    if not recent or total <= 0:
        return {}, ""
    shares = {phase: seconds / total for phase, seconds in phases.items()}
    numbers = {"flare/step_seconds": sum(recent) / len(recent)}
    numbers.update({f"flare/share/{phase}": round(share, 6) for phase, share in shares.items()})
    if (mfu := perf.mfu) is not None:
        numbers["flare/mfu"] = mfu
    return numbers, BottleneckPolicy().classify(shares)


def capture_numbers(capture: Any) -> dict[str, float]:
    """A captured profile's numbers to log (flare/profile/...)."""
    summary = capture.summary
    numbers = {}
    if isinstance(step := summary.get("step_seconds"), int | float):
        numbers["flare/profile/step_seconds"] = float(step)
    shares = summary.get("shares")
    for part in label_values.PROFILE_PARTS if isinstance(shares, Mapping) else ():
        if isinstance(value := shares.get(part), int | float):
            numbers[f"flare/profile/share/{part}"] = float(value)
    return numbers


def capture_text(capture: Any) -> str:
    return f"{capture.bottleneck} (capture {capture.id}, {capture.trigger}): {json.dumps(capture.evidence)}"


class WandbRun:
    """The script's active W&B run (wandb.run), if it has one."""

    name = "wandb"

    def active(self) -> bool:
        wandb = sys.modules.get("wandb")
        return wandb is not None and getattr(wandb, "run", None) is not None

    def log(self, numbers: Mapping[str, float], step: int, texts: Mapping[str, str]) -> None:
        sys.modules["wandb"].run.summary.update({**numbers, **texts, "flare/step": step})


class TensorBoardRuns:
    """flare's own SummaryWriter beside each log directory the script's writers write to."""

    name = "tensorboard"

    def __init__(self, rank: Callable[[], int]) -> None:
        self.rank = rank
        self.log_dirs: list[str] = []  # appended by the wrapped SummaryWriter.__init__ (any thread)
        self.writers: dict[str, Any] = {}

    def seen(self, log_dir: str) -> None:
        if log_dir not in self.log_dirs and len(self.log_dirs) < 8:
            self.log_dirs.append(log_dir)

    def active(self) -> bool:
        return bool(self.log_dirs)

    def log(self, numbers: Mapping[str, float], step: int, texts: Mapping[str, str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        class FlareWriter(SummaryWriter):  # type: ignore[misc]
            flare_own = True  # not the script's: the wrapped __init__ does not report it

        for log_dir in list(self.log_dirs):
            writer = self.writers.get(log_dir)
            if writer is None:
                writer = self.writers[log_dir] = FlareWriter(f"{log_dir}/flare-rank{self.rank()}")
            for tag, value in numbers.items():
                writer.add_scalar(tag, value, step)
            for tag, text in texts.items():
                writer.add_text(tag, text, step)
            writer.flush()


class ImportWatch(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` is imported (now, if it already is)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then

    def install(self) -> None:
        if self.name in sys.modules:
            self.then(sys.modules[self.name])
        else:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the real finders find it
        found = importlib.machinery.PathFinder.find_spec(fullname, path)
        if found is None or found.loader is None:
            return found
        loader, then = found.loader, self.then

        class Watched(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)  # type: ignore[attr-defined]
                then(module)

        found.loader = Watched()
        return found


def wrap_summary_writer(module: Any, runs: TensorBoardRuns, health: ExporterHealth) -> None:
    """Wrap `module.SummaryWriter.__init__` to tell `runs` each log directory a writer is made for."""
    cls = module.SummaryWriter
    if getattr(cls, "flare_wrapped", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (what it wraps)
        original(self, *args, **kwargs)
        try:
            if not getattr(self, "flare_own", False):
                runs.seen(str(self.get_logdir()))
        except Exception as error:
            health.error("tracker", error)

    cls.__init__ = __init__
    cls.flare_wrapped = True


class Trackers:
    """Logs the perf summary every `interval` seconds and each new capture once, to the active trackers;
    `after_drain` runs at the end of every timing-manager drain and starts the logging thread when due."""

    def __init__(self, state: Any, interval: float, trackers: list[Any], health: ExporterHealth) -> None:
        self.state = state
        self.interval = interval
        self.trackers = trackers
        self.health = health
        self.logged_at = 0.0
        self.logged_capture = 0
        self.lock = threading.Lock()  # held by the logging thread: one at a time

    def after_drain(self) -> None:
        """Log on a thread of its own when one is due: a tracker that blocks (a slow log directory, a wedged
        W&B service) must not hold the drain, and the scrapes behind it, up. One at a time."""
        if not self.due() or not self.lock.acquire(blocking=False):
            return
        threading.Thread(target=self._log_once, name="flare-trackers", daemon=True).start()

    def due(self) -> bool:
        """A tracker is active, and the interval passed or a capture ended since the last log."""
        if not any(tracker.active() for tracker in self.trackers):
            return False
        last = self.state.profiler.last if self.state.profiler is not None else None
        new_capture = last is not None and last.id != self.logged_capture and last.state == "captured"
        return new_capture or time.monotonic() - self.logged_at >= self.interval

    def _log_once(self) -> None:
        try:
            self._log()
        except Exception as error:
            self.health.error("tracker", error)
        finally:
            self.lock.release()

    def _log(self) -> None:
        active = [tracker for tracker in self.trackers if tracker.active()]
        if not active:
            return
        numbers: dict[str, float] = {}
        texts: dict[str, str] = {}
        now = time.monotonic()
        if now - self.logged_at >= self.interval:
            self.logged_at = now
            if self.state.perf is not None:
                numbers, bottleneck = perf_numbers(self.state.perf)
                texts.update({"flare/bottleneck": bottleneck} if bottleneck else {})
        last = self.state.profiler.last if self.state.profiler is not None else None
        if last is not None and last.id != self.logged_capture and last.state == "captured":
            self.logged_capture = last.id
            numbers.update(capture_numbers(last))
            texts["flare/profile/verdict"] = capture_text(last)
        if not numbers and not texts:
            return
        step = int(self.state.steps.steps)
        for tracker in active:
            try:
                tracker.log(numbers, step, texts)
            except Exception as error:  # that tracker stops; the others and training go on
                self.health.error(f"tracker_{tracker.name}", error)
                self.trackers.remove(tracker)


def make_trackers(state: Any) -> Trackers | None:
    """The trackers of a rank with `experiment_trackers: auto`, logged at every drain; None when off."""
    config = state.config
    if config.experiment_trackers != "auto":
        return None
    tensorboard = TensorBoardRuns(lambda: state.identity.rank)
    ImportWatch(
        TENSORBOARD_MODULE, lambda module: wrap_summary_writer(module, tensorboard, state.health)
    ).install()
    trackers = Trackers(state, config.tracker_interval_seconds, [WandbRun(), tensorboard], state.health)
    state.manager.after_drain.append(trackers.after_drain)
    return trackers
