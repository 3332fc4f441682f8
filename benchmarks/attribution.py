"""Attribution time: `flare diagnose --prometheus` on a simulated cluster of 1,024 ranks with one hung rank.

    python benchmarks/attribution.py [--ranks 1024] [--culprit 777] [--repeats 10] [--subprocess-repeats 3] \
                                     [--scrape-interval 2] [--pass-run] [--json OUT] [--keep]

The cluster is flare_exporter.local.testing.virtual_cluster (shared with benchmarks/scale.py): one asyncio
server in
this process serves every virtual rank's /metrics on its own loopback port. Each rank's exposition is
rendered once, up front, by flare-exporter's own collectors (agent.build_registry over a FlareState built as
the hooks would leave it, every signal on): rank N on host node-<N//8>, in the world group, a data-parallel
group and a tensor-parallel group, with steps, collective histograms, sequence numbers, straggler windows,
issue-latency distributions, GPU health (fake NVML), a heartbeat and a stack sample. The fault: rank
`--culprit` is stuck in compute and never issued the world group's next all-reduce; every other rank has
that all-reduce in flight, issued 600 s before the benchmark started. Timestamps are real Unix times.

A real Prometheus (PrometheusProcess) discovers the ranks through one file_sd file (a target group per rank,
with `rank` and `run` labels, as the ranks write theirs) and scrapes them every `--scrape-interval`
seconds. Once it is ready and holds flare_rank_info for every rank, the benchmark times:

- in-process:
  `flare_exporter.engine.cli.main(["diagnose", "--prometheus", URL, "--hang-seconds", "60", "--json"])`,
  `--repeats` times, and its two parts alone: sources.from_prometheus (the queries) and diagnosis.diagnose
  (the engine);
- the whole command: `python -m flare_exporter.cli diagnose ...` as a subprocess,
  `--subprocess-repeats`
  times (interpreter start-up and imports included), and `python -c "import flare_exporter.cli"` alone.

The in-process times share this process, and so the GIL, with the server's thread (about 500 scrapes a
second at 1,024 ranks): they come out slower than the whole command less its start-up.

Every result must be one verdict: kind hang, ranks [culprit], group world; anything else is an error.
Goal: the whole command's median < 1 s (the in-process median is checked against it too).

Exit status: 0 when every verdict was right (whatever the times), 1 for a wrong verdict or a failure,
2 for bad arguments. Prometheus and the server are stopped on exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli_runs import BenchError, command, in_process, one_line, verdicts_of  # noqa: E402  (benchmarks/)

from flare_exporter.engine import cli, diagnosis, promql, sources
from flare_exporter.engine.scrape import parse
from flare_exporter.local.prometheus import PrometheusProcess, find_binary, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.rank.groups import WORLD

GOAL_SECONDS = 1.0
HANG_SECONDS = 60
HUNG_FOR_SECONDS = 600.0  # how long before the start the others issued the collective the culprit never did
DEFAULT_CULPRIT = 777
RUN = "bench-attribution"
SUBPROCESS_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------------------
# the simulated cluster (flare_exporter.local.testing.virtual_cluster, shared with benchmarks/scale.py)


def default_culprit(ranks: int) -> int:
    """777 at 1,024 ranks; the same relative position (777/1024) in a smaller cluster."""
    return DEFAULT_CULPRIT if ranks > DEFAULT_CULPRIT else ranks * DEFAULT_CULPRIT // 1024


def render_cluster(ranks: int, culprit: int, run: str) -> list[bytes]:
    """Every rank's exposition (index = rank) 600 s into the hang the culprit causes (real Unix times)."""
    perf_now = time.perf_counter()
    return vc.render_cluster(
        ranks, run, vc.Faults(hung=culprit, hung_at=perf_now - HUNG_FOR_SECONDS), perf_now
    )


# ---------------------------------------------------------------------------------------------------------
# timing and checking


def check_verdict(code: int, output: str, ranks: int, culprit: int, where: str) -> None:
    """The CLI's JSON must be exactly one verdict: hang, ranks [culprit], group world, from every rank."""
    result, summary = verdicts_of(code, output, where)
    verdicts = result.get("verdicts", [])
    if code != cli.EXIT_ANOMALY:
        raise BenchError(
            f"{where}: exit code {code} (expected {cli.EXIT_ANOMALY}, anomaly); verdicts: {summary}"
        )
    if result.get("ranks_seen") != ranks or result.get("world_size") != ranks:
        raise BenchError(
            f"{where}: saw {result.get('ranks_seen')} ranks of world size {result.get('world_size')}, "
            f"expected {ranks}"
        )
    if len(verdicts) != 1 or (verdicts[0]["kind"], verdicts[0]["ranks"], verdicts[0]["group"]) != (
        "hang",
        [culprit],
        WORLD,
    ):
        raise BenchError(f"{where}: wrong verdict: {summary} (expected hang [{culprit}] [world])")


def time_calls(call: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return times, result


def stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def _row(what: str, how: str, times: list[float]) -> str:
    s = stats(times)
    return (
        f"  {what:<14} {how:<42} median {_seconds(s['median']):>9}  min {_seconds(s['min']):>9}  "
        f"max {_seconds(s['max']):>9}"
    )


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process, from /proc (0.0 where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value < 0.1 else f"{value:.3f} s"


def count_queries(call: Callable[[], Any]) -> tuple[int, Any]:
    """How many requests `call` sends to Prometheus's API: queries, and label values (the run discovery;
    promql.query and promql.label_values wrapped while it runs)."""
    originals = {name: getattr(promql, name) for name in ("query", "label_values")}
    sent = itertools.count()

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            next(sent)
            return original(*args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(promql, name, counting(original))
    try:
        result = call()
    finally:
        for name, original in originals.items():
            setattr(promql, name, original)
    return next(sent), result


# ---------------------------------------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"attribution: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks (default 1024)")
    parser.add_argument(
        "--culprit",
        type=int,
        default=None,
        help=f"the rank that hangs the job (default {DEFAULT_CULPRIT}; below {DEFAULT_CULPRIT + 1} ranks, "
        f"ranks*{DEFAULT_CULPRIT}//1024)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="in-process CLI runs (default 10)")
    parser.add_argument(
        "--subprocess-repeats",
        type=int,
        default=3,
        metavar="N",
        help="whole-command runs, python -m flare_exporter.cli (default 3)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="Prometheus scrape interval (default 2)",
    )
    parser.add_argument(
        "--pass-run",
        action="store_true",
        help=f"pass --run {RUN} to flare, which skips run discovery (one request fewer)",
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write every number as JSON to OUT")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (Prometheus data, log)"
    )
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: at least 2 ranks (a culprit and a rank waiting on it)")
    if args.culprit is None:
        args.culprit = default_culprit(args.ranks)
    if not 0 <= args.culprit < args.ranks:
        parser.error(f"--culprit {args.culprit}: must be a rank, 0 to {args.ranks - 1}")
    if args.repeats < 1 or args.subprocess_repeats < 0:
        parser.error("--repeats must be at least 1, --subprocess-repeats at least 0")
    if not 0.1 <= args.scrape_interval <= 60:
        parser.error(f"--scrape-interval {args.scrape_interval:g}: between 0.1 and 60 seconds")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: no directory {Path(args.json).resolve().parent}")
    if find_binary() is None:
        parser.error(
            "prometheus is not installed (apt-get install prometheus, or scripts/install-system-deps.sh)"
        )
    return args


def prometheus_version() -> str:
    binary = find_binary() or "prometheus"
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    words = (out.stdout or out.stderr).split()
    return words[2] if len(words) > 2 else "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks stop Prometheus
    tmp = Path(tempfile.mkdtemp(prefix="flare-attribution-"))
    try:
        results = benchmark(args, tmp)
    except BenchError as error:
        print(f"attribution: error: {error}", file=sys.stderr)
        return 1
    except (promql.PrometheusError, TimeoutError, RuntimeError, OSError) as error:
        print(f"attribution: error: {one_line(str(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attribution: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        except OSError as error:
            print(f"attribution: error: cannot write {args.json}: {error.strerror or error}", file=sys.stderr)
            return 1
        print(f"results written to {args.json}")
    return 0


def benchmark(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ranks, culprit = args.ranks, args.culprit
    version = prometheus_version()
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "prometheus": version,
        },
        "config": {
            "ranks": ranks,
            "culprit": culprit,
            "repeats": args.repeats,
            "subprocess_repeats": args.subprocess_repeats,
            "scrape_interval_seconds": args.scrape_interval,
            "hang_seconds": HANG_SECONDS,
            "hung_for_seconds": HUNG_FOR_SECONDS,
            "pass_run": args.pass_run,
        },
    }
    print(
        f"flare attribution benchmark  {results['date']}  {os.cpu_count()} CPUs  "
        f"python {platform.python_version()}  prometheus {version}"
    )
    started = time.perf_counter()
    pages = render_cluster(ranks, culprit, RUN)
    render_s = time.perf_counter() - started
    sample = pages[culprit]
    series_per_rank = len(parse(sample.decode()))
    mean_bytes = sum(len(page) for page in pages) / ranks
    hosts = -(-ranks // vc.RANKS_PER_HOST)
    print(
        f"cluster: {ranks} ranks on {hosts} hosts, run {RUN}; rank {culprit} stuck in compute, behind in "
        f"group world; the other {ranks - 1} in allreduce #{vc.STEPS + 1} for {HUNG_FOR_SECONDS:.0f} s"
    )
    print(
        f"  each rank: 3 process groups, {series_per_rank} series, {mean_bytes / 1024:.1f} KiB of exposition "
        f"(all {ranks} rendered by flare's collectors in {render_s:.2f} s)"
    )
    results["cluster"] = {
        "hosts": hosts,
        "series_per_rank": series_per_rank,
        "exposition_bytes_mean": mean_bytes,
        "render_seconds": render_s,
    }

    with vc.ClusterServer(pages) as server:
        file_sd_dir = tmp / "file_sd"
        vc.write_file_sd(str(file_sd_dir), RUN, server.targets(), ranks)
        prometheus = PrometheusProcess(
            str(tmp / "prometheus"), str(file_sd_dir), f"{args.scrape_interval:g}s"
        )
        try:
            results.update(measure(args, server, prometheus))
        finally:
            prometheus.stop()
    return results


def measure(
    args: argparse.Namespace, server: vc.ClusterServer, prometheus: PrometheusProcess
) -> dict[str, Any]:
    """Time `flare diagnose` against Prometheus once it has scraped every rank: in-process, its queries and
    engine alone, and as a whole command; every verdict checked."""
    url = prometheus.url
    seen = wait_until_scraped(args, prometheus)
    cli_args = ["diagnose", "--prometheus", url, "--hang-seconds", str(HANG_SECONDS), "--json"]
    if args.pass_run:
        cli_args += ["--run", RUN]
    run = RUN if args.pass_run else ""
    queries = count_requests(args, url, run, cli_args)
    times = time_in_process(args, url, run, cli_args)
    background = time_commands(args, prometheus, cli_args, times)
    ranks = args.ranks
    print(f"verdict, every run: HANG rank {args.culprit} in group world, {ranks} of {ranks} ranks seen")
    goal, headline = judge(ranks, times)
    return {
        "prometheus": seen,
        "queries": queries,
        "scrapes_served": next(server.served),
        "background": background,
        "times_seconds": times,
        "summary": {name: stats(values) for name, values in times.items() if values},
        "goal_seconds": GOAL_SECONDS,
        "goal_met": goal,
        "goal_headline": headline,
    }


def wait_until_scraped(args: argparse.Namespace, prometheus: PrometheusProcess) -> dict[str, float]:
    """Wait for Prometheus to be ready and to have scraped every rank: how long each took, and the series
    of the run it holds (printed)."""
    ranks, url = args.ranks, prometheus.url
    started = time.perf_counter()
    prometheus.wait_ready()
    ready_s = time.perf_counter() - started

    def every_rank_seen() -> bool:
        if prometheus.process.poll() is not None:
            raise BenchError(
                f"Prometheus exited with {prometheus.process.returncode}: {prometheus.log_tail(3)}"
            )
        answer = promql.query(url, f'count(flare_rank_info{{run="{RUN}"}})')
        return bool(answer) and int(float(answer[0]["value"][1])) == ranks

    wait_for(
        every_rank_seen, max(120.0, 30 * args.scrape_interval), f"Prometheus to scrape all {ranks} ranks"
    )
    all_seen_s = time.perf_counter() - started
    answer = promql.query(url, f'count({{run="{RUN}"}})')
    series_total = int(float(answer[0]["value"][1])) if answer else 0
    print(
        f"prometheus: ready in {ready_s:.1f} s, flare_rank_info of all {ranks} ranks after "
        f"{all_seen_s:.1f} s (scraping every {args.scrape_interval:g} s); {series_total:,} series of the run"
    )
    return {"ready_seconds": ready_s, "all_seen_seconds": all_seen_s, "series": series_total}


def count_requests(args: argparse.Namespace, url: str, run: str, cli_args: list[str]) -> int:
    """The requests one `sources.from_prometheus` sends, checked against the queries it should send
    (and the run's discovery without --run); the command printed with them."""
    expected_queries = len(sources.PROMETHEUS_QUERIES) + (0 if args.pass_run else 1)
    queries, _ = count_queries(lambda: sources.from_prometheus(url, run, "5m", 5.0))
    if queries != expected_queries:
        raise BenchError(f"from_prometheus sent {queries} requests, expected {expected_queries}")
    discovery = (
        "--run given: no run discovery" if args.pass_run else "1 of them the run's discovery, an index read"
    )
    print(f"flare {' '.join(cli_args).replace(url, 'URL')}  ({queries} Prometheus requests, {discovery})")
    return queries


def time_in_process(
    args: argparse.Namespace, url: str, run: str, cli_args: list[str]
) -> dict[str, list[float]]:
    """`cli.main` in this process `--repeats` times, then its queries alone and its engine alone, each
    verdict checked: their times (printed)."""
    ranks, culprit = args.ranks, args.culprit
    in_process_times = []
    for index in range(args.repeats):
        elapsed, code, output = in_process(cli_args)
        check_verdict(code, output, ranks, culprit, f"in-process run {index + 1}")
        in_process_times.append(elapsed)
    print(_row("in-process", f"cli.main, {args.repeats} runs", in_process_times))
    query_times, snapshot = time_calls(lambda: sources.from_prometheus(url, run, "5m", 5.0), args.repeats)
    print(_row("  queries", "sources.from_prometheus alone", query_times))
    engine_times, verdicts = time_calls(lambda: diagnosis.diagnose(snapshot, HANG_SECONDS), args.repeats)
    if [(v.kind, v.ranks, v.group) for v in verdicts] != [("hang", (culprit,), WORLD)]:
        raise BenchError(f"engine alone: wrong verdicts {[(v.kind, v.ranks, v.group) for v in verdicts]}")
    print(_row("  engine", "diagnosis.diagnose alone", engine_times))
    return {"in_process": in_process_times, "queries_alone": query_times, "engine_alone": engine_times}


def time_commands(
    args: argparse.Namespace,
    prometheus: PrometheusProcess,
    cli_args: list[str],
    times: dict[str, list[float]],
) -> dict[str, float]:
    """The whole command `--subprocess-repeats` times, each followed by the interpreter's start-up alone,
    into `times`; how busy Prometheus and the simulated ranks' server kept the CPUs meanwhile (printed)."""
    whole, whole_cpu, startup = [], [], []
    window = (time.perf_counter(), time.process_time(), process_cpu(prometheus.process.pid))
    for index in range(args.subprocess_repeats):
        elapsed, code, output, cpu_seconds = command(
            ["-m", "flare_exporter.cli", *cli_args], SUBPROCESS_TIMEOUT_S
        )
        check_verdict(code, output, args.ranks, args.culprit, f"subprocess run {index + 1}")
        whole.append(elapsed)
        whole_cpu.append(cpu_seconds)
        elapsed, code, output, _ = command(["-c", "import flare_exporter.cli"], SUBPROCESS_TIMEOUT_S)
        if code != 0:
            raise BenchError(f"python -c 'import flare_exporter.cli' exited with {code}: {one_line(output)}")
        startup.append(elapsed)
    times.update(whole_command=whole, whole_command_cpu=whole_cpu, startup_alone=startup)
    background: dict[str, float] = {"load_average_1m": os.getloadavg()[0]}
    if whole:
        span = time.perf_counter() - window[0]
        background["server_cpus"] = (time.process_time() - window[1]) / span
        background["prometheus_cpus"] = (process_cpu(prometheus.process.pid) - window[2]) / span
        cpu = f"CPU time (user + sys): median {_seconds(statistics.median(whole_cpu))}"
        print(_row("whole command", f"python -m flare_exporter.cli, {len(whole)} runs", whole) + f"; {cpu}")
        print(_row("  start-up", "python -c 'import flare_exporter.cli'", startup))
        print(
            f"  busy meanwhile: Prometheus {background['prometheus_cpus']:.2f} CPUs, the simulated ranks' "
            f"server {background['server_cpus']:.2f} CPUs; load average {background['load_average_1m']:.2f} "
            f"on {os.cpu_count()} CPUs"
        )
    return background


def judge(ranks: int, times: dict[str, list[float]]) -> tuple[dict[str, bool], str]:
    """The goal, met or not, for the in-process runs and the whole command (the headline where it ran),
    printed."""
    in_process_times, whole = times["in_process"], times["whole_command"]
    goal = {"in_process": statistics.median(in_process_times) < GOAL_SECONDS}
    if whole:
        goal["whole_command"] = statistics.median(whole) < GOAL_SECONDS
    headline = "whole_command" if whole else "in_process"
    parts = [f"in-process median {_seconds(statistics.median(in_process_times))}"]
    if whole:
        parts.insert(0, f"whole command median {_seconds(statistics.median(whole))}")
    print(
        f"goal: attribution from Prometheus at {ranks} ranks < {GOAL_SECONDS:g} s of CLI time: "
        f"{'PASS' if goal[headline] else 'MISS'} ({', '.join(parts)})"
    )
    return goal, headline


if __name__ == "__main__":
    sys.exit(main())
