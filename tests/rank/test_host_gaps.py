"""Host gaps: the training thread's time between ops, timed by both host-dispatch timers in their windows.

- the native timer (csrc/dispatch_timer.cpp) and the dispatch mode (rank/dispatch.py) measure the same gaps:
  only the window's thread, only between top-level ops, a gap in which a collective completed left out;
- the step breakdown (rank/perf.py) turns them into the host phase, with the gaps inside the data loader and
  the optimizer step left to those phases, and the last measured step's share for the steps in between;
- the host_gap ILD distribution shifts when the gaps grow;
- real 4-rank gloo jobs with flare's extension built: a rank whose training thread loses the interpreter to
  two threads that hold the GIL in a loop, and a rank whose garbage collector runs several times a step,
  are each named host-side (`flare perf`: launch_bound; the ILD verdict where it names one).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from conftest import flare_json, ild_state, torch_extension

from flare_exporter import label_values
from flare_exporter.config import Config
from flare_exporter.engine import scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.policies import BottleneckPolicy, IldPolicy
from flare_exporter.rank import perf as rank_perf
from flare_exporter.rank.perf import PerfMonitor, PhaseClock, StepMark, step_gaps

BOUNDS = list(label_values.ISSUE_LATENCY_BUCKETS)


def gap_counts(taken) -> tuple[int, float]:
    """(gaps, their seconds) in what the native timer's take() returned."""
    return sum(count for t in taken for _, count in t.gap_buckets), sum(t.gap_seconds for t in taken)


# ---------------------------------------------------------------------------------------------------------
# the native timer


def test_native_gaps_are_the_window_threads_time_outside_top_level_ops():
    native = torch_extension()
    native.take(BOUNDS)
    seconds_before, windows_before = native.host_gaps()
    x, weight = torch.ones(4), torch.ones(3, 4)
    native.open_window(5)
    for _ in range(4):
        time.sleep(0.003)
        x = x * 2  # one op
        torch.nn.functional.linear(x, weight)  # one top-level op, with ops nested in it
    time.sleep(0.002)
    during = native.host_gaps()[0] - seconds_before  # with the current gap
    native.close_window()
    seconds, windows = native.host_gaps()
    gaps, gap_seconds = gap_counts(native.take(BOUNDS))
    assert windows == windows_before + 1  # closed on its own thread: measured whole
    assert gaps == 8 + 1  # before each of the 8 top-level ops, and from the last to the close
    assert 0.014 <= seconds - seconds_before < 0.5 and gap_seconds == pytest.approx(seconds - seconds_before)
    assert 0.014 <= during <= seconds - seconds_before
    assert native.host_gaps() == (seconds, windows)  # no window: nothing grows


def test_other_threads_ops_make_no_gaps_and_a_gap_with_a_completion_is_a_wait():
    native = torch_extension()
    native.take(BOUNDS)
    seconds_before, _ = native.host_gaps()

    def other_thread() -> None:
        y = torch.ones(4)
        for _ in range(50):
            y = y * 2

    x = torch.ones(4)
    opened = time.perf_counter()
    native.open_window(9)
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    x = x * 2
    time.sleep(0.004)
    native.note_completion(time.perf_counter())  # a collective completed while the thread waited
    time.sleep(0.004)
    x = x * 2
    time.sleep(0.002)
    x = x * 2
    native.close_window()
    window = time.perf_counter() - opened
    seconds = native.host_gaps()[0] - seconds_before
    taken = native.take(BOUNDS)
    ops = sum(count for t in taken for _, count in t.buckets)
    gaps, _ = gap_counts(taken)
    assert ops >= 53  # the other thread's ops are timed ...
    assert gaps == 3  # ... but only this thread's gaps count: to the first op, 2 ms, to the close
    assert 0.002 <= seconds <= window - 0.008  # the 8 ms or more around the completion are the collective's


# ---------------------------------------------------------------------------------------------------------
# both timers, from the step hook


class Rank:
    """A rank's state with its step hooks, ILD windows and step breakdown installed, and a small model."""

    def __init__(self, flops_step: int = 0, **overrides) -> None:
        self.state = ild_state("gaps", **{"ild_launch_sample_every": 10**6, **overrides})  # no kernel samples
        self.state.steps.install()
        self.state.ild.install()
        sampler = self.state.ild.dispatch
        self.clock = PhaseClock(
            self.state.steps, self.state.health, flops_step, sampler.host_gaps, sampler.every
        )
        self.clock.install()
        self.monitor = PerfMonitor(self.clock, self.state.config)
        self.state.windows.step_listeners.append(self.monitor.on_step)
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.optimizer = torch.optim.SGD([self.weight], lr=0.01)

    def step(self, host_seconds: float = 0.0, ops: int = 4, between_ops: float = 0.0) -> None:
        if host_seconds:
            time.sleep(host_seconds)
        value = self.weight * 2
        for _ in range(ops):
            if between_ops:
                time.sleep(between_ops)
            value = value + 1
        value.sum().backward()
        self.optimizer.step()

    def close(self) -> None:
        self.clock.remove()
        self.state.steps.remove()
        self.state.ild.remove()
        self.state.manager.stop()


@pytest.fixture
def rank(dispatch_timer):
    created = Rank()
    assert (created.state.ild.dispatch.native is not None) == (dispatch_timer == "native")
    yield created
    created.close()
    assert created.state.health.errors == {}, created.state.health.errors


def test_both_timers_time_each_step_windows_gaps(rank):
    per_window = []
    for _ in range(12):
        seconds, windows = rank.state.ild.dispatch.host_gaps()
        rank.step(host_seconds=0.003)
        after, windows_after = rank.state.ild.dispatch.host_gaps()
        if windows_after == windows + 1:
            per_window.append(after - seconds)
    rank.state.manager.drain()
    assert len(per_window) >= 10  # every step is a window here, and each is measured whole
    assert 0.003 <= statistics.median(per_window) < 0.020
    gaps = rank.state.ild.host_gap
    assert gaps.active and sum(gaps.drift.baseline) >= 10 * 6  # 6+ gaps a step: the ops, the tail


def test_the_host_phase_leaves_data_and_optimizer_gaps_to_their_phases(rank):
    """Each step: 4 ms of the script's own, 10 ms in the data loader's next, 10 ms in an optimizer hook."""

    class SlowData(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, index: int) -> torch.Tensor:
            time.sleep(0.010)
            return torch.zeros(1)

    batches = iter(torch.utils.data.DataLoader(SlowData(), batch_size=1))
    rank.optimizer.register_step_pre_hook(lambda *_: time.sleep(0.010))
    for _ in range(16):
        next(batches)
        rank.step(host_seconds=0.004)
    rank.state.manager.drain()
    monitor = rank.monitor
    assert monitor.steps >= 14 and monitor.host_measured
    per_step = {phase: seconds / monitor.steps for phase, seconds in monitor.phase_seconds.items()}
    assert per_step["data"] >= 0.010 and per_step["optimizer"] >= 0.010
    # the 4 ms and the interpreter's few µs between ops: neither the data loader's 10 ms nor the optimizer's
    assert 0.004 <= per_step["host"] < 0.010, per_step
    assert per_step["compute"] >= 0.0


def test_windows_on_one_step_in_three_give_every_step_its_host_phase(dispatch_timer):
    created = Rank(ild_dispatch_every_steps=3)
    try:
        for _ in range(20):
            created.step(host_seconds=0.004)
        created.state.manager.drain()
        monitor = created.monitor
        assert monitor.steps >= 18 and monitor.host_measured
        host = monitor.phase_seconds["host"] / monitor.steps  # the steps before the first window have none
        assert 0.004 * 16 / 20 <= host < 0.010, monitor.phase_seconds
    finally:
        created.close()
    assert created.state.health.errors == {}


def test_the_step_hook_keeps_the_phase_clock_in_c_where_it_is_built_and_counts_the_flops(dispatch_timer):
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    created = Rank(flops_step=5, ild_dispatch_every_steps=3)  # counted from step 4's end to 5's: no window
    matrix = torch.ones(8, 8)
    try:
        for _ in range(8):
            (created.weight @ matrix).sum().backward()  # FlopCounterMode counts matrix products only
            created.optimizer.step()
        hooks = [*_global_optimizer_pre_hooks.values(), *_global_optimizer_post_hooks.values()]
        python_hooks = [hook for hook in hooks if hasattr(hook, "__code__")]
        if dispatch_timer == "native":  # the clock's pre hook and the counter's post hook: C functions
            assert created.clock.counter is not None and len(hooks) == 2 and python_hooks == []
        else:
            assert created.clock.counter is None and len(python_hooks) == 3
        created.state.manager.drain()
        assert created.monitor.flops_per_step == 2 * 8 * 8 * 2  # the product forward, and its weight's grad
        assert created.monitor.steps >= 6 and created.monitor.phase_seconds["optimizer"] > 0.0
    finally:
        created.close()
    assert created.state.health.errors == {}


def test_gaps_that_grow_shift_the_host_gap_distribution(rank):
    for _ in range(14):  # warm-up and baseline: ops back to back
        rank.step(ops=8)
        rank.state.manager.drain()
    for _ in range(4):  # 2 ms before each of the 8 additions
        rank.step(ops=8, between_ops=0.002)
        rank.state.manager.drain()
    current = rank.state.ild.host_gap.drift.current
    assert current is not None
    ks, wasserstein = current
    # about half of a step's gaps moved from µs to 2 ms (native 0.5, dispatch mode 0.6 here): shifted by the
    # engine's policy (IldPolicy.ks) whichever timer measured them
    assert ks >= IldPolicy().ks and wasserstein >= 5e-4, current


# ---------------------------------------------------------------------------------------------------------
# the step breakdown's arithmetic


def mark(step: int, gaps: float, phase_gaps: float, windows: int, data=0.0, optimizer=0.0) -> tuple:
    return (step, data, optimizer, gaps, phase_gaps, windows)


def monitor_with(*marks: tuple) -> PerfMonitor:
    kept = deque(marks)
    taken = lambda: [kept.popleft() for _ in range(len(kept))]  # noqa: E731
    clock = SimpleNamespace(take_marks=taken, counted_flops=None, measures_gaps=True)
    return PerfMonitor(clock, Config())  # type: ignore[arg-type]


def test_a_measured_step_is_its_gaps_outside_data_and_optimizer_and_the_next_steps_share_it():
    monitor = monitor_with(
        mark(1, 0.0, 0.0, 0),
        mark(2, 0.020, 0.003, 1, data=0.010, optimizer=0.002),  # a window covered step 2
        mark(3, 0.020, 0.003, 1, data=0.020, optimizer=0.004),  # none covered step 3
    )
    monitor.on_step(2, 0.1, 0.03)
    assert monitor.phase_seconds["host"] == pytest.approx(0.017) and monitor.host_measured
    assert monitor.phase_seconds["compute"] == pytest.approx(0.1 - 0.010 - 0.002 - 0.03 - 0.017)
    monitor.on_step(3, 0.2, 0.03)  # the rest of step 3: 0.2 - 0.01 - 0.002 - 0.03; step 2's share of it
    rest = 0.2 - 0.010 - 0.002 - 0.03
    assert monitor.phase_seconds["host"] == pytest.approx(0.017 + 0.017 / 0.058 * rest)
    assert sum(monitor.phase_seconds.values()) == pytest.approx(0.3)


def test_gaps_beyond_the_step_are_clamped_and_no_gap_clock_measures_no_host_phase():
    monitor = monitor_with(mark(1, 0.0, 0.0, 0), mark(2, 0.5, 0.0, 1))
    monitor.on_step(2, 0.1, 0.02)
    assert monitor.phase_seconds["host"] == pytest.approx(0.08) and monitor.phase_seconds["compute"] == 0.0
    unmeasured = monitor_with(mark(1, 0.0, 0.0, -1), mark(2, 0.0, 0.0, -1))
    unmeasured.on_step(2, 0.1, 0.02)
    assert unmeasured.phase_seconds["host"] == 0.0 and not unmeasured.host_measured
    assert step_gaps(StepMark(*mark(1, 0.0, 0.0, 3)), StepMark(*mark(2, 1.0, 0.0, 5))) is None  # two windows


def test_a_gpu_process_measures_no_host_phase(monkeypatch):
    monkeypatch.setattr(rank_perf, "torch_cuda_initialized", lambda: True)
    created = Rank()
    try:
        for _ in range(6):
            created.step(host_seconds=0.002)
        created.state.manager.drain()
        assert created.monitor.steps >= 4 and not created.monitor.host_measured
        assert created.monitor.phase_seconds["host"] == 0.0
    finally:
        created.close()


# ---------------------------------------------------------------------------------------------------------
# real jobs

RANKS = 4
FAULT_STEP = 40
JOB_ENV = {
    "FLARE_ILD_DISPATCH_EVERY_STEPS": "2",
    "FLARE_ILD_WARMUP_STEPS": "3",
    "FLARE_ILD_BASELINE_STEPS": "30",
    "FLARE_ILD_WINDOW_STEPS": "5",
    "FLARE_TIMING_INTERVAL_SECONDS": "0.2",
    "FLARE_LINGER_SECONDS": "0",
}
JOBS = {
    # two threads that hold the GIL in a loop, started on rank 1 at step 40
    "gil": ["--fault", "contention", "--fault-rank", "1", "--contention-threads", "2"],
    # 20,000 reference cycles a step on rank 2 from step 40: its collector runs ~30 times a step
    "gc": ["--gc-rank", "2", "--gc-cycles", "20000"],
}
FAULTY = {"gil": 1, "gc": 2}


def host_side(verdicts: list[dict], perf: dict, rank: int) -> list[str]:
    """How `flare diagnose` and `flare perf` name `rank` host-side: an ILD regression of it, its class."""
    named = [
        f"ild_regression ({', '.join(v['evidence']['distributions'])})"
        for v in verdicts
        if v["kind"] == "ild_regression" and rank in v["ranks"]
    ]
    row = {row["rank"]: row for row in perf.get("ranks", [])}.get(rank, {})
    if row.get("bottleneck") == "launch_bound" and not row.get("waits_for_last_arriver"):
        named.append("launch_bound")  # its own class, not the one of a rank it waits for
    return named


@pytest.fixture(scope="module")
def extension_built():
    return torch_extension()  # the ranks load it from the same build directory


@pytest.mark.multirank
@pytest.mark.process
@pytest.mark.parametrize("job", ["gil", "gc"])
def test_a_host_side_fault_on_one_rank_is_named_host_side_with_the_extension_built(
    extension_built, tmp_path, job
):
    rank = FAULTY[job]
    args = ["--steps", "100000", "--fault-step", str(FAULT_STEP), *JOBS[job]]
    seen: list[tuple] = []
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, RANKS, job, env=JOB_ENV) as observed:
        targets = ["--targets", observed.file_sd_dir]

        def named() -> tuple | None:
            _, report = flare_json("diagnose", *targets, "--timeout", "2", "--run", job)
            _, perf = flare_json("perf", *targets)
            seen.append((report.get("verdicts", []), perf))
            found = host_side(report.get("verdicts", []), perf, rank)
            return (found, perf) if found else None

        try:
            found, perf = wait_for(named, 150, f"rank {rank} to be named host-side")
        except TimeoutError:
            pytest.fail(f"rank {rank} never named host-side; last: {seen[-1:]}\n{observed.log_tail(rank)}")
        samples = scrape.scrape_all(observed.targets, timeout=5)
    rows = {row["rank"]: row for row in perf["ranks"]}
    print(job, found, {r: (row["bottleneck"], row["phases_share"].get("host")) for r, row in rows.items()})
    # the healthy ranks are not: what they lose waiting for the faulty rank is the collective's
    for other in set(range(RANKS)) - {rank}:  # host shares of 0.02-0.08 seen (flare's own scrapes among them)
        row = rows[other]  # launch_bound only as the faulty rank's class, where it waits for that rank
        assert row["bottleneck"] != "launch_bound" or row.get("waits_for_last_arriver"), row
        assert row["phases_share"].get("host", 0.0) < BottleneckPolicy().launch_share / 2, row
    # flare's extension timed the ops (its per-op shift), and every rank exports its host gaps' drift
    for answer in samples.values():
        assert isinstance(answer, list)
        shifts = {s.labels["distribution"] for s in answer if s.name == "flare_ild_op_shift_seconds"}
        drifts = {s.labels["distribution"] for s in answer if s.name == "flare_ild_drift_ks"}
        assert shifts == {"host_dispatch"} and "host_gap" in drifts
