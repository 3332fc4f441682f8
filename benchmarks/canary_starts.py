"""The canary under `enforce` on a busy host: healthy starts it lets through, throttled ranks it stops.

    python benchmarks/canary_starts.py [--healthy 20] [--throttled 5] [--share 0.3] [--busy N] [--json OUT]

Each start is a real 4-rank gloo job of flare's DDP workload under the launcher, `canary: enforce`, with
every core of the host busy beside it (`--busy` spinning processes; default one per core and one more,
BusyCores). A healthy start trains 30 steps and ends 0; a stopped one ends 75 on every rank. In the throttled
starts rank 2 runs `--share` of every 100 ms (DutyCycle, as a cgroup quota would): the canary must stop the
start and name rank 2 in its one line.

Reported: healthy starts stopped (goal 0), throttled starts stopped naming rank 2 (goal all), the
preflight's runs per start (1, or more where a rank failed its first), and the stop lines. Exit status 0
when both goals hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from flare_exporter.engine import scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.testing.load import BusyCores, DutyCycle
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank import canary

RANKS, THROTTLED, STEPS = 4, 2, 30
ENV = {"FLARE_CANARY": "enforce", "FLARE_CANARY_COMPUTE_SECONDS": "0.5"}


def start(work: Path, index: int, share: float) -> dict:
    """One start: its exit codes, its preflight runs (as rank 0 exported them) and the canary's stop line."""
    run = f"start-{index}"
    (work / run).mkdir()
    args = ["--steps", str(STEPS), "--step-seconds", "0.02"]
    runs = None
    with ObservedJob(str(work / run), train_ddp.__file__, args, RANKS, run, env=ENV) as job:
        throttle = DutyCycle(job.processes[THROTTLED].pid) if share else None
        if throttle is not None:
            throttle.throttle(share)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(p.poll() is None for p in job.processes):
            samples = scrape.scrape_all(job.targets[:1], timeout=2)
            found = next(iter(samples.values()))
            if isinstance(found, list):
                runs = scrape.value(found, "flare_canary_runs_total", phase="preflight") or runs
                if (scrape.value(found, "flare_steps_total") or 0) >= STEPS:
                    job.release()
            time.sleep(0.5)
        codes = job.wait(30)
        if throttle is not None:
            throttle.stop()
        lines = [
            line
            for rank in range(RANKS)
            for line in job.log_tail(rank, 50).splitlines()
            if "flare canary: preflight failed" in line
        ]
    return {"codes": codes, "preflight_runs": runs, "line": lines[0] if lines else ""}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--healthy", type=int, default=20)
    parser.add_argument("--throttled", type=int, default=5)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="canary-starts-"))
    results: dict[str, list[dict]] = {"healthy": [], "throttled": []}
    with BusyCores(args.busy, seconds=3600) as busy:
        print(f"{busy.count} busy processes beside each start", flush=True)
        for index in range(args.healthy + args.throttled):
            kind = "healthy" if index < args.healthy else "throttled"
            found = start(work, index, 0.0 if kind == "healthy" else args.share)
            results[kind].append(found)
            print(kind, index, found["codes"], found["preflight_runs"], found["line"][:160], flush=True)
    stopped = [r for r in results["healthy"] if canary.CANARY_EXIT_CODE in r["codes"]]
    named = [
        r
        for r in results["throttled"]
        if r["codes"] == [canary.CANARY_EXIT_CODE] * RANKS and f"rank {THROTTLED} (host " in r["line"]
    ]
    print(f"healthy starts stopped: {len(stopped)} of {args.healthy} (goal 0)")
    print(f"throttled starts stopped, rank {THROTTLED} named: {len(named)} of {args.throttled} (goal all)")
    runs = [r["preflight_runs"] for r in results["healthy"]]
    print(f"preflight runs of the healthy starts: {runs}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if not stopped and len(named) == args.throttled else 1


if __name__ == "__main__":
    sys.exit(main())
