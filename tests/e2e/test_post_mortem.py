"""A run that died explains itself: real 4-rank gloo jobs, one fault in one chosen rank, diagnosed after every
rank is gone, from Prometheus's history and from the incident files the ranks left, under torchrun (whose
agent tears the survivors down with SIGTERM) and launched without an agent (the survivors die of gloo's
connection errors or timeouts). The page for a dead run (FlareRunDied) must name the same rank and cause.

The training script is flare's unmodified workload (local/workloads/train_ddp.py) under
`flare_exporter.launch`; the ranks write their file_sd targets into one directory that a real Prometheus
watches, and their incident files beside them (its `incidents` subdirectory, the default). No survivor may
ever be named.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import flare_json

from flare_exporter.engine import scrape
from flare_exporter.local.jobs import free_port, free_port_block
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.mixin import rule_model, rules_render

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed"),
]

RANKS = 4
FAULT_RANK = 2
STEP_SECONDS = 0.1  # paced: Prometheus (every second) sees every rank for seconds before the fault
FAULT_STEP = 40
WINDOW = "10m"


@dataclass(frozen=True)
class Scenario:
    """One fault, how it is played, and what every source must say of it afterwards."""

    fault: str  # train_ddp's --fault, or "kill"/"host" (signals from here), or "none"
    launcher: str  # torchrun | none
    culprits: tuple[int, ...]
    cause: str | None  # None: no verdict, no page
    args: tuple[str, ...] = ()
    killed: tuple[int, ...] = ()
    hosts: dict[int, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.fault}-{self.launcher}"


SAME_HOST = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
SCENARIOS = [
    Scenario(fault, launcher, culprits, cause, args, killed, hosts)
    for launcher in ("torchrun", "none")
    for fault, culprits, cause, args, killed, hosts in (
        ("oom", (FAULT_RANK,), "out_of_memory", (), (), {}),
        ("estale", (FAULT_RANK,), "storage", ("--data-workers", "1"), (), {}),
        ("kill", (FAULT_RANK,), "node_failure", (), (FAULT_RANK,), {}),
        ("mismatch", (FAULT_RANK,), "collective_mismatch", ("--pg-timeout", "6"), (), {}),
        ("host", (2, 3), "node_failure", (), (2, 3), SAME_HOST),
        ("none", (), None, (), (), {}),
    )
]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory):
    """A Prometheus scraping every second the ranks in one file_sd directory, with flare's rules (every
    `for:` at 0 s) evaluated every second."""
    work = tmp_path_factory.mktemp("post-mortem")
    targets = work / "targets"
    targets.mkdir()
    thresholds = rule_model.Thresholds(scrape_interval_seconds=1.0, dead_run_window=WINDOW, slow_interval="")
    thresholds = thresholds.with_for("0s")
    rule_file = work / "flare.rules.yml"
    rule_file.write_text(rules_render.render(thresholds))
    server = PrometheusProcess(str(work / "prometheus"), str(targets), "1s", rule_files=[str(rule_file)])
    with server:
        server.wait_ready()
        yield server, targets


def training_args(scenario: Scenario, done: Path) -> list[str]:
    fault = scenario.fault if scenario.fault in train_ddp.FAULTS else "none"
    steps = 60 if scenario.fault == "none" else 100_000  # a killed run trains until it is killed
    return [
        "--steps", str(steps), "--step-seconds", str(STEP_SECONDS), "--fault", fault,
        "--fault-rank", str(FAULT_RANK), "--fault-step", str(FAULT_STEP), "--wait-for", str(done),
        *scenario.args,
    ]  # fmt: skip


def flare_env(run: str, targets: Path, base_port: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FLARE_RUN": run,
        "FLARE_PORT": str(base_port),
        "FLARE_ADDR": "127.0.0.1",
        "FLARE_FILE_SD_DIR": str(targets),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }


def start_without_agent(scenario: Scenario, run: str, targets: Path, work: Path) -> list[subprocess.Popen]:
    """One process per rank, as a launcher without an agent (mpirun, a plain Slurm step) starts them."""
    base_port, master_port = free_port_block(RANKS), free_port()
    command = [sys.executable, "-m", "flare_exporter.launch", train_ddp.__file__]
    processes = []
    for rank in range(RANKS):
        env = flare_env(run, targets, base_port)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(master_port)
        if rank in scenario.hosts:
            env["FLARE_HOST"] = scenario.hosts[rank]
        log = open(work / f"rank{rank}.log", "wb")
        args = training_args(scenario, work / "done")
        processes.append(subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT))
    return processes


def start_under_torchrun(scenario: Scenario, run: str, targets: Path, work: Path) -> list[subprocess.Popen]:
    """torchrun's elastic agent; for the host fault, two agents (two "hosts" of two ranks each, their
    FLARE_HOST told apart) meeting at one rendezvous, as on two machines."""
    nodes = 2 if scenario.hosts else 1
    per_node = RANKS // nodes
    rendezvous = f"127.0.0.1:{free_port()}"
    processes = []
    for node in range(nodes):
        env = flare_env(run, targets, free_port_block(per_node))
        if scenario.hosts:
            env["FLARE_HOST"] = scenario.hosts[node * per_node]
        topology = ["--standalone"] if nodes == 1 else [
            "--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rendezvous, "--rdzv-id", run,
        ]  # fmt: skip
        command = [
            sys.executable, "-m", "torch.distributed.run", *topology, "--nproc-per-node", str(per_node),
            "-m", "flare_exporter.launch", train_ddp.__file__, *training_args(scenario, work / "done"),
        ]  # fmt: skip
        log = open(work / f"agent{node}.log", "wb")
        processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return processes


def seen_by_prometheus(server: PrometheusProcess, run: str) -> dict[int, dict[str, str]]:
    """rank -> its flare_rank_info labels, once Prometheus has scraped every rank of `run`."""
    answer = server.query(f'flare_rank_info{{run="{run}"}}')
    return {int(item["metric"]["rank"]): item["metric"] for item in answer} if len(answer) == RANKS else {}


def play(scenario: Scenario, server: PrometheusProcess, targets: Path, work: Path) -> str:
    """Run the scenario's job until every process of it is gone; its run id."""
    run = f"pm-{scenario.name}-{int(time.time())}"
    if scenario.fault == "none":
        (work / "done").touch()  # the healthy run ends by itself
    start = start_under_torchrun if scenario.launcher == "torchrun" else start_without_agent
    processes = start(scenario, run, targets, work)
    try:
        info = wait_for(lambda: seen_by_prometheus(server, run), 120, f"Prometheus scraping run {run}")
        if scenario.killed:
            wait_for(lambda: _trained(info, steps=FAULT_STEP // 2), 60, "some training")
            for rank in scenario.killed:
                os.kill(int(info[rank]["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 180
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return run


def _trained(info: dict[int, dict[str, str]], steps: int) -> bool:
    """Whether every rank's endpoint reports at least `steps` optimizer steps."""
    for labels in info.values():
        host_port = labels.get("instance") or ""
        try:
            samples = scrape.scrape(host_port, 2.0) if host_port else []
        except scrape.ScrapeError:
            return False
        if (scrape.value(samples, "flare_steps_total") or 0) < steps:
            return False
    return True


def dead_run_verdicts(*args: str) -> dict:
    """`flare diagnose ARGS --json` once it judges the run post-mortem (every rank seen down)."""

    def judged() -> dict:
        code, result = flare_json("diagnose", *args)
        return result if result.get("post_mortem") else {}

    return wait_for(judged, 60, f"a post-mortem from {' '.join(args)}")


def explained(result: dict, work: Path) -> str:
    """What a failed assertion shows: the verdicts' summaries, the timeline, each rank's log's last line."""
    lines = [f"{v['kind']} {v['ranks']} {v['cause']}: {v['summary']}" for v in result.get("verdicts", [])]
    lines += [f"{e['timestamp_seconds']} rank {e['rank']}: {e['event']}" for e in result.get("timeline", [])]
    for log in sorted(work.glob("*.log")):
        last = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        lines.append(f"{log.name}: {last[0][-300:]}")
    return "\n".join(lines)


def named(result: dict) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(verdict["ranks"]), verdict["cause"]) for verdict in result["verdicts"]]


def dead_run_pages(server: PrometheusProcess, run: str) -> list[tuple[tuple[int, ...], str]]:
    """The FlareRunDied pages of `run` (as (ranks, cause)) once Prometheus holds the run dead and has
    evaluated the dead-run rules since."""
    wait_for(lambda: server.query(f'run:flare_run:dead{{run="{run}"}}'), 60, f"run {run} recorded dead")
    seen_dead = time.time()
    wait_for(lambda: last_evaluation(server, "flare.dead_runs") > seen_dead, 30, "the dead-run rules")
    pages = server.query(f'ALERTS{{alertname="FlareRunDied", alertstate="firing", run="{run}"}}')
    return sorted(((int(page["metric"]["rank"]),), page["metric"]["cause"]) for page in pages)


def last_evaluation(server: PrometheusProcess, group: str) -> float:
    """Unix time Prometheus last evaluated the rule group `group` (0 if never)."""
    with urllib.request.urlopen(f"{server.url}/api/v1/rules", timeout=10) as answer:
        groups = json.load(answer)["data"]["groups"]
    stamp = next((found["lastEvaluation"] for found in groups if found["name"] == group), "")
    if not stamp or stamp.startswith("0001"):
        return 0.0
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + float(f"0.{fraction or 0}")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[scenario.name for scenario in SCENARIOS])
def test_a_dead_run_names_the_rank_that_ended_it_and_why(prometheus, tmp_path, scenario):
    server, targets = prometheus
    run = play(scenario, server, targets, tmp_path)
    expected = [(scenario.culprits, scenario.cause)] if scenario.cause else []

    from_history = dead_run_verdicts("--prometheus", server.url, "--run", run, "--window", WINDOW)
    assert named(from_history) == expected, explained(from_history, tmp_path)
    from_files = dead_run_verdicts("--targets", str(targets), "--run", run)
    assert named(from_files) == expected, explained(from_files, tmp_path)
    assert from_files["source"].startswith("incidents ")
    code, report = flare_json("report", "--incidents", str(targets / "incidents"), "--run", run)
    assert code == (1 if expected else 0) and named(report) == expected
    assert sorted(report["ranks"]) == [str(rank) for rank in range(RANKS)]

    pages = dead_run_pages(server, run)
    expected_pages = sorted(((rank,), scenario.cause) for rank in scenario.culprits) if scenario.cause else []
    assert pages == expected_pages
    if scenario.fault == "estale":  # the DataLoader worker's exception, unwrapped to its root cause
        verdict = report["verdicts"][0]
        assert verdict["evidence"]["root_cause"]["message"].startswith("[Errno 116] Stale file handle")
    if scenario.hosts:
        assert [verdict["domain"] for verdict in from_history["verdicts"]] == ["host"]
