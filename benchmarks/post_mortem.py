"""Post-mortem time: `flare diagnose --prometheus` naming the rank that ended a dead run of 1,024 ranks.

    python benchmarks/post_mortem.py [--ranks 1024] [--culprit 777] [--repeats 5] [--scrape-interval 2]
                                     [--healthy-scrapes 3] [--last-scrapes 1] [--json OUT] [--keep]

A virtual cluster (flare_exporter.local.testing.virtual_cluster) of `--ranks` ranks, each page rendered by
flare's collectors, served on a loopback port per rank and scraped by a real Prometheus. It trains (healthy
pages, `--healthy-scrapes` scrapes a rank); it dies (every page swapped for the rank's last words: rank
`--culprit` raised OutOfMemoryError a second before the others, the even ranks follow with RuntimeError, the
odd ones get their launcher's SIGTERM; `--last-scrapes` scrapes); it is gone (every connection refused,
until Prometheus sees every target down). Each step waits on Prometheus's API, not on a clock.

Then `flare diagnose --prometheus URL --run RUN --json` runs `--repeats` times in this process (wall and CPU,
its parts: the live round that finds no rank up, the history round, the rules and report; every request to
Prometheus) and as many times as a command (start-up included), in turns; Prometheus's CPU per diagnosis
from /proc. Every answer must be the one verdict rank_down of [culprit], cause out_of_memory. Goal: the
command's median < 1 s at 1,024 ranks.

Exit status: 0 when every verdict was right (whatever the times), 1 for a wrong verdict or a failure, 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prometheus_client.utils import floatToGoString

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli_runs import (  # noqa: E402  (benchmarks/)
    BenchError,
    command,
    in_process,
    one_line,
    process_cpu,
    prometheus_version,
    revision,
    seconds_text,
    stats,
    verdicts_of,
)

from flare_exporter.engine import cli, history_source, promql, report
from flare_exporter.local.prometheus import PrometheusProcess, find_binary, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.rank.last_word import RaisedException, Termination

RUN = "bench-post-mortem"
GOAL_SECONDS = 1.0
COMMAND_TIMEOUT_S = 120.0
CULPRIT_TYPE, CULPRIT_CAUSE = "OutOfMemoryError", "out_of_memory"
FOLLOWER_TYPE, FOLLOWER_CAUSE = "RuntimeError", "communication"
FOLLOWERS_AFTER_SECONDS = 1.0  # the others raise or are stopped this long after the culprit raised
# The pages are rendered up front with these times in place of the deaths' (one text each in a page), and
# dated when the run dies (dated), as virtual_cluster does a hang's time.
CULPRIT_SENTINEL, FOLLOWER_SENTINEL = 1111111111.5, 1222222222.5
SENTINEL_TEXTS = tuple(floatToGoString(value).encode() for value in (CULPRIT_SENTINEL, FOLLOWER_SENTINEL))
SLOWEST_REQUESTS = 4


# ---------------------------------------------------------------------------------------------------------
# the run: healthy pages, then its ranks' last words


def last_words(rank: int, culprit: int) -> tuple[RaisedException | None, Termination | None]:
    """How rank `rank` ends (sentinel times): the culprit's own exception, a follower's, or the launcher's
    SIGTERM."""
    if rank == culprit:
        return RaisedException(CULPRIT_TYPE, CULPRIT_CAUSE, CULPRIT_SENTINEL), None
    if rank % 2 == 0:
        return RaisedException(FOLLOWER_TYPE, FOLLOWER_CAUSE, FOLLOWER_SENTINEL), None
    return None, Termination("SIGTERM", "launcher", FOLLOWER_SENTINEL)


def render_pages(ranks: int, culprit: int) -> tuple[list[bytes], list[bytes]]:
    """Every rank's healthy page, and its last words' (sentinel times): each rank's state built once."""
    healthy, dying = [], []
    perf_now = time.perf_counter()
    for rank in range(ranks):
        state = vc.rank_state(rank, ranks, RUN, perf_now)
        healthy.append(vc.render(state))
        state.exception, state.terminated = last_words(rank, culprit)
        page = vc.render(state)
        if not any(text in page for text in SENTINEL_TEXTS):
            raise BenchError(f"rank {rank}: its death's time is not in its page")
        dying.append(page)
    return healthy, dying


def dated(pages: list[bytes], culprit_raised_at: float) -> list[bytes]:
    """`pages` from render_pages with the culprit's exception at `culprit_raised_at` and the others' deaths
    FOLLOWERS_AFTER_SECONDS later."""
    culprit, followers = (
        floatToGoString(at).encode()
        for at in (culprit_raised_at, culprit_raised_at + FOLLOWERS_AFTER_SECONDS)
    )
    return [page.replace(SENTINEL_TEXTS[0], culprit).replace(SENTINEL_TEXTS[1], followers) for page in pages]


# ---------------------------------------------------------------------------------------------------------
# waiting on Prometheus


def counted(url: str, expr: str) -> int:
    """The value of a `count(...)` query, 0 where it has none."""
    answer = promql.query(url, expr, 30)
    return int(float(answer[0]["value"][1])) if answer else 0


def await_count(
    args: argparse.Namespace, prometheus: PrometheusProcess, exprs: tuple[str, ...], wanted: int, what: str
) -> float:
    """Wait until the counts of `exprs` add up to `wanted`; the seconds it took."""
    started = time.perf_counter()

    def reached() -> bool:
        if prometheus.process.poll() is not None:
            raise BenchError(
                f"Prometheus exited with {prometheus.process.returncode}: {prometheus.log_tail(3)}"
            )
        return sum(counted(prometheus.url, expr) for expr in exprs) == wanted

    wait_for(reached, max(120.0, 30 * args.scrape_interval), what)
    return time.perf_counter() - started


def train_then_die(
    args: argparse.Namespace, server: vc.ClusterServer, prometheus: PrometheusProcess, dying: list[bytes]
) -> dict[str, float]:
    """The run's life as Prometheus sees it: trained, died, gone (see the module's doc); how long each
    took (printed)."""
    ranks, selector = args.ranks, f'{{run="{RUN}"}}'
    started = time.perf_counter()
    prometheus.wait_ready()
    phases = {"ready": time.perf_counter() - started}
    scraped = f"count(count_over_time(flare_rank_info{selector}[1h]) >= {args.healthy_scrapes})"
    phases["trained"] = await_count(
        args, prometheus, (scraped,), ranks, f"{args.healthy_scrapes} scrapes of all {ranks} ranks"
    )
    server.set_pages(dated(dying, time.time() - FOLLOWERS_AFTER_SECONDS))
    words = tuple(
        f"count(count_over_time({name}{selector}[1h]) >= {args.last_scrapes})"
        for name in ("flare_rank_exception_info", history_source.TERMINATED)
    )
    phases["last_words_scraped"] = await_count(
        args, prometheus, words, ranks, f"{args.last_scrapes} scrapes of every rank's last words"
    )
    server.close()
    phases["gone"] = await_count(
        args, prometheus, (f"count(up{selector} == 0)",), ranks, f"all {ranks} targets down"
    )
    phases["stale"] = await_count(
        args, prometheus, (f"count(flare_rank_info{selector})",), 0, "the run's series to go stale"
    )
    print(
        f"run {RUN}: trained {phases['trained']:.1f} s ({args.healthy_scrapes} scrapes a rank, every "
        f"{args.scrape_interval:g} s), last words scraped in {phases['last_words_scraped']:.1f} s, "
        f"every target down {phases['gone']:.1f} s later (Prometheus ready in {phases['ready']:.1f} s)"
    )
    return phases


# ---------------------------------------------------------------------------------------------------------
# timing and checking


def check_verdict(code: int, output: str, args: argparse.Namespace, where: str) -> dict[str, Any]:
    """The CLI's JSON must be the post-mortem's one verdict: rank_down, ranks [culprit], the culprit's
    cause; that verdict."""
    result, _ = verdicts_of(code, output, where)
    verdicts = result.get("verdicts", [])
    got = [(v.get("kind"), v.get("ranks"), v.get("cause")) for v in verdicts]
    if (
        code != cli.EXIT_ANOMALY
        or result.get("post_mortem") is not True
        or result.get("world_size") != args.ranks
        or got != [("rank_down", [args.culprit], CULPRIT_CAUSE)]
    ):
        said = "; ".join(f"{kind} {ranks} ({cause})" for kind, ranks, cause in got) or "none"
        raise BenchError(
            f"{where}: exit code {code}, post_mortem {result.get('post_mortem')}, world size "
            f"{result.get('world_size')}, verdicts: {said} (expected rank_down [{args.culprit}] "
            f"({CULPRIT_CAUSE}) of {args.ranks} ranks)"
        )
    return dict(verdicts[0])


# What the in-process runs time of themselves: (part, module, function), each function wrapped while the
# CLI runs (it is called through its module's globals).
PARTS = (
    ("live round", cli, "_snapshot"),
    ("history round", history_source, "dead_run_from_prometheus"),
    ("last words", history_source, "dead_run"),
    ("rules and report", report, "incident_report"),
)
REQUESTS = ("query", "label_values")  # of promql: every request to Prometheus


@contextlib.contextmanager
def timed_parts() -> Iterator[tuple[dict[str, float], list[tuple[str, float]]]]:
    """While it lasts, the seconds of each of PARTS and of each request to Prometheus (its expression or
    label, and seconds), recorded into what it yields."""
    seconds = dict.fromkeys((part for part, _, _ in PARTS), 0.0)
    requests: list[tuple[str, float]] = []

    def add_part(part: str) -> Callable[[tuple[Any, ...], float], None]:
        return lambda _, elapsed: seconds.__setitem__(part, seconds[part] + elapsed)

    wrapped = [(module, name, add_part(part)) for part, module, name in PARTS]
    wrapped += [
        (promql, name, lambda call, elapsed: requests.append((call[1], elapsed))) for name in REQUESTS
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in wrapped]
    for module, name, record in wrapped:
        setattr(module, name, _timed(getattr(module, name), record))
    try:
        yield seconds, requests
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _timed(
    function: Callable[..., Any], record: Callable[[tuple[Any, ...], float], None]
) -> Callable[..., Any]:
    def timed(*call: Any, **keywords: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*call, **keywords)
        finally:
            record(call, time.perf_counter() - started)

    return timed


def diagnose_in_process(
    args: argparse.Namespace, cli_args: list[str], runs: dict[str, Any], where: str
) -> None:
    """`cli.main` once, its verdict checked: its wall and CPU seconds, parts and requests into `runs`."""
    with timed_parts() as (seconds, asked):
        cpu_started = time.process_time()
        elapsed, code, output = in_process(cli_args)
        cpu = time.process_time() - cpu_started
    runs["verdict"] = check_verdict(code, output, args, where)
    runs["wall"].append(elapsed)
    runs["cpu"].append(cpu)
    seconds["rest"] = elapsed - seconds["live round"] - seconds["history round"] - seconds["rules and report"]
    for part, value in seconds.items():
        runs["parts"][part].append(value)
    for expr, value in asked:
        runs["requests"][expr].append(value)


def diagnose_command(args: argparse.Namespace, cli_args: list[str], runs: dict[str, Any], where: str) -> None:
    """`python -m flare_exporter.cli` once, its verdict checked: its wall and CPU seconds into
    `runs`."""
    elapsed, code, output, cpu = command(["-m", "flare_exporter.cli", *cli_args], COMMAND_TIMEOUT_S)
    check_verdict(code, output, args, where)
    runs["wall"].append(elapsed)
    runs["cpu"].append(cpu)


MODES = {"in_process": diagnose_in_process, "command": diagnose_command}


def time_both(args: argparse.Namespace, cli_args: list[str], pid: int) -> dict[str, dict[str, Any]]:
    """flare in each of MODES in turns, `--repeats` times each (so that both see the same background load),
    each verdict checked: each mode's figures, with Prometheus's CPU seconds meanwhile."""
    runs: dict[str, dict[str, Any]] = {
        mode: dict(wall=[], cpu=[], prometheus_cpu=[], parts=defaultdict(list), requests=defaultdict(list))
        for mode in MODES
    }
    for index in range(args.repeats):
        for mode, diagnose in MODES.items():
            prometheus_cpu = process_cpu(pid)
            diagnose(args, cli_args, runs[mode], f"{mode.replace('_', '-')} run {index + 1}")
            runs[mode]["prometheus_cpu"].append(process_cpu(pid) - prometheus_cpu)
    return {mode: summarized(mode_runs, args.repeats) for mode, mode_runs in runs.items()}


def summarized(runs: dict[str, Any], repeats: int) -> dict[str, Any]:
    """A mode's figures: its wall and CPU seconds, Prometheus's CPU seconds a run (median); where it timed
    them, its parts and requests (medians) and its verdict."""
    figures = {key: runs[key] for key in ("wall", "cpu")}
    figures["prometheus_cpu_per_run"] = statistics.median(runs["prometheus_cpu"])
    if runs["parts"]:
        figures["parts"] = {part: statistics.median(values) for part, values in runs["parts"].items()}
        figures["requests"] = {expr: statistics.median(values) for expr, values in runs["requests"].items()}
        figures["requests_per_run"] = sum(map(len, runs["requests"].values())) / repeats
        figures["verdict"] = runs["verdict"]
    return figures


# ---------------------------------------------------------------------------------------------------------
# the figures


def short(expr: str) -> str:
    """A request's expression, the run's selector left out, at most 80 characters."""
    return one_line(expr.replace(f'{{run="{RUN}"}}', ""), 80)


def print_table(in_process_runs: dict[str, Any], commands: dict[str, Any]) -> None:
    """Median, min and max of wall and CPU seconds of both modes; where the in-process time goes."""
    print(
        f"  {'':<38} {'wall: median':>12} {'min':>9} {'max':>9}   {'CPU: median':>11} {'min':>9} {'max':>9}"
    )
    for mode, runs in (
        ("in-process (cli.main)", in_process_runs),
        ("command (python -m flare_exporter.cli)", commands),
    ):
        wall, cpu = stats(runs["wall"]), stats(runs["cpu"])
        figures = [seconds_text(s[key]) for s in (wall, cpu) for key in ("median", "min", "max")]
        print(
            f"  {mode:<38} {figures[0]:>12} {figures[1]:>9} {figures[2]:>9}   "
            f"{figures[3]:>11} {figures[4]:>9} {figures[5]:>9}"
        )
    parts = {part: seconds_text(value) for part, value in in_process_runs["parts"].items()}
    print(
        f"  in-process, medians: live round (no rank up) {parts['live round']}, history round "
        f"{parts['history round']} (last words from its answers {parts['last words']}), rules and report "
        f"{parts['rules and report']}, the rest (arguments, JSON out) {parts['rest']}"
    )
    slowest = sorted(in_process_runs["requests"].items(), key=lambda item: -item[1])[:SLOWEST_REQUESTS]
    print(
        f"  {in_process_runs['requests_per_run']:.0f} requests to Prometheus a run, at most 8 at once; "
        "slowest (median): " + "; ".join(f"{seconds_text(value)} {short(expr)}" for expr, value in slowest)
    )
    inside, whole = (seconds_text(runs["prometheus_cpu_per_run"]) for runs in (in_process_runs, commands))
    print(f"  Prometheus's CPU per diagnosis (median): {inside} (in-process), {whole} (command)")


def judge(ranks: int, in_process_runs: dict[str, Any], commands: dict[str, Any]) -> bool:
    """The goal on the command's median (the in-process median alongside), printed."""
    whole, inside = statistics.median(commands["wall"]), statistics.median(in_process_runs["wall"])
    met = whole < GOAL_SECONDS
    print(
        f"goal: < {GOAL_SECONDS:g} s of CLI time at {ranks:,} ranks: {'met' if met else 'missed'} "
        f"(command median {seconds_text(whole)}, in-process {seconds_text(inside)})"
    )
    return met


# ---------------------------------------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"post_mortem: error: {message}", file=sys.stderr)
        sys.exit(2)


OPTIONS = (  # flag, type, default, metavar, help
    ("--ranks", int, 1024, "N", "ranks of the run (default 1024)"),
    ("--culprit", int, None, "RANK", "the rank that raises first (default 777; ranks*777//1024 below)"),
    ("--repeats", int, 5, "N", "runs of flare in each mode (default 5)"),
    ("--scrape-interval", float, 2.0, "S", "Prometheus scrape interval (default 2)"),
    ("--healthy-scrapes", int, 3, "N", "scrapes of each healthy rank (default 3)"),
    ("--last-scrapes", int, 1, "N", "scrapes of each rank's last words (default 1)"),
    ("--json", str, "", "OUT", "also write the figures as JSON to OUT"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, default, metavar, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (Prometheus data)")
    args = parser.parse_args(argv)
    if args.culprit is None:  # 777 at 1,024 ranks; the same relative position in a smaller cluster
        args.culprit = 777 if args.ranks > 777 else args.ranks * 777 // 1024
    problems = {
        f"--ranks {args.ranks}: at least 2 (a culprit and a follower)": args.ranks < 2,
        f"--culprit {args.culprit}: a rank, 0 to {args.ranks - 1}": args.culprit not in range(args.ranks),
        "--repeats must be at least 1": args.repeats < 1,
        "--scrape-interval: between 0.1 and 60 seconds": not 0.1 <= args.scrape_interval <= 60,
        "--healthy-scrapes and --last-scrapes: at least 1": min(args.healthy_scrapes, args.last_scrapes) < 1,
        f"--json {args.json}: no such directory": args.json and not Path(args.json).resolve().parent.is_dir(),
        "prometheus is not installed (apt-get install prometheus)": find_binary() is None,
    }
    for message, problem in problems.items():
        if problem:
            parser.error(message)
    return args


FAILURES = (BenchError, promql.PrometheusError, TimeoutError, RuntimeError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks stop Prometheus
    tmp = Path(tempfile.mkdtemp(prefix="flare-post-mortem-"))
    try:
        return run(args, tmp)
    except KeyboardInterrupt:
        print("post_mortem: interrupted", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> int:
    """The benchmark in `tmp`, its figures written where --json says: 0, or 1 with one line on what failed."""
    try:
        results = benchmark(args, tmp)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
            print(f"results written to {args.json}")
    except FAILURES as error:
        print(f"post_mortem: error: {one_line(str(error), 600)}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
    return 0


def benchmark(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The run rendered, trained, killed and gone under a real Prometheus; flare timed on it: the figures."""
    machine = dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version())
    machine["prometheus"] = prometheus_version()
    config = {key: getattr(args, key) for key in ("ranks", "culprit", "repeats", "scrape_interval")}
    config |= {"healthy_scrapes": args.healthy_scrapes, "last_scrapes": args.last_scrapes, "run": RUN}
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "commit": revision(), "machine": machine, "config": config}
    machine = results["machine"]
    print(
        f"flare post-mortem benchmark  {results['date']}  {results['commit']}  {machine['cpus']} CPUs  "
        f"python {machine['python']}  prometheus {machine['prometheus']}"
    )
    started = time.perf_counter()
    healthy, dying = render_pages(args.ranks, args.culprit)
    results["render_seconds"] = time.perf_counter() - started
    print(
        f"cluster: {args.ranks} ranks, {sum(map(len, healthy)) / args.ranks / 1024:.1f} KiB a healthy page, "
        f"rendered with their last words in {results['render_seconds']:.1f} s; rank {args.culprit} raises "
        f"{CULPRIT_TYPE}"
    )
    with vc.ClusterServer(healthy) as server:
        vc.write_file_sd(str(tmp / "file_sd"), RUN, server.targets(), args.ranks)
        prometheus = PrometheusProcess(
            str(tmp / "prometheus"), str(tmp / "file_sd"), f"{args.scrape_interval:g}s"
        )
        try:
            results["phases_seconds"] = train_then_die(args, server, prometheus, dying)
            results.update(measure(args, prometheus))
        finally:
            prometheus.stop()
    return results


def measure(args: argparse.Namespace, prometheus: PrometheusProcess) -> dict[str, Any]:
    """flare diagnose on the dead run, in-process and as a command, checked and timed: the figures."""
    cli_args = ["diagnose", "--prometheus", prometheus.url, "--run", RUN, "--json"]
    pid = prometheus.process.pid
    figures = time_both(args, cli_args, pid)
    in_process_runs, commands = figures["in_process"], figures["command"]
    verdict = in_process_runs.pop("verdict")
    print(f"flare {' '.join(cli_args).replace(prometheus.url, 'URL')}, {args.repeats} runs in each mode:")
    print(
        f"  verdict, every run: {verdict['kind'].upper()} rank {', '.join(map(str, verdict['ranks']))}, "
        f"cause {verdict['cause']}"
    )
    print_table(in_process_runs, commands)
    met = judge(args.ranks, in_process_runs, commands)
    summary = {
        f"{mode}_{kind}": stats(runs[kind]) for mode, runs in figures.items() for kind in ("wall", "cpu")
    }
    verdict = {key: verdict[key] for key in ("kind", "ranks", "cause", "summary")}
    out = {"verdict": verdict, "in_process": in_process_runs, "command": commands, "summary": summary}
    return out | {"goal_seconds": GOAL_SECONDS, "goal_met": met}


if __name__ == "__main__":
    sys.exit(main())
