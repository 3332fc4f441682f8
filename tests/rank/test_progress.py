"""The global optimizer step hook: which steps count, their durations, boundaries, listeners, the heartbeat.

Each behaviour is checked on both hooks: the extension's C function (csrc/steps.cpp) and StepTracker.on_step.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import torch_extension

from flare_exporter import label_values
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.progress import STEP_BOUNDARIES_KEPT, StepTracker, wall_time


def make_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


@pytest.fixture(params=["native", "python"])
def tracker(request: pytest.FixtureRequest) -> Iterator[StepTracker]:
    """An installed tracker whose hook is the C function (native) or StepTracker.on_step (python)."""
    native = request.param == "native"
    if native:
        torch_extension()
    installed = StepTracker(ExporterHealth())
    installed.install(native=native)
    assert (installed.counter is not None) == native
    try:
        yield installed
    finally:
        installed.remove()


def test_steps_of_the_first_optimizer_count_once_each(tracker: StepTracker):
    first, second = make_optimizer(), make_optimizer()
    before = time.perf_counter()
    for _ in range(3):
        first.step()
        second.step()  # a second optimizer in the same iteration is not a second step
    after = time.perf_counter()
    tracker.remove()
    make_optimizer().step()  # after remove(), nothing is counted
    assert tracker.steps == 3
    assert before < tracker.last_step_at < after  # perf_counter's clock, for the heartbeat
    buckets, total = tracker.durations.snapshot()
    assert buckets[-1] == ("+Inf", 2)  # durations are gaps between steps
    assert 0 < total < after - before
    assert [label for label, _ in buckets[:-1]] == [
        repr(bound) for bound in label_values.STEP_DURATION_BUCKETS
    ]
    assert [step for step, _ in tracker.boundaries_after(0)] == [1, 2, 3]
    times = [at for _, at in tracker.boundaries_after(0)]
    assert times == sorted(times) and times[-1] == tracker.last_step_at
    assert total == pytest.approx(times[-1] - times[0])


def test_once_the_counted_optimizer_is_gone_the_next_one_is_counted(tracker: StepTracker):
    first, second = make_optimizer(), make_optimizer()
    first.step()
    second.step()
    assert tracker.steps == 1
    del first
    gc.collect()
    second.step()
    second.step()
    assert tracker.steps == 3


def test_durations_fall_into_their_buckets(tracker: StepTracker):
    optimizer = make_optimizer()
    optimizer.step()
    time.sleep(0.04)  # the step's duration itself, not a wait for something
    optimizer.step()
    counts = dict(tracker.durations.snapshot()[0])  # cumulative
    assert counts["0.0316"] == 0 and counts["0.1"] == 1  # 40 ms: in the 100 ms bucket, not below


def test_only_the_last_boundaries_are_kept(tracker: StepTracker):
    optimizer = make_optimizer()
    for _ in range(STEP_BOUNDARIES_KEPT + 5):
        optimizer.step()
    boundaries = tracker.boundaries_after(0)
    assert len(boundaries) == STEP_BOUNDARIES_KEPT
    assert boundaries[0][0] == 6 and boundaries[-1][0] == STEP_BOUNDARIES_KEPT + 5
    if tracker.counter is not None:  # the drain's incremental read
        assert [step for step, _ in tracker.counter.boundaries(STEP_BOUNDARIES_KEPT + 3)] == [
            STEP_BOUNDARIES_KEPT + 4,
            STEP_BOUNDARIES_KEPT + 5,
        ]


def test_the_listener_runs_only_on_its_steps_and_on_the_step_after_a_true_answer(tracker: StepTracker):
    calls: list[int] = []

    def listener(step: int) -> bool:
        calls.append(step)
        return step == 4  # a window opened at step 4 asks to be closed at step 5

    tracker.set_listener(listener, 4)
    optimizer = make_optimizer()
    for _ in range(13):
        optimizer.step()
    assert calls == [4, 5, 8, 12]
    tracker.set_listener(None, 0)
    optimizer.step()
    assert calls == [4, 5, 8, 12] and tracker.steps == 14


def test_a_listener_that_raises_is_counted_and_training_goes_on(tracker: StepTracker):
    def broken(step: int) -> bool:
        raise ValueError("listener bug")

    tracker.set_listener(broken, 1)
    optimizer = make_optimizer()
    optimizer.step()
    optimizer.step()
    tracker.report_errors()  # the timing manager's thread, for the C function's count
    tracker.report_errors()  # counted once
    assert tracker.health.errors["step_hook"] == 2 and tracker.steps == 2


def test_ctrl_c_in_a_listener_still_stops_training(tracker: StepTracker):
    def interrupted(step: int) -> bool:
        raise KeyboardInterrupt

    tracker.set_listener(interrupted, 1)
    with pytest.raises(KeyboardInterrupt):
        make_optimizer().step()
    assert tracker.steps == 1


def test_a_failing_python_hook_is_counted_not_raised():
    health = ExporterHealth()
    tracker = StepTracker(health)
    tracker.on_step(None, (), {})  # weakref.ref(None) fails inside the hook
    assert health.errors["step_hook"] == 1 and tracker.steps == 0


def test_the_c_hook_ignores_calls_it_cannot_read():
    tracker = StepTracker(ExporterHealth())
    torch_extension()
    hook = tracker.hook(native=True)
    assert tracker.counter is not None
    hook()  # no optimizer: nothing to count, nothing raised
    hook(None, (), {})  # None is not weakly referenceable: counted by identity alone
    assert tracker.steps == 1


def test_wall_time_converts_a_perf_counter_reading_to_unix_time():
    assert abs(wall_time(time.perf_counter()) - time.time()) < 1.0
    assert abs(wall_time(time.perf_counter() - 60) - (time.time() - 60)) < 1.0
