"""ILD: drift math on buckets, the baseline and window ring, the samplers, and the collector, on CPU."""

from __future__ import annotations

import time
from bisect import bisect_left
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import ild_state, torch_extension
from prometheus_client import generate_latest

from flare_exporter import label_values
from flare_exporter.engine.scrape import parse
from flare_exporter.rank import attach, cpp_recorder, fake_device
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.fake_device import FakeDevice
from flare_exporter.rank.ild import Drift, bucket_points, drift
from flare_exporter.rank.state import FlareState

BOUNDS = label_values.ISSUE_LATENCY_BUCKETS


def test_bucket_points_are_log_midpoints():
    points = bucket_points((1.0, 10.0, 100.0))
    assert points == pytest.approx([10**-0.5, 10**0.5, 10**1.5, 100.0])


def test_identical_distributions_have_no_drift():
    counts = [0, 5, 10, 5, 0]
    assert drift(counts, [0, 10, 20, 10, 0], bucket_points((1.0, 2.0, 4.0, 8.0))) == (0.0, 0.0)


def test_a_shift_by_one_bucket_moves_ks_to_one_and_w1_to_the_bucket_step():
    points = bucket_points((1.0, 2.0, 4.0, 8.0))
    ks, wasserstein = drift([0, 10, 0, 0, 0], [0, 0, 10, 0, 0], points)
    assert ks == 1.0
    assert wasserstein == pytest.approx(points[2] - points[1])


def test_half_the_mass_moving_gives_ks_one_half():
    ks, _ = drift([0, 10, 10, 0, 0], [0, 20, 0, 0, 0], bucket_points((1.0, 2.0, 4.0, 8.0)))
    assert ks == pytest.approx(0.5)


def test_drift_needs_samples_on_both_sides():
    with pytest.raises(ValueError):
        drift([0, 0], [1, 0], [1.0, 2.0])


def test_baseline_then_a_ring_of_the_last_steps():
    tracker = Drift((1.0, 2.0), warmup_steps=2, baseline_steps=3, window_steps=2, min_samples=2)
    for step in range(5):
        tracker.add_counts(step, [(0, 4)])
    assert tracker.baseline == [12, 0, 0]  # steps 2, 3, 4
    tracker.refresh()
    assert tracker.current is None  # no window yet
    tracker.add_counts(5, [(1, 4)])
    tracker.add_counts(6, [(1, 4)])
    tracker.refresh()
    assert tracker.current is not None and tracker.current[0] == 1.0
    tracker.add_counts(7, [(0, 4)])  # step 5 leaves the window
    tracker.add_counts(5, [(2, 100)])  # a late sample of a step that left: ignored
    assert sorted(tracker.windows) == [6, 7]
    tracker.refresh()
    assert tracker.current[0] == pytest.approx(0.5)


def test_counts_of_a_step_are_added_at_once():
    tracker = Drift((1.0, 2.0), warmup_steps=1, baseline_steps=2, window_steps=2, min_samples=1)
    steps = {0: [(0, 9)], 1: [(0, 3), (2, 1)], 2: [(1, 2)], 3: [], 4: [(0, 1), (1, 5)], 5: [(2, 7)]}
    for step, buckets in steps.items():
        tracker.add_counts(step, buckets)
    assert tracker.baseline == [3, 2, 1]  # steps 1 and 2
    assert tracker.windows == {4: [1, 5, 0], 5: [0, 0, 7]}
    assert tracker.window() == [1, 5, 7]  # the window's steps summed
    tracker.add_counts(3, [(0, 50)])  # a late step that left the window: ignored
    assert tracker.windows == {4: [1, 5, 0], 5: [0, 0, 7]} and tracker.window() == [1, 5, 7]
    tracker.add_counts(6, [(1, 2)])  # step 4 leaves the window, and its counts the sum
    tracker.add_counts(5, [(0, 1)])
    assert tracker.windows == {5: [1, 0, 7], 6: [0, 2, 0]} and tracker.window() == [1, 2, 7]


def op_shift_tracker(baseline: dict[str, list[float]], window_steps: int = 2) -> Any:
    """The extension's OpShift, whose baseline steps 0..n-1 gave each op these fastest times."""
    steps = len(next(iter(baseline.values())))
    tracker = torch_extension().OpShift(warmup_steps=0, baseline_steps=steps, window_steps=window_steps)
    for step in range(steps):
        tracker.add_minimums(step, {op: times[step] for op, times in baseline.items()})
    return tracker


# short ops, stable in their baseline ("view" MAD 15 ns: 5 % of its median; "detach" 10 ns), and long ones,
# "addmm" noisy (MAD 2 µs); each op weighs 1 / MAD^2, so "detach" decides the weighted median
BASELINE = {
    "view": [300e-9, 310e-9, 290e-9, 300e-9, 320e-9, 280e-9, 300e-9],
    "detach": [100e-9, 110e-9, 90e-9, 100e-9, 100e-9, 90e-9, 110e-9],
    "addmm": [20e-6, 22e-6, 18e-6, 20e-6, 25e-6, 16e-6, 20e-6],
    "mm": [8e-6, 8.2e-6, 7.8e-6, 8e-6, 8.1e-6, 7.9e-6, 8e-6],
    "relu": [5e-6, 5.1e-6, 4.9e-6, 5e-6, 5e-6, 5.2e-6, 4.8e-6],
}
MEDIANS = {"view": 300e-9, "detach": 100e-9, "addmm": 20e-6, "mm": 8e-6, "relu": 5e-6}


def test_per_op_shift_estimates_a_delay_added_to_every_op():
    tracker = op_shift_tracker(BASELINE)
    assert tracker.shift() is None and tracker.references is None  # no window yet
    for step in (7, 8):  # every op 150 ns slower
        slower = {op: median + 150e-9 for op, median in MEDIANS.items()}
        tracker.add_minimums(step, {**slower, "new": 1e-6})
    # the long ops' relative change (under 3 %) is taken for a proportional part: a few ns off
    assert tracker.shift() == pytest.approx(150e-9, abs=5e-9)
    assert tracker.references == len(MEDIANS)  # "new" has no baseline


def test_a_slower_core_moves_every_op_in_proportion_and_is_no_shift():
    tracker = op_shift_tracker(BASELINE)
    for step in (7, 8):  # every op x1.5: a vCPU slowed down, not the issue path
        tracker.add_minimums(step, {op: median * 1.5 for op, median in MEDIANS.items()})
    assert tracker.shift() == pytest.approx(0.0, abs=1e-12)


def test_per_op_shift_ignores_a_noisy_op_and_is_zero_when_nothing_moved():
    tracker = op_shift_tracker(BASELINE)
    tracker.add_minimums(7, {**MEDIANS, "addmm": 60e-6})  # addmm 40 µs slower
    tracker.add_minimums(8, {**MEDIANS, "addmm": 61e-6})
    assert tracker.shift() == pytest.approx(0.0, abs=1e-12)
    tracker.add_minimums(9, {"view": 900e-9, "detach": 600e-9})  # step 7 leaves the window: 8 and 9
    assert tracker.window_steps == [8, 9]
    assert tracker.shift() == 0.0  # +500 ns in the newer half only: a burst, not a shift
    tracker.add_minimums(10, {"view": 700e-9, "detach": 500e-9})  # steps 9 and 10: both slower
    assert tracker.shift() == pytest.approx(400e-9)  # the half nearer zero: step 10's (detach decides)
    tracker.add_minimums(8, {"view": 1e-3})  # a late sample of a step that has left the window
    assert tracker.window_steps == [9, 10] and tracker.shift() == pytest.approx(400e-9)
    tracker.add_minimums(10, {"detach": 450e-9})  # more of step 10: each op's fastest time is kept
    assert tracker.shift() == pytest.approx(350e-9)


def test_per_op_shift_is_taken_on_each_half_of_the_window():
    tracker = op_shift_tracker(BASELINE, window_steps=4)
    for step, view in ((7, 500e-9), (8, 300e-9), (9, 600e-9), (10, 500e-9)):
        tracker.add_minimums(step, {"view": view})
    # halves (7, 8) and (9, 10): each op's median over the half, +100 ns and +250 ns; the nearer zero
    assert tracker.shift() == pytest.approx(100e-9)


def test_an_op_needs_enough_baseline_steps_to_count():
    tracker = op_shift_tracker({"view": [300e-9] * 4})  # 4 < the 5 baseline steps an op needs
    tracker.add_minimums(4, {"view": 1e-6})
    assert tracker.shift() is None and tracker.references == 0  # the references are taken at the first shift


def test_the_drift_reads_the_per_op_shift_at_each_refresh():
    tracker = Drift((1.0,), warmup_steps=0, baseline_steps=7, window_steps=2, min_samples=1)
    tracker.keep_op_shift(torch_extension())
    for step in range(7):
        tracker.add_counts(step, [(0, 1)])
        tracker.op_shifts.add_minimums(step, {op: times[step] for op, times in BASELINE.items()})
    tracker.refresh()
    assert tracker.op_shift is None
    for step in (7, 8):
        tracker.add_counts(step, [(0, 1)])
        tracker.op_shifts.add_minimums(step, {op: median + 150e-9 for op, median in MEDIANS.items()})
    tracker.refresh()
    assert tracker.op_shift == pytest.approx(150e-9, abs=5e-9)


def test_too_few_samples_export_no_drift():
    tracker = Drift((1.0,), warmup_steps=0, baseline_steps=1, window_steps=4, min_samples=10)
    tracker.add_counts(0, [(0, 50)])
    tracker.add_counts(1, [(1, 9)])
    tracker.refresh()
    assert tracker.current is None


# ---------------------------------------------------------------------------------------------------------
# the samplers, in a rank's state


def make_state(**overrides) -> FlareState:
    """ild_state, every kernel launch sampled."""
    return ild_state("ild", **{"ild_launch_sample_every": 1, **overrides})


@pytest.fixture
def state():
    """ILD installed, every fake-device launch sampled (as a rank with the shim samples a GPU's)."""
    state = make_state()
    state.ild.install()
    state.steps.install()
    fake_device.sample_launches(state.ild, state.config.ild_events)
    yield state
    fake_device.set_launch_hook(None)
    state.steps.remove()
    state.ild.remove()
    state.manager.stop()


def fake_step(
    state: FlareState, device: FakeDevice, optimizer, kernels: int = 16, stall: float = 0.0
) -> None:
    """One step of a host that launches ahead of a busy device; a stall mid-way lets the queue drain."""
    for _ in range(8):  # some host ops for the dispatch windows to time
        torch.ones(4).add_(1)
    for index in range(kernels):
        if stall and index == kernels // 2:
            time.sleep(stall)
        device.launch(0.002)
    optimizer.step()
    device.synchronize(timeout=30)
    state.manager.drain()


def test_a_host_stall_every_step_collapses_kernel_issue_latency(state):
    device = FakeDevice()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        for _ in range(12):  # warm-up and baseline
            fake_step(state, device, optimizer)
        for _ in range(3):
            fake_step(state, device, optimizer)
        healthy = state.ild.kernel_issue.drift.current
        for _ in range(3):  # the whole window now stalls half-way through its launches
            fake_step(state, device, optimizer, stall=0.03)
        stalled = state.ild.kernel_issue.drift.current
    finally:
        device.close()
    assert healthy is not None and stalled is not None
    assert healthy[0] < 0.3
    assert stalled[0] >= 0.4  # half the kernels now find an empty queue
    assert stalled[1] > 5e-3  # and start ~8 queued kernels (2 ms each) sooner
    assert state.health.errors == {}


def test_a_fake_device_is_sampled_by_the_exporter_attached_to_its_process(monkeypatch):
    """As train_ddp.py's --fake-kernels under flare-run: the script knows nothing of the exporter."""
    state = make_state()
    assert not FakeDevice().sampled  # no exporter attached: nothing samples it
    monkeypatch.setattr(attach, "_attachment", SimpleNamespace(state=state))
    device = FakeDevice()
    try:
        for _ in range(5):
            device.launch(0.001)
        device.synchronize(timeout=30)
        state.manager.drain()
    finally:
        device.close()
        state.manager.stop()
    assert device.sampled and fake_device._launch_hook is None  # closed: no longer sampled
    assert state.ild.kernels.launches == 5 and sum(state.ild.kernel_issue.histogram.counts) == 5
    assert state.health.errors == {}


def test_dispatch_windows_open_on_one_step_in_n_and_time_every_op(dispatch_timer):
    state = make_state(ild_dispatch_every_steps=3)
    assert (state.ild.dispatch.native is not None) == (dispatch_timer == "native")
    state.ild.install()
    state.steps.install()
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    try:
        for _ in range(9):
            (weight * 2).sum().backward()
            optimizer.step()
        state.manager.drain()
        # opened when 3, 6 and 9 steps were done, each closed at the next step; the last is still open
        assert state.ild.dispatch.windows == 2 and state.ild.dispatch.window_open
        assert state.ild.dispatch.handed_over == (dispatch_timer == "native")  # to the C step hook
        assert state.ild.host_dispatch.active
        histogram = state.ild.host_dispatch.histogram
        # two windows of one step: mul, sum, their backward and the SGD update, a few to tens of ops each
        assert 8 <= sum(histogram.counts) < 200
        assert 0 < histogram.sum < 0.5
        assert set(state.ild.host_dispatch.drift.windows) <= {3, 6}  # samples carry their window's step
        # with the native timer, each op's fastest time in both windows went to the baseline (steps 2 to 11);
        # the dispatch mode's own Python per op is too noisy for the per-op shift
        op_shifts = state.ild.host_dispatch.drift.op_shifts
        if dispatch_timer == "native":
            assert 3 <= len(op_shifts.baseline) <= 60
            assert all(len(times) == 2 and 0 < min(times) < 0.5 for times in op_shifts.baseline.values())
        else:
            assert op_shifts is None
    finally:
        state.steps.remove()
        state.ild.remove()
    assert not state.ild.dispatch.window_open and state.ild.dispatch.windows == 3
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    state.manager.drain()
    assert state.health.errors == {} and state.health.dropped == {}


def test_the_c_step_hook_takes_the_windows_over_and_gives_them_back_when_cuda_comes_up(monkeypatch):
    from flare_exporter.rank import dispatch

    torch_extension()
    state = make_state(ild_dispatch_every_steps=2, ild_launch_sample_every=10**6)
    sampler = state.ild.dispatch
    calls: list[int] = []
    on_step = sampler.on_step

    def counted(step: int) -> bool:
        calls.append(step)
        return on_step(step)

    monkeypatch.setattr(sampler, "on_step", counted)
    state.steps.install()
    state.ild.install()
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def steps(count: int) -> None:
        for _ in range(count):
            (weight * 2).sum().backward()
            optimizer.step()

    try:
        steps(6)
        # Python ran once, at the first window's step; the C hook opened windows at 2, 4, 6, closed 2 of them
        assert calls == [2] and sampler.handed_over
        assert sampler.windows == 2 and sampler.window_open
        state.manager.drain()
        assert state.ild.host_dispatch.active and sum(state.ild.host_dispatch.histogram.counts) >= 8
        assert set(state.ild.host_dispatch.drift.windows) <= {2, 4}
        # a GPU job that initialises CUDA after attach, without the native shim: at the next drain the windows
        # go back to the listener, whose dispatch-mode windows record CUDA events
        monkeypatch.setattr(dispatch, "_cuda_initialized", lambda: True)
        events = fake_device.FakeDeviceEvents(state.health, state.config.ild_events)
        monkeypatch.setattr(sampler, "cuda_events", lambda: events)
        state.manager.drain()
        assert not sampler.handed_over and not sampler.window_open and sampler.windows == 3
        steps(2)  # steps 7 and 8: the listener's again, called at 8 only
        assert calls == [2, 8] and sampler.window is not None
        steps(1)
        assert calls == [2, 8, 9] and sampler.window is None and sampler.windows == 4
    finally:
        state.steps.remove()
        state.ild.remove()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert state.health.errors == {}


def test_native_timer_hands_over_each_step_counted_into_buckets():
    native = torch_extension()
    native.take(BOUNDS)  # what earlier tests left
    x = torch.ones(4)
    native.inject_delay(0.002)  # every op takes at least 2 ms, inside its timed interval
    try:
        for step in (7, 8):
            native.open_window(step)
            for _ in range(step - 5):  # twice in step 7, three times in step 8
                x = x * 2
            native.close_window()
    finally:
        native.inject_delay(-1)
    taken = native.take(BOUNDS)
    assert [t.step for t in taken] == [7, 8]
    samples = [sum(count for _, count in t.buckets) for t in taken]
    assert samples[0] >= 2 and samples[0] * 3 == samples[1] * 2  # the same aten ops for each `x * 2`
    for t, count in zip(taken, samples, strict=True):
        assert all(index >= bisect_left(BOUNDS, 0.002) for index, _ in t.buckets)  # bisect_left's buckets
        assert 0.002 * count <= t.seconds < 1.0
        # each op's fastest time, keyed by its name's hash: the same ops in both steps, each at least 2 ms
        assert 0.002 <= min(t.op_minimums.values()) and max(t.op_minimums.values()) < t.seconds
    assert set(taken[0].op_minimums) == set(taken[1].op_minimums)
    assert len(taken[0].op_minimums) < samples[0]  # `x * 2` twice: the same op names
    assert native.take(BOUNDS) == []


def test_window_under_a_user_mode_is_disabled_and_popped_later(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    monkeypatch.setattr(cpp_recorder, "load", lambda: None)  # the dispatch-mode windows
    state = make_state()
    sampler = state.ild.dispatch
    sampler.on_step(1)  # opens a window
    user = TorchDispatchMode()
    user.__enter__()
    sampler.on_step(2)  # the user's mode is above ours: ours is disabled, kept, and a new window opens
    assert sampler.stale and not sampler.stale[0].enabled
    sampler.close()
    user.__exit__(None, None, None)
    sampler.on_step(3)
    sampler.close()
    assert _get_current_dispatch_mode() is None and not sampler.stale
    assert state.health.errors == {}


def test_collector_exports_histograms_and_drift_gauges(dispatch_timer, state):  # the timer first
    device = FakeDevice()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        for _ in range(16):
            fake_step(state, device, optimizer)
    finally:
        device.close()
    samples = parse(generate_latest(build_registry(state)).decode())
    names = {sample.name for sample in samples}
    assert "flare_kernel_issue_latency_seconds_bucket" in names
    assert "flare_host_dispatch_latency_seconds_count" in names
    drifts = {s.labels["distribution"] for s in samples if s.name == "flare_ild_drift_ks"}
    assert drifts == {"kernel_issue", "host_dispatch", "host_gap"}  # host_gap: drift only, no histogram
    assert not [name for name in names if "host_gap" in name]
    assert all(s.labels["rank"] == "0" for s in samples if s.name.startswith("flare_ild_"))
    # the per-op shift: host dispatch by the native timer only (kernel launches carry no op name)
    shifts = [s for s in samples if s.name == "flare_ild_op_shift_seconds"]
    if dispatch_timer == "native":
        assert [s.labels["distribution"] for s in shifts] == ["host_dispatch"]
        assert abs(shifts[0].value) < 1e-3
    else:
        assert shifts == []


def test_no_source_no_histograms():
    state = make_state(ild_dispatch_every_steps=0)
    samples = parse(generate_latest(build_registry(state)).decode())
    assert not [s for s in samples if "issue_latency" in s.name or "dispatch_latency" in s.name]


def test_kernel_sampler_samples_one_launch_in_n_and_never_raises():
    state = make_state(ild_launch_sample_every=4)

    class Broken:
        def record(self, stream=None):
            raise RuntimeError("no device")

    for _ in range(8):
        state.ild.kernels.on_launch(Broken())
    assert state.health.errors["kernel_sampler"] == 2
