"""What flare's rules cost Prometheus at thousands of ranks: each rule's evaluation alone, on a quiet server.

    python benchmarks/rule_cost.py [--ranks 6144] [--scrape-interval 15] [--repeats 3] [--rules FILE]
                                   [--json OUT]

A virtual cluster of `--ranks` ranks (scale.py's) is scraped by a real Prometheus evaluating flare's rules
(or `--rules FILE`) at every scrape interval until every group ran three times over the job's later pages.
Then the targets go (nothing scraped or ingested), and every rule's expression is asked alone as an instant
query at the last evaluation's time, `--repeats` times, the recorded series it reads in place. Per rule:
the samples it reads (Prometheus's count, which the machine's pace does not move), Prometheus's CPU time a
query (/proc) and its evalTotalTime (`stats=all`); per group the sum, what one evaluation costs on one
core, against the group's interval. A quiet server and CPU time because while Prometheus ingests a
6,144-rank job on two shared cores, a group's evaluationTime is mostly waiting for a core.

Exit status: 0 when every group's cost is within its interval, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli_runs import faulty_ranks, process_cpu  # noqa: E402  (benchmarks/)

from flare_exporter.durations import duration_seconds  # noqa: E402
from flare_exporter.engine import promql  # noqa: E402
from flare_exporter.local.prometheus import PrometheusProcess, wait_for  # noqa: E402
from flare_exporter.local.testing import virtual_cluster as vc  # noqa: E402
from flare_exporter.mixin import rule_model, rules_render  # noqa: E402

RUN = "bench-rules"
EVALUATIONS = 3  # of every group over the later pages before the targets go
SHOWN = 8  # costliest rules printed


def rules_file(args: argparse.Namespace, directory: Path) -> Path:
    """`--rules`, or flare's rules as they ship (each run's own hang threshold) but with every group at the
    scrape interval, the slow ones too."""
    if args.rules:
        return Path(args.rules)
    thresholds = rule_model.Thresholds(scrape_interval_seconds=args.scrape_interval, slow_interval="")
    path = directory / "flare.rules.yml"
    path.write_text(rules_render.render(thresholds.with_for("0s")))
    return path


def shipped_intervals() -> dict[str, float]:
    """Each group's interval as `flare rules` ships them (the fast ones: the default scrape interval)."""
    document = yaml.safe_load(rules_render.render(rule_model.Thresholds()))
    default = rule_model.Thresholds().scrape_interval_seconds
    return {
        group["name"]: duration_seconds(group["interval"], "interval") if "interval" in group else default
        for group in document["groups"]
    }


def groups_of(url: str) -> list[dict[str, Any]]:
    answer = promql.urlopen(url, "/api/v1/rules", 60)
    with answer:
        return json.load(answer)["data"]["groups"]


def evaluated_since(url: str, since: float) -> float | None:
    """The newest evaluation time of the group evaluated last, once every group has been evaluated
    EVALUATIONS intervals after `since`; else None."""
    times = []
    for group in groups_of(url):
        last = group.get("lastEvaluation", "")
        if not last or last.startswith("0001"):
            return None
        stamp = time.mktime(time.strptime(last[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        if stamp < since + EVALUATIONS * group["interval"]:
            return None
        times.append(stamp)
    return min(times)


class Cost(NamedTuple):
    seconds: float  # the engine's median evalTotalTime
    cpu_seconds: float  # Prometheus's CPU time a query
    series: int  # in the answer
    samples: int  # read: Prometheus's totalQueryableSamples, a count that does not depend on the machine


def cost_of(url: str, pid: int, expr: str, at: float, repeats: int) -> Cost:
    """What `expr` costs as an instant query at `at`. The CPU time is the measure where the machine is
    shared: the engine's wall time also counts the time it waited for a core."""
    timings, size, samples = [], 0, 0
    started = process_cpu(pid)
    for _ in range(repeats):
        params = {"query": expr, "time": repr(at), "stats": "all"}
        data = promql._data(url, "query", params, 120, repr(expr))  # noqa: SLF001 - with its stats
        timings.append(float(data["stats"]["timings"]["evalTotalTime"]))
        samples = int(data["stats"]["samples"]["totalQueryableSamples"])
        size = len(data["result"])
    return Cost(statistics.median(timings), (process_cpu(pid) - started) / repeats, size, samples)


def measure(args: argparse.Namespace, url: str, pid: int, at: float) -> dict[str, Any]:
    intervals = shipped_intervals()
    groups: dict[str, Any] = {}
    for group in groups_of(url):
        costs = [
            {"rule": rule["name"], **cost_of(url, pid, rule["query"], at, args.repeats)._asdict()}
            for rule in group["rules"]
        ]
        figures = {key: sum(cost[key] for cost in costs) for key in ("seconds", "cpu_seconds", "samples")}
        interval = intervals.get(group["name"], float(group["interval"]))
        figures |= {"interval_seconds": interval, "share_of_interval": figures["cpu_seconds"] / interval}
        groups[group["name"]] = figures | {"rules": sorted(costs, key=lambda cost: -cost["cpu_seconds"])}
    return groups


def report(groups: dict[str, Any]) -> None:
    print(
        f"{'group':<22} {'one evaluation: CPU':>20} {'(wall)':>11} {'samples read':>13} {'interval':>9} "
        f"{'share':>7}"
    )
    for name, group in groups.items():
        print(
            f"{name:<22} {group['cpu_seconds'] * 1e3:17.0f} ms {group['seconds'] * 1e3:8.0f} ms "
            f"{group['samples']:13d} {group['interval_seconds']:8.0f}s {group['share_of_interval']:7.1%}"
        )
    every = sorted(
        (
            (rule["cpu_seconds"], rule["seconds"], name, rule["rule"], rule["series"])
            for name, group in groups.items()
            for rule in group["rules"]
        ),
        reverse=True,
    )
    print("costliest rules (CPU, wall):")
    for cpu, seconds, group, rule, size in every[:SHOWN]:
        print(f"  {cpu * 1e3:7.0f} ms {seconds * 1e3:7.0f} ms  {group:<20} {rule} ({size} series)")
    most = sorted(
        ((rule["samples"], name, rule["rule"]) for name, group in groups.items() for rule in group["rules"]),
        reverse=True,
    )
    print("most samples read:")
    for samples, group, rule in most[:SHOWN]:
        print(f"  {samples:10d}  {group:<20} {rule}")


def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], float]:
    """Every group's cost (measure), and the seconds of history Prometheus held when they were asked."""
    started = time.perf_counter()
    faults = faulty_ranks(args.ranks)
    healthy, later, _ = vc.render_phases(args.ranks, RUN, faults["straggler"], faults["hang"])
    print(f"{args.ranks} ranks rendered in {time.perf_counter() - started:.1f} s", flush=True)
    targets = tmp / "targets"
    with vc.ClusterServer(healthy) as server:
        sd_file = vc.write_file_sd(str(targets), RUN, server.targets(), args.ranks)
        prometheus = PrometheusProcess(
            str(tmp / "prometheus"),
            str(targets),
            f"{args.scrape_interval}s",
            rule_files=[rules_file(args, tmp)],
        )
        try:
            prometheus.wait_ready()
            scraping_since = time.time()
            wait_for(lambda: _scraped(prometheus.url) == args.ranks, 900, "every rank scraped")
            server.set_pages(later)
            since = time.time()
            at = wait_for(lambda: evaluated_since(prometheus.url, since), 1800, "three evaluations")
            Path(sd_file).write_text("[]")  # no target left: no scrape, no ingestion while we ask
            wait_for(lambda: _scraped(prometheus.url, at + 600) == 0, 300, "the targets to go")
            print(f"every group evaluated {EVALUATIONS} times; asking each rule at {at:.0f}", flush=True)
            history = at - scraping_since
            print(
                f"history: {history / 60:.1f} minutes (a rule over a longer range reads fewer samples here "
                "than in a long job)",
                flush=True,
            )
            return measure(args, prometheus.url, prometheus.process.pid, at), history
        finally:
            prometheus.stop()


def _scraped(url: str, at: float | None = None) -> int:
    """Ranks of the run up at `at` (now by default): 0 once the targets are gone (stale)."""
    answer = promql.query(url, f'count(up{{run="{RUN}"}} == 1)', 60, at=at)
    return int(float(answer[0]["value"][1])) if answer else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=6144, help="virtual ranks (default 6144)")
    parser.add_argument("--scrape-interval", type=int, default=15, help="seconds (default 15)")
    parser.add_argument("--repeats", type=int, default=3, help="queries of each rule (default 3)")
    parser.add_argument("--rules", default="", help="a rules file to measure instead of flare's")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    if args.ranks < 8 or args.scrape_interval < 1 or args.repeats < 1:
        parser.error("--ranks must be at least 8, --scrape-interval and --repeats at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="flare-rule-cost-"))
    try:
        groups, history = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(groups)
    if args.json:
        figures = {"ranks": args.ranks, "load": os.getloadavg(), "history_seconds": history, "groups": groups}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if all(group["share_of_interval"] <= 1 for group in groups.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
