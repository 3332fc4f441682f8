"""Scale: thousands of virtual ranks scraped by a real Prometheus with flare's rules; faults, pages, verdicts.

    python benchmarks/scale.py [--ranks 6144] [--scrape-interval S] [--hang-seconds 20] [--repeats 3]
                               [--direct-repeats 1] [--json OUT] [--keep]
    python benchmarks/scale.py --ranks 1024        # the direct-scrape goal's size; about 2 minutes

The cluster (flare_exporter.local.testing.virtual_cluster): every virtual rank's /metrics rendered by
flare's own
collectors with every signal on (three process groups, straggler windows, ILD, GPU health via the fake NVML;
about 280 series and 36 KiB each), each served on its own loopback port by one asyncio server in this
process, and listed in one file_sd file as the ranks write theirs. A real Prometheus with the project's rules
(`rules.render(Thresholds(hang_seconds, scrape_interval).with_for("0s"))`: every alert without its `for:`,
the slow signals' groups evaluated every minute as they ship) and a real Alertmanager with the example
configuration, paging a webhook receiver here (alertmanager_process.AlertingStack), scrape it.

Phases, each a fault on a different rank (straggler N*3//8, hung N*777//1024, dead N*5//8):

1. straggler: from the start, one rank's GPU throttles; it waits least in every straggler window.
2. hang: at a known time every rank but the hung one issues the world group's next all-reduce and waits in it
   (every page is swapped at once; the pages carry that time); the hung one is stuck in compute.
3. dead: the hang is over; one rank's endpoint is closed (connection refused) at a known time.

Measured: Prometheus's ingestion (samples appended per second), rule evaluation time of each rule group,
scrape durations and the actual interval between scrapes of a target (does it keep up?), series, memory and
CPU; time from each fault to its page at the webhook (FlareCollectiveHangCulprit naming the hung rank, from
the hang's time, and how much of it is beyond the hang threshold; FlareRankDown naming the dead rank), and
the culprit pages that name another rank than the hung one (any fails the run); and
in each phase `flare diagnose --prometheus URL` (in-process and as a subprocess) and `flare diagnose
--targets DIR` (direct scrape, subprocess), timed, with the verdict checked: the first verdict must name the
phase's faulty rank. Goals: the right culprit in < 1 s of CLI time via Prometheus at 6,144 ranks, < 3 s via
direct scrape at 1,024.

Exit status: 0 when every verdict and page was right (whatever the times), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli_runs import BenchError, command, in_process, verdicts_of  # noqa: E402  (benchmarks/)

from flare_exporter.engine import cli, promql, scrape
from flare_exporter.local.alertmanager import AlertingStack, can_alert
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.mixin.rules import CULPRIT_ALERTS, LAST_WINDOW, Thresholds

RUN = "bench-scale"
PROMETHEUS_GOAL_S = 1.0  # via Prometheus, at 6,144 ranks
DIRECT_GOAL_S = 3.0  # via direct scrape, at 1,024 ranks
CLI_TIMEOUT_S = 300.0


def default_interval(ranks: int) -> int:
    """A scrape interval one Prometheus keeps up with on two shared cores (see benchmarks/README.md)."""
    return 5 if ranks <= 1024 else 10 if ranks <= 3072 else 15


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


# ---------------------------------------------------------------------------------------------------------
# Prometheus's own numbers


def prometheus_metrics(url: str) -> list[scrape.Sample]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return scrape.parse(response.read().decode())


def first(samples: list[scrape.Sample], name: str, **labels: str) -> float:
    found = scrape.value(samples, name, **labels)
    return float("nan") if found is None else found


SLOWEST_RULES = 6


def prometheus_load(url: str, seconds: float) -> dict[str, Any]:
    """Ingestion, rule evaluation, scrape interval and CPU of Prometheus over `seconds` of steady state."""
    before, started = prometheus_metrics(url), time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronisation: Prometheus keeps scraping meanwhile
    after, elapsed = prometheus_metrics(url), time.monotonic() - started

    def rate(name: str) -> float:
        return (first(after, name) - first(before, name)) / elapsed

    groups = {
        s.labels["rule_group"].rsplit(";", 1)[-1]: s.value
        for s in after
        if s.name == "prometheus_rule_group_last_duration_seconds"
    }
    evaluations = {
        s.labels["rule_group"].rsplit(";", 1)[-1]: s.value
        for s in after
        if s.name == "prometheus_rule_group_interval_seconds"
    }
    interval = {
        s.labels.get("quantile", ""): s.value
        for s in after
        if s.name == "prometheus_target_interval_length_seconds" and s.labels.get("quantile")
    }
    with urllib.request.urlopen(url + "/api/v1/rules", timeout=30) as response:
        rule_groups = json.load(response)["data"]["groups"]
    rules = sorted(
        ((rule["name"], rule.get("evaluationTime", 0.0)) for group in rule_groups for rule in group["rules"]),
        key=lambda item: -item[1],
    )
    scrape_seconds = promql.query(url, f'quantile(0.5, scrape_duration_seconds{{run="{RUN}"}})', 30)
    scrape_max = promql.query(url, f'max(scrape_duration_seconds{{run="{RUN}"}})', 30)
    return {
        "window_seconds": elapsed,
        "samples_appended_per_second": rate("prometheus_tsdb_head_samples_appended_total"),
        "cpu_cores": rate("process_cpu_seconds_total"),
        "head_series": first(after, "prometheus_tsdb_head_series"),
        "resident_bytes": first(after, "process_resident_memory_bytes"),
        "rule_group_seconds": groups,
        "rule_group_interval_seconds": evaluations,
        "slowest_rules_seconds": dict(rules[:SLOWEST_RULES]),  # each rule's last evaluation
        "target_interval_seconds": interval,
        "scrape_duration_median_seconds": float(scrape_seconds[0]["value"][1]) if scrape_seconds else None,
        "scrape_duration_max_seconds": float(scrape_max[0]["value"][1]) if scrape_max else None,
    }


# ---------------------------------------------------------------------------------------------------------
# the CLI, timed and checked


def check(code: int, output: str, kind: str, rank: int, where: str) -> str:
    """The first verdict must be `kind` naming exactly `rank`; returns a one-line summary of all."""
    result, summary = verdicts_of(code, output, where)
    verdicts = result.get("verdicts", [])
    if (
        code != cli.EXIT_ANOMALY
        or not verdicts
        or (verdicts[0]["kind"], verdicts[0]["ranks"]) != (kind, [rank])
    ):
        raise BenchError(f"{where}: exit code {code}, verdicts {summary} (expected {kind} [{rank}] first)")
    return f"{summary}; {result.get('ranks_seen')} ranks seen"


def as_subprocess(argv: list[str]) -> tuple[float, int, str, float]:
    """(wall seconds, exit code, output, CPU seconds) of `python -m flare_exporter.engine.cli ARGV`."""
    return command(["-m", "flare_exporter.engine.cli", *argv], CLI_TIMEOUT_S)


def attribution(
    args: argparse.Namespace, prometheus_url: str, targets_dir: str, kind: str, rank: int, phase: str
) -> dict[str, Any]:
    """Time `flare diagnose` via Prometheus (in-process, subprocess) and via direct scrape; check verdicts."""
    common = ["diagnose", "--hang-seconds", str(args.hang_seconds), "--json", "--run", RUN]
    via_prometheus = [*common, "--prometheus", prometheus_url, "--timeout", "30"]
    direct = [*common, "--targets", targets_dir]
    times: dict[str, list[float]] = {"in_process": [], "subprocess": [], "subprocess_cpu": [], "direct": []}
    summary = ""
    for index in range(args.repeats):
        elapsed, code, output = in_process(via_prometheus)
        summary = check(code, output, kind, rank, f"{phase}: in-process run {index + 1}")
        times["in_process"].append(elapsed)
        elapsed, code, output, cpu = as_subprocess(via_prometheus)
        check(code, output, kind, rank, f"{phase}: subprocess run {index + 1}")
        times["subprocess"].append(elapsed)
        times["subprocess_cpu"].append(cpu)
    direct_summary = ""
    for index in range(args.direct_repeats):
        elapsed, code, output, cpu = as_subprocess(direct)
        direct_summary = check(code, output, kind, rank, f"{phase}: direct scrape run {index + 1}")
        times["direct"].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items() if values}
    line = (
        f"  flare diagnose --prometheus: {_seconds(medians['subprocess'])} as a command "
        f"(CPU {_seconds(medians['subprocess_cpu'])}), {_seconds(medians['in_process'])} in-process"
    )
    if times["direct"]:
        line += f"; --targets (direct scrape): {_seconds(medians['direct'])}"
    print(line + f"; median of {args.repeats}/{args.direct_repeats}")
    print(f"  verdict: {summary}" + (f" | direct: {direct_summary}" if direct_summary else ""))
    return {
        "times_seconds": times,
        "medians": medians,
        "verdicts": summary,
        "direct_verdicts": direct_summary,
    }


# ---------------------------------------------------------------------------------------------------------


def await_page(stack: AlertingStack, alertname: str, rank: int, timeout: float) -> float:
    found = wait_for(
        lambda: stack.pages.alerts(run=RUN, alertname=alertname, rank=str(rank)),
        timeout,
        f"{alertname} {rank}",
    )
    return min(arrived for arrived, _ in found)


def pages_naming_another_rank(stack: AlertingStack, since: float, rank: int) -> list[str]:
    """The culprit alerts (alertname[rank]) delivered since `since` that name a rank other than `rank`."""
    return sorted(
        {
            f"{alert['labels']['alertname']}[{alert['labels'].get('rank', '')}]"
            for arrived, alert in stack.pages.alerts(run=RUN)
            if arrived >= since
            and alert["labels"]["alertname"] in CULPRIT_ALERTS
            and alert["labels"].get("rank") != str(rank)
        }
    )


def await_straggler_figures(url: str, timeout: float) -> float:
    """Seconds until the rules' straggler figures (rules.straggler_summary_rules), which `flare diagnose`
    reads in place of every rank's windows, are of the windows every rank serves now."""
    started = time.monotonic()
    (last,) = promql.query(url, f'max(flare_straggler_last_window{{run="{RUN}"}})', 30)
    figure = f'{LAST_WINDOW}:min{{run="{RUN}"}} == {last["value"][1]}'
    wait_for(lambda: bool(promql.query(url, figure, 30)), timeout, "the rules' straggler figures")
    return time.monotonic() - started


def alerts_firing(url: str) -> list[str]:
    answer = promql.query(url, f'ALERTS{{alertstate="firing", run="{RUN}"}}', 30)
    return sorted({f"{a['metric'].get('alertname')}[{a['metric'].get('rank', '')}]" for a in answer})


def benchmark(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ranks = args.ranks
    straggler, hung, dead = ranks * 3 // 8, ranks * 777 // 1024, ranks * 5 // 8
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "config": {
            "ranks": ranks,
            "scrape_interval_seconds": args.scrape_interval,
            "hang_seconds": args.hang_seconds,
            "straggler": straggler,
            "hung": hung,
            "dead": dead,
        },
    }
    print(
        f"flare scale benchmark  {results['date']}  {os.cpu_count()} CPUs  "
        f"python {platform.python_version()}  "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    started = time.perf_counter()
    healthy, later, hung_pages = vc.render_phases(ranks, RUN, straggler, hung)
    render_s = time.perf_counter() - started
    series = vc.series_count(healthy[0].decode())
    mean_kib = sum(map(len, healthy)) / ranks / 1024
    print(
        f"cluster: {ranks} virtual ranks on {-(-ranks // vc.RANKS_PER_HOST)} hosts, {series} series and "
        f"{mean_kib:.1f} KiB per rank ({ranks * series:,} series in all); each rank's page rendered 3 "
        f"times by "
        f"flare's collectors in {render_s:.1f} s"
    )
    results["cluster"] = {"series_per_rank": series, "kib_per_rank": mean_kib, "render_seconds": render_s}

    targets_dir = str(tmp / "targets")
    with vc.ClusterServer(healthy) as server:
        vc.write_file_sd(targets_dir, RUN, server.targets(), ranks)
        # every for: 0s, so that the pages come in minutes; the slow groups' interval as the rules ship
        stack = AlertingStack(
            str(tmp / "alerting"),
            targets_dir,
            args.hang_seconds,
            args.scrape_interval,
            "0s",
            Thresholds.slow_interval,
        )
        try:
            stack.wait_ready()
            results.update(
                phases(args, server, stack, targets_dir, (later, hung_pages), straggler, hung, dead)
            )
        finally:
            stack.stop()
        results["scrapes_served"] = next(server.served)
    return results


def phases(
    args: argparse.Namespace,
    server: vc.ClusterServer,
    stack: AlertingStack,
    targets_dir: str,
    pages: tuple[list[bytes], list[bytes]],
    straggler: int,
    hung: int,
    dead: int,
) -> dict[str, Any]:
    ranks, url, out = args.ranks, stack.prometheus.url, {}
    later, hung_pages = pages
    started = time.monotonic()

    def every_rank_scraped() -> bool:
        if stack.prometheus.process.poll() is not None:
            raise BenchError(f"Prometheus exited: {stack.prometheus.log_tail(3)}")
        answer = promql.query(url, f'count(flare_rank_info{{run="{RUN}"}})', 30)
        return bool(answer) and int(float(answer[0]["value"][1])) == ranks

    wait_for(every_rank_scraped, 600, f"Prometheus to scrape all {ranks} ranks")
    print(
        f"prometheus: every rank scraped {time.monotonic() - started:.1f} s after start "
        f"(scrape and rule evaluation every {args.scrape_interval} s); the job then takes 40 steps"
    )
    server.set_pages(later)  # the job makes progress: counters move between two scrapes of each rank
    load = prometheus_load(url, max(30.0, 3 * args.scrape_interval))
    out["prometheus"] = load
    rules = ", ".join(
        f"{group} {_seconds(seconds)}" for group, seconds in sorted(load["rule_group_seconds"].items())
    )
    interval = load["target_interval_seconds"]
    print(
        f"  ingestion {load['samples_appended_per_second']:,.0f} samples/s, "
        f"{load['head_series']:,.0f} series in "
        f"the head, {load['resident_bytes'] / 2**30:.2f} GiB resident, {load['cpu_cores']:.2f} CPU cores"
    )
    print(f"  rule evaluation (last, per group): {rules}")
    slowest = ", ".join(f"{rule} {_seconds(took)}" for rule, took in load["slowest_rules_seconds"].items())
    print(f"  slowest rules (last evaluation): {slowest}")
    print(
        f"  scrape duration median {_seconds(load['scrape_duration_median_seconds'] or 0)}, max "
        f"{_seconds(load['scrape_duration_max_seconds'] or 0)}; interval between scrapes of a target: "
        f"p50 {interval.get('0.5', float('nan')):.3f} s, p99 {interval.get('0.99', float('nan')):.3f} s "
        f"(configured {args.scrape_interval} s)"
    )

    waited = await_straggler_figures(url, 600)
    print(
        f"  the rules' straggler figures cover every rank's windows {waited:.1f} s later (the slow signals' "
        f"group runs every {Thresholds.slow_interval})"
    )
    out["straggler_figures_seconds"] = waited
    print(f"phase 1, straggler: rank {straggler} (throttled GPU) waits least in every window")
    out["straggler"] = attribution(args, url, targets_dir, "straggler", straggler, "straggler")

    print(f"phase 2, hang: rank {hung} never issues the world's next all-reduce; the others wait in it")
    fault_at = time.time()
    server.set_pages(vc.hung_at(hung_pages, fault_at))
    swapped = time.time() - fault_at
    paged_at = await_page(stack, "FlareCollectiveHangCulprit", hung, 300 + args.hang_seconds)
    page_s = paged_at - fault_at
    print(
        f"  page FlareCollectiveHangCulprit rank {hung}: {page_s:.1f} s after the hang "
        f"({page_s - args.hang_seconds:.1f} s beyond the {args.hang_seconds} s threshold; pages swapped in "
        f"{swapped:.2f} s); firing: {', '.join(alerts_firing(url))}"
    )
    out["hang"] = attribution(args, url, targets_dir, "hang", hung, "hang")
    out["hang"].update(page_seconds=page_s, beyond_threshold_seconds=page_s - args.hang_seconds)
    wrong = pages_naming_another_rank(stack, fault_at, hung)  # by the end of the phase's diagnoses
    print(f"  pages naming another rank than {hung}: {len(wrong)} {', '.join(wrong[:20])}")
    out["hang"]["wrong_pages"] = wrong

    print(f"phase 3, dead: the hang is over; rank {dead}'s endpoint refuses connections")
    server.set_pages(later)
    fault_at = time.time()
    server.kill(dead)
    paged_at = await_page(stack, "FlareRankDown", dead, 300)
    page_s = paged_at - fault_at
    print(f"  page FlareRankDown rank {dead}: {page_s:.1f} s after it died")
    out["dead"] = attribution(args, url, targets_dir, "rank_down", dead, "dead")
    out["dead"]["page_seconds"] = page_s
    return out


def summary(args: argparse.Namespace, results: dict[str, Any]) -> None:
    print("summary:")
    for phase in ("straggler", "hang", "dead"):
        medians = results[phase]["medians"]
        direct = f", direct scrape {_seconds(medians['direct'])}" if "direct" in medians else ""
        print(
            f"  {phase:9} right culprit every run; via Prometheus {_seconds(medians['subprocess'])} "
            f"(command), {_seconds(medians['in_process'])} (in-process){direct}"
        )
    wrong = results["hang"]["wrong_pages"]
    print(f"  hang pages: {'right' if not wrong else f'{len(wrong)} naming another rank'}")
    worst_prometheus = max(results[p]["medians"]["subprocess"] for p in ("straggler", "hang", "dead"))
    print(
        f"  goal via Prometheus < {PROMETHEUS_GOAL_S:g} s at {args.ranks} ranks: "
        f"{'PASS' if worst_prometheus < PROMETHEUS_GOAL_S else 'MISS'} "
        f"(slowest phase {_seconds(worst_prometheus)})"
    )
    directs = [
        results[p]["medians"]["direct"]
        for p in ("straggler", "hang", "dead")
        if "direct" in results[p]["medians"]
    ]
    if directs:
        print(
            f"  goal via direct scrape < {DIRECT_GOAL_S:g} s (set at 1,024 ranks) at {args.ranks} ranks: "
            f"{'PASS' if max(directs) < DIRECT_GOAL_S else 'MISS'} (slowest phase {_seconds(max(directs))})"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=6144, help="virtual ranks (default 6144)")
    parser.add_argument(
        "--scrape-interval",
        type=int,
        default=0,
        metavar="S",
        help="seconds (default: 5 up to 1,024 ranks, 10 up to 3,072, else 15)",
    )
    parser.add_argument(
        "--hang-seconds", type=int, default=20, help="hang threshold of rules and CLI (default 20)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="CLI runs via Prometheus per phase (default 3)"
    )
    parser.add_argument(
        "--direct-repeats", type=int, default=1, help="direct-scrape runs per phase (default 1)"
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write every number as JSON to OUT")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if args.ranks < 16 or args.repeats < 1 or args.direct_repeats < 0 or args.hang_seconds < 1:
        parser.error("--ranks >= 16, --repeats >= 1, --direct-repeats >= 0, --hang-seconds >= 1")
    args.scrape_interval = args.scrape_interval or default_interval(args.ranks)
    if not can_alert():
        parser.error("needs prometheus and alertmanager (scripts/install-system-deps.sh)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * args.ranks + 1024  # a listener and a Prometheus connection per rank, and some
    if soft < needed:
        if hard < needed:
            parser.error(f"{args.ranks} ranks need {needed} open files; the limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks stop Prometheus
    tmp = Path(tempfile.mkdtemp(prefix="flare-scale-"))
    try:
        results = benchmark(args, tmp)
        summary(args, results)
    except (BenchError, TimeoutError, RuntimeError, OSError, promql.PrometheusError) as error:
        print(f"scale: error: {' '.join(str(error).split())[:500]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    if results["hang"]["wrong_pages"]:
        print("scale: error: culprit pages named other ranks than the hung one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
