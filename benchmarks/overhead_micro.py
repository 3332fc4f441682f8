"""The overhead benchmark's micro section: what a hook adds to one call on the training thread, in ns.

Imported by overhead.py, which puts the checkout on sys.path first.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from overhead_jobs import RunError

from flare_exporter.local.workloads import train_ddp

COLD_CALLS = 501
WINDOW_STEPS = 600  # steps with a sampling window open, and as many without
# (key in the results, the loop timed, its baseline): each printed net of its baseline
NET_COSTS = (
    ("collective_hook", "hooks", "empty"),
    ("wrapper_path", "wrapper", "direct"),
    ("step_hook", "step", "empty"),
    ("step_hook_all_signals", "step_all", "empty"),
    ("step_hook_python", "step_python", "empty"),
)


def micro(loops: int = 5000, repeats: int = 21) -> dict[str, float]:
    """ns per call of the collective hook (issue + track) and the step hook, net of an empty loop."""
    from flare_exporter.config import Config

    bench = HookBench(loops)
    bench.check_each_records_a_collective()
    raw = bench.time_loops(repeats)
    cold = bench.time_cold()
    bench.check_no_errors()
    result: dict[str, float] = {
        "loops": loops,
        "repeats": repeats,
        "empty_loop_ns": statistics.median(raw["empty"]),
        "manager_drain_ns": statistics.median(bench.drain_ns),
        "completion_stamped": float(getattr(bench.extension, "stamp_completion", None) is not None),
        **cold,
        "step_hook_native": float(bench.full.steps.counter is not None),
    }
    if bench.extension is not None:
        result.update(window_cost(bench.extension, Config().ild_dispatch_every_steps))
    for key, timed, baseline in NET_COSTS:
        # median of the differences within a repetition; best case as timeit gives it (min minus min)
        pairs = zip(raw[timed], raw[baseline], strict=True)
        result[key + "_ns"] = statistics.median([with_hook - without for with_hook, without in pairs])
        result[key + "_min_ns"] = min(raw[timed]) - min(raw[baseline])
    return result


class HookBench:
    """The hooks as attach() installs them, on fakes: a work whose torch Future is already complete (so the
    completion callback runs inline too), a backend that only hands it back, an optimizer that is a name."""

    def __init__(self, loops: int) -> None:
        import torch

        from flare_exporter.rank import cpp_recorder
        from flare_exporter.rank.exporter_health import ExporterHealth
        from flare_exporter.rank.groups import GroupTracker
        from flare_exporter.rank.process_group import FlareProcessGroup
        from flare_exporter.rank.progress import StepTracker
        from flare_exporter.rank.timing import FutureTiming, TimingManager

        self.loops = loops
        self.health = ExporterHealth()
        # Not started: each repetition's completions stay queued (room for all of them), drained after it.
        self.manager = TimingManager(self.health, queue_size=loops + 16, interval_seconds=1.0)
        # as the exporter does: completions stamped by flare's extension where built, else a Python callback
        self.extension = cpp_recorder.load()
        self.tracker = GroupTracker(
            "world", 4, "gloo", FutureTiming(self.manager, self.extension), self.health
        )
        self.manager.add_group(self.tracker)  # each drain forgets its finished collectives, as in a job
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        self.work = FakeWork(future)
        self.inner = FakeInner(self.work)
        self.bucket = [torch.empty(25 * 2**20 // 4)]  # one 25 MiB DDP bucket (only its size is read)
        self.wrapped = FlareProcessGroup(self.inner, 0, 4, self.tracker)
        self.installed_hook = StepTracker(self.health).hook()  # the extension's C function where built
        # the step hook with every signal at its defaults: the ILD dispatch sampler's listener opens a
        # sampling window on one step in ild_dispatch_every_steps and closes it at the next
        self.full, self.full_hook = with_all_signals(native=True)
        self.full_python, self.full_python_hook = with_all_signals(native=False)
        self.optimizer = FakeOptimizer()
        self.drain_ns: list[float] = []

    def collective_hooks(self, n: int) -> None:
        """`n` collectives issued and tracked, as the wrapper does for each."""
        issue, track, bucket, work = self.tracker.issue, self.tracker.track, self.bucket, self.work
        for _ in range(n):
            track(issue("allreduce", bucket), work)

    def direct(self, n: int) -> None:
        """`n` calls of the inner backend itself: the wrapper's baseline."""
        allreduce, bucket = self.inner.allreduce, self.bucket
        for _ in range(n):
            allreduce(bucket)

    def through_wrapper(self, n: int) -> None:
        """`n` calls through FlareProcessGroup.allreduce, the override DDP's C++ reducer reaches."""
        allreduce, bucket = self.wrapped.allreduce, self.bucket
        for _ in range(n):
            allreduce(bucket)

    def drain(self) -> None:
        """The timing manager's share, which runs on its own thread in a real job: timed per collective."""
        queued = len(self.manager.completed) + len(self.manager.polled)  # called back, or stamped and polled
        started = time.perf_counter_ns()
        self.manager.drain()
        if queued:
            self.drain_ns.append((time.perf_counter_ns() - started) / queued)

    def check_each_records_a_collective(self) -> None:
        """One call of each first: a hook that records nothing (say, its completion callback raises, which
        torch only logs) would make every number after meaningless."""
        checks = (
            ("GroupTracker.issue + track", self.collective_hooks),
            ("FlareProcessGroup.allreduce", self.through_wrapper),
        )
        for name, body in checks:
            before = self.tracker.last_completed_seq
            body(1)
            self.manager.drain()
            if self.tracker.last_completed_seq != before + 1 or self.health.errors or self.health.dropped:
                raise RunError(
                    f"micro: {name} did not record one completed collective for one completed future "
                    f"(errors {dict(self.health.errors)}, drops {dict(self.health.dropped)}); see torch's "
                    "messages above"
                )

    def time_loops(self, repeats: int) -> dict[str, list[float]]:
        """ns per iteration of each loop, `repeats` times.

        Each repetition times every loop back to back, so that a slow moment of a noisy machine weighs on both
        sides of a difference taken within it."""
        loops = self.loops
        step, step_all = calling(self.installed_hook, self.optimizer), calling(self.full_hook, self.optimizer)
        step_python = calling(self.full_python_hook, self.optimizer)
        raw: dict[str, list[float]] = {
            name: [] for name in ("empty", "hooks", "direct", "wrapper", "step", "step_all", "step_python")
        }
        for _ in range(repeats):
            raw["empty"].append(_time_once(empty_loop, loops))
            raw["hooks"].append(_time_once(self.collective_hooks, loops))
            self.drain()
            raw["direct"].append(_time_once(self.direct, loops))
            raw["wrapper"].append(_time_once(self.through_wrapper, loops))
            self.drain()
            raw["step"].append(_time_once(step, loops))
            raw["step_all"].append(_time_once(step_all, loops))
            raw["step_python"].append(_time_once(step_python, loops))
        return raw

    def time_cold(self) -> dict[str, float]:
        """The same hooks, each call alone after compute evicted the caches (see _cold_ns)."""
        issue, track, bucket, work = self.tracker.issue, self.tracker.track, self.bucket, self.work
        full_hook, full_python_hook, optimizer = self.full_hook, self.full_python_hook, self.optimizer
        return {
            "collective_hook_cold_ns": _cold_ns(lambda: track(issue("allreduce", bucket), work), self.drain),
            "step_hook_all_signals_cold_ns": _cold_ns(
                lambda: full_hook(optimizer, (), {}), self.full.manager.drain
            ),
            "step_hook_python_cold_ns": _cold_ns(
                lambda: full_python_hook(optimizer, (), {}), self.full_python.manager.drain
            ),
            # the timed call itself, cold
            "empty_call_cold_ns": _cold_ns(lambda: None, self.full.manager.drain),
        }

    def check_no_errors(self) -> None:
        """Take the sampling windows' listeners out, and fail if any hook reported an error or a drop."""
        errors = dict(self.health.errors)
        for state in (self.full, self.full_python):
            assert state.ild is not None
            state.ild.remove()
            state.steps.report_errors()
            errors.update(state.health.errors)
        if errors or self.health.dropped:
            raise RunError(f"micro: hooks reported errors {errors}, drops {dict(self.health.dropped)}")


class FakeWork:
    """A collective's work whose future is already complete."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def get_future(self) -> Any:
        return self.future


class FakeInner:
    """The real backend, reduced to handing back the work."""

    def __init__(self, work: FakeWork) -> None:
        self.work = work

    def allreduce(self, *args: object, **kwargs: object) -> FakeWork:
        return self.work


class FakeOptimizer:
    """What the step hook is called with: only its identity is read."""


def with_all_signals(native: bool) -> tuple[Any, Callable[..., None]]:
    """A rank's state with every signal at its defaults, its ILD sampler installed, and its step hook (the
    extension's C function if `native`, else StepTracker.on_step)."""
    from flare_exporter.config import Config
    from flare_exporter.rank.identity import RankIdentity
    from flare_exporter.rank.state import FlareState

    state = FlareState.create(Config(), RankIdentity(0, 0, 1, "micro", "localhost", os.getpid()))
    hook = state.steps.hook(native)
    assert state.ild is not None
    state.ild.install()
    return state, hook


def empty_loop(n: int) -> None:
    """The loop itself: every hook's baseline."""
    for _ in range(n):
        pass


def calling(hook: Callable[..., None], optimizer: object) -> Callable[[int], None]:
    """A loop of `n` calls of a step hook, as the optimizer calls it after each step."""

    def loop(n: int) -> None:
        for _ in range(n):
            hook(optimizer, (), {})

    return loop


def _time_once(body: Callable[[int], None], loops: int) -> float:
    """ns per iteration of one body(loops), with the GC off as timeit does."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter_ns()
        body(loops)
        return (time.perf_counter_ns() - started) / loops
    finally:
        if gc_was_enabled:
            gc.enable()


def window_cost(extension: Any, every: int) -> dict[str, float]:
    """What a host-dispatch sampling window adds to a training step: the training script's model and
    optimizer in this process (no process group), the training thread's CPU time of steps with the native
    timer's window open against steps without, alternated; medians, and the ops a window timed. A window
    opens on one step in `every` (ild_dispatch_every_steps)."""
    import torch

    from flare_exporter import label_values

    model = train_ddp.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(64, train_ddp.WIDTH), torch.randint(0, 10, (64,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(20):
        step()
    bounds = list(label_values.ISSUE_LATENCY_BUCKETS)
    extension.take(bounds)
    plain, windowed, ops = [], [], 0
    for index in range(2 * WINDOW_STEPS):
        sampled = index % 2 == 1
        started = time.thread_time_ns()
        if sampled:
            extension.open_window(index)
        step()
        if sampled:
            extension.close_window()
        (windowed if sampled else plain).append(time.thread_time_ns() - started)
        if sampled:
            ops += sum(count for taken in extension.take(bounds) for _, count in taken.buckets)
    added = statistics.median(windowed) - statistics.median(plain)
    return {
        "ild_window_step_ns": added,
        "ild_window_ops": ops / WINDOW_STEPS,
        "ild_plain_step_cpu_ns": statistics.median(plain),
        "ild_dispatch_every_steps": every,
    }


def _cold_ns(hook: Callable[[], None], drain: Callable[[], None]) -> float:
    """ns of one call of `hook` right after compute has evicted the CPU caches, as in a training step.

    In a loop a hook's code and data stay in the caches; in a step, a collective comes after the backward
    pass's matrix products and the step hook after the optimizer's, which evict them, and every Python frame
    and call into torch then waits on memory. Each call is timed alone after 64 products of 256 x 256
    matrices (16 MiB of results, kept until after the call); median of COLD_CALLS. `drain` runs every 100
    calls, as the timing manager would.
    """
    import torch

    left, right = torch.randn(256, 256), torch.randn(256, 256)
    times = []
    for call in range(COLD_CALLS):
        products = [torch.mm(left, right) for _ in range(64)]  # 16 MiB written, as a backward pass does
        started = time.perf_counter_ns()
        hook()
        times.append(time.perf_counter_ns() - started)
        del products
        if call % 100 == 0:
            drain()
    drain()
    return statistics.median(times)


def print_micro(result: dict[str, float]) -> None:
    """Print the micro section: a row per hook, net of its baseline, then the cold calls and the window."""
    print(
        f"micro (ns per call on the training thread, net of the baseline loop; median [best] of "
        f"{result['repeats']} repetitions x {result['loops']} calls):"
    )
    step_hook = "C function" if result["step_hook_native"] else "StepTracker.on_step"
    rows = [
        (
            "collective hook",
            "GroupTracker.issue + track (completed Future: "
            + ("stamped in C++)" if result["completion_stamped"] else "Python callback inline)"),
            "collective_hook",
        ),
        ("wrapper path", "FlareProcessGroup.allreduce minus inner.allreduce", "wrapper_path"),
        ("step hook", f"StepTracker's hook ({step_hook}) vs. an empty loop", "step_hook"),
        (
            "step hook, all",
            "the same with every default signal's listener (ILD windows)",
            "step_hook_all_signals",
        ),
        ("step hook, Python", "StepTracker.on_step with the same listener", "step_hook_python"),
    ]
    for name, what, key in rows:
        print(f"  {name:17} {what:63} {result[key + '_ns']:7.0f} ns  [{result[key + '_min_ns']:6.0f}]")
    print(
        f"  {'collective hook, cold':22} the same, each call alone after compute evicted the caches "
        f"{result['collective_hook_cold_ns']:7.0f} ns  (median of {COLD_CALLS})"
    )
    print(
        f"  {'step hook, all, cold':22} the same for the step hook with every default signal's listener  "
        f"{result['step_hook_all_signals_cold_ns']:7.0f} ns"
    )
    print(
        f"  {'step hook, Python, cold':22} the same for StepTracker.on_step with the same listener      "
        f"{result['step_hook_python_cold_ns']:7.0f} ns"
    )
    if "ild_window_step_ns" in result:
        every, added = result["ild_dispatch_every_steps"], result["ild_window_step_ns"]
        ops, step_cpu = result["ild_window_ops"], result["ild_plain_step_cpu_ns"]
        print(
            f"  ILD window        a sampling window's {ops:.0f} ops timed, on the script's model "
            f"({step_cpu / 1e3:.0f} us of CPU a step): +{added / 1e3:.1f} us a window step, "
            f"{added / every / 1e3:.2f} us a step at 1 in {every:.0f} ({added / every / step_cpu:.2%})"
        )
    print(
        f"  (empty loop: {result['empty_loop_ns']:.0f} ns per iteration; an empty call, cold: "
        f"{result['empty_call_cold_ns']:.0f} ns; off the training thread, "
        f"the timing manager's drain: {result['manager_drain_ns']:.0f} ns per collective)"
    )
