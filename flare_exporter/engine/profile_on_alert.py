"""`flare profile --on-alert HOST:PORT`: an Alertmanager webhook receiver that asks a paged rank for a
capture, and a healthy peer for one beside it (CLI engine; runs until interrupted).

A person starts it, and points an Alertmanager receiver at it (docs/profiler.md):

    receivers:
      - name: flare-profile
        webhook_configs: [{url: "http://HOST:PORT/", send_resolved: false}]

Each firing alert of ALERTS (--alerts chooses others) that names a run and a rank arms, once per (run,
rank) per --cooldown, a capture of --steps steps on that rank (POST /profile?trigger=alert) and one on the
next rank of the run that no alert of the same notification names (trigger=peer&of=RANK): the same
endpoints `flare profile` asks, found the same way (--targets or --prometheus). A page for a hung or dead
rank asks nothing: a rank that takes no step captures nothing. The captures run on the ranks; `flare
profile --ranks A,B --compare` or each rank's GET /profile reads them. One line per rank asked, on stdout
(a JSON object per line with --json).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

from . import profile_command
from .rank_auth import Client

# Alerts for a rank that is slow but still steps: what a capture of a few steps can explain.
ALERTS = (
    "FlareRankStraggler",
    "FlareIssueLatencyShifted",
    "FlareCanaryInFlightFailed",
    "FlareCanaryDrift",
    "FlareGPUThrottled",
    "FlareGPUClockBelowMax",
)
MAX_BODY_BYTES = 4 << 20  # Alertmanager groups alerts: a notification of many is still far below this


def alerts_wanted(text: str) -> frozenset[str]:
    """--alerts `A,B`: those alert names; empty: ALERTS."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    return names or frozenset(ALERTS)


def paged_ranks(payload: Any, alerts: frozenset[str]) -> dict[str, list[int]]:
    """run -> the ranks that firing alerts of `alerts` name in one webhook notification (version 4)."""
    found: dict[str, set[int]] = {}
    alerts_found = payload.get("alerts") if isinstance(payload, dict) else None
    for alert in alerts_found if isinstance(alerts_found, list) else []:
        labels = alert.get("labels") if isinstance(alert, dict) else None
        if not isinstance(labels, dict) or alert.get("status", "firing") != "firing":
            continue
        rank, run = str(labels.get("rank", "")), labels.get("run")
        if labels.get("alertname") in alerts and rank.isdigit() and isinstance(run, str) and run:
            found.setdefault(run[:256], set()).add(int(rank))
    return {run: sorted(ranks) for run, ranks in found.items()}


def healthy_peer(rank: int, ranks: list[int], paged: list[int]) -> int | None:
    """The next rank of `ranks` after `rank` (wrapping) that no alert names; None if there is none."""
    ordered = sorted(ranks)
    later = [r for r in ordered if r > rank] + [r for r in ordered if r < rank]
    return next((r for r in later if r not in paged), None)


class AlertCaptures:
    """Arms the captures a notification asks for, each (run, rank) once per `cooldown` seconds."""

    def __init__(
        self,
        args: argparse.Namespace,
        connection: Any,
        client: Client,
        out: TextIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.connection = connection
        self.client = client
        self.out = out
        self.clock = clock
        self.alerts = alerts_wanted(args.alerts)
        self.asked_at: dict[tuple[str, int], float] = {}
        self.lock = threading.Lock()  # notifications may arrive together: one arms at a time

    def on_notification(self, payload: Any) -> list[dict[str, Any]]:
        """Arm what `payload` asks for; the rows printed, one per rank asked."""
        rows = []
        with self.lock:
            for run, paged in paged_ranks(payload, self.alerts).items():
                rows += self._run(run, paged)
        for row in rows:
            self.out.write((json.dumps(row) if self.args.json else _line(row)) + "\n")
        self.out.flush()
        return rows

    def _run(self, run: str, paged: list[int]) -> list[dict[str, Any]]:
        due = [rank for rank in paged if self._due(run, rank)]
        if not due:
            return []
        try:
            _, found = profile_command.endpoints(
                argparse.Namespace(**{**vars(self.args), "run": run}), self.connection, self.client
            )
        except Exception as error:  # a source that does not answer now: the next page tries again
            return [{"run": run, "rank": rank, "state": "unreachable", "error": str(error)} for rank in due]
        rows = []
        for rank in due:
            self.asked_at[(run, rank)] = self.clock()
            rows.append(self._arm(run, rank, found, "trigger=alert"))
            peer = healthy_peer(rank, list(found), paged)
            if peer is not None and self._due(run, peer):
                self.asked_at[(run, peer)] = self.clock()
                rows.append(self._arm(run, peer, found, f"trigger=peer&of={rank}"))
        return rows

    def _due(self, run: str, rank: int) -> bool:
        asked = self.asked_at.get((run, rank))
        return asked is None or self.clock() - asked >= self.args.cooldown

    def _arm(self, run: str, rank: int, found: Mapping[int, str], trigger: str) -> dict[str, Any]:
        row: dict[str, Any] = {"run": run, "rank": rank, "trigger": trigger.split("&")[0][len("trigger=") :]}
        if rank not in found:
            return {**row, "state": "unreachable", "error": "no endpoint found for the rank"}
        path = f"/profile?steps={self.args.steps}&{trigger}"
        status, reply = profile_command.call(self.client, found[rank], "POST", path, self.args.timeout)
        if status == 202:
            return {**row, "state": "armed", "capture": reply.get("capture", {}).get("id")}
        return {**row, "state": "refused", "status": status, "error": profile_command.why(status, reply)}


def _line(row: Mapping[str, Any]) -> str:
    said = f"run {row['run']} rank {row['rank']} ({row['trigger']}): {row['state']}"
    return said + (f": {row['error']}" if row.get("error") else "")


def serve(captures: AlertCaptures, listen: str) -> ThreadingHTTPServer:
    """An HTTP server on `listen` (HOST:PORT) that hands each POSTed notification to `captures`."""
    host, _, port = listen.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY_BYTES:
                self._answer(413, b"notification too large\n")
                return
            try:
                payload = json.loads(self.rfile.read(length))
            except ValueError:
                self._answer(400, b"not a JSON webhook notification\n")
                return
            captures.on_notification(payload)
            self._answer(200, b"ok\n")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per capture asked is what the person reads

    return ThreadingHTTPServer((host.strip("[]") or "0.0.0.0", int(port)), Handler)


def run(args: argparse.Namespace, connection: Any, client: Client) -> int:
    """Receive notifications until interrupted; 0 then."""
    server = serve(AlertCaptures(args, connection, client, sys.stdout), args.on_alert)
    print(f"flare profile: receiving Alertmanager notifications on {args.on_alert}", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
