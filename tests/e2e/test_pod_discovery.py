"""A rank that dies under pod discovery is paged and diagnosed: a real 4-rank gloo job whose targets
Prometheus finds as Kubernetes pod discovery gives them, bare addresses whose `up` carries no rank and no run
(the ranks' own file_sd files land in a directory Prometheus does not watch). Rank 2 is killed and its target
dropped, as Kubernetes drops a dead pod: only its own series going stale can say it is gone. Before that,
rank 3's pod is not discovered at first: fewer ranks report than the world size, and FlareRanksMissing says
so until it is.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import flare_json

from flare_exporter.local.jobs import free_port, free_port_block
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.mixin import rule_model, rules_render
from flare_exporter.mixin.dashboards import model

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed"),
]

RANKS = 4
KILLED = 2
UNDISCOVERED = 3  # at first
RUN = "pods"


def write_targets(sd_dir: Path, addresses: list[str]) -> None:
    """The discovered pods, bare: no rank, no run (written whole, then renamed into place)."""
    scratch = sd_dir / "pods.json.tmp"
    scratch.write_text(json.dumps([{"targets": addresses, "labels": {}}]))
    scratch.replace(sd_dir / "pods.json")


def start_ranks(work: Path, base_port: int) -> list[subprocess.Popen]:
    """One process per rank under flare's launcher, their file_sd files where no Prometheus looks."""
    master_port = free_port()
    unwatched = work / "flare-file-sd"
    command = [sys.executable, "-m", "flare_exporter.launch", train_ddp.__file__]
    args = ["--steps", "100000", "--step-seconds", "0.1", "--wait-for", str(work / "done")]
    processes = []
    for rank in range(RANKS):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "FLARE_RUN": RUN,
            "FLARE_PORT": str(base_port),
            "FLARE_ADDR": "127.0.0.1",
            "FLARE_FILE_SD_DIR": str(unwatched),
            "FLARE_LINGER_SECONDS": "120",  # the survivors, dying of the lost peer, stay in sight
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(RANKS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
        }
        log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 (the process's, closed with it)
        processes.append(subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT))
    return processes


def ranks_seen(server: PrometheusProcess) -> dict[int, dict[str, str]]:
    """rank -> its flare_rank_info labels, once Prometheus scrapes every rank of the run."""
    answer = server.query(f'flare_rank_info{{run="{RUN}"}}')
    return {int(item["metric"]["rank"]): item["metric"] for item in answer} if len(answer) == RANKS else {}


def missing(server: PrometheusProcess) -> bool:
    """Whether FlareRanksMissing fires for the run."""
    return bool(server.query(f'ALERTS{{alertname="FlareRanksMissing", alertstate="firing", run="{RUN}"}}'))


def panel_value(server: PrometheusProcess, expr: str) -> float:
    """A dashboard query for this run and all its ranks, as Grafana would send it: its one value."""
    (item,) = server.query(expr.replace("$run", RUN).replace("$rank", ".*").replace(model.SELECTOR, ""))
    return float(item["value"][1])


def paged_down(server: PrometheusProcess) -> set[str]:
    answer = server.query(f'ALERTS{{alertname="FlareRankDown", alertstate="firing", run="{RUN}"}}')
    return {item["metric"]["rank"] for item in answer}


def test_a_killed_rank_whose_pod_is_dropped_is_paged_and_diagnosed(tmp_path):
    sd_dir = tmp_path / "pods"
    sd_dir.mkdir()
    base_port = free_port_block(RANKS)
    addresses = [f"127.0.0.1:{base_port + rank}" for rank in range(RANKS)]
    write_targets(sd_dir, [address for rank, address in enumerate(addresses) if rank != UNDISCOVERED])
    thresholds = rule_model.Thresholds(scrape_interval_seconds=1.0, slow_interval="").with_for("0s")
    rule_file = tmp_path / "flare.rules.yml"
    rule_file.write_text(rules_render.render(thresholds))
    server = PrometheusProcess(str(tmp_path / "prometheus"), str(sd_dir), "1s", rule_files=[str(rule_file)])
    processes: list[subprocess.Popen] = []
    with server:
        server.wait_ready()
        try:
            processes = start_ranks(tmp_path, base_port)
            count = f'count(flare_rank_info{{run="{RUN}"}}) == {RANKS - 1}'
            wait_for(lambda: server.query(count), 120, "Prometheus scraping the discovered ranks")
            wait_for(lambda: missing(server), 60, "FlareRanksMissing")
            assert paged_down(server) == set()  # never seen: not "down" by number
            write_targets(sd_dir, addresses)
            info = wait_for(lambda: ranks_seen(server), 120, "Prometheus scraping every rank")
            assert server.query('up{rank!=""}') == []  # the pods' targets: `up` knows no rank
            steps = f'count(flare_steps_total{{run="{RUN}"}} >= 10) == {RANKS}'
            wait_for(lambda: server.query(steps), 60, "some training")
            assert paged_down(server) == set()
            wait_for(lambda: not missing(server), 30, "FlareRanksMissing resolved")
            assert panel_value(server, model.ranks_up(model.RANKS)) == RANKS
            assert panel_value(server, model.ranks_gone(model.RANKS)) == 0

            os.kill(int(info[KILLED]["pid"]), signal.SIGKILL)
            write_targets(sd_dir, [address for rank, address in enumerate(addresses) if rank != KILLED])

            paged = wait_for(lambda: paged_down(server), 60, "FlareRankDown")
            assert paged == {str(KILLED)}
            code, report = flare_json("diagnose", "--prometheus", server.url, "--run", RUN)
            assert code != 0, report
            verdicts = [(verdict["kind"], verdict["ranks"]) for verdict in report["verdicts"]]
            assert ("rank_down", [KILLED]) in verdicts, report
            assert panel_value(server, model.ranks_gone(model.RANKS)) == 1  # the dashboards see it too
            assert panel_value(server, model.ranks_up(model.RANKS)) == RANKS - 1
            # no survivor was paged as down, then or since
            ever = f'max by (rank) (max_over_time(ALERTS{{alertname="FlareRankDown", run="{RUN}"}}[5m]))'
            assert {item["metric"]["rank"] for item in server.query(ever)} == {str(KILLED)}
        finally:
            (tmp_path / "done").touch()
            for process in processes:
                if process.poll() is None:
                    process.kill()
            for process in processes:
                process.wait(timeout=30)
