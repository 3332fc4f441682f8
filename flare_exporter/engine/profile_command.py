"""`flare profile`: ask ranks' exporters for a capture of a few steps, wait for it, print each rank's verdict.

    flare profile (--targets FILE|DIR | --prometheus URL) [--ranks 3,5] [--steps 3] [--run RUN]
                  [--wait 120] [--compare] [--json]

Each rank named (every rank found where --ranks is not given, up to MAX_RANKS) is asked over HTTP (POST
/profile?steps=N, with the ranks' TLS and basic auth where they have them); it captures N optimizer steps
from a step boundary on and reduces them on its node (rank/profiler.py). The command then reads each
rank's GET /profile until its capture ended or --wait passed. A rank started without `profile: on` has no
such endpoint: it refuses (404), as does a rank already capturing (409) or in its cooldown (429).
With --compare and two ranks, the ops or kernels whose time per step differs most between their captures.
With --on-alert HOST:PORT, an Alertmanager webhook receiver that asks paged ranks (profile_on_alert.py).

Exit codes: 0 every rank asked captured; 1 a capture failed on the rank; 2 a rank refused (or a usage
error); 3 no rank answered.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from ..policies import ProfilePolicy
from ..rank.profile_summary import TraceError, classify, compare
from . import promql, scrape
from .perf_command import add_source_arguments
from .prometheus_source import matcher, the_run
from .rank_auth import Client
from .records import RANK_INFO, SourceError, one_run
from .targets import read_targets

MAX_RANKS = 64  # asked at once: a capture costs each rank's training steps
POLL_SECONDS = 0.5
EXIT_CAPTURED, EXIT_FAILED, EXIT_REFUSED, EXIT_UNANSWERED = 0, 1, 2, 3
DONE = ("captured", "failed")


class ProfileError(RuntimeError):
    """The command cannot go on: the message is its one line, `code` its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def add_arguments(command: argparse.ArgumentParser) -> None:
    add_source_arguments(command)
    command.add_argument("--ranks", default="", help="the ranks to capture, e.g. 3,5 (default: every rank)")
    command.add_argument("--steps", type=int, default=3, help="optimizer steps per capture (default 3)")
    command.add_argument("--run", default="", help="the run (needed when several are seen)")
    command.add_argument("--json", action="store_true", help="print one JSON object for programs")
    command.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    command.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for the captures to end (default 120)"
    )
    command.add_argument(
        "--compare", action="store_true", help="two ranks: the ops whose time per step differs most"
    )
    command.add_argument(
        "--on-alert",
        default="",
        metavar="HOST:PORT",
        help="receive Alertmanager webhooks there: capture each paged rank and a healthy peer (runs until "
        "interrupted; profile_on_alert.py)",
    )
    command.add_argument(
        "--alerts",
        default="",
        help="with --on-alert: the alert names that ask for captures (default: slow ranks')",
    )
    command.add_argument(
        "--cooldown",
        type=float,
        default=3600.0,
        help="with --on-alert: seconds before the same rank is asked again (default 3600)",
    )


def wanted_ranks(text: str) -> set[int]:
    """--ranks `3,5`: the ranks; empty: every rank. ProfileError (usage) on anything else."""
    if not text.strip():
        return set()
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ProfileError(
            EXIT_REFUSED, f"flag --ranks: {text!r} is not a list of ranks such as 3,5"
        ) from None
    if any(rank < 0 for rank in ranks):
        raise ProfileError(EXIT_REFUSED, f"flag --ranks: {text!r} names a negative rank")
    return ranks


def endpoints(args: argparse.Namespace, connection: Any, client: Client) -> tuple[str, dict[int, str]]:
    """The run and each of its ranks' endpoint (host:port), from the ranks or from Prometheus."""
    if args.prometheus:
        now = time.time()
        run = args.run or the_run(connection, "5m", args.timeout, now)
        expr = f"max by (rank, instance) (last_over_time({RANK_INFO}{{{matcher(run)}}}[5m]))"
        found = promql.query(connection, expr, args.timeout, now)
        return run, {int(item["metric"]["rank"]): item["metric"].get("instance", "") for item in found}
    targets = [target.address for target in read_targets(args.targets)]
    results = scrape.scrape_all(targets, timeout=args.timeout, via=client, wanted=frozenset([RANK_INFO]))
    identities = {
        address: scrape.labels_of(samples, RANK_INFO)
        for address, samples in results.items()
        if isinstance(samples, list)
    }
    run = one_run(
        [labels.get("run", "") for labels in identities.values()], args.run, f"{len(targets)} targets"
    )
    return run, {
        int(labels["rank"]): address
        for address, labels in identities.items()
        if labels.get("run") == run and labels.get("rank", "").isdigit()
    }


def answer(args: argparse.Namespace, connection: Any, client: Client) -> tuple[int, dict[str, Any], str]:
    """Ask the ranks, wait for their captures: (exit code, JSON object, text)."""
    if not 1 <= args.steps <= 1000:
        raise ProfileError(EXIT_REFUSED, f"flag --steps: {args.steps} must be between 1 and 1000")
    asked = wanted_ranks(args.ranks)
    try:
        run, found = endpoints(args, connection, client)
    except (SourceError, scrape.ScrapeError, promql.PrometheusError) as error:
        raise ProfileError(EXIT_UNANSWERED, f"flare profile: {error}") from None
    ranks = sorted(asked or found)[:MAX_RANKS]
    missing = [rank for rank in ranks if rank not in found]
    if not found or len(missing) == len(ranks):
        raise ProfileError(EXIT_UNANSWERED, f"flare profile: no rank of run {run!r} answered")
    rows = {rank: {"rank": rank, "state": "unreachable"} for rank in missing}
    armed = {}
    for rank in (rank for rank in ranks if rank in found):
        status, reply = call(client, found[rank], "POST", f"/profile?steps={args.steps}", args.timeout)
        if status == 202:
            armed[rank] = int(reply["capture"]["id"])
        else:
            rows[rank] = {"rank": rank, "state": "refused", "status": status, "error": why(status, reply)}
    rows.update(_await(client, found, armed, args))
    judged_beside_peers(rows)
    result: dict[str, Any] = {"run": run, "steps": args.steps, "ranks": [rows[rank] for rank in sorted(rows)]}
    if args.compare:
        result["compare"] = _compared(result["ranks"])
    return _exit_code(result["ranks"]), result, _text(result)


def judged_beside_peers(rows: Mapping[int, dict[str, Any]]) -> None:
    """Each captured rank's class judged again beside the other ranks' captures of the same steps (a rank
    classes its capture alone: the time it waited in a collective for a slower peer looks like
    communication to it). Where fewer than two captured, the ranks' own verdicts stand."""
    captured = {rank: row for rank, row in rows.items() if row.get("state") == "captured"}
    if len(captured) < 2:
        return
    for rank, row in captured.items():
        peers = [other["summary"] for other_rank, other in captured.items() if other_rank != rank]
        try:
            row["bottleneck"], row["evidence"] = classify(row["summary"], ProfilePolicy(), peers)
        except TraceError as error:  # a summary this flare cannot read: the rank's verdict stands
            row["evidence"] = {**(row.get("evidence") or {}), "not_judged_beside_peers": str(error)}


def _compared(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The two ranks' captures side by side (profile_summary.compare); ProfileError unless two captured."""
    captured = [row for row in rows if row["state"] == "captured"]
    if len(rows) != 2 or len(captured) != 2:
        raise ProfileError(EXIT_REFUSED, "flag --compare: name two ranks (--ranks A,B) that both capture")
    return compare(captured[0]["summary"], captured[1]["summary"])


def _await(
    client: Client, found: Mapping[int, str], armed: Mapping[int, int], args: argparse.Namespace
) -> dict:
    """Each armed rank's capture once it ended, or as it stands when --wait passed."""
    rows: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + args.wait
    waiting = dict(armed)
    while waiting:
        for rank, capture in list(waiting.items()):
            status, reply = call(client, found[rank], "GET", "/profile", args.timeout)
            last = reply.get("last") if status == 200 else None
            if isinstance(last, dict) and last.get("id") == capture and last.get("state") in DONE:
                rows[rank] = _row(rank, last)
                del waiting[rank]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(POLL_SECONDS)
    for rank in waiting:
        rows[rank] = {"rank": rank, "state": "timed out", "error": f"no capture ended within {args.wait:g} s"}
    return rows


def _row(rank: int, capture: Mapping[str, Any]) -> dict[str, Any]:
    row = {
        "rank": rank,
        "state": capture.get("state"),
        "steps": capture.get("steps"),
        "bottleneck": capture.get("bottleneck"),
        "evidence": capture.get("evidence"),
        "summary_bytes": capture.get("summary_bytes"),
        "summary": capture.get("summary"),
        "trace_path": capture.get("trace_path") or None,
    }
    if capture.get("error"):
        row["error"] = capture["error"]
    return row


def call(client: Client, address: str, method: str, path: str, timeout: float) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of one request to a rank; status 0 where it did not answer."""
    request = urllib.request.Request(
        f"{client.scheme}://{address}{path}",
        method=method,
        headers=client.headers(),
        data=b"" if method == "POST" else None,
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=client.ssl_context) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _json(error.read())
    except (OSError, ValueError) as error:
        return 0, {"error": str(error)}


def _json(body: bytes) -> dict[str, Any]:
    try:
        found = json.loads(body[: 1 << 20])
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def why(status: int, reply: Mapping[str, Any]) -> str:
    if status == 404:
        return "profiling is off on this rank (start it with profile: on, FLARE_PROFILE=1)"
    if status == 0:
        return f"no answer: {reply.get('error', '')}"
    return str(reply.get("error") or f"HTTP {status}")


def _exit_code(rows: list[dict[str, Any]]) -> int:
    states = {row["state"] for row in rows}
    if states == {"captured"}:
        return EXIT_CAPTURED
    if "refused" in states:
        return EXIT_REFUSED
    if states <= {"unreachable", "timed out"}:
        return EXIT_UNANSWERED
    return EXIT_FAILED


def _text(result: Mapping[str, Any]) -> str:
    lines = [f"run {result['run']}: captures of {result['steps']} steps"]
    for row in result["ranks"]:
        if row["state"] == "captured":
            lines.append(f"rank {row['rank']}: {row['bottleneck']} ({row['summary_bytes']} bytes of summary)")
            for key, value in (row.get("evidence") or {}).items():
                lines.append(f"  {key}: {value}")
        else:
            lines.append(f"rank {row['rank']}: {row['state']}: {row.get('error', '')}")
    for row in result.get("compare", []):
        seconds = (
            f"{value * 1000:.3f}ms" if value is not None else "-"
            for value in (row["a_seconds"], row["b_seconds"])
        )
        lines.append(f"  {row['name']}: {' vs '.join(seconds)} ({row['difference_seconds'] * 1000:+.3f}ms)")
    return "\n".join(lines) + "\n"
