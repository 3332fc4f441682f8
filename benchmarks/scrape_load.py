"""Scrape load A/B: does a scraper hammering one rank's /metrics slow training down?

    python benchmarks/scrape_load.py [--pairs 6] [--ranks 2] [--steps 800] [--batch 64] [--warmup 50] \
                                     [--rate 200] [--new-connections]

Each pair runs the same gloo DDP job (flare_exporter/local/workloads/train_ddp.py on `--ranks` local ranks,
under the flare launcher) twice: once unscraped (A) and once with rank 0 scraped by a separate process at
`--rate` requests per second for the whole run (B; SCRAPER_THREADS threads, on keep-alive connections as
Prometheus scrapes, or a new connection per request with --new-connections), from before the rank's
endpoint first answers until training has ended. Odd pairs run A then B, even pairs B then A. A run's step
time is the median over ranks of each rank's median step time, the first `--warmup` steps left out; a
pair's ratio is B / A.

On a machine whose cores the ranks already fill (2 ranks on 2 cores), the scraper's own CPU slows them
whatever the exporter does: run `--ranks 1` there to leave the scraper a core.

Printed per pair and in the summary: the step times, the ratio, the scraper's achieved rate over the
training window, and its failed scrapes (any request that did not return HTTP 200 with flare metrics
after the endpoint first answered and before training ended). Goal: median ratio <= 1.02, no failure.
Exit status: 0 when every run completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from flare_exporter.local.jobs import free_port, free_port_block
from flare_exporter.local.workloads import train_ddp

SCRAPER_THREADS = 8  # requests in flight at once: one slow answer does not lower the offered rate


def scraper(port: int, rate: float, stop_file: str, out: str, new_connections: bool) -> None:
    """Scrape 127.0.0.1:port/metrics at `rate` per second until `stop_file` exists; write the counts.

    SCRAPER_THREADS threads, each paced at rate / SCRAPER_THREADS and started a fraction of an interval
    apart, each keeping its connection open between requests as Prometheus does, or with
    `new_connections` opening one per request (curl in a loop)."""
    counts = {"ok": 0, "failed": 0, "not_yet": 0}
    times: list[float] = []
    lock = threading.Lock()
    interval = SCRAPER_THREADS / rate

    def scrape_paced(offset: float) -> None:
        next_at = time.monotonic() + offset
        connection = None
        while not os.path.exists(stop_file):
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the load, not synchronising
            elif delay < -1.0:
                next_at = time.monotonic()  # a second behind: give up on the backlog rather than burst
            next_at += interval  # behind by less: go on at once and keep the offered rate
            success, connection = scrape_once(connection, port, new_connections)
            with lock:
                if success:
                    counts["ok"] += 1
                    times.append(time.monotonic())
                elif not times:
                    counts["not_yet"] += 1  # the rank is still importing torch
                else:
                    counts["failed"] += 1

    threads = [
        threading.Thread(target=scrape_paced, args=(index * interval / SCRAPER_THREADS,))
        for index in range(SCRAPER_THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open(out, "w") as handle:
        json.dump({**counts, "times": sorted(times)}, handle)


def scrape_once(
    connection: http.client.HTTPConnection | None, port: int, new_connections: bool
) -> tuple[bool, http.client.HTTPConnection | None]:
    """One GET of /metrics on `connection` (a new one if None): whether flare's metrics came back, and the
    connection for the next request (None: open a new one)."""
    try:
        if connection is None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read()
        success = response.status == 200 and b"flare_steps_total" in body
        if new_connections or response.will_close:
            connection.close()
            connection = None
    except (OSError, http.client.HTTPException):
        if connection is not None:
            connection.close()
        return False, None
    return success, connection


def run_job(work: str, args: argparse.Namespace, scraped: bool) -> dict:
    os.makedirs(work)
    base_port = free_port_block(args.ranks)
    master_port = free_port()
    done_file = os.path.join(work, "done")
    stop_file = os.path.join(work, "stop")
    scraper_out = os.path.join(work, "scraper.json")
    scraper_process = None
    if scraped:
        scraper_process = subprocess.Popen(
            [sys.executable, __file__, "--scraper", str(base_port), "--rate", str(args.rate)]
            + (["--new-connections"] if args.new_connections else [])
            + ["--stop-file", stop_file, "--out", scraper_out]
        )
    ranks = []
    for rank in range(args.ranks):
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "OMP_NUM_THREADS": "1",
                "FLARE_PORT": str(base_port),
                "FLARE_ADDR": "127.0.0.1",
                "FLARE_RUN": "scrape-load",
            }
        )
        report = os.path.join(work, f"rank{rank}.json")
        command = [
            sys.executable,
            "-m",
            "flare_exporter.launch",
            train_ddp.__file__,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
        ]
        command += ["--report", report, "--wait-for", done_file]
        log = open(os.path.join(work, f"rank{rank}.log"), "wb")
        ranks.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), report))
        log.close()
    deadline = time.monotonic() + args.timeout
    try:
        while not all(os.path.exists(report) for _, report in ranks):  # training has ended on every rank
            if any(process.poll() not in (None, 0) for process, _ in ranks) or time.monotonic() > deadline:
                raise RuntimeError(f"a rank failed or timed out; see {work}")
            time.sleep(0.1)
        training_ended = time.monotonic()
        open(stop_file, "w").close()
        if scraper_process is not None:
            scraper_process.wait(timeout=60)
    finally:
        open(done_file, "w").close()
        open(stop_file, "w").close()
        for process, _ in ranks:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    medians = []
    for _, report in ranks:
        with open(report) as handle:
            times = json.load(handle)["step_times"][args.warmup :]
        medians.append(statistics.median(times))
    result: dict = {"step_seconds": statistics.median(medians)}
    if scraped:
        with open(scraper_out) as handle:
            counts = json.load(handle)
        window = [t for t in counts["times"] if t <= training_ended]
        span = (window[-1] - window[0]) if len(window) > 1 else 0.0
        result.update(
            ok=counts["ok"],
            failed=counts["failed"],
            rate=(len(window) - 1) / span if span else 0.0,
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=64, help="the workload's batch: its step time")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--new-connections", action="store_true", help="a connection per request (default: keep-alive)"
    )
    parser.add_argument("--scraper", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scraper:
        scraper(args.scraper, args.rate, args.stop_file, args.out, args.new_connections)
        return 0
    work = tempfile.mkdtemp(prefix="flare-scrape-load-")
    print(
        f"scrape_load: {args.pairs} pairs, {args.ranks} ranks, {args.steps} steps of batch {args.batch}, "
        f"rank 0 at {args.rate:g}/s"
        f" by {SCRAPER_THREADS} threads, "
        + ("a new connection per request" if args.new_connections else "keep-alive connections")
    )
    ratios, rates, failures, oks = [], [], 0, 0
    for pair in range(1, args.pairs + 1):
        order = (False, True) if pair % 2 else (True, False)
        results = {}
        for scraped in order:
            try:
                results[scraped] = run_job(os.path.join(work, f"pair{pair}-{int(scraped)}"), args, scraped)
            except RuntimeError as error:
                print(f"scrape_load: error: pair {pair}: {error}")
                return 1
        a, b = results[False], results[True]
        ratio = b["step_seconds"] / a["step_seconds"]
        ratios.append(ratio)
        rates.append(b["rate"])
        failures += b["failed"]
        oks += b["ok"]
        print(
            f"  pair {pair}: unscraped {a['step_seconds'] * 1000:.3f} ms, "
            f"scraped {b['step_seconds'] * 1000:.3f} ms, ratio {ratio:.4f}; "
            f"{b['rate']:.0f} scrapes/s, {b['ok']} ok, {b['failed']} failed"
        )
    summary = {
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_scrape_rate": statistics.median(rates),
        "scrapes_ok": oks,
        "scrapes_failed": failures,
    }
    print(
        f"summary: median step-time ratio scraped/unscraped {summary['median_ratio']:.4f} "
        f"(min {summary['min_ratio']:.4f}, max {summary['max_ratio']:.4f}); goal <= 1.02"
    )
    print(
        f"  scrape rate (median of runs) {summary['median_scrape_rate']:.0f}/s; {oks} ok, {failures} failed"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": summary, "ratios": ratios}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
