"""The `flare` command: look at a running job's ranks.

    flare ranks --targets DIR|FILE [--json]    one line per rank, scraped directly from its endpoint

Exit codes: 0 every rank answered; 1 some rank did not answer; 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import scrape
from .targets import TargetsError, read_targets

EXIT_OK, EXIT_ANOMALY, EXIT_USAGE = 0, 1, 2


def rank_rows(
    results: dict[str, list[scrape.Sample] | scrape.ScrapeError], now: float
) -> list[dict[str, Any]]:
    """One row per target: identity, steps, heartbeat age and world-group sequence numbers, or its error."""
    rows: list[dict[str, Any]] = []
    for target, samples in results.items():
        if isinstance(samples, scrape.ScrapeError):
            rows.append({"target": target, "error": str(samples)})
            continue
        info = scrape.labels_of(samples, "flare_rank_info")
        heartbeat = scrape.value(samples, "flare_heartbeat_timestamp_seconds")
        rows.append(
            {
                "target": target,
                "rank": int(info["rank"]) if "rank" in info else None,
                "run": info.get("run"),
                "host": info.get("host"),
                "steps": scrape.value(samples, "flare_steps_total"),
                "heartbeat_age_seconds": round(now - heartbeat, 3) if heartbeat else None,
                "last_issued_seq": scrape.value(samples, "flare_collective_last_issued_seq", group="world"),
                "last_completed_seq": scrape.value(
                    samples, "flare_collective_last_completed_seq", group="world"
                ),
            }
        )
    return sorted(rows, key=lambda row: (row.get("rank") is None, row.get("rank") or 0, row["target"]))


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'rank':>5} {'host':<16} {'steps':>7} {'heartbeat':>10} {'issued':>7} {'completed':>9}  target"
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"{'?':>5} {'-':<16} {'-':>7} {'-':>10} {'-':>7} {'-':>9}  {row['error']}")
            continue
        age = "-" if row["heartbeat_age_seconds"] is None else f"{row['heartbeat_age_seconds']:.1f}s ago"
        lines.append(
            f"{row['rank']:>5} {row['host'] or '-':<16} {_int(row['steps']):>7} {age:>10} "
            f"{_int(row['last_issued_seq']):>7} {_int(row['last_completed_seq']):>9}  {row['target']}"
        )
    return "\n".join(lines)


def _int(value: float | None) -> str:
    return "-" if value is None else str(int(value))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flare", description="Look at a running job's ranks.")
    commands = parser.add_subparsers(dest="command", required=True)
    ranks = commands.add_parser("ranks", help="one line per rank, scraped directly from its endpoint")
    ranks.add_argument(
        "--targets",
        required=True,
        help="file of host:port lines, a file_sd JSON file, or a directory of them",
    )
    ranks.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape (default 5)")
    ranks.add_argument("--json", action="store_true", help="print JSON for programs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_USAGE if exit.code else EXIT_OK
    try:
        targets = read_targets(args.targets)
    except TargetsError as error:
        print(f"flare: {error}", file=sys.stderr)
        return EXIT_USAGE
    rows = rank_rows(scrape.scrape_all(targets, timeout=args.timeout), time.time())
    if args.json:
        print(json.dumps({"ranks": rows, "ranks_seen": sum("error" not in row for row in rows)}, indent=2))
    else:
        print(format_rows(rows))
    return EXIT_ANOMALY if any("error" in row for row in rows) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
