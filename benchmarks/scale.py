"""Scale: thousands of virtual ranks scraped by a real store with flare's rules; faults, pages, verdicts.

    python benchmarks/scale.py [--ranks 6144] [--store prometheus|victoria-metrics|both]
                               [--scrape-interval S] [--hang-seconds 20] [--repeats 3]
                               [--direct-repeats 1 | --no-direct] [--json OUT] [--keep]

The cluster (flare_exporter.local.testing.virtual_cluster): every virtual rank's /metrics rendered by
flare's own collectors with every signal on, each served on its own loopback port by one asyncio server,
listed in one file_sd file. The stores (benchmarks/scale_stores.py), one after the other, each over a fresh
server of the same pages, with the project's rules (every `for:` at 0 s) paging a real Alertmanager that
pages a webhook here: one Prometheus; or 2 vmagent shards into VictoriaMetrics, the rules in vmalert.

Phases, each a fault on its own rank (straggler N*3//8, hung N*777//1024, dead N*5//8): a straggler from
the start; a hang (every rank but one waits in the world group's next all-reduce from a known time); then
the hang ends (the job 40 steps on: its pages must name no other rank) and a rank's endpoint closes.

Measured per store: its CPU, memory, ingestion and series in steady state; every rule group's evaluations
(median, longest, share of the interval) and the slowest rules; the interval between a target's scrapes.
Per phase: the time from the fault to its page, the pages naming another rank (any fails the run; alerts
about a rank's monitoring are listed apart), and `flare diagnose --prometheus STORE --json` timed as a
command and in-process, its first verdict checked; with the first store only, `flare diagnose --targets`
(its goal is benchmarks/direct_scrape.py's). Goal: the right culprit in < 1 s via the store at 6,144 ranks.

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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import scale_stores as stores  # noqa: E402  (benchmarks/)
from cli_runs import BenchError, command, faulty_ranks, first_verdict, in_process  # noqa: E402  (benchmarks/)

from flare_exporter.engine import promql
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.record_names import LAST_WINDOW

RUN = "bench-scale"
PROMETHEUS_GOAL_S = 1.0  # via the store, at 6,144 ranks
CLI_TIMEOUT_S = 300.0
PHASES = ("straggler", "hang", "dead")
VERDICT_KIND = {"straggler": "straggler", "hang": "hang", "dead": "rank_down"}
PAGED_BY = {"straggler": "FlareRankStraggler", "hang": "FlareCollectiveHangCulprit", "dead": "FlareRankDown"}
# the alerts that rightly name each fault's rank (the straggler's GPU throttles: its hardware reasons too)
RIGHT_ALERTS = {
    "straggler": ("FlareRankStraggler", "FlareGPUThrottled", "FlareGPUClockBelowMax"),
    "hang": ("FlareCollectiveHangCulprit",),
    "dead": ("FlareRankDown",),
}
# the alerts of a hang, which must all resolve once it is over
HANG_ALERTS = ("FlareCollectiveHang", "FlareCollectiveHangCulprit", "FlareCollectiveMismatch")
# alerts about the monitoring of a rank (is it scraped on time, does its exporter work), not blaming it
MONITORING_ALERTS = (
    "FlareRankScrapesLate",
    "FlareExporterErrors",
    "FlareExporterDroppingEvents",
    "FlareExporterCollectorFailing",
)
PAGE_TIMEOUT_S = 600.0
SLOWEST_RULES = 6


def default_interval(ranks: int) -> int:
    """A scrape interval one Prometheus keeps up with on two shared cores (see benchmarks/README.md)."""
    return 5 if ranks <= 1024 else 10 if ranks <= 3072 else 15


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


@dataclass
class StoreRun:
    """One store's run over a served cluster: what the phases share."""

    args: argparse.Namespace
    store: stores.Store
    server: vc.ClusterServer
    targets_dir: str
    pages: vc.PhasePages
    faults: dict[str, int]  # phase -> its faulty rank
    direct_repeats: int
    right: set[tuple[str, str]] = field(default_factory=set)  # (alertname, rank) of the faults so far

    def query(self, expr: str) -> list[dict[str, Any]]:
        return promql.query(self.store.url, expr, 30)


# ---------------------------------------------------------------------------------------------------------
# the store's own numbers


def scrape_figures(run: StoreRun) -> dict[str, float | None]:
    """Median and longest scrape of a rank now (scrape_duration_seconds, which both stores record)."""

    def one(expr: str) -> float | None:
        found = run.query(expr)
        return float(found[0]["value"][1]) if found else None

    return {
        "scrape_duration_median_seconds": one(f'quantile(0.5, scrape_duration_seconds{{run="{RUN}"}})'),
        "scrape_duration_max_seconds": one(f'max(scrape_duration_seconds{{run="{RUN}"}})'),
    }


def scrape_intervals(run: StoreRun, seconds: int) -> dict[str, float | None]:
    """The mean interval between scrapes of a target over the last `seconds` (its samples of `up`): the
    median over targets, the 99th percentile and the longest."""
    per_target = f'{seconds} / count_over_time(up{{run="{RUN}"}}[{seconds}s])'
    out: dict[str, float | None] = {}
    for name, expr in (
        ("p50", f"quantile(0.5, {per_target})"),
        ("p99", f"quantile(0.99, {per_target})"),
        ("max", f"max({per_target})"),
    ):
        found = run.query(expr)
        out[name] = float(found[0]["value"][1]) if found else None
    return out


def measure_load(run: StoreRun, seconds: float) -> dict[str, Any]:
    """The store's CPU, memory and ingestion over `seconds` of steady state, and its scrape durations."""
    before, started = run.store.metrics(), time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronisation: the store keeps scraping meanwhile
    after, elapsed = run.store.metrics(), time.monotonic() - started
    return {
        "window_seconds": elapsed,
        **stores.cpu_and_memory(before, after, elapsed),
        **stores.ingestion(run.store, before, after, elapsed),
        **scrape_figures(run),
    }


def print_load(load: dict[str, Any]) -> None:
    per_process = ", ".join(f"{name} {cores:.2f}" for name, cores in load["cpu_cores_by_process"].items())
    print(
        f"  steady state ({load['window_seconds']:.0f} s): ingestion {load['samples_per_second']:,.0f} "
        f"samples/s, {load['series']:,.0f} series, {load['resident_bytes'] / 2**30:.2f} GiB resident, "
        f"{load['cpu_cores']:.2f} CPU cores ({per_process}); scrape duration median "
        f"{_seconds(load['scrape_duration_median_seconds'])}, "
        f"max {_seconds(load['scrape_duration_max_seconds'])}"
    )


def rule_figures(run: StoreRun, watch: stores.RuleWatch) -> dict[str, Any]:
    """The rule groups' evaluations seen while the store ran; its rules' last evaluations and failures."""
    figures: dict[str, Any] = {"groups": watch.summary(), "failed_polls": watch.failed_polls}
    try:
        groups = run.store.answered_rule_groups()
        # each rule's last evaluation
        slowest = stores.slowest_rules(groups, SLOWEST_RULES, run.store.cumulative_recordings)
        figures.update(
            slowest_rules_seconds=slowest,
            failing_rules=stores.rule_problems(groups),
            failed_evaluations=run.store.failed_evaluations(),
        )
    except BenchError as error:  # the groups' figures stand: the thread polled them while the store ran
        figures["error"] = str(error)
    print_rule_figures(figures)
    return figures


def print_rule_figures(figures: dict[str, Any]) -> None:
    text = "; ".join(
        f"{name} {_seconds(group['median_seconds'])} (max {_seconds(group['max_seconds'])}, "
        f"{group['evaluations']} runs) of {group['interval_seconds']:g} s"
        for name, group in sorted(figures["groups"].items())
    )
    print(f"  rule groups, median evaluation: {text}")
    if "error" in figures:
        print(f"  rules' last evaluations: {figures['error']}")
        return
    slowest = ", ".join(f"{rule} {_seconds(took)}" for rule, took in figures["slowest_rules_seconds"].items())
    print(f"  slowest rules (last evaluation): {slowest}")
    print(f"  rule evaluations that failed: {figures['failed_evaluations']:.0f}")
    for rule, error in figures["failing_rules"].items():
        print(f"  rule failing: {rule}: {error[:300]}")


# ---------------------------------------------------------------------------------------------------------
# the CLI, timed and checked


def attribution(run: StoreRun, phase: str) -> dict[str, Any]:
    """Time `flare diagnose` via the store (in-process, subprocess) and via direct scrape; check verdicts."""
    args, kind, rank, where = run.args, VERDICT_KIND[phase], run.faults[phase], f"{run.store.name}, {phase}"
    common = ["diagnose", "--hang-seconds", str(args.hang_seconds), "--json", "--run", RUN]
    via_store = ["-m", "flare_exporter.cli", *common, "--prometheus", run.store.url, "--timeout", "30"]
    direct = ["-m", "flare_exporter.cli", *common, "--targets", run.targets_dir]
    times: dict[str, list[float]] = {"in_process": [], "subprocess": [], "subprocess_cpu": [], "direct": []}
    summary = direct_summary = ""
    for index in range(args.repeats):
        elapsed, code, output = in_process(via_store[2:])
        summary = first_verdict(code, output, kind, rank, f"{where}: in-process run {index + 1}")
        times["in_process"].append(elapsed)
        elapsed, code, output, cpu = command(via_store, CLI_TIMEOUT_S)
        first_verdict(code, output, kind, rank, f"{where}: subprocess run {index + 1}")
        times["subprocess"].append(elapsed)
        times["subprocess_cpu"].append(cpu)
    for index in range(run.direct_repeats):
        elapsed, code, output, cpu = command(direct, CLI_TIMEOUT_S)
        direct_summary = first_verdict(code, output, kind, rank, f"{phase}: direct scrape run {index + 1}")
        times["direct"].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items() if values}
    line = (
        f"  flare diagnose --prometheus {run.store.name}: {_seconds(medians['subprocess'])} as a command "
        f"(CPU {_seconds(medians['subprocess_cpu'])}), {_seconds(medians['in_process'])} in-process"
    )
    if times["direct"]:
        line += f"; --targets (direct scrape): {_seconds(medians['direct'])}"
    print(line + f"; median of {args.repeats}/{run.direct_repeats}")
    print(f"  verdict: {summary}" + (f" | direct: {direct_summary}" if direct_summary else ""))
    return {
        "times_seconds": times,
        "medians": medians,
        "verdicts": summary,
        "direct_verdicts": direct_summary,
    }


# ---------------------------------------------------------------------------------------------------------
# pages


def await_page(run: StoreRun, phase: str, timeout: float) -> float | None:
    """Arrival time of the first page of the phase's alert naming its rank; None if none came in time."""
    alertname, rank = PAGED_BY[phase], str(run.faults[phase])

    def arrived() -> list[tuple[float, dict[str, Any]]]:
        run.store.check_alive()
        return run.store.pages.alerts(run=RUN, alertname=alertname, rank=rank)

    try:
        found = wait_for(arrived, timeout, f"{alertname} {rank}")
    except TimeoutError:
        return None
    return min(at for at, _ in found)


def pages_since(run: StoreRun, since: float) -> dict[str, Any]:
    """The alerts delivered since `since`, by kind: naming a fault's rank rightly, naming another rank
    (wrong: each with its labels and its first arrival), about the monitoring of a rank, naming no rank."""
    right: set[str] = set()
    monitoring: set[str] = set()
    without_rank: set[str] = set()
    wrong: dict[str, dict[str, Any]] = {}
    for arrived, alert in run.store.pages.alerts(run=RUN):
        labels = alert["labels"]
        name, rank = labels["alertname"], labels.get("rank")
        if arrived < since:
            continue
        if rank is None:
            without_rank.add(name)
        elif (name, rank) in run.right:
            right.add(f"{name}[{rank}]")
        elif name in MONITORING_ALERTS:
            monitoring.add(f"{name}[{rank}]")
        elif f"{name}[{rank}]" not in wrong:
            wrong[f"{name}[{rank}]"] = {"labels": labels, "after_seconds": round(arrived - since, 1)}
    return {
        "right": sorted(right),
        "wrong": wrong,
        "monitoring": sorted(monitoring),
        "without_rank": sorted(without_rank),
    }


def print_pages(pages: dict[str, Any]) -> None:
    wrong, monitoring = pages["wrong"], pages["monitoring"]
    print(
        f"  pages: right {', '.join(pages['right']) or 'none'}; naming another rank: {len(wrong)} "
        f"{', '.join(list(wrong)[:20])}; without a rank: {', '.join(pages['without_rank']) or 'none'}; "
        f"monitoring: {len(monitoring)} {', '.join(monitoring[:10])}"
    )
    for name, detail in list(wrong.items())[:20]:
        print(f"    wrong: {name} {detail['after_seconds']} s into the phase, labels {detail['labels']}")


# ---------------------------------------------------------------------------------------------------------
# the phases


def await_every_rank(run: StoreRun, timeout: float) -> None:
    def every_rank_stored() -> bool:
        run.store.check_alive()
        try:
            answer = run.query(f'count(flare_rank_info{{run="{RUN}"}})')
        except promql.PrometheusError:  # busy with the first scrapes' new series: asked again
            return False
        return bool(answer) and int(float(answer[0]["value"][1])) == run.args.ranks

    wait_for(every_rank_stored, timeout, f"{run.store.name} to hold all {run.args.ranks} ranks")


def await_straggler_figures(run: StoreRun, timeout: float) -> float:
    """Seconds until the rules' straggler figures (straggler_rules.straggler_summary_rules), which `flare
    diagnose` reads in place of every rank's windows, are of the windows every rank serves now."""
    started = time.monotonic()
    (last,) = run.query(f'max(flare_straggler_last_window{{run="{RUN}"}})')
    figure = f'{LAST_WINDOW}:min{{run="{RUN}"}} == {last["value"][1]}'
    wait_for(lambda: bool(run.query(figure)), timeout, "the rules' straggler figures")
    return time.monotonic() - started


def start_fault(run: StoreRun, phase: str, started_at: float) -> float:
    """Start the phase's fault; its time (the straggler's is there from the store's start, `started_at`)."""
    if phase == "hang":
        fault_at = time.time()
        run.server.set_pages(vc.hung_at(run.pages.hung, fault_at))
        return fault_at
    if phase == "dead":
        fault_at = time.time()
        run.server.kill(run.faults["dead"])
        return fault_at
    return started_at


def phase_of(run: StoreRun, phase: str, fault_at: float) -> dict[str, Any]:
    """Phase `phase` from its fault on (at `fault_at`): its page, `flare diagnose` and the pages.

    The straggler's `flare diagnose` runs as soon as the rules' straggler figures are current, before its
    page (which vmalert sends minutes later): the virtual job takes no step after its first 40, and five
    minutes on the engine sees a job that makes no progress, which it does not judge for stragglers."""
    rank = run.faults[phase]
    run.right.update((name, str(rank)) for name in RIGHT_ALERTS[phase])
    print(f"phase {phase}: rank {rank}; load average {load_average()}")
    out: dict[str, Any] = {"rank": rank, "load_average": load_average()}
    if phase == "straggler":
        out["straggler_figures_seconds"] = await_straggler_figures(run, PAGE_TIMEOUT_S)
        out.update(attribution(run, phase))
    paged_at = await_page(run, phase, PAGE_TIMEOUT_S)
    out["page_seconds"] = None if paged_at is None else paged_at - fault_at
    what = "the store's start" if phase == "straggler" else "the fault"
    print(
        f"  page {PAGED_BY[phase]} rank {rank}: "
        + (f"{out['page_seconds']:.1f} s after {what}" if paged_at else f"none in {PAGE_TIMEOUT_S:.0f} s")
    )
    if phase != "straggler":
        out.update(attribution(run, phase))
    out["pages"] = pages_since(run, fault_at)
    print_pages(out["pages"])
    return out


def hang_over(run: StoreRun, timeout: float) -> dict[str, Any]:
    """The hang ends (every rank completed the all-reduce, the job 40 steps on): the seconds until
    Alertmanager holds none of the hang's alerts (every rank scraped since, the rules evaluated), and the
    pages meanwhile, which must name no other rank than the hung one: for up to a scrape interval the rules
    see some ranks before the hang's end and some after it."""
    over_at = time.time()
    run.server.set_pages(run.pages.resumed)

    def settled() -> bool:
        run.store.check_alive()
        active = run.store.active_alerts(RUN)
        return not [alert for alert in active if alert["labels"]["alertname"] in HANG_ALERTS]

    wait_for(settled, timeout, "the hang's alerts to resolve")
    out: dict[str, Any] = {"seconds": time.time() - over_at, "pages": pages_since(run, over_at)}
    print(f"the hang is over: its alerts resolved {out['seconds']:.1f} s later")
    print_pages(out["pages"])
    return out


def phases(run: StoreRun, started_at: float, out: dict[str, Any]) -> None:
    """Every phase in turn into `out`, after a steady-state measurement of the store."""
    await_every_rank(run, 600)
    held_at = time.time()
    print(f"  every rank stored {held_at - started_at:.1f} s after the store started; the job takes 40 steps")
    run.server.set_pages(run.pages.later)  # the job makes progress: counters move between two scrapes
    out["every_rank_stored_seconds"] = held_at - started_at
    out["steady"] = measure_load(run, max(30.0, 3 * run.args.scrape_interval))
    print_load(out["steady"])
    out["phases"] = {}
    for phase in PHASES:
        if phase == "dead":
            out["hang_over"] = hang_over(run, PAGE_TIMEOUT_S)
        fault_at = start_fault(run, phase, started_at)
        out["phases"][phase] = phase_of(run, phase, fault_at)
    out["scrape_interval_seconds"] = scrape_intervals(run, max(60, int(time.time() - held_at)))
    print(f"  interval between scrapes of a target, over the run: {out['scrape_interval_seconds']}")


def run_store(
    args: argparse.Namespace,
    name: str,
    work: Path,
    pages: vc.PhasePages,
    faults: dict[str, int],
    direct_repeats: int,
) -> dict[str, Any]:
    """The phases against store `name`, over a fresh server of `pages`."""
    out: dict[str, Any] = {"load_average_at_start": load_average()}
    print(f"store {name}: scrapes and rule evaluations every {args.scrape_interval} s")
    try:
        with vc.ClusterServer(pages.healthy) as server:
            targets_dir = str(work / "targets")
            vc.write_file_sd(targets_dir, RUN, server.targets(), args.ranks)
            started_at = time.time()
            store = stores.open_store(
                name, str(work / "stack"), targets_dir, args.hang_seconds, args.scrape_interval
            )
            try:
                store.wait_ready()
                run = StoreRun(args, store, server, targets_dir, pages, faults, direct_repeats)
                observed(run, started_at, out)
            finally:
                store.stop()
            out["scrapes_served"] = next(server.served)
    except (BenchError, TimeoutError, RuntimeError, OSError, promql.PrometheusError) as error:
        out["error"] = stores.error_line(error)
        print(f"scale: error: {name}: {out['error']}", file=sys.stderr)
    out["load_average_at_end"] = load_average()
    return out


def observed(run: StoreRun, started_at: float, out: dict[str, Any]) -> None:
    """The phases into `out`, with the store's rule groups watched and its processes' CPU over the run."""
    first, first_at = run.store.metrics(), time.monotonic()
    with stores.RuleWatch(run.store) as watch:
        try:
            phases(run, started_at, out)
        finally:  # the rules' figures of a run that failed too
            out["rules"] = rule_figures(run, watch)
    elapsed = time.monotonic() - first_at
    try:
        out["whole_run"] = {"seconds": elapsed, **stores.cpu_and_memory(first, run.store.metrics(), elapsed)}
    except BenchError as error:  # a figure missing, not a wrong one
        out["whole_run"] = {"seconds": elapsed, "error": str(error)}
        print(f"  over the whole run ({elapsed:.0f} s): {error}")
        return
    print(
        f"  over the whole run ({elapsed:.0f} s): {out['whole_run']['cpu_cores']:.2f} CPU cores, "
        f"{out['whole_run']['resident_bytes'] / 2**30:.2f} GiB resident at the end"
    )


# ---------------------------------------------------------------------------------------------------------


def render(args: argparse.Namespace, faults: dict[str, int]) -> tuple[vc.PhasePages, dict[str, Any]]:
    """Every rank's page in each phase: healthy, 40 steps later, hung, and 40 steps after the hang."""
    ranks = args.ranks
    started = time.perf_counter()
    pages = vc.render_pages(ranks, RUN, faults["straggler"], faults["hang"], resumed_steps=40)
    render_s = time.perf_counter() - started
    healthy = pages.healthy
    series = vc.series_count(healthy[0].decode())
    mean_kib = sum(map(len, healthy)) / ranks / 1024
    print(
        f"cluster: {ranks} virtual ranks on {-(-ranks // vc.RANKS_PER_HOST)} hosts, {series} series and "
        f"{mean_kib:.1f} KiB per rank ({ranks * series:,} series in all); each rank's page rendered 4 "
        f"times by flare's collectors in {render_s:.1f} s"
    )
    return pages, {"series_per_rank": series, "kib_per_rank": mean_kib, "render_seconds": render_s}


def benchmark(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ranks = args.ranks
    faults = faulty_ranks(ranks)
    machine = dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version())
    config = dict(ranks=ranks, stores=args.stores, scrape_interval_seconds=args.scrape_interval)
    config.update(hang_seconds=args.hang_seconds, faults=faults)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine | {"load_average": load_average()}}
    results["config"] = config
    print(
        f"flare scale benchmark  {results['date']}  {os.cpu_count()} CPUs  python {platform.python_version()}"
        f"  load average {load_average()}"
    )
    pages, results["cluster"] = render(args, faults)
    results["stores"] = {}
    for index, name in enumerate(args.stores):
        direct = args.direct_repeats if index == 0 else 0  # the store plays no part in a direct scrape
        results["stores"][name] = run_store(args, name, tmp / name, pages, faults, direct)
    return results


# ---------------------------------------------------------------------------------------------------------
# the side-by-side summary


def cell(figures: dict[str, Any], phase: str, what: str) -> str:
    """One phase's figure of one store, as the summary table shows it."""
    if phase not in figures.get("phases", {}):
        return "error"
    found = figures["phases"][phase]
    if what == "page":
        return "none" if found["page_seconds"] is None else f"{found['page_seconds']:.1f} s"
    if what == "wrong":
        return str(len(found["pages"]["wrong"]))
    return _seconds(found["medians"].get(what))


def table(rows: list[tuple[str, list[str]]], names: list[str]) -> None:
    width = max(len(label) for label, _ in rows)
    columns = [max([len(name)] + [len(values[i]) for _, values in rows]) for i, name in enumerate(names)]

    def line(label: str, values: list[str]) -> str:
        cells = (value.rjust(column) for value, column in zip(values, columns, strict=True))
        return "  " + label.ljust(width) + "  " + "  ".join(cells)

    print(line("", names))
    for label, values in rows:
        print(line(label, values))


def phase_rows(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    names = list(results["stores"])
    rows = []
    for phase in PHASES:
        for what, label in (
            ("subprocess", "diagnose, command"),
            ("in_process", "diagnose, in-process"),
            ("direct", "diagnose, direct scrape"),
            ("page", f"page {PAGED_BY[phase]}"),
            ("wrong", "pages naming another rank"),
        ):
            rows.append((f"{phase}: {label}", [cell(results["stores"][n], phase, what) for n in names]))
    return rows


def hang_over_rows(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    figures = [results["stores"][name].get("hang_over") for name in results["stores"]]
    return [
        ("hang over: its alerts resolved", [f"{f['seconds']:.1f} s" if f else "-" for f in figures]),
        (
            "hang over: pages naming another rank",
            [str(len(f["pages"]["wrong"])) if f else "-" for f in figures],
        ),
    ]


def rule_rows(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    figures = [results["stores"][name] for name in results["stores"]]
    groups = sorted({group for f in figures for group in f.get("rules", {}).get("groups", {})})
    rows = []
    for group in groups:
        values = []
        for f in figures:
            found = f.get("rules", {}).get("groups", {}).get(group)
            values.append(
                "-"
                if not found or found["median_seconds"] is None
                else f"{_seconds(found['median_seconds'])} ({found['median_share_of_interval']:.0%} of "
                f"{found['interval_seconds']:g} s)"
            )
        rows.append((f"rules {group}, median", values))
    return rows


def load_rows(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    figures = [results["stores"][name] for name in results["stores"]]

    def each(path: tuple[str, str], show: Any) -> list[str]:
        return [show(f[path[0]][path[1]]) if path[1] in f.get(path[0], {}) else "-" for f in figures]

    return [
        ("CPU cores, steady state", each(("steady", "cpu_cores"), lambda v: f"{v:.2f}")),
        ("CPU cores, whole run", each(("whole_run", "cpu_cores"), lambda v: f"{v:.2f}")),
        (
            "resident GiB, whole run's end",
            each(("whole_run", "resident_bytes"), lambda v: f"{v / 2**30:.2f}"),
        ),
        ("samples ingested per second", each(("steady", "samples_per_second"), lambda v: f"{v:,.0f}")),
        ("scrape interval p99 (s)", each(("scrape_interval_seconds", "p99"), lambda v: f"{v or 0:.1f}")),
        ("load average at start", [str(f["load_average_at_start"]) for f in figures]),
        ("load average at end", [str(f["load_average_at_end"]) for f in figures]),
    ]


def summary(args: argparse.Namespace, results: dict[str, Any]) -> None:
    names = list(results["stores"])
    print(
        f"summary: {args.ranks} ranks, scrapes every {args.scrape_interval} s, hang threshold "
        f"{args.hang_seconds} s"
    )
    table(phase_rows(results) + hang_over_rows(results) + rule_rows(results) + load_rows(results), names)
    for name in names:
        figures = results["stores"][name]
        if "error" in figures:
            print(f"  {name}: error: {figures['error']}")
            continue
        worst = max(figures["phases"][p]["medians"]["subprocess"] for p in PHASES)
        print(
            f"  {name}: goal via the store < {PROMETHEUS_GOAL_S:g} s at {args.ranks} ranks: "
            f"{'PASS' if worst < PROMETHEUS_GOAL_S else 'MISS'} (slowest phase {_seconds(worst)})"
        )


def wrong_pages(where: str, pages: dict[str, Any]) -> list[str]:
    wrong = pages["wrong"]
    if not wrong:
        return []
    named = ", ".join(list(wrong)[:10]) + (f" ({len(wrong)} in all)" if len(wrong) > 10 else "")
    return [f"{where}: pages naming another rank: {named}"]


def failures(results: dict[str, Any]) -> list[str]:
    """What makes the run fail: a store's error, a page naming another rank, a page that never came."""
    found = []
    for name, figures in results["stores"].items():
        if "error" in figures:
            found.append(f"{name}: {figures['error']}")
        for phase, figures_of_phase in figures.get("phases", {}).items():
            found += wrong_pages(f"{name}, {phase}", figures_of_phase["pages"])
            if figures_of_phase["page_seconds"] is None:
                found.append(
                    f"{name}, {phase}: no {PAGED_BY[phase]} page naming rank {figures_of_phase['rank']}"
                )
        if "hang_over" in figures:
            found += wrong_pages(f"{name}, the hang's end", figures["hang_over"]["pages"])
    return found


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store", choices=[*stores.STORES, "both"], default="both", help="both (default): Prometheus first"
    )
    for flag, default, says in (
        ("--ranks", 6144, "virtual ranks (default 6144)"),
        ("--scrape-interval", 0, "seconds (default: 5 up to 1,024 ranks, 10 up to 3,072, else 15)"),
        ("--hang-seconds", 20, "hang threshold of rules and CLI (default 20)"),
        ("--repeats", 3, "CLI runs via the store per phase (default 3)"),
        ("--direct-repeats", 1, "direct-scrape runs per phase, first store (default 1)"),
    ):
        parser.add_argument(flag, type=int, default=default, help=says)
    parser.add_argument("--no-direct", action="store_true", help="no direct-scrape run (--direct-repeats 0)")
    parser.add_argument("--json", default="", metavar="OUT", help="also write every number as JSON to OUT")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if args.ranks < 16 or args.repeats < 1 or args.direct_repeats < 0 or args.hang_seconds < 1:
        parser.error("--ranks >= 16, --repeats >= 1, --direct-repeats >= 0, --hang-seconds >= 1")
    args.direct_repeats = 0 if args.no_direct else args.direct_repeats
    args.scrape_interval = args.scrape_interval or default_interval(args.ranks)
    args.stores = list(stores.STORES) if args.store == "both" else [args.store]
    missing = [name for name in args.stores if not stores.installed(name)]
    if missing:
        parser.error(
            f"--store {args.store} needs {' and '.join(missing)} with Alertmanager "
            "(scripts/install-system-deps.sh)"
        )
    raise_open_files(parser, args.ranks)
    return args


def raise_open_files(parser: argparse.ArgumentParser, ranks: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * ranks + 1024  # a listener and a store's connection per rank, and some
    if soft < needed:
        if hard < needed:
            parser.error(f"{ranks} ranks need {needed} open files; the limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks stop the stores
    tmp = Path(tempfile.mkdtemp(prefix="flare-scale-"))
    try:
        results = benchmark(args, tmp)
        summary(args, results)
    except (BenchError, RuntimeError, OSError) as error:  # rendering the cluster
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
    problems = failures(results)
    for problem in problems:
        print(f"scale: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
