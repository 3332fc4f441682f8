"""Faults injected into real 4-rank gloo DDP jobs, diagnosed from a real Prometheus and by direct scrape.

Each scenario runs the unmodified workload under the launcher with a fault in one chosen rank (injected by
the workload's --fault flags, or by a real signal from here), awaits the verdict through `flare diagnose
--json`, and checks that it names the right rank and kind. Thresholds are short (FLARE_HANG_SECONDS=3) so
that a hang shows within seconds; the incident files must survive the job's teardown.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import flare_json, pages_without_stragglers, without_stragglers

from flare_exporter.engine import cli, scrape
from flare_exporter.local import alertmanager
from flare_exporter.local.alertmanager import AlertingStack, WebhookReceiver
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.mixin.rules import CULPRIT_ALERTS

pytestmark = pytest.mark.multirank

RANKS = 4
HANG_SECONDS = 3
FAULT_STEP = 15


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One Prometheus for every scenario, watching one file_sd directory; each scenario is its own run.

    Prometheus evaluates `flare rules` for this test's thresholds (hang after 3 s, every for: 5s) and sends
    alerts to a real Alertmanager running alerts/alertmanager/alertmanager.yml, which pages `pages`.
    """
    work = tmp_path_factory.mktemp("scenarios")
    targets = work / "targets"
    targets.mkdir()
    prometheus = pages = None
    stack = None
    if alertmanager.can_alert():
        # for: 5s, as production's 1m: one scrape timing out on this busy machine is not a dead rank
        stack = AlertingStack(str(work / "alerting"), str(targets), HANG_SECONDS, for_="5s")
        stack.wait_ready()
        prometheus, pages = stack.prometheus, stack.pages
    yield work, targets, prometheus, pages
    if stack is not None:
        stack.stop()


def start_job(work: Path, targets: Path, run: str, *script_args: str) -> ObservedJob:
    env = {
        "FLARE_FILE_SD_DIR": str(targets),
        "FLARE_STALL_SECONDS": "1",
        "FLARE_HANG_SECONDS": str(HANG_SECONDS),
        "FLARE_LINGER_SECONDS": "120",
        "FLARE_INCIDENT_DIR": str(work / run / "incidents"),
    }
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}  # two ranks per host
    (work / run).mkdir()
    args = ["--steps", "100000", "--step-seconds", "0.02", "--fault-step", str(FAULT_STEP), *script_args]
    return ObservedJob(str(work / run), train_ddp.__file__, args, RANKS, run, env=env, rank_env=hosts)


def await_steps(job: ObservedJob, steps: int, prometheus: PrometheusProcess | None) -> None:
    """Every rank has taken `steps` steps, and Prometheus (if any) has scraped every rank of the run."""

    def every_rank_stepped() -> bool:
        results = scrape.scrape_all(job.targets, timeout=2)
        return all(
            isinstance(samples, list) and (scrape.value(samples, "flare_steps_total") or 0) >= steps
            for samples in results.values()
        )

    wait_for(every_rank_stepped, 120, f"every rank to take {steps} steps")
    if prometheus is not None:
        run = os.path.basename(os.path.dirname(job.done_file))
        expr = f'flare_steps_total{{run="{run}"}} >= {steps}'
        wait_for(lambda: len(prometheus.query(expr)) == RANKS, 60, "Prometheus to scrape every rank")


def await_verdict(
    source: list[str], run: str, expected: tuple[str, list[int]], until: Callable[[dict], bool] = bool
) -> dict:
    """The first verdict once diagnose names `expected` (kind, ranks) and `until(verdict)` holds."""
    reports = []

    def named() -> dict | None:
        code, report = flare_json("diagnose", *source, "--run", run, "--hang-seconds", str(HANG_SECONDS))
        reports.append(report)
        verdicts = report.get("verdicts", [])
        if code == cli.EXIT_ANOMALY and verdicts and (verdicts[0]["kind"], verdicts[0]["ranks"]) == expected:
            return verdicts[0] if until(verdicts[0]) else None
        return None

    try:
        return wait_for(named, 60, f"diagnose {' '.join(source)} to name {expected}")
    except TimeoutError:
        pytest.fail(f"never named {expected}; last report: {json.dumps(reports[-1:], indent=1)[:3000]}")


def await_culprit_page(
    pages: WebhookReceiver | None, run: str, alertname: str, ranks: list[int], **labels: str
) -> None:
    """Alertmanager delivered `alertname` for `ranks` of `run`, and no page of the run names another rank."""
    if pages is None:
        return
    expected = {str(rank) for rank in ranks}

    def delivered() -> bool:
        named = {
            alert["labels"].get("rank") for _, alert in pages.alerts(run=run, alertname=alertname, **labels)
        }
        return expected <= named

    wait_for(delivered, 60, f"a {alertname} page naming rank {ranks} of run {run}")
    named = {
        alert["labels"]["rank"]
        for _, alert in pages.alerts(run=run)
        if alert["labels"]["alertname"] in CULPRIT_ALERTS
    }
    assert named == expected, [alert["labels"] for _, alert in pages.alerts(run=run)]


def sources(targets: Path, prometheus: PrometheusProcess | None) -> list[list[str]]:
    found = [["--targets", str(targets), "--timeout", "2"]]
    if prometheus is not None:
        found.append(["--prometheus", prometheus.url, "--window", "2m"])
    return found


def incidents(work: Path, run: str) -> dict[int, dict]:
    directory = work / run / "incidents"
    if not directory.exists():
        return {}
    return {
        json.loads(path.read_text())["identity"]["rank"]: json.loads(path.read_text())
        for path in directory.glob("*.json")
    }


def test_rank_stuck_in_python_before_a_collective(shared):
    work, targets, prometheus, pages = shared
    with start_job(work, targets, "stuck", "--fault", "stuck", "--fault-rank", "0"):
        for source in sources(targets, prometheus):
            verdict = await_verdict(source, "stuck", ("hang", [0]))
            assert verdict["domain"] == "rank" and verdict["group"] == "world"
            culprit = verdict["evidence"]["culprits"]["0"]
            assert culprit["activity"] == "compute" and "stuck_in_compute" in culprit["frames"]
            assert "stuck_in_compute" in verdict["summary"]
            evidence = verdict["evidence"]
            assert evidence["last_issued_seq"] == {"0": evidence["max_issued_seq"] - 1}
            assert evidence["ranks_at_max_issued_seq"] == 3
        await_culprit_page(pages, "stuck", "FlareCollectiveHangCulprit", [0], group="world", host="node-0")
        wait_for(
            lambda: [i["steps"] for i in incidents(work, "stuck").values()] == [FAULT_STEP] * RANKS,
            30,
            "every rank's hang incident",
        )
    written = incidents(work, "stuck")  # the job is torn down (SIGKILL); the files stay
    assert all(incident["reason"] == "hang" for incident in written.values())
    assert all(incident["detail"].startswith("no progress") for incident in written.values())
    assert "stuck_in_compute" in json.dumps(written[0]["threads"])
    assert written[0]["groups"]["world"]["in_flight"] is None
    assert written[1]["groups"]["world"]["in_flight"]["op"] == "allreduce"


def test_rank_killed_mid_run(shared):
    work, targets, prometheus, pages = shared
    with start_job(work, targets, "killed") as job:
        await_steps(job, 20, prometheus)
        os.kill(job.processes[2].pid, signal.SIGKILL)
        for source in sources(targets, prometheus):
            verdict = await_verdict(source, "killed", ("rank_down", [2]))
            assert verdict["evidence"]["ranks"]["2"]["host"] == "node-1", (source, verdict)
        await_culprit_page(pages, "killed", "FlareRankDown", [2], host="node-1")

        wait_for(lambda: set(incidents(work, "killed")) == {0, 1, 3}, 60, "the survivors' incident files")
    written = incidents(work, "killed")
    assert 2 not in written  # a SIGKILLed rank writes nothing: the survivors' files tell its story
    # a survivor whose connection to rank 2 broke raised; one waiting on another survivor hangs instead
    reasons = {incident["reason"] for incident in written.values()}
    assert reasons <= {"exception", "hang"}
    raised = [incident["exception"] for incident in written.values() if incident["reason"] == "exception"]
    assert all(exception["cause"] == "communication" for exception in raised)  # a survivor's, secondary
    assert all(incident["groups"]["world"]["last_issued_seq"] > 0 for incident in written.values())


def test_rank_frozen_inside_a_collective(shared):
    work, targets, prometheus, pages = shared
    with start_job(work, targets, "frozen") as job:
        await_steps(job, 20, prometheus)
        os.kill(job.processes[1].pid, signal.SIGSTOP)
        try:
            for source in sources(targets, prometheus):
                verdict = await_verdict(
                    source, "frozen", ("rank_down", [1]), until=lambda v: v["evidence"]["hung_groups"]
                )
                assert verdict["evidence"]["hung_groups"] == ["world"]
                assert "timed out" in verdict["summary"] or "down" in verdict["summary"]
            await_culprit_page(pages, "frozen", "FlareRankDown", [1], host="node-0")
        finally:
            os.kill(job.processes[1].pid, signal.SIGCONT)


def test_rank_issuing_a_different_collective(shared):
    work, targets, prometheus, pages = shared
    with start_job(work, targets, "mismatch", "--fault", "mismatch", "--fault-rank", "3"):
        for source in sources(targets, prometheus):
            verdict = await_verdict(source, "mismatch", ("mismatch", [3]))
            in_flight = verdict["evidence"]["in_flight"]
            assert in_flight["3"]["op"] == "broadcast"
            assert {in_flight[rank]["op"] for rank in "012"} == {"allreduce"}
            assert len({in_flight[rank]["seq"] for rank in "0123"}) == 1
        await_culprit_page(
            pages, "mismatch", "FlareCollectiveMismatch", [3], mismatch="op_or_size", host="node-1"
        )


def test_two_ranks_of_one_host_failing_together(shared):
    work, targets, prometheus, pages = shared
    with start_job(work, targets, "host") as job:
        await_steps(job, 20, prometheus)
        for rank in (2, 3):  # both ranks of node-1
            os.kill(job.processes[rank].pid, signal.SIGKILL)
        for source in sources(targets, prometheus):
            verdict = await_verdict(source, "host", ("host_fault", [2, 3]))
            assert verdict["domain"] == "host" and verdict["evidence"]["host"] == "node-1"
            assert verdict["evidence"]["ranks_on_host"] == [2, 3]
        if pages is not None:
            wait_for(
                lambda: pages.alerts(run="host", alertname="FlareHostDown", host="node-1"),
                60,
                "the host page",
            )
            # the host's page inhibits its ranks' pages; none names a rank of another host
            ranks = {alert["labels"].get("rank") for _, alert in pages.alerts(run="host")} - {None}
            assert ranks <= {"2", "3"}, ranks


def began(alert: dict) -> float:
    """When Alertmanager says an alert began firing (Unix time)."""
    return datetime.datetime.fromisoformat(alert["startsAt"].replace("Z", "+00:00")).timestamp()


def test_healthy_run_has_no_verdict_from_start_to_end(shared):
    work, targets, prometheus, pages = shared
    steps = 150
    job = start_job(work, targets, "healthy", "--steps", str(steps))  # the later --steps wins
    with job:
        await_steps(job, 1, prometheus)
        every_rank_seen = time.time()
        reports = []

        def finished() -> bool:
            for source in sources(targets, prometheus):
                code, report = flare_json("diagnose", *source, "--run", "healthy", "--hang-seconds", "3")
                reports.append((code, report))
            results = scrape.scrape_all(job.targets, timeout=2)
            return all(
                isinstance(samples, list) and scrape.value(samples, "flare_steps_total") == steps
                for samples in results.values()
            )

        wait_for(finished, 180, "the healthy run to finish")
        if pages is not None:  # no page while it trained
            # ranks that start seconds apart on a loaded machine are missing until the last starts: with
            # this stack's `for: 5s` (production's is 1m), a page that began before every rank was seen
            paged = [
                alert
                for alert in pages_without_stragglers(pages.alerts(run="healthy"))
                if not (
                    alert["labels"]["alertname"] == "FlareRanksMissing" and began(alert) < every_rank_seen
                )
            ]
            assert paged == []
        job.release()
        assert job.wait(timeout=60) == [0] * RANKS
    assert len(reports) >= 4
    assert [without_stragglers(report["verdicts"]) for _, report in reports] == [[]] * len(reports)
    assert all(code == (cli.EXIT_ANOMALY if report["verdicts"] else cli.EXIT_OK) for code, report in reports)
