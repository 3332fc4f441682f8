"""The hardware canary: its arithmetic, its measurements, and real 4-rank gloo jobs under the launcher, one
rank of which is throttled from outside (stopped and continued on a duty cycle): before the first step, or
more and more in flight (its moving average drifts before its hard threshold fails); in the latter job one
rank's storage path is a rate-limited reader (named as storage, not compute)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO, NamedTuple

import pytest
from conftest import flare_json

from flare_exporter.engine import cli, scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing.fake_nvml import FakeNvml, make_device
from flare_exporter.local.testing.load import DutyCycle
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank import canary_measure, gpu_health
from flare_exporter.rank.canary import CANARY_EXIT_CODE
from flare_exporter.rank.canary_verdict import (
    DriftTracker,
    Policy,
    RankResults,
    bus_bandwidth,
    confirmed,
    describe,
    judge,
    plan_groups,
)
from flare_exporter.rank.exporter_health import ExporterHealth

RANKS = 4
STEPS = 20
THROTTLED = 2
POLICY = Policy(relative_floor=0.5, absolute_floors={})
STORAGE_RATE = 4 << 20  # bytes/s of the rate-limited reader

# --- the arithmetic ---------------------------------------------------------------------------------------


def test_bus_bandwidth_follows_nccl_tests():
    # 8 ranks all-reducing 1 GB in 10 ms: algbw 100 GB/s, busbw 2*7/8 of it
    assert bus_bandwidth("allreduce", 10**9, 0.01, 8) == pytest.approx(175e9)
    # all-gather of a 1 GB output: (n-1)/n
    assert bus_bandwidth("allgather", 10**9, 0.01, 8) == pytest.approx(87.5e9)
    assert bus_bandwidth("allreduce", 10**9, 0.01, 1) == 0.0  # no bus to measure


def test_groups_are_per_host_and_per_local_index_across_hosts():
    plan = plan_groups(["a", "a", "b", "b", "c"])
    assert plan.intra_host == ((0, 1), (2, 3))  # host c has one rank: no group of its own
    assert plan.inter_host == ((0, 2, 4), (1, 3))
    single = plan_groups(["a"] * 4)
    assert single.intra_host == ((0, 1, 2, 3),) and single.inter_host == ()


def results(gemm: list[float], storage: list[float] | None = None) -> list[RankResults]:
    found = []
    for rank, flops in enumerate(gemm):
        values = {("gemm_flops", "device"): flops, ("allreduce_busbw", "intra_host"): 1e9}
        if storage is not None:
            values["storage_read", "path0"] = storage[rank]
        found.append(RankResults(rank, f"node-{rank // 2}", values))
    return found


def test_a_healthy_job_has_no_failure():
    assert judge(results([10.0, 9.0, 11.0, 8.0]), POLICY) == []


def test_the_slowest_rank_below_the_relative_floor_is_named_first():
    failures = judge(results([10.0, 4.0, 11.0, 3.0, 10.0]), POLICY)
    assert [(f.rank, f.measurement, f.reason) for f in failures] == [
        (3, "gemm_flops", "relative"),
        (1, "gemm_flops", "relative"),
    ]
    line = describe(failures[0])
    assert line.startswith("rank 3 (host node-1) failed gemm_flops [device]: 3 FLOP/s, 0.30 of")


def test_an_absolute_floor_fails_every_rank_below_it():
    policy = Policy(relative_floor=0.0, absolute_floors={"gemm_flops": 9.5})
    assert [f.rank for f in judge(results([10.0, 9.0, 11.0, 8.0]), policy)] == [3, 1]


def test_a_slow_storage_path_is_named_as_storage_and_a_slow_rank_as_compute():
    storage_only = judge(results([10.0, 10.0, 10.0, 10.0], [5e8, 5e8, 1e8, 5e8]), POLICY)
    assert [(f.rank, f.measurement, f.scope) for f in storage_only] == [(2, "storage_read", "path0")]
    # a rank slowed as a whole reads slowly too: its compute is named, before its storage
    slow_rank = judge(results([10.0, 10.0, 2.0, 10.0], [5e8, 5e8, 1e8, 5e8]), POLICY)
    assert [(f.rank, f.measurement) for f in slow_rank] == [(2, "gemm_flops"), (2, "storage_read")]


def test_gpu_health_readings_fail_below_their_own_maximum_whatever_the_median():
    healthy = {("gemm_flops", "device"): 10.0, ("gpu_pcie_width", "device"): 1.0}
    narrow = {("gemm_flops", "device"): 10.0, ("gpu_pcie_width", "device"): 0.5}
    ranks = [RankResults(0, "a", healthy), RankResults(1, "a", narrow), RankResults(2, "a", healthy)]
    failures = judge(ranks, Policy(relative_floor=0.0, absolute_floors={}))
    assert [(f.rank, f.measurement, f.reason) for f in failures] == [(1, "gpu_pcie_width", "absolute")]


@pytest.mark.process
@pytest.mark.parametrize(
    ("runs", "expected_runs", "fails"),
    [
        ([1.0, 12.0], 2, False),  # a transient dip: the second run passes, nothing fails
        ([1.0, 2.0, 3.0, 40.0], 3, True),  # below its floor in every run: confirmed after 1 + 2 runs
        ([12.0], 1, False),  # passed at once: one run
    ],
)
def test_a_failing_preflight_is_measured_again_and_judged_on_the_best_of_its_runs(runs, expected_runs, fails):
    """A real (one-rank gloo) process group; the measurements scripted: GEMM values of successive runs
    against an absolute floor of 10 FLOP/s."""
    import datetime

    import torch.distributed as dist

    from flare_exporter.config import Config
    from flare_exporter.local.jobs import free_port
    from flare_exporter.rank.canary import Canary
    from flare_exporter.rank.identity import RankIdentity

    config = Config(canary="warn", canary_min_gemm_flops=10.0, canary_confirm_runs=2)
    me = RankIdentity(rank=0, local_rank=0, world_size=1, run="c", host="node-0", pid=1)
    canary = Canary(config, lambda: me, ExporterHealth(), lambda: 0)
    measured = iter(runs)
    canary._measure_preflight = lambda groups: {("gemm_flops", "device"): next(measured)}  # type: ignore
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        failures = canary._preflight()
    finally:
        dist.destroy_process_group()
    assert canary.confirm_runs == expected_runs and bool(failures) == fails
    best = max(runs[:expected_runs])
    assert canary.snapshot.preflight == {("gemm_flops", "device"): best}  # the best of the runs
    if fails:
        assert confirmed(failures, 3) == "confirmed by 3 runs (best of each): gemm_flops [device]"


def test_in_flight_a_rank_fails_only_below_its_own_baseline_and_the_jobs_median_of_the_same_run():
    from flare_exporter.config import Config
    from flare_exporter.rank.canary import IN_FLIGHT, Canary
    from flare_exporter.rank.identity import RankIdentity

    me = RankIdentity(rank=0, local_rank=0, world_size=4, run="c", host="node-0", pid=1)
    canary = Canary(Config(canary="warn", canary_relative_floor=0.5), lambda: me, ExporterHealth(), lambda: 0)
    key = ("gemm_flops", "device")
    canary.trackers[key] = DriftTracker(10.0, 0.3, 0.2, 0.5)
    canary._record_in_flight({key: 4.0}, {key: 4.5})  # every rank as slow: the host's or the job's load
    assert canary.snapshot.failed == frozenset()
    canary._record_in_flight({key: 4.0}, {key: 10.0})  # its peers are not: its own failure
    assert canary.snapshot.failed == {(*key, IN_FLIGHT)}
    canary._record_in_flight({key: 9.0}, {key: 10.0})  # recovered: the in-flight failure clears
    assert canary.snapshot.failed == frozenset()


def test_a_cpu_gemm_that_failed_beside_the_others_is_measured_alone_beside_a_reference_rank():
    """A busy host's scheduler can keep one CPU rank at 0.64 of the median in every run (its core holds one
    more runnable process): alone it computes as fast as the reference rank alone, and passes. A throttled
    rank is as slow alone, and fails, and the line says how it did alone."""
    from flare_exporter.config import Config
    from flare_exporter.rank.canary import Canary
    from flare_exporter.rank.identity import RankIdentity

    me = RankIdentity(rank=0, local_rank=0, world_size=5, run="c", host="node-0", pid=1)
    canary = Canary(Config(canary="enforce", canary_confirm_runs=2), lambda: me, ExporterHealth(), lambda: 0)
    found = results([10.0, 4.0, 11.0, 3.0, 10.0], [5e8, 1e8, 5e8, 5e8, 5e8])
    failures = judge(found, POLICY)
    measured: list[int] = []
    alone = {4: 10.0, 1: 9.0, 3: 2.0}  # rank 4: the median of those that passed, measured first
    canary._gemm_alone = lambda rank: measured.append(rank) or alone[rank]  # type: ignore[method-assign]
    standing = canary._confirmed_alone(failures, found, POLICY)
    assert measured == [4, 1, 3]
    assert [(f.rank, f.measurement) for f in standing] == [(3, "gemm_flops"), (1, "storage_read")]
    assert canary._alone_text(standing[0]) == "; alone, 0.20 of rank 4's alone"


def test_the_moving_average_flags_a_growing_degradation_before_the_hard_threshold():
    tracker = DriftTracker(baseline=100.0, alpha=0.3, band=0.2, hard_fraction=0.5)
    drifted_at = hard_at = None
    for index, value in enumerate(100.0 - 5.0 * step for step in range(1, 15)):  # 95, 90, ... 30
        below_hard, drifted = tracker.update(value)
        drifted_at = index if drifted and drifted_at is None else drifted_at
        hard_at = index if below_hard and hard_at is None else hard_at
    assert drifted_at is not None and hard_at is not None
    assert drifted_at < hard_at, (drifted_at, hard_at)


def test_one_noisy_reading_does_not_drift_but_a_sustained_fall_does():
    tracker = DriftTracker(baseline=100.0, alpha=0.3, band=0.2, hard_fraction=0.5)
    assert tracker.update(60.0) == (False, False)  # 0.88 of the baseline
    for _ in range(5):
        tracker.update(100.0)
    assert not tracker.drifted
    for _ in range(6):
        tracker.update(70.0)
    assert tracker.drifted and 0.7 < tracker.ratio < 0.8


# --- the measurements -------------------------------------------------------------------------------------


def test_storage_reads_are_bounded_in_bytes(tmp_path):
    for index in range(3):
        (tmp_path / f"shard{index}").write_bytes(os.urandom(1 << 20))
    started = time.perf_counter()
    throughput = canary_measure.storage_read(str(tmp_path), max_bytes=2 << 20, max_seconds=10)
    assert throughput > 0 and time.perf_counter() - started < 10


class PacedFifo:
    """A FIFO at `path` that a thread feeds at `rate` bytes/s, as a slow mount serves: each reader that opens
    it is fed until it closes it, until stop()."""

    def __init__(self, path: str, rate: int, chunk: int = 64 << 10) -> None:
        os.mkfifo(path)
        self.path, self.rate, self.chunk = path, rate, chunk
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            with open(self.path, "wb") as pipe:  # until a reader opens it
                self._feed(pipe)

    def _feed(self, pipe: BinaryIO) -> None:
        started, sent = time.perf_counter(), 0
        while not self.done.is_set():
            try:
                pipe.write(b"\0" * self.chunk)
                pipe.flush()
            except BrokenPipeError:  # the reader is done
                return
            sent += self.chunk
            time.sleep(max(0.0, started + sent / self.rate - time.perf_counter()))

    def stop(self) -> None:
        self.done.set()
        os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))  # a reader, for a feeder waiting for one
        self.thread.join(timeout=10)


def test_a_rate_limited_reader_is_measured_at_its_rate(tmp_path):
    """A FIFO fed at 4 MiB/s by a paced writer, as a slow mount serves: bounded by time, measured at its
    rate (not the page cache's)."""
    fifo = PacedFifo(str(tmp_path / "slow-mount"), STORAGE_RATE)
    try:
        throughput = canary_measure.storage_read(fifo.path, max_bytes=1 << 30, max_seconds=1.0)
    finally:
        fifo.stop()
    assert 0.5 * STORAGE_RATE < throughput < 2 * STORAGE_RATE, throughput


def test_nvml_readings_show_a_narrowed_link_and_a_slowdown():
    device = make_device(0)
    device.pcie_width = 8
    device.clock_events = 0x40  # hw_thermal_slowdown
    monitor = gpu_health.GpuHealthMonitor(FakeNvml([device]), 0, ExporterHealth(), 60)
    assert monitor.open()
    assert canary_measure.gpu_state(monitor) == {"gpu_pcie_width": 0.5, "gpu_clock_ok": 0.0}
    healthy = gpu_health.GpuHealthMonitor(FakeNvml([make_device(0)]), 0, ExporterHealth(), 60)
    assert healthy.open()
    assert canary_measure.gpu_state(healthy) == {"gpu_pcie_width": 1.0, "gpu_clock_ok": 1.0}
    assert canary_measure.gpu_state(None) == {}


def test_the_cpu_gemm_is_timed_in_wall_time():
    import torch

    flops = canary_measure.gemm_flops(torch.device("cpu"), 64, 0.05)
    assert 1e6 < flops < 1e13


# --- real jobs --------------------------------------------------------------------------------------------


def canary_job(tmp_path, mode: str, **extra: str) -> ObservedJob:
    env = {
        "FLARE_CANARY": mode,
        "FLARE_CANARY_RELATIVE_FLOOR": "0.5",  # four ranks on two shared cores: healthy ones are within 0.8
        "FLARE_CANARY_COMPUTE_SECONDS": "0.5",
        "FLARE_CANARY_INTERVAL_STEPS": "10",
        **extra,
    }
    args = ["--steps", str(STEPS), "--step-seconds", "0.02"]
    return ObservedJob(str(tmp_path), train_ddp.__file__, args, RANKS, f"canary-{mode}", env=env)


def scraped(targets: list[str]) -> dict[str, list[scrape.Sample]] | None:
    """Every rank's samples, or None while one does not answer."""
    answers = scrape.scrape_all(targets, timeout=2)
    found = {target: s for target, s in answers.items() if not isinstance(s, scrape.ScrapeError)}
    return found if len(found) == len(targets) else None


def canary_samples(targets: list[str]) -> dict[str, list[scrape.Sample]] | None:
    """Every rank's samples once each has its preflight verdict."""
    answers = scraped(targets)
    if answers is None:
        return None
    done = all(scrape.value(s, "flare_canary_preflight_passed") is not None for s in answers.values())
    return answers if done else None


def trained(targets: list[str]) -> dict[str, list[scrape.Sample]] | None:
    answers = scraped(targets)
    if answers is None:
        return None
    done = all(scrape.value(s, "flare_steps_total") == STEPS for s in answers.values())
    return answers if done else None


def logs(job: ObservedJob) -> str:
    return "\n".join(f"rank {rank}: {job.log_tail(rank)}" for rank in range(RANKS))


@pytest.fixture
def throttled() -> Iterator[list[DutyCycle]]:
    cycles: list[DutyCycle] = []
    yield cycles
    for cycle in cycles:
        cycle.stop()


@pytest.mark.multirank
def test_enforce_names_the_throttled_rank_and_stops_the_start(tmp_path, throttled):
    with canary_job(tmp_path, "enforce") as job:
        throttled.append(DutyCycle(job.processes[THROTTLED].pid))
        codes = job.wait(timeout=240)
        throttled[0].stop()
        assert codes == [CANARY_EXIT_CODE] * RANKS, logs(job)
        lines = [line for line in logs(job).splitlines() if "flare canary: preflight failed" in line]
        # rank 0 and the named rank say it, in one line each; nobody trained
        assert len(lines) == 2, logs(job)
        assert f"rank {THROTTLED} (host " in lines[0] and "failed gemm_flops [device]" in lines[0]
        # measured again twice, and still below in the best of the three runs: confirmed, then condemned
        assert "; confirmed by 3 runs (best of each): gemm_flops [device]" in lines[0], lines[0]
        assert lines[0].endswith(f"exiting with status {CANARY_EXIT_CODE}")


@pytest.mark.multirank
def test_warn_trains_on_and_the_metrics_name_the_throttled_rank(tmp_path, throttled):
    with canary_job(tmp_path, "warn") as job:
        throttled.append(DutyCycle(job.processes[THROTTLED].pid))
        verdicts = wait_for(lambda: canary_samples(job.targets), 240, "the preflight verdict")
        throttled[0].stop()
        for rank, target in enumerate(job.targets):
            samples = verdicts[target]
            assert scrape.value(samples, "flare_canary_preflight_passed") == 0  # every rank agrees
            failed = scrape.value(
                samples, "flare_canary_failed", measurement="gemm_flops", scope="device", phase="preflight"
            )
            assert failed == (1 if rank == THROTTLED else 0), rank
        relative = scrape.value(
            verdicts[job.targets[THROTTLED]],
            "flare_canary_relative",
            measurement="gemm_flops",
            scope="device",
        )
        assert relative < 0.5
        samples = wait_for(lambda: trained(job.targets), 240, "training to finish")

        def in_flight_runs() -> list[float | None]:  # the run after step 20 ends a moment after the step
            answers = scraped(job.targets) or samples
            runs = [
                scrape.value(answers[t], "flare_canary_runs_total", phase="in_flight") for t in job.targets
            ]
            return runs if runs == [2] * RANKS else []

        # in flight twice, after steps 10 and 20, on every rank (a third would fail this wait too)
        assert wait_for(in_flight_runs, 60, "every rank's two in-flight canary runs") == [2] * RANKS
        # `flare diagnose` names it for its compute before the first step, and no other rank's preflight
        code, report = flare_json("diagnose", "--targets", job.file_sd_dir)
        assert code == cli.EXIT_ANOMALY, report
        canary = [v for v in report["verdicts"] if v["kind"] == "canary"]
        preflight = [
            (v["ranks"], v["evidence"]["measurement"])
            for v in canary
            if v["evidence"]["check"] == "preflight"
        ]
        assert preflight == [([THROTTLED], "gemm_flops")], canary
        assert canary[0]["summary"].startswith(f"rank {THROTTLED} (host "), canary[0]
        job.release()
        assert job.wait(timeout=60) == [0] * RANKS, logs(job)
        assert "preflight failed: rank 2" in job.log_tail(0, 200)


@pytest.mark.multirank
def test_a_healthy_job_passes_and_trains(tmp_path):
    # four ranks on two shared cores measure a healthy GEMM as low as 0.5 of the median now and then: a run
    # that fails one is repeated, and the best of the runs passes (the floor is the others' 0.5)
    with canary_job(tmp_path, "enforce") as job:
        samples = wait_for(lambda: trained(job.targets), 240, "training to finish")
        runs = {scrape.value(samples[t], "flare_canary_runs_total", phase="preflight") for t in job.targets}
        assert len(runs) == 1 and runs <= {1, 2, 3}  # every rank ran as many: they repeat together
        for target in job.targets:
            assert scrape.value(samples[target], "flare_canary_preflight_passed") == 1
            busbw = scrape.value(
                samples[target],
                "flare_canary_value",
                measurement="allreduce_busbw",
                scope="intra_host",
                phase="preflight",
            )
            assert busbw > 0
            # the canary's groups are its own: the training's signals show only the world group
            groups = [s.labels["group"] for s in samples[target] if s.name == "flare_process_group_info"]
            assert groups == ["world"]
        job.release()
        assert job.wait(timeout=60) == [0] * RANKS, logs(job)


# --- a degradation growing mid-run, and a slow storage path: one job ---------------------------------------
#
# Rank DRIFTING passes its preflight, then is throttled one notch more after each of its in-flight checks
# (its share of CPU time times RAMP_FACTOR), until a check fails the relaxed hard threshold: a drift of hours
# scaled down to seconds, with a check every INTERVAL steps, a moving average quick to follow (alpha 0.5) and
# a band (0.6: the average below 0.4 of the preflight value) well above the hard threshold (HARD_FRACTION of
# it), wide enough that the healthy ranks, slowed now and then by other jobs on the machine's two cores, stay
# inside it. Rank SLOW_STORAGE's storage path is a FIFO fed at STORAGE_RATE; the others' a (sparse) file, read
# as fast as the file system serves it.

DRIFTING, SLOW_STORAGE = THROTTLED, 1
INTERVAL = 5
MAX_CHECKS = 16
FIRST_SHARE, RAMP_FACTOR, LEAST_SHARE = 0.4, 0.7, 0.01
SHORTEST_RUN = 0.005  # seconds the rank is let run a cycle: its period lengthens as its share falls (below)
HARD_FRACTION = 0.12
GEMM = {"measurement": "gemm_flops", "scope": "device"}


class Check(NamedTuple):
    """The drifting rank's gemm_flops right after one of its in-flight checks, as its /metrics says, and
    the other ranks' by then."""

    runs: int
    share: float  # of CPU time it was let run before the check
    ratio: float  # the check's value over the rank's preflight value
    ewma_ratio: float
    drift: float
    failed: float  # flare_canary_failed{phase="in_flight"}
    others: tuple[tuple[int, float | None, float | None], ...] = ()  # (rank, its ewma_ratio, its drift)


def gemm_reading(samples: list[scrape.Sample], name: str, **labels: str) -> float:
    found = scrape.value(samples, name, **GEMM, **labels)
    assert found is not None, name
    return found


def after_check(target: str, runs: int, share: float) -> Check | None:
    """The rank's state once it has run `runs` in-flight checks (or more), else None."""
    try:
        samples = scrape.scrape(target, timeout=5)
    except scrape.ScrapeError:
        return None
    done = scrape.value(samples, "flare_canary_runs_total", phase="in_flight") or 0
    if done < runs:
        return None
    measured = gemm_reading(samples, "flare_canary_value", phase="in_flight")
    preflight = gemm_reading(samples, "flare_canary_value", phase="preflight")
    ewma = gemm_reading(samples, "flare_canary_ewma_ratio")
    drift = gemm_reading(samples, "flare_canary_drift")
    failed = gemm_reading(samples, "flare_canary_failed", phase="in_flight")
    return Check(int(done), share, measured / preflight, ewma, drift, failed)


def others_gemm(job: ObservedJob) -> tuple[tuple[int, float | None, float | None], ...]:
    """Every other rank's gemm_flops now: (rank, its moving average over its preflight value, its drift)."""
    targets = {rank: target for rank, target in enumerate(job.targets) if rank != DRIFTING}
    answers = scrape.scrape_all(list(targets.values()), timeout=5)
    found = []
    for rank, target in targets.items():
        samples = answers[target]
        assert not isinstance(samples, scrape.ScrapeError), samples
        ewma = scrape.value(samples, "flare_canary_ewma_ratio", **GEMM)
        found.append((rank, ewma, scrape.value(samples, "flare_canary_drift", **GEMM)))
    return tuple(found)


def duty_period(share: float) -> float:
    """A tenth of a second, longer where it would let the rank run less than SHORTEST_RUN a cycle: each cycle
    it runs a few milliseconds more than it is let (the throttler's wake-up), which would blur a low share."""
    return max(0.1, SHORTEST_RUN / share)


def follow_the_ramp(job: ObservedJob, cycle: DutyCycle) -> list[Check]:
    """Throttle the drifting rank one notch more after each in-flight check it reports, until one fails the
    hard threshold (or MAX_CHECKS); the others' drift is read after each check."""
    checks: list[Check] = []
    share = FIRST_SHARE
    cycle.throttle(share, duty_period(share))
    while not (checks and (checks[-1].failed or checks[-1].runs >= MAX_CHECKS)):
        runs = checks[-1].runs + 1 if checks else 1
        check = wait_for(
            functools.partial(after_check, job.targets[DRIFTING], runs, share), 60, f"in-flight check {runs}"
        )
        share = max(LEAST_SHARE, share * RAMP_FACTOR)
        cycle.throttle(share, duty_period(share))
        checks.append(check._replace(others=others_gemm(job)))
    return checks


def storage_paths(directory: str) -> dict[int, dict[str, str]]:
    """Each rank's storage path: a sparse file of 256 MiB (the canary's default read), SLOW_STORAGE's a
    rate-limited reader (its FIFO made by the caller)."""
    paths = {}
    for rank in range(RANKS):
        path = os.path.join(directory, f"shard{rank}")
        if rank != SLOW_STORAGE:
            with open(path, "wb") as handle:
                handle.truncate(256 << 20)
        paths[rank] = {"FLARE_CANARY_STORAGE_PATHS": path}
    return paths


class DriftRun(NamedTuple):
    job: ObservedJob
    preflight: dict[str, list[scrape.Sample]]  # every rank's samples once the preflight verdict was in
    checks: list[Check]
    view: dict[str, Any]  # `flare canary --targets --json` at the last check, before the throttle stopped


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DriftRun]:
    directory = str(tmp_path_factory.mktemp("canary_drift"))
    paths = storage_paths(directory)
    fifo = PacedFifo(paths[SLOW_STORAGE]["FLARE_CANARY_STORAGE_PATHS"], STORAGE_RATE)
    env = {
        "FLARE_CANARY": "warn",
        # a rank's storage read at a thousandth of the others' fails; its GEMM a few times slower than the
        # others' on two cores shared with other jobs does not
        "FLARE_CANARY_RELATIVE_FLOOR": "0.25",
        "FLARE_CANARY_COMPUTE_SECONDS": "4.0",  # in flight, GEMMs for 0.4 s: four duty cycles
        "FLARE_CANARY_INTERVAL_STEPS": str(INTERVAL),
        "FLARE_CANARY_EWMA_ALPHA": "0.5",
        "FLARE_CANARY_DRIFT_BAND": "0.6",
        "FLARE_CANARY_IN_FLIGHT_FRACTION": str(HARD_FRACTION),
        "FLARE_CANARY_STORAGE_MAX_SECONDS": "1.0",
        "FLARE_CANARY_COLLECTIVE_BYTES": str(256 << 10),  # the throttled rank's all-reduces stay short
    }
    args = ["--steps", str(INTERVAL * MAX_CHECKS), "--step-seconds", "0.05"]
    job = ObservedJob(directory, train_ddp.__file__, args, RANKS, "canary-drift", env=env, rank_env=paths)
    cycle: DutyCycle | None = None
    try:
        with job:
            preflight = wait_for(lambda: canary_samples(job.targets), 240, "the preflight verdict")
            cycle = DutyCycle(job.processes[DRIFTING].pid)
            checks = follow_the_ramp(job, cycle)
            _, view = flare_json("canary", "--targets", job.file_sd_dir)
            cycle.stop()
            yield DriftRun(job, preflight, checks, view)
    finally:
        if cycle is not None:
            cycle.stop()
        fifo.stop()


@pytest.mark.multirank
def test_a_growing_degradation_drifts_before_the_hard_threshold_fails(drift_run):
    checks = drift_run.checks
    trace = "\n".join(map(str, checks))
    for target in drift_run.job.targets:  # its preflight passed: the baseline is a healthy one
        assert (
            scrape.value(drift_run.preflight[target], "flare_canary_failed", phase="preflight", **GEMM) == 0
        )
    drifted = [check for check in checks if check.drift == 1]
    assert drifted, trace
    first = drifted[0]
    # the moving average flagged it at a check that the relaxed hard threshold still passed ...
    assert first.failed == 0 and first.ratio >= HARD_FRACTION, trace
    # ... and which fails only later, as the rank keeps slowing
    assert checks[-1].failed == 1 and checks[-1].runs > first.runs, trace
    # no other rank's own hardware drifted, at any check
    assert all(drift != 1 for check in checks for _, _, drift in check.others), trace
    # `flare canary` shows it so at the last check: the drifting rank failed in flight and drifts, alone
    rows = drift_run.view["canary"]
    flagged = {
        (row["rank"], row["scope"]): (row["failed"], row["drift"])
        for row in rows
        if row["measurement"] == "gemm_flops"
    }
    assert flagged[DRIFTING, "device"] == (["in_flight"], True), rows
    assert all(not drift for (rank, _), (_, drift) in flagged.items() if rank != DRIFTING), rows


@pytest.mark.multirank
def test_a_slow_storage_path_is_named_as_storage_not_compute(drift_run):
    for rank, target in enumerate(drift_run.job.targets):
        failed = scrape.value(
            drift_run.preflight[target], "flare_canary_failed", measurement="storage_read", phase="preflight"
        )
        assert failed == (1 if rank == SLOW_STORAGE else 0), rank
    code, report = flare_json("diagnose", "--targets", drift_run.job.file_sd_dir)
    assert code == cli.EXIT_ANOMALY
    named = [v for v in report["verdicts"] if SLOW_STORAGE in v["ranks"]]
    found = [(v["kind"], v["evidence"]["measurement"], v["evidence"]["check"], v["cause"]) for v in named]
    assert found == [("canary", "storage_read", "preflight", "storage")], report["verdicts"]
    assert named[0]["ranks"] == [SLOW_STORAGE] and named[0]["domain"] == "rank"
    # its compute is not named, with it or on its own; nor is any rank's compute before the first step
    also = named[0]["evidence"]["ranks"][str(SLOW_STORAGE)]["also_failed"]
    assert not [check for check in also if check.startswith("gemm_flops")], also
    preflight_compute = [
        v
        for v in report["verdicts"]
        if v["kind"] == "canary" and v["evidence"]["check"] == "preflight" and v["cause"] != "storage"
    ]
    assert preflight_compute == [], report["verdicts"]
