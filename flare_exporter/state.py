"""The state one rank's exporter keeps; hooks write it, collectors read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import Config
from .groups import GroupTracker
from .health import ExporterHealth
from .identity import RankIdentity
from .progress import StepTracker
from .stall import StackSample
from .timing import TimingManager


@dataclass
class FlareState:
    """Everything the collectors read. `identity` may be replaced (never mutated) once the job starts."""

    config: Config
    identity: RankIdentity
    health: ExporterHealth
    manager: TimingManager
    steps: StepTracker
    groups: dict[str, GroupTracker] = field(default_factory=dict)
    stack: StackSample | None = None  # the training thread while it makes no progress (stall watcher)
    exception: tuple[str, float] | None = None  # type and Unix time of the exception ending the rank

    @classmethod
    def create(cls, config: Config, identity: RankIdentity) -> FlareState:
        health = ExporterHealth()
        return cls(
            config=config,
            identity=identity,
            health=health,
            manager=TimingManager(health, config.queue_size, config.timing_interval_seconds),
            steps=StepTracker(health),
        )
