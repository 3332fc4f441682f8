"""The global optimizer step hook: which steps count, their durations, and the heartbeat clock."""

from __future__ import annotations

import time

import torch

from flare_exporter.health import ExporterHealth
from flare_exporter.progress import StepTracker, wall_time


def make_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_steps_of_the_first_optimizer_count_once_each():
    tracker = StepTracker(ExporterHealth())
    tracker.install()
    try:
        first, second = make_optimizer(), make_optimizer()
        for _ in range(3):
            first.step()
            second.step()  # a second optimizer in the same iteration is not a second step
    finally:
        tracker.remove()
    make_optimizer().step()  # after remove(), nothing is counted
    assert tracker.steps == 3
    buckets, total = tracker.durations.snapshot()
    assert buckets[-1] == ("+Inf", 2)  # durations are gaps between steps
    assert total > 0


def test_a_failing_hook_is_counted_not_raised():
    health = ExporterHealth()
    tracker = StepTracker(health)
    tracker.on_step(None, (), {})  # weakref.ref(None) fails inside the hook
    assert health.errors["step_hook"] == 1 and tracker.steps == 0


def test_wall_time_converts_a_perf_counter_reading_to_unix_time():
    assert abs(wall_time(time.perf_counter()) - time.time()) < 1.0
    assert abs(wall_time(time.perf_counter() - 60) - (time.time() - 60)) < 1.0
