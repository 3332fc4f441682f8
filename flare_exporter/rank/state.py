"""The state one rank's exporter keeps; hooks write it, collectors read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from . import shim
from .canary import Canary
from .exporter_health import ExporterHealth
from .gpu_health import GpuHealthMonitor
from .groups import GroupTracker
from .identity import RankIdentity
from .ild import IldState
from .last_word import RaisedException, ScrapeTimes, Termination
from .perf import PerfMonitor
from .profiler import Profiler
from .progress import StepTracker
from .stall import StackSample
from .straggler_windows import StepWindows
from .timing import TimingManager


@dataclass
class FlareState:
    """Everything the collectors read. `identity` may be replaced (never mutated) once the job starts."""

    config: Config
    identity: RankIdentity
    health: ExporterHealth
    manager: TimingManager
    steps: StepTracker
    windows: StepWindows  # straggler windows, advanced at every timing-manager drain
    groups: dict[str, GroupTracker] = field(default_factory=dict)
    gpu: GpuHealthMonitor | None = None  # the rank's own GPU (None: GPU health disabled)
    stack: StackSample | None = None  # the training thread while it makes no progress (stall watcher)
    exception: RaisedException | None = None  # the exception ending the rank (incident.IncidentWriter)
    terminated: Termination | None = None  # the signal ending the rank (incident.IncidentWriter)
    scrapes: ScrapeTimes = field(default_factory=ScrapeTimes)  # when /metrics was scraped (exposition)
    ild: IldState | None = None  # issue-latency distributions and their samplers
    shim_feed: shim.ShimFeed | None = None  # the launch shim's ring reader (None: the shim is not loaded)
    canary: Canary | None = None  # the hardware canary (None: canary off)
    perf: PerfMonitor | None = None  # where the step time goes, MFU (None: perf off)
    profiler: Profiler | None = None  # captures of a few steps (None: profile off)

    @classmethod
    def create(cls, config: Config, identity: RankIdentity) -> FlareState:
        health = ExporterHealth()
        manager = TimingManager(health, config.queue_size, config.timing_interval_seconds)
        steps = StepTracker(health)
        manager.after_drain.append(steps.report_errors)
        groups: dict[str, GroupTracker] = {}
        windows = StepWindows(
            steps, groups, health, config.straggler_window_steps, config.straggler_windows, manager.finished
        )
        manager.add_group(windows)  # its forget_finished() runs at the end of every drain
        ild = IldState(config, health, manager, steps)
        shim_feed = shim.attach(ild, manager, steps, health)  # reads the shim's ring if it is preloaded
        return cls(
            config=config,
            identity=identity,
            health=health,
            manager=manager,
            steps=steps,
            windows=windows,
            groups=groups,
            ild=ild,
            shim_feed=shim_feed,
        )
