"""`flare perf` and the `seconds lost` column of `flare stragglers`: engine/perf.py's view, from a source.

    flare perf (--prometheus URL | --targets FILE|DIR) [--run RUN] [--window 5m] [--timeout 5] [--json]

From Prometheus the phases are their increase over --window; from the ranks' endpoints, their totals since
each rank started.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from . import perf
from .promql import PrometheusError
from .records import SourceError
from .samples import ScrapeError
from .targets import TargetsError, read_targets


def add_source_arguments(command: argparse.ArgumentParser) -> None:
    """--prometheus or --targets, one of them: where the ranks are (also `flare profile`'s)."""
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="Prometheus base URL, e.g. http://localhost:9090")
    source.add_argument(
        "--targets",
        metavar="FILE|DIR",
        help="scrape the ranks directly: host:port lines, a file_sd JSON file, or a directory of them",
    )


def add_arguments(command: argparse.ArgumentParser) -> None:
    add_source_arguments(command)
    command.add_argument("--run", default="", help="the run to show (needed when several are seen)")
    command.add_argument("--json", action="store_true", help="print one JSON object for programs")
    command.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape or query (default 5)")
    command.add_argument(
        "--window", default="5m", help="Prometheus: the span whose steps are broken down (default 5m)"
    )


def records(args: argparse.Namespace, connection: Any, client: Any) -> tuple[str, dict[int, perf.PerfRank]]:
    """The run and its ranks' PerfRanks from the source the flags name."""
    if args.prometheus:
        return perf.from_prometheus(connection, args.run, args.window, args.timeout, time.time())
    return perf.from_targets(read_targets(args.targets), args.run, args.timeout, client)


def answer(args: argparse.Namespace, connection: Any, client: Any) -> tuple[dict[str, Any], str]:
    """`flare perf`'s JSON object and text."""
    run, found = records(args, connection, client)
    source = f"prometheus {args.prometheus}" if args.prometheus else f"targets {args.targets}"
    result, lines = perf.perf_view(found)
    result = {"run": run, "source": source, "ranks_seen": len(found), **result}
    header = f"run {run}: {len(found)} ranks' step breakdown ({source})"
    return result, "\n".join([header, *lines]) + "\n"


def stragglers_with_losses(
    rows: list[dict[str, Any]], fetch: Callable[[], dict[int, perf.PerfRank]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """`flare stragglers`' rows with each rank's seconds lost (the badput ledger), most first, and its
    lines; the rows as they were, and no column, where the ranks export no step breakdown."""
    try:
        found = fetch()
    except (SourceError, PrometheusError, ScrapeError, TargetsError):  # the scores stand without it
        found = {}
    lost = perf.seconds_lost(found) if found else {}
    if lost:
        rows = sorted(
            ({**row, "seconds_lost": round(lost.get(row["rank"], 0.0), 6)} for row in rows),
            key=lambda row: (-row["seconds_lost"], row["rank"]),
        )
    lines = [f"{'rank':>5} {'step':>10} {'wait/step':>10} {'score':>7}" + (f" {'lost':>10}" if lost else "")]
    for row in rows:
        line = (
            f"{row['rank']:>5} {row['step_seconds'] * 1000:>8.2f}ms "
            f"{row['wait_seconds_per_step'] * 1000:>8.2f}ms {row['score']:>7.1f}"
        )
        lines.append(line + (f" {row['seconds_lost']:>9.2f}s" if lost else ""))
    if not rows:
        lines.append("(no step and collective timings yet)")
    return rows, lines
