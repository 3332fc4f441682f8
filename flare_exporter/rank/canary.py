"""The hardware canary, inside each training process: benchmarks of the rank's own hardware once the process
group is up and before the first step (preflight), and a smaller set at agreed step boundaries (in flight).

When it runs: right after `init_process_group` returns (attach() wraps it), else, for a script whose group
came up some other way, before the first optimizer step. In flight, after every `canary_interval_steps`-th
optimizer step, on the training thread: every rank counts the same steps, so every rank runs it after the
same step with no collective on the training's groups to agree on it, and nothing of the training is in
flight while it runs.

Its collectives run on process groups of its own, created by every rank in the same order and never
observed by flare (process_group.unobserved): a world-sized group that gathers every rank's host and then
its results, one group per host (ranks sharing a host) and, on several hosts, one group per local index
(ranks on different hosts). The training's groups carry none of its traffic.

The verdict (canary_verdict.judge) is computed on every rank from the same gathered results, so every rank
agrees: `warn` logs it and exports flare_canary_*; `enforce` also ends every rank with exit status 75
(CANARY_EXIT_CODE), after one line naming the rank, its host and the measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import label_values
from ..config import Config
from . import canary_measure as measure
from . import process_group
from .canary_verdict import (
    DriftTracker,
    Failure,
    Key,
    Policy,
    RankResults,
    best_of,
    confirmed,
    describe,
    judge,
    medians,
    plan_groups,
)
from .exporter_health import ExporterHealth
from .identity import RankIdentity

log = logging.getLogger("flare_exporter")

PREFLIGHT, IN_FLIGHT = label_values.CANARY_PHASES
# A failed preflight under canary=enforce ends every rank with this status (sysexits' EX_TEMPFAIL: the job
# may succeed elsewhere; a scheduler reschedules it without the named host).
CANARY_EXIT_CODE = 75
IN_FLIGHT_COMPUTE_SHARE = 0.1  # of canary_compute_seconds
IN_FLIGHT_ITERATIONS = 2


@dataclass(frozen=True)
class CanarySnapshot:
    """What the canary last found, as the collector reads it; replaced whole, never mutated."""

    preflight: dict[Key, float] = field(default_factory=dict)
    relative: dict[Key, float] = field(default_factory=dict)
    failed: frozenset[tuple[str, str, str]] = frozenset()  # (measurement, scope, phase)
    passed: bool | None = None  # None until the preflight ran
    in_flight: dict[Key, float] = field(default_factory=dict)
    ewma_ratio: dict[Key, float] = field(default_factory=dict)
    drift: dict[Key, bool] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)


@dataclass
class CanaryGroups:
    """The canary's groups this rank is a member of (None where it is in none of that kind)."""

    world: Any
    scoped: dict[str, Any]  # scope (intra_host, inter_host) -> group


def policy_of(config: Config) -> Policy:
    floors = {
        "gemm_flops": config.canary_min_gemm_flops,
        "allreduce_busbw": config.canary_min_busbw_bytes_per_second,
        "allgather_busbw": config.canary_min_busbw_bytes_per_second,
        "storage_read": config.canary_min_storage_bytes_per_second,
    }
    return Policy(config.canary_relative_floor, floors)


def storage_paths(config: Config) -> list[str]:
    return [path.strip() for path in config.canary_storage_paths.split(",") if path.strip()]


class Canary:
    """One rank's canary: install() hooks it in; the collector reads `snapshot`."""

    def __init__(
        self,
        config: Config,
        identity: Callable[[], RankIdentity],
        health: ExporterHealth,
        step_count: Callable[[], int],
        gpu_monitor: Callable[[], Any] = lambda: None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.health = health
        self.step_count = step_count
        self.gpu_monitor = gpu_monitor
        self.snapshot = CanarySnapshot()
        self.groups: CanaryGroups | None = None
        self.device = torch.device("cpu")
        self.trackers: dict[Key, DriftTracker] = {}
        self.preflight_done = False
        self.confirm_runs = 0  # the preflight's runs: 1, or more where a rank failed the first
        self.alone: dict[int, float] = {}  # CPU GEMMs measured alone to confirm a failure: rank -> FLOP/s
        self._last_in_flight_step = 0
        self._pre_hook: Any = None
        self._post_hook: Any = None

    # hooks

    def install(self) -> None:
        """Run the preflight when init_process_group returns (or before the first optimizer step), and the
        in-flight set every canary_interval_steps steps."""
        original = c10d.init_process_group

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.preflight()
            return result

        c10d.init_process_group = init_process_group  # type: ignore[assignment]
        dist.init_process_group = init_process_group  # type: ignore[assignment]
        self._pre_hook = register_optimizer_step_pre_hook(self._before_step)
        self._post_hook = register_optimizer_step_post_hook(self._after_step)

    def remove(self) -> None:
        for handle in (self._pre_hook, self._post_hook):
            if handle is not None:
                handle.remove()
        self._pre_hook = self._post_hook = None

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.preflight_done and dist.is_available() and dist.is_initialized():
            self.preflight()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._pre_hook is not None and self.preflight_done:
            self._pre_hook.remove()  # not from its own call: torch is iterating over the pre-hooks then
            self._pre_hook = None
        every = self.config.canary_interval_steps
        steps = self.step_count()
        if every and steps and steps % every == 0 and steps != self._last_in_flight_step:
            self._last_in_flight_step = steps
            self.in_flight()

    # preflight

    def preflight(self) -> None:
        """Measure, gather every rank's results, judge; under `enforce`, end the process if a rank failed.
        Runs once; an error in the canary itself is counted, never raised into training."""
        if self.preflight_done:
            return
        self.preflight_done = True
        started = time.perf_counter()
        try:
            failures = self._preflight()
        except Exception as error:
            self.health.error("canary", error)
            log.warning("flare canary: preflight not completed: %s: %s", type(error).__name__, error)
            return
        self._count_run(PREFLIGHT, time.perf_counter() - started, self.confirm_runs)
        self._report(failures)

    def _preflight(self) -> list[Failure]:
        """Measure, judge; while a rank fails, every rank measures again (at most canary_confirm_runs
        more), and the job is judged on each rank's best value of the runs so far: a rank fails only where
        it failed in every run. Every rank judges the same gathered values, so all repeat together."""
        self.device = self._device()
        self.groups = self._make_groups()
        policy = policy_of(self.config)
        values = self._measure_preflight(self.groups)
        results = self._gathered(values)
        failures = judge(results, policy)
        runs = 1
        while failures and runs <= self.config.canary_confirm_runs:
            values = best_of(values, self._measure_preflight(self.groups))
            results = self._gathered(values)
            failures = judge(results, policy)
            runs += 1
        self.confirm_runs = runs
        if self.device.type == "cpu" and self.config.canary_confirm_runs:
            failures = self._confirmed_alone(failures, results, policy)
        self._record_preflight(self.identity().rank, values, results, failures)
        return failures

    def _confirmed_alone(
        self, failures: list[Failure], results: list[RankResults], policy: Policy
    ) -> list[Failure]:
        """`failures` without the CPU GEMMs that pass when measured alone. On a host with more runnable
        processes than cores a CPU GEMM measures the scheduler as much as the core: a rank whose core holds
        one more runnable process keeps 0.64 of the median over every run. So each rank whose GEMM failed
        measures it again alone, and so does a reference rank (the median one of those that passed), the
        others waiting at a barrier; it fails only below the relative floor of the reference's. A
        throttled rank (a quota, a stopped process) is as slow alone."""
        suspects = sorted(
            {f.rank for f in failures if f.measurement == "gemm_flops" and f.reason == "relative"}
        )
        key = ("gemm_flops", "device")
        passed = sorted(
            (result.values[key], result.rank)
            for result in results
            if result.rank not in suspects and key in result.values
        )
        if not suspects or not passed:
            return failures
        reference = passed[len(passed) // 2][1]
        alone = {rank: self._gemm_alone(rank) for rank in (reference, *suspects)}
        floor = policy.relative_floor * alone[reference]
        self.alone = alone
        return [
            f
            for f in failures
            if f.rank not in suspects or f.measurement != "gemm_flops" or alone[f.rank] < floor
        ]

    def _gemm_alone(self, rank: int) -> float:
        """`rank`'s GEMM FLOP/s measured while every other rank waits (every rank calls it, in one order)."""
        assert self.groups is not None
        world = self.groups.world
        dist.barrier(group=world)
        found: list[Any] = [None]
        if self.identity().rank == rank:
            size = measure.gemm_size(self.device, self.config.canary_gemm_size)
            found[0] = measure.gemm_flops(self.device, size, self.config.canary_compute_seconds)
        dist.broadcast_object_list(found, src=rank, group=world)
        return float(found[0])

    def _gathered(self, values: dict[Key, float]) -> list[RankResults]:
        """Every rank's values (this rank's: `values`), gathered over the canary's world group."""
        assert self.groups is not None
        me = self.identity()
        gathered: list[Any] = [None] * dist.get_world_size(self.groups.world)
        dist.all_gather_object(gathered, (me.rank, me.host, values), group=self.groups.world)
        return [RankResults(rank, host, dict(found)) for rank, host, found in gathered]

    def _device(self) -> torch.device:
        if dist.get_backend() == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _make_groups(self) -> CanaryGroups:
        """Every rank creates every group, in one order (creating a group is itself a collective)."""
        world_size, me = dist.get_world_size(), self.identity()
        with process_group.unobserved():
            world = dist.new_group(ranks=list(range(world_size)), group_desc="flare_canary_world")
            hosts: list[Any] = [None] * world_size
            dist.all_gather_object(hosts, me.host, group=world)
            plan = plan_groups([str(host) for host in hosts])
            scoped: dict[str, Any] = {}
            for scope, members in (("intra_host", plan.intra_host), ("inter_host", plan.inter_host)):
                for ranks in members:
                    group = dist.new_group(ranks=list(ranks), group_desc=f"flare_canary_{scope}")
                    if me.rank in ranks:
                        scoped[scope] = group
        return CanaryGroups(world, scoped)

    def _measure_preflight(self, groups: CanaryGroups) -> dict[Key, float]:
        config, device = self.config, self.device
        values: dict[Key, float] = {}
        dist.barrier(group=groups.world)  # every rank computes at once, under the same contention
        size = measure.gemm_size(device, config.canary_gemm_size)
        values["gemm_flops", "device"] = measure.gemm_flops(device, size, config.canary_compute_seconds)
        for measurement, value in measure.gpu_state(self.gpu_monitor()).items():
            values[measurement, "device"] = value
        if device.type == "cuda":
            values["h2d_copy", "device"] = measure.copy_bandwidth(device, "h2d")
            values["d2h_copy", "device"] = measure.copy_bandwidth(device, "d2h")
        payload = measure.collective_bytes(device, config.canary_collective_bytes)
        for scope in ("intra_host", "inter_host"):  # every member measures its group in the same order
            group = groups.scoped.get(scope)
            if group is None:
                continue
            for op in ("allreduce", "allgather"):
                iterations = config.canary_collective_iterations
                values[f"{op}_busbw", scope] = measure.collective_busbw(
                    op, group, payload, iterations, device
                )
        for index, path in enumerate(storage_paths(config)):
            reading = measure.storage_read(
                path, config.canary_storage_max_bytes, config.canary_storage_max_seconds
            )
            values["storage_read", f"path{index}"] = reading
        return values

    def _record_preflight(
        self, rank: int, values: dict[Key, float], results: list[RankResults], failures: list[Failure]
    ) -> None:
        mine = next(result for result in results if result.rank == rank)
        job_medians = medians(results)
        relative = {
            key: value / job_medians[key] for key, value in mine.values.items() if job_medians.get(key)
        }
        failed = frozenset((f.measurement, f.scope, PREFLIGHT) for f in failures if f.rank == rank)
        self.snapshot = dataclasses.replace(
            self.snapshot, preflight=dict(values), relative=relative, failed=failed, passed=not failures
        )
        config = self.config
        for key, value in values.items():
            if value > 0:
                self.trackers[key] = DriftTracker(
                    value,
                    config.canary_ewma_alpha,
                    config.canary_drift_band,
                    config.canary_in_flight_fraction,
                )

    def _report(self, failures: list[Failure]) -> None:
        """Say the verdict once: on rank 0, and on the named rank itself (its own log names it too)."""
        if not failures:
            return
        primary, rank = failures[0], self.identity().rank
        speaks = rank in (0, primary.rank)
        if self.config.canary == "enforce":
            if speaks:
                print(
                    f"flare canary: preflight failed: {describe(primary)}; "
                    f"{confirmed(failures, self.confirm_runs)}{self._alone_text(primary)}; "
                    f"exiting with status {CANARY_EXIT_CODE}",
                    file=sys.stderr,
                    flush=True,
                )
            # at once: the interpreter's teardown with the process groups' threads alive aborted a rank
            # (SIGABRT, "terminate called without an active exception") instead of exiting 75
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(CANARY_EXIT_CODE)
        if speaks:
            log.warning(
                "flare canary: preflight failed: %s; %s (canary=warn: training goes on)",
                describe(primary),
                confirmed(failures, self.confirm_runs),
            )

    def _alone_text(self, failure: Failure) -> str:
        """How the failing GEMM compared, measured alone, with the reference rank's ('' if it was not)."""
        alone = dict(self.alone)
        if failure.measurement != "gemm_flops" or failure.rank not in alone or len(alone) < 2:
            return ""
        reference = next(iter(alone))  # measured first
        ratio = alone[failure.rank] / alone[reference] if alone[reference] > 0 else 0.0
        return f"; alone, {ratio:.2f} of rank {reference}'s alone"

    # in flight

    def in_flight(self) -> None:
        """The smaller set: a short GEMM and a small all-reduce on the rank's host group, each folded into
        its moving average against the preflight value, and compared with the job's median of the same
        run (gathered: every rank runs it at the same step)."""
        if self.groups is None:
            return
        started = time.perf_counter()
        try:
            values = self._measure_in_flight(self.groups)
            job_medians = medians(self._gathered(values))
        except Exception as error:
            self.health.error("canary", error)
            return
        self._record_in_flight(values, job_medians)
        self._count_run(IN_FLIGHT, time.perf_counter() - started)

    def _measure_in_flight(self, groups: CanaryGroups) -> dict[Key, float]:
        config, device = self.config, self.device
        seconds = config.canary_compute_seconds * IN_FLIGHT_COMPUTE_SHARE
        size = measure.gemm_size(device, config.canary_gemm_size)
        values: dict[Key, float] = {("gemm_flops", "device"): measure.gemm_flops(device, size, seconds)}
        payload = measure.collective_bytes(device, config.canary_collective_bytes)  # as the baseline's
        for scope in (
            "intra_host",
            "inter_host",
        ):  # in the preflight's order: no member waits on another group
            group = groups.scoped.get(scope)
            if group is not None:
                busbw = measure.collective_busbw("allreduce", group, payload, IN_FLIGHT_ITERATIONS, device)
                values["allreduce_busbw", scope] = busbw
        return values

    def _record_in_flight(self, values: dict[Key, float], job_medians: Mapping[Key, float]) -> None:
        """Fold `values` in; a measurement fails in flight below its hard threshold (of its own preflight
        value) and below the relative floor of the job's median of the same run: a load that slows every
        rank alike (a busy host, a job-wide change) is not one rank's failure."""
        failed = {entry for entry in self.snapshot.failed if entry[2] != IN_FLIGHT}
        ewma, drift = dict(self.snapshot.ewma_ratio), dict(self.snapshot.drift)
        floor = self.config.canary_relative_floor
        for key, value in values.items():
            tracker = self.trackers.get(key)
            if tracker is None:
                continue
            below_hard, drifted = tracker.update(value)
            below_peers = not floor or value < floor * job_medians.get(key, 0.0)
            if below_hard and below_peers:
                failed.add((*key, IN_FLIGHT))
            if drifted and not drift.get(key):
                log.warning(
                    "flare canary: rank %d %s [%s] drifting: moving average %.2f of its preflight value",
                    self.identity().rank,
                    *key,
                    tracker.ratio,
                )
            ewma[key], drift[key] = tracker.ratio, drifted
        self.snapshot = dataclasses.replace(
            self.snapshot, in_flight=dict(values), failed=frozenset(failed), ewma_ratio=ewma, drift=drift
        )

    def _count_run(self, phase: str, seconds: float, count: int = 1) -> None:
        runs = dict(self.snapshot.runs)
        runs[phase] = runs.get(phase, 0) + count
        durations = {**self.snapshot.durations, phase: seconds}
        self.snapshot = dataclasses.replace(self.snapshot, runs=runs, durations=durations)
