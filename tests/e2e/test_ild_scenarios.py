"""ILD regressions injected into real 4-rank gloo DDP jobs, diagnosed by `flare diagnose` from the ranks.

- a host stall every step on one rank, with the fake device: its kernel issue latency collapses;
- CPU and interpreter contention on one rank: its host dispatch latency shifts;
- a slowed issue path on one rank (every op delayed on the host): its host dispatch latency shifts;
- no injection: no verdict from the first step to the last.

Baselines and windows are short (a few dozen steps) so that the runs stay small; the injected faults are
large, so that a busy machine does not decide the outcome. Sensitivity belongs in benchmarks/.

Where Prometheus and Alertmanager are installed, a Prometheus evaluating `flare rules` scrapes every run:
the engine must name the same rank from it, and Alertmanager must page FlareIssueLatencyShifted for it
(except under contention, whose size depends on the machine's cores: see its test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import await_page, flare_json, pages_without_stragglers, without_stragglers

from flare_exporter.engine import cli, scrape
from flare_exporter.engine.targets import read_targets
from flare_exporter.local import alertmanager
from flare_exporter.local.alertmanager import AlertingStack
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.policies import IldPolicy

pytestmark = pytest.mark.multirank

RANKS = 4
FAULT_STEP = 40
ILD_ENV = {
    "FLARE_ILD_LAUNCH_SAMPLE_EVERY": "1",
    "FLARE_ILD_DISPATCH_EVERY_STEPS": "2",
    "FLARE_ILD_WARMUP_STEPS": "3",
    "FLARE_ILD_BASELINE_STEPS": "30",
    "FLARE_ILD_WINDOW_STEPS": "5",
    "FLARE_TIMING_INTERVAL_SECONDS": "0.2",
    "FLARE_LINGER_SECONDS": "0",
}
FAKE_KERNELS = ["--fake-kernels", "16", "--fake-kernel-seconds", "0.001"]


@pytest.fixture(scope="module")
def alerting(tmp_path_factory):
    """A file_sd directory for every run, and the alerting stack watching it (None if not installed)."""
    work = tmp_path_factory.mktemp("ild_alerting")
    targets = work / "targets"
    targets.mkdir()
    stack = None
    if alertmanager.can_alert():
        stack = AlertingStack(str(work / "stack"), str(targets), hang_seconds=60, for_="5s")
        stack.wait_ready()
    yield targets, stack
    if stack is not None:
        stack.stop()


def start(work: Path, targets: Path, run: str, *script_args: str) -> ObservedJob:
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    (work / run).mkdir()
    args = ["--fault-step", str(FAULT_STEP), *FAKE_KERNELS, *script_args]
    env = dict(ILD_ENV, FLARE_FILE_SD_DIR=str(targets))
    return ObservedJob(str(work / run), train_ddp.__file__, args, RANKS, run, env=env, rank_env=hosts)


def diagnose(source: list[str], run: str) -> tuple[int, dict]:
    return flare_json("diagnose", *source, "--run", run)


def await_ild_verdict(source: list[str], run: str, ranks: list[int]) -> dict:
    reports = []

    def named() -> dict | None:
        code, report = diagnose(source, run)
        reports.append(report)
        ild = [v for v in report.get("verdicts", []) if v["kind"] == "ild_regression"]
        return ild[0] if code == cli.EXIT_ANOMALY and ild and ild[0]["ranks"] == ranks else None

    try:
        return wait_for(named, 150, f"diagnose {source[0]} to name rank {ranks} for an ILD regression")
    except TimeoutError:
        pytest.fail(f"never named {ranks}; last report: {json.dumps(reports[-1:], indent=1)[:3000]}")


def _run_fault(tmp_path: Path, alerting, run: str, rank: int, *fault: str, page: bool = True) -> dict:
    targets, stack = alerting
    with start(tmp_path, targets, run, "--steps", "100000", "--fault-rank", str(rank), *fault):
        verdict = await_ild_verdict(["--targets", str(targets), "--timeout", "2"], run, [rank])
        if stack is not None:  # the same verdict from Prometheus
            await_ild_verdict(["--prometheus", stack.prometheus.url, "--window", "1m"], run, [rank])
        if stack is not None and page:  # and the page names the same rank
            distribution = verdict["evidence"]["distributions"][0]
            paged = await_page(stack, "FlareIssueLatencyShifted", run=run, distribution=distribution)
            assert {alert["labels"]["rank"] for _, alert in paged} == {str(rank)}
            assert paged[0][1]["labels"]["host"] == f"node-{rank // 2}"
        return verdict


def test_host_stall_on_one_rank_is_named_by_its_kernel_issue_latency(tmp_path, alerting):
    verdict = _run_fault(tmp_path, alerting, "stall", 2, "--fault", "host-stall", "--stall-seconds", "0.03")
    assert verdict["domain"] == "rank"
    assert "kernel_issue" in verdict["evidence"]["distributions"]
    shifted = verdict["evidence"]["shifted"]["2"]["kernel_issue"]
    # the stall moves the distribution by milliseconds; how much of it moved depends on this machine's load
    assert shifted["wasserstein_seconds"] > 1e-3 and shifted["ks"] >= IldPolicy().partial_ks


def test_contention_on_one_rank_is_named_by_its_host_dispatch_latency(tmp_path, alerting):
    # How much busy threads slow a rank's ops depends on the machine's cores, not on flare: on one 2-core
    # machine the rank's KS held at 0.33-0.41 with 8 threads, on CI's it crossed the alert's 0.3 only now and
    # then (pending 18 times in 3 minutes, never for 5 s). The engine must name the rank (it looks at every
    # instant); the page is asserted for the same distribution under a fault of fixed size, below.
    # With flare's extension built the ops are timed in C++, after the op has released the GIL and before it
    # waits for it again: the wait lies in the gap to the next op (the host_gap distribution; docs/ild.md).
    verdict = _run_fault(
        tmp_path, alerting, "contention", 1, "--fault", "contention", "--contention-threads", "8", page=False
    )
    assert verdict["domain"] == "rank"
    host_side = [d for d in ("host_dispatch", "host_gap") if d in verdict["evidence"]["distributions"]]
    assert host_side, verdict["evidence"]["distributions"]
    shifted = verdict["evidence"]["shifted"]["1"][host_side[0]]
    median = verdict["evidence"]["median_wasserstein_seconds"][host_side[0]]
    # 25-80 times the others' median in five runs; 1.8 times in one (CI's fresh clone, 2026-12-06): the 8
    # threads take both cores of this machine from the other ranks too, whose host gaps then grow as well
    assert shifted["wasserstein_seconds"] > 1.5 * median, (shifted, median)


def test_slowed_issue_path_on_one_rank_is_named_and_paged_by_its_host_dispatch_latency(tmp_path, alerting):
    # 20 us busy-waited before every op the rank dispatches: its KS held at 0.39-0.40 over 80 s, the other
    # ranks' at 0.01-0.05, whatever the machine's cores
    verdict = _run_fault(
        tmp_path, alerting, "host-delay", 3, "--fault", "host-delay", "--host-delay-seconds", "20e-6"
    )
    assert verdict["domain"] == "rank"
    # the busy-wait lies between ops too: the host gaps may shift with it
    assert "host_dispatch" in verdict["evidence"]["distributions"]
    assert set(verdict["evidence"]["distributions"]) <= {"host_dispatch", "host_gap"}
    shifted = verdict["evidence"]["shifted"]["3"]["host_dispatch"]
    assert shifted["wasserstein_seconds"] > 5e-6 and shifted["ks"] >= IldPolicy().partial_ks


def test_healthy_run_has_no_ild_verdict_from_start_to_end(tmp_path, alerting):
    targets, stack = alerting
    steps = 150
    with start(tmp_path, targets, "healthy", "--steps", str(steps)) as job:

        def every_rank_answers() -> bool:
            # and is listed: a rank writes its target file once its endpoint serves, and a diagnosis from
            # the directory in between would rightly find that rank gone
            listed = [
                target for target in read_targets(str(targets)) if target.labels.get("run") == "healthy"
            ]
            results = scrape.scrape_all(job.targets, timeout=2)
            return len(listed) == RANKS and all(isinstance(samples, list) for samples in results.values())

        wait_for(every_rank_answers, 120, "every rank's endpoint and target file")
        reports = []

        def finished() -> bool:
            reports.append(diagnose(["--targets", str(targets), "--timeout", "2"], "healthy"))
            results = scrape.scrape_all(job.targets, timeout=2)
            return all(
                isinstance(samples, list) and scrape.value(samples, "flare_steps_total") == steps
                for samples in results.values()
            )

        wait_for(finished, 180, "the healthy run to finish")
        final = scrape.scrape_all(job.targets, timeout=2)
        if stack is not None:
            assert pages_without_stragglers(stack.pages.alerts(run="healthy")) == []
        job.release()
        assert job.wait(timeout=60) == [0] * RANKS
    assert len(reports) >= 3
    verdicts = [without_stragglers(report["verdicts"]) for _, report in reports]
    assert verdicts == [[]] * len(reports), json.dumps([v for v in verdicts if v != []][:2], indent=1)[:3000]
    for samples in final.values():  # the drift was measured, and every rank exported it
        assert isinstance(samples, list)
        assert {s.labels["distribution"] for s in samples if s.name == "flare_ild_drift_ks"} == {
            "kernel_issue",
            "host_dispatch",
            "host_gap",
        }
