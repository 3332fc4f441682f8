"""The fault scenarios that matter most, with every core of the host loaded: the same verdicts, ranks and
causes as on a quiet host (tests/e2e/test_scenarios.py, tests/e2e/test_post_mortem.py run them quiet).

Real nodes are never quiet: data-loader workers, checkpoint writers, other jobs' processes share the
cores. `busy_host` runs one busy process per core and one more (a run queue longer than the cores) for the
test, each ending by itself after BUSY_SECONDS at most. The jobs are judged from the ranks (`--targets`):
live where they live, post-mortem from the files they left where they are gone.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import flare_json, without_stragglers

from flare_exporter.engine import cli, scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing.load import BusyCores
from flare_exporter.local.workloads import train_ddp

pytestmark = pytest.mark.multirank

RANKS, FAULT_RANK, FAULT_STEP, HANG_SECONDS = 4, 2, 15, 3
BUSY_SECONDS = 300


@pytest.fixture
def busy_host() -> Iterator[int]:
    """Every core busy for the test (BusyCores: one spinning process per core and one more); their count."""
    with BusyCores(seconds=BUSY_SECONDS) as busy:
        yield busy.count


def start(tmp_path: Path, run: str, *fault: str, steps: int = 100_000, linger: int = 60) -> ObservedJob:
    env = {
        "FLARE_STALL_SECONDS": "1",
        "FLARE_HANG_SECONDS": str(HANG_SECONDS),
        "FLARE_LINGER_SECONDS": str(linger),
    }
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    args = ["--steps", str(steps), "--step-seconds", "0.02", "--fault-step", str(FAULT_STEP), *fault]
    return ObservedJob(str(tmp_path), train_ddp.__file__, args, RANKS, run, env=env, rank_env=hosts)


def diagnosed(job: ObservedJob, run: str) -> tuple[int, list[dict]]:
    """`flare diagnose`'s exit code and every verdict, from the ranks directly."""
    code, report = flare_json(
        "diagnose", "--targets", job.file_sd_dir, "--run", run, "--timeout", "5", "--hang-seconds", "3"
    )
    return code, report.get("verdicts", [])


def verdicts(job: ObservedJob, run: str) -> tuple[int, list[dict]]:
    code, found = diagnosed(job, run)
    return code, without_stragglers(found)


def first_verdict(job: ObservedJob, run: str, kind: str, ranks: list[int], budget: float = 120) -> dict:
    seen: list[list[dict]] = []

    def named() -> dict | None:
        code, found = verdicts(job, run)
        seen.append(found)
        if code == cli.EXIT_ANOMALY and found and (found[0]["kind"], found[0]["ranks"]) == (kind, ranks):
            return found[0]
        return None

    try:
        return wait_for(named, budget, f"{kind} {ranks} named")
    except TimeoutError:
        pytest.fail(f"never named {kind} {ranks} on a busy host; last: {seen[-1:]}")


def stepped(job: ObservedJob, steps: int) -> None:
    def every_rank() -> bool:
        found = scrape.scrape_all(job.targets, timeout=5)
        return all(
            isinstance(samples, list) and (scrape.value(samples, "flare_steps_total") or 0) >= steps
            for samples in found.values()
        )

    wait_for(every_rank, 180, f"every rank to take {steps} steps on a busy host")


def test_a_stuck_rank_is_named_with_every_core_busy(tmp_path, busy_host):
    with start(tmp_path, "busy-stuck", "--fault", "stuck", "--fault-rank", str(FAULT_RANK)) as job:
        verdict = first_verdict(job, "busy-stuck", "hang", [FAULT_RANK])
        assert "stuck_in_compute" in verdict["summary"], verdict["summary"]
        job.release()


def test_a_killed_rank_is_named_down_with_every_core_busy(tmp_path, busy_host):
    with start(tmp_path, "busy-killed") as job:
        stepped(job, 5)
        job.processes[FAULT_RANK].send_signal(signal.SIGKILL)
        first_verdict(job, "busy-killed", "rank_down", [FAULT_RANK])
        job.release()


def test_a_rank_that_raises_is_named_with_its_cause_with_every_core_busy(tmp_path, busy_host):
    """The rank's exception is in its incident file before it exits, however loaded the host and however
    fast its peers die of gloo errors: the post-mortem names it and why."""
    fault = ("--fault", "raise", "--fault-rank", str(FAULT_RANK))
    with start(tmp_path, "busy-raise", *fault, linger=5) as job:

        def post_mortem() -> tuple[int, dict] | None:
            code, report = flare_json("diagnose", "--targets", job.file_sd_dir, "--run", "busy-raise")
            return (code, report) if report.get("post_mortem") else None

        code, report = wait_for(post_mortem, 150, "every rank gone and the run judged from its files")
    assert code == cli.EXIT_ANOMALY and report["verdicts"], report
    first = report["verdicts"][0]
    assert (first["ranks"], first["cause"]) == ([FAULT_RANK], "software_exception"), first


def test_a_healthy_job_has_no_verdict_with_every_core_busy(tmp_path, busy_host):
    with start(tmp_path, "busy-healthy", steps=50) as job:
        stepped(job, 40)
        code, found = diagnosed(job, "busy-healthy")
        # a rank the spinners starve can be slower than the others for a while, a straggler (its page: exit
        # 1); nothing else is named
        assert without_stragglers(found) == [], found
        assert code == (cli.EXIT_ANOMALY if found else cli.EXIT_OK), found
        job.release()
        assert job.wait(120) == [0] * RANKS


def test_a_healthy_job_slowed_by_a_busy_host_is_the_hosts_warning_not_a_page(tmp_path):
    """The issue's loaded host: a job, flat out, closes its best windows and sets the host's pressure floor;
    then two busy loops and another 4-rank job share the cores and every rank slows 2-3x alike. On a quiet
    host the job crowds its own cores already (CPU pressure ~0.6 here); the others raise it to ~0.9. That is
    the host's load (cause host_contention, a warning: exit 0), not a job-wide slowdown to page for (exit 1
    before), nor a rank's fault."""
    (tmp_path / "job").mkdir()
    (tmp_path / "neighbour").mkdir()
    with start(tmp_path / "job", "busy-later", "--step-seconds", "0") as job:
        stepped(job, 2000)  # its best windows closed before the load, well after the ranks' start
        seen: list[tuple[int, list]] = []

        def warned() -> tuple[int, list[dict]] | None:
            code, report = flare_json("diagnose", "--targets", job.file_sd_dir, "--run", "busy-later")
            found = report.get("verdicts", [])
            seen.append((code, [(v["kind"], v["ranks"], v["cause"], v["summary"][:80]) for v in found]))
            warnings = [v for v in found if v["cause"] == "host_contention"]
            return (code, warnings) if warnings and code == cli.EXIT_OK else None  # 0: nothing pages

        neighbour = ObservedJob(
            str(tmp_path / "neighbour"), train_ddp.__file__, ["--steps", "100000"], 4, "other"
        )
        with BusyCores(count=2, seconds=BUSY_SECONDS), neighbour:
            try:
                code, found = wait_for(warned, 240, "the busy host's warning")
            except TimeoutError:
                pytest.fail(f"the busy host never explained the slowdown; last: {seen[-3:]}")
            neighbour.release()
        job.release()
    first = found[0]
    assert (first["kind"], first["ranks"], first["severity"]) == ("straggler", [], "warning"), first
    assert sorted(first["evidence"]["host_load"]) == ["node-0", "node-1"]  # every "host" of this machine
    assert first["evidence"]["slowed_ranks"] == [0, 1, 2, 3]
    for load in first["evidence"]["host_load"].values():
        assert load["cpu_pressure"] - load["cpu_pressure_floor"] >= 0.15, load


def test_a_straggler_is_named_with_every_core_busy(tmp_path, busy_host):
    """Rank 2 sleeps 40 ms in every step (paced at 100 ms): the busy cores slow every rank, rank 2 most."""
    slow = ["--slow-rank", str(FAULT_RANK), "--slowdown", "40", "--slow-by", "sleep", "--slow-from-step", "0"]
    with start(tmp_path, "busy-straggler", *slow, "--step-seconds", "0.1") as job:
        seen: list[dict] = []

        def named() -> dict | None:
            code, report = flare_json("diagnose", "--targets", job.file_sd_dir, "--run", "busy-straggler")
            seen.append(report)
            stragglers = [v for v in report.get("verdicts", []) if v["kind"] == "straggler"]
            return stragglers[0] if stragglers and stragglers[0]["ranks"] == [FAULT_RANK] else None

        try:
            wait_for(named, 150, "the straggler named on a busy host")
        except TimeoutError:
            pytest.fail(f"never named rank {FAULT_RANK}; last: {seen[-1:]}")
        job.release()


def test_a_rank_whose_interpreter_is_contended_is_named_by_its_host_side_latency_with_every_core_busy(
    tmp_path, busy_host
):
    """Eight threads spinning in rank 1's own interpreter (its GIL contended) beside the busy cores: an
    issue-latency regression of rank 1, host side, as on a quiet host (tests/e2e/test_ild_scenarios.py)."""
    from test_ild_scenarios import FAKE_KERNELS, ILD_ENV

    fault = ["--fault", "contention", "--contention-threads", "8", "--fault-rank", "1", "--fault-step", "40"]
    args = ["--steps", "100000", *FAKE_KERNELS, *fault]
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, RANKS, "busy-gil", env=ILD_ENV) as job:
        seen: list[dict] = []

        def named() -> dict | None:
            code, report = flare_json("diagnose", "--targets", job.file_sd_dir, "--run", "busy-gil")
            seen.append(report)
            ild = [v for v in report.get("verdicts", []) if v["kind"] == "ild_regression"]
            return report["verdicts"] if ild and ild[0]["ranks"] == [1] else None

        try:
            found = wait_for(named, 150, "rank 1's issue-latency regression on a busy host")
        except TimeoutError:
            pytest.fail(
                f"never named rank 1; last: {[(v['kind'], v['ranks']) for v in seen[-1]['verdicts']]}"
            )
        verdict = next(v for v in found if v["kind"] == "ild_regression")
        # host side it stays, even where rank 1 is also the slowest: no straggler verdict names it
        assert not [v for v in found if v["kind"] == "straggler" and 1 in v["ranks"]], found
        assert {"host_dispatch", "host_gap"} & set(verdict["evidence"]["distributions"]), verdict["evidence"]
        job.release()
