"""Unmodified torch programs of every parallelism, under the launcher, on both recorder paths.

The programs (tests/programs/) are written as users write them, not as flare's workload: pipelining (GPipe
and 1F1B over 4 stages), FSDP2, FSDP2 with tensor parallel on a 2x2 DeviceMesh, an expert-dispatch layer
(`all_to_all_single` with data-dependent splits) and DDP. Each runs on the C++ recorder and on the Python
hooks (`FLARE_NATIVE_COLLECTIVES=0`, what a plain `pip install` without the extension gives). One job per
program and path: healthy for its first steps (no verdict, and its communication seen where it happens),
then a rank stuck in its own code, named from the ranks (`--targets`), from Prometheus and in the page.
Each also loses a rank (SIGKILL) and freezes one (SIGSTOP), and the pipeline deadlocks.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import flare_json, without_stragglers

from flare_exporter.engine import cli, scrape
from flare_exporter.local import alertmanager
from flare_exporter.local.alertmanager import AlertingStack, WebhookReceiver
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.mixin.rules import CULPRIT_ALERTS

pytestmark = pytest.mark.multirank

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
RANKS = 4
HANG_SECONDS = 3
STUCK_STEP = 12
RECORDERS = {"cpp": {}, "python": {"FLARE_NATIVE_COLLECTIVES": "0"}}
# program -> (script, its arguments, the culprit page a rank stuck in its own code gets)
JOBS = {
    "pipeline_gpipe": ("pipeline_train.py", ["--schedule", "gpipe"], "FlarePointToPointCulprit"),
    "pipeline_1f1b": ("pipeline_train.py", ["--schedule", "1f1b"], "FlarePointToPointCulprit"),
    "fsdp": ("fsdp_train.py", [], "FlareCollectiveHangCulprit"),
    "fsdp_tp": ("fsdp_tp_train.py", [], "FlareCollectiveHangCulprit"),
    "expert_dispatch": ("moe_train.py", [], "FlareCollectiveHangCulprit"),
    "ddp": ("ddp_train.py", [], "FlareCollectiveHangCulprit"),
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One Prometheus and Alertmanager for every job (each its own run), as tests/e2e/test_scenarios.py."""
    work = tmp_path_factory.mktemp("parallelisms")
    targets = work / "targets"
    targets.mkdir()
    stack = None
    if alertmanager.can_alert():
        stack = AlertingStack(str(work / "alerting"), str(targets), HANG_SECONDS, for_="5s")
        stack.wait_ready()
    yield work, targets, stack
    if stack is not None:
        stack.stop()


def start(work: Path, targets: Path, run: str, script: str, args: list[str], env: dict) -> ObservedJob:
    (work / run).mkdir()
    flare_env = {
        "FLARE_FILE_SD_DIR": str(targets),
        "FLARE_STALL_SECONDS": "1",
        "FLARE_HANG_SECONDS": str(HANG_SECONDS),
        "FLARE_LINGER_SECONDS": "120",
        **env,
    }
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    return ObservedJob(
        str(work / run), str(PROGRAMS / script), args, RANKS, run, env=flare_env, rank_env=hosts
    )


def every_rank(job: ObservedJob, steps: int) -> dict[str, list[scrape.Sample]]:
    """Every rank's samples once each has taken `steps` steps."""

    def stepped() -> dict[str, list[scrape.Sample]] | None:
        results = scrape.scrape_all(job.targets, timeout=2)
        if all(
            isinstance(samples, list) and (scrape.value(samples, "flare_steps_total") or 0) >= steps
            for samples in results.values()
        ):
            return results  # type: ignore[return-value]
        return None

    return wait_for(stepped, 120, f"every rank to take {steps} steps")


def sources(targets: Path, stack: AlertingStack | None) -> list[list[str]]:
    found = [["--targets", str(targets), "--timeout", "2"]]
    if stack is not None:
        found.append(["--prometheus", stack.prometheus.url, "--window", "2m"])
    return found


def await_verdict(source: list[str], run: str, kind: str, ranks: list[int]) -> dict:
    """The verdict of `kind` on `ranks` once `flare diagnose` names it first (stragglers aside)."""
    reports = []

    def named() -> dict | None:
        code, report = flare_json("diagnose", *source, "--run", run, "--hang-seconds", str(HANG_SECONDS))
        reports.append(report)
        verdicts = without_stragglers(report.get("verdicts", []))
        if (
            code == cli.EXIT_ANOMALY
            and verdicts
            and (verdicts[0]["kind"], verdicts[0]["ranks"]) == (kind, ranks)
        ):
            return verdicts[0]
        return None

    try:
        return wait_for(named, 60, f"diagnose {' '.join(source)} to name {kind} {ranks}")
    except TimeoutError:
        pytest.fail(f"never named {kind} {ranks}; last report: {json.dumps(reports[-1:], indent=1)[:3000]}")


def await_page(stack: AlertingStack | None, run: str, alertname: str, ranks: list[int]) -> None:
    """Alertmanager delivered `alertname` for `ranks` of `run`, and no culprit page names another rank."""
    if stack is None:
        return
    pages: WebhookReceiver = stack.pages
    expected = {str(rank) for rank in ranks}

    def delivered() -> bool:
        return expected <= {
            alert["labels"].get("rank") for _, alert in pages.alerts(run=run, alertname=alertname)
        }

    wait_for(delivered, 60, f"a {alertname} page naming rank {ranks} of run {run}")
    named = {
        alert["labels"]["rank"]
        for _, alert in pages.alerts(run=run)
        if alert["labels"]["alertname"] in CULPRIT_ALERTS
    }
    assert named == expected, [alert["labels"] for _, alert in pages.alerts(run=run)]


def communication_seen(program: str, samples: dict[str, list[scrape.Sample]]) -> None:
    """What each program communicates is seen where it happens, on either recorder path."""
    ranks = {_rank(s): s for s in samples.values()}
    if program.startswith("pipeline"):
        for stage in range(RANKS - 1):  # each stage sends to the next, which receives from it (the exact
            # match of the counts is what names the stuck stage below: counts scraped apart differ by a step)
            assert _p2p(ranks[stage], "flare_p2p_completed_total", "send", stage + 1) >= STUCK_STEP // 2
            assert _p2p(ranks[stage + 1], "flare_p2p_completed_total", "recv", stage) >= STUCK_STEP // 2
        ops = {s.labels.get("op") for s in ranks[1] if s.name == "flare_collective_duration_seconds_count"}
        assert not ops & {"send", "recv"}  # not mixed into the collectives

        def phase(name: str) -> float:
            return sum(
                scrape.value(s, "flare_step_phase_seconds_total", phase=name) or 0.0 for s in ranks.values()
            )

        assert phase("bubble") > phase("collective")  # the stages' waits for each other: the bubble
        return
    roles = {"fsdp_tp": {"dp", "tp"}}.get(program, {"world"})
    for rank, series in ranks.items():
        infos = [s.labels for s in series if s.name == "flare_process_group_info"]
        issued = {
            info["role"]: scrape.value(series, "flare_collective_last_issued_seq", group=info["group"]) or 0
            for info in infos
            if info["role"] in roles
        }
        assert set(issued) == roles and min(issued.values()) >= STUCK_STEP // 2, (rank, issued)


def _rank(samples: list[scrape.Sample]) -> int:
    return int(next(s.labels["rank"] for s in samples if s.name == "flare_rank_info"))


def _p2p(samples: list[scrape.Sample], name: str, direction: str, peer: int) -> float:
    return scrape.value(samples, name, direction=direction, peer=str(peer)) or 0.0


@pytest.mark.parametrize("recorder", sorted(RECORDERS))
@pytest.mark.parametrize("program", sorted(JOBS))
def test_a_healthy_run_then_a_rank_stuck_in_its_own_code(shared, program, recorder):
    work, targets, stack = shared
    script, args, page = JOBS[program]
    run = f"{program}-{recorder}"
    steps = [
        "--steps",
        "100000",
        "--step-seconds",
        "0.05",
        "--stuck-rank",
        "2",
        "--stuck-step",
        str(STUCK_STEP),
    ]
    with start(work, targets, run, script, [*args, *steps], RECORDERS[recorder]) as job:
        samples = every_rank(job, STUCK_STEP // 2)
        recorders = {
            s.labels["recorder"]
            for ss in samples.values()
            for s in ss
            if s.name == "flare_process_group_info"
        }
        assert recorders == {recorder}
        said = {
            "cpp": "collectives recorded in C++",
            "python": "recorded by Python hooks: the C++ recorder is switched off",
        }
        assert said[recorder] in Path(job.log_paths[0]).read_text()  # one line at start-up, on local rank 0
        assert "collectives recorded" not in Path(job.log_paths[1]).read_text()
        communication_seen(program, samples)
        code, report = flare_json("diagnose", "--targets", str(targets), "--run", run)
        assert without_stragglers(report["verdicts"]) == [], report  # healthy so far
        if program.startswith("pipeline"):  # stages differ by design: each weighed only against itself
            code, found = flare_json("perf", "--targets", str(targets), "--run", run)
            assert found["slow_ranks"] == [] and {row["stage"] for row in found["ranks"]} == {
                f"world stage {rank}" for rank in range(RANKS)
            }
        for source in sources(targets, stack):
            verdict = await_verdict(source, run, "hang", [2])
            assert "stuck_in_" in verdict["summary"], verdict["summary"]
        await_page(stack, run, page, [2])


def test_a_pipeline_deadlock_is_a_cycle_of_exactly_its_ranks(shared):
    work, targets, stack = shared
    args = ["--steps", "100000", "--step-seconds", "0.05", "--deadlock", "--stuck-step", "8"]
    with start(work, targets, "deadlock", "pipeline_train.py", args, {}):
        for source in sources(targets, stack):
            verdict = await_verdict(source, "deadlock", "hang", [1, 2])
            assert verdict["cause"] == "deadlock" and verdict["evidence"]["cycle"] == [1, 2]
            assert verdict["summary"].startswith("deadlock: ranks 1, 2 wait for each other")
        code, report = flare_json(
            "hang", "--targets", str(targets), "--run", "deadlock", "--hang-seconds", "3"
        )
        [world] = report["groups"]
        waits = {
            (flight["rank"], flight["peer"]) for flight in world["p2p_in_flight"] if flight["waits_for_peer"]
        }
        assert {(1, 2), (2, 1)} <= waits
        await_page(stack, "deadlock", "FlarePointToPointDeadlock", [1, 2])


@pytest.mark.parametrize("fault", ["kill", "stop"])
@pytest.mark.parametrize("program", sorted(JOBS))
def test_a_rank_killed_or_frozen_is_named_down(shared, program, fault):
    work, targets, stack = shared
    script, args, _ = JOBS[program]
    run = f"{program}-{fault}"
    with start(work, targets, run, script, [*args, "--steps", "100000", "--step-seconds", "0.05"], {}) as job:
        every_rank(job, 5)
        if stack is not None:
            expr = f'flare_steps_total{{run="{run}"}} >= 5'
            wait_for(
                lambda: len(stack.prometheus.query(expr)) == RANKS, 60, "Prometheus to scrape every rank"
            )
        os.kill(job.processes[2].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        try:
            for source in sources(targets, stack):
                await_verdict(source, run, "rank_down", [2])
            await_page(stack, run, "FlareRankDown", [2])
        finally:
            if fault == "stop":
                os.kill(job.processes[2].pid, signal.SIGCONT)


@pytest.mark.parametrize("recorder", sorted(RECORDERS))
def test_point_to_point_durations_are_the_injected_delay(tmp_path, recorder):
    delay, rounds = 0.2, 6
    env = {"FLARE_FILE_SD_DIR": str(tmp_path / "targets"), **RECORDERS[recorder]}
    args = ["--rounds", str(rounds), "--delay-seconds", str(delay)]
    with ObservedJob(
        str(tmp_path), str(PROGRAMS / "p2p_delay.py"), args, 2, f"p2p-{recorder}", env=env
    ) as job:

        def exchanged() -> tuple[list[scrape.Sample], list[scrape.Sample]] | None:
            results = scrape.scrape_all(job.targets, timeout=2)
            if any(not isinstance(samples, list) for samples in results.values()):
                return None
            sender, receiver = (results[target] for target in job.targets)
            received = scrape.value(receiver, "flare_p2p_completed_total", direction="recv", peer="0")
            sent = scrape.value(sender, "flare_p2p_completed_total", direction="send", peer="1")
            return (sender, receiver) if received == sent == rounds else None  # type: ignore[return-value]

        sender, receiver = wait_for(exchanged, 120, f"{rounds} receives")
        job.release()
    received = _mean(receiver, "recv")
    assert delay * 0.8 <= received <= delay * 1.2, received
    assert _mean(sender, "send") < delay * 0.2  # its peer already waited: the send takes no delay
    assert scrape.value(sender, "flare_p2p_issued_total", direction="send", peer="1") == rounds


def _mean(samples: list[scrape.Sample], direction: str) -> float:
    count = scrape.value(samples, "flare_p2p_duration_seconds_count", direction=direction) or 0.0
    return (scrape.value(samples, "flare_p2p_duration_seconds_sum", direction=direction) or 0.0) / count
