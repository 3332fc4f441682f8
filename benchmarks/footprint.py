"""Footprint: series and bytes per rank per scrape with every signal on, and what one scrape costs to render.

    python benchmarks/footprint.py [--world 1024] [--repeats 200] [--json OUT]

The ranks are a virtual cluster's (flare_exporter.local.testing.virtual_cluster): FlareStates as a real
rank's hooks leave them after 1,200 steps with every signal on at its defaults, in four roles: healthy, a
straggler (its GPU throttles), stuck before a collective, waiting in one. Per role: series, bytes of the
text format and gzip-compressed. Render time per scrape on the straggler, median of `--repeats`: the
collectors alone, the text flare serves (exposition.render_text, csrc/text_format.cpp), the same written
in Python, prometheus_client's renderers, gzip, and a whole scrape of the real endpoint over loopback.

Goals: <= 300 series and <= 32 KiB per rank per scrape. Exit status 0 (whatever the numbers), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest  # noqa: E402

from flare_exporter.engine.scrape import parse
from flare_exporter.local.testing import PROMETHEUS_SCRAPE_HEADERS
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exposition import MetricsServer, metrics_body, python_text_format, render_text

SERIES_GOAL = 300
RUN = "4817233"  # a Slurm job id: the run label is on every series, so its length counts
BYTES_GOAL = 32 * 1024


def median_ms(call: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median, best) milliseconds per call: the machine is shared, the best case shows the noise."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, min(times) * 1e3


def scrape_endpoint(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics", headers=PROMETHEUS_SCRAPE_HEADERS)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    if response.status != 200 or not body:
        raise RuntimeError(f"scrape answered {response.status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=1024, help="the virtual job's world size (default 1024)")
    parser.add_argument(
        "--repeats", type=int, default=200, help="timed renders per measurement (default 200)"
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write every number as JSON to OUT")
    args = parser.parse_args(argv)
    if args.world < 16 or args.repeats < 1:
        parser.error("--world must be at least 16, --repeats at least 1")
    print(
        f"flare footprint benchmark  {datetime.now(timezone.utc).isoformat(timespec='seconds')}  "
        f"{os.cpu_count()} CPUs  python {platform.python_version()}  load average {os.getloadavg()[0]:.2f}"
    )
    now = time.perf_counter()
    faults = vc.Faults(hung=5, hung_at=now - 600.0, straggler=3)
    roles = {
        "healthy": (11, vc.Faults()),
        "straggler": (3, faults),
        "stuck": (5, faults),
        "waiting": (11, faults),
    }
    results: dict[str, Any] = {"world": args.world, "roles": {}}
    print(f"one rank of a {args.world}-rank job, every signal on (GPU health through the fake NVML):")
    print(f"  {'role':10} {'series':>6} {'text bytes':>11} {'gzip bytes':>11}")
    for role, (rank, role_faults) in roles.items():
        text = vc.render(vc.rank_state(rank, args.world, RUN, now, role_faults))
        results["roles"][role] = row = dict(series=len(parse(text.decode())), bytes=len(text))
        row["gzip_bytes"] = len(gzip.compress(text, 1))
        print(f"  {role:10} {row['series']:6d} {row['bytes']:11,d} {row['gzip_bytes']:11,d}")
    worst_series = max(row["series"] for row in results["roles"].values())
    worst_bytes = max(row["bytes"] for row in results["roles"].values())
    worst_gzip = max(row["gzip_bytes"] for row in results["roles"].values())

    state = vc.rank_state(3, args.world, RUN, now, faults)
    registry = build_registry(state)
    text = render_text(registry)
    timings = {
        "collectors": median_ms(lambda: list(registry.collect()), args.repeats),
        "render_text": median_ms(lambda: render_text(registry), args.repeats),
        "python_text": median_ms(lambda: python_text_format(registry.collect()), args.repeats),
        "generate_latest": median_ms(lambda: generate_latest(registry), args.repeats),
        "openmetrics": median_ms(lambda: openmetrics_latest(registry), args.repeats),
        "gzip_level_1": median_ms(lambda: gzip.compress(text, 1), args.repeats),
        "response": median_ms(lambda: metrics_body(registry, "gzip"), args.repeats),
    }
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        timings["endpoint_scrape"] = median_ms(lambda: scrape_endpoint(server.port), args.repeats)
    finally:
        server.close()
    results["render_ms"] = timings
    print(f"render time per scrape (the straggler, median [best] of {args.repeats}):")
    rows = (
        ("collectors", "the collectors alone (registry.collect)"),
        ("render_text", "collect + text format, as flare serves it (exposition.render_text)"),
        ("python_text", "the same, the text written in Python (a rank without flare's extension)"),
        ("generate_latest", "collect + prometheus_client's text format (before)"),
        ("openmetrics", "collect + prometheus_client's OpenMetrics (what Prometheus got before)"),
        ("gzip_level_1", "gzip -1 of the text"),
        ("response", "the /metrics response body: render_text + gzip"),
        ("endpoint_scrape", "a whole scrape of MetricsServer over loopback, Prometheus's headers"),
    )
    for key, what in rows:
        print(f"  {what:72} {timings[key][0]:7.3f} ms  [best {timings[key][1]:6.3f}]")
    speedup = timings["openmetrics"][0] / timings["render_text"][0]
    print(f"  render path: {speedup:.1f}x faster than what Prometheus was served before")
    series_ok, bytes_ok = worst_series <= SERIES_GOAL, worst_bytes <= BYTES_GOAL
    print(
        f"goal: <= {SERIES_GOAL} series per rank: {'PASS' if series_ok else 'MISS'} ({worst_series}); "
        f"<= {BYTES_GOAL // 1024} KiB per rank per scrape: {'PASS' if bytes_ok else 'MISS'} "
        f"({worst_bytes / 1024:.1f} KiB of text, {worst_gzip / 1024:.1f} KiB on the wire with gzip)"
    )
    results["goal"] = {"series": series_ok, "bytes": bytes_ok}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
