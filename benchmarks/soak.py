"""Soak: a million collectives through the real hooks, the rank's resident memory sampled all along.

    python benchmarks/soak.py [--collectives 1000000] [--collectives-per-step 100] [--scrape-interval 1]
                              [--json OUT]

One gloo rank under the flare launcher issues `--collectives` tiny all-reduces through the wrapped process
group, an optimizer step after every `--collectives-per-step` (0: none), while this process scrapes its
/metrics every `--scrape-interval` seconds and reads its VmRSS at each scrape. Printed: collectives issued
and completed, errors and dropped events, RSS at 10 % of the run and at the end, and the slope of RSS over
the second half in KiB per million collectives (flat: near zero). Exit status: 0 when the rank completed
every collective, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from flare_exporter.engine import scrape
from flare_exporter.local.jobs import free_port


def worker(collectives: int, per_step: int, done_file: str) -> None:
    """The rank: `collectives` all-reduces of one float, an optimizer step after every `per_step` of them
    (none if 0), then wait for `done_file`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.0)
    for issued in range(1, collectives + 1):
        dist.all_reduce(tensor)
        if per_step and issued % per_step == 0:
            parameter.grad = tensor
            optimizer.step()
    while not os.path.exists(done_file):
        time.sleep(0.05)
    dist.destroy_process_group()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class SoakError(Exception):
    """The soak could not finish: the rank exited, or the time ran out."""


def parse_args() -> argparse.Namespace:
    """The command line (and the worker's, hidden)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=1_000_000)
    parser.add_argument("--collectives-per-step", type=int, default=100, help="0: no optimizer steps")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default="")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--done-file", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args.collectives, args.collectives_per_step, args.done_file)
        return 0

    work = tempfile.mkdtemp(prefix="flare-soak-")
    done_file = os.path.join(work, "done")
    port = free_port()
    log = open(os.path.join(work, "rank0.log"), "wb")
    process = start_rank(args, port, done_file, log)
    try:
        samples, last, completed = watch(args, process, f"127.0.0.1:{port}", work)
    except SoakError as error:
        print(f"soak: error: {error}")
        return 1
    finally:
        open(done_file, "w").close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()

    result = soak_result(args, samples, last, completed)
    print_result(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"result": result, "samples": samples}, out, indent=1)
    return 0 if completed >= args.collectives else 1


def start_rank(args: argparse.Namespace, port: int, done_file: str, log: IO[bytes]) -> subprocess.Popen:
    """The rank, under flare's launcher, its exporter on `port`; its output to `log`."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1", FLARE_RUN="soak")
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FLARE_PORT=str(port), FLARE_ADDR="127.0.0.1"
    )
    command = [sys.executable, "-m", "flare_exporter.launch", __file__, "--worker"]
    command += ["--collectives", str(args.collectives), "--done-file", done_file]
    command += ["--collectives-per-step", str(args.collectives_per_step)]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))


def watch(
    args: argparse.Namespace, process: subprocess.Popen, target: str, work: str
) -> tuple[list[tuple[float, float, float]], list[scrape.Sample], float]:
    """Scrape the rank and read its memory every `--scrape-interval` until it has completed every
    collective: the samples (seconds, collectives issued, RSS bytes), its last scrape, the collectives it
    completed."""
    samples: list[tuple[float, float, float]] = []
    started = time.monotonic()
    last: list[scrape.Sample] = []
    while time.monotonic() - started < args.timeout:
        if process.poll() is not None:
            raise SoakError(f"the rank exited with {process.returncode}; see {work}/rank0.log")
        try:
            last = scrape.scrape(target, timeout=5)
        except scrape.ScrapeError:
            time.sleep(args.scrape_interval)
            continue
        issued = scrape.value(last, "flare_collective_last_issued_seq", group="world") or 0.0
        completed = scrape.value(last, "flare_collective_last_completed_seq", group="world") or 0.0
        samples.append((time.monotonic() - started, issued, float(rss_bytes(process.pid))))
        if completed >= args.collectives:
            return samples, last, completed
        time.sleep(args.scrape_interval)
    raise SoakError(f"timed out after {args.timeout:.0f} s")


def soak_result(
    args: argparse.Namespace,
    samples: list[tuple[float, float, float]],
    last: list[scrape.Sample],
    completed: float,
) -> dict[str, object]:
    """The soak's figures: collectives, time, the exporter's errors and drops, RSS and its slope."""
    start = next(s for s in samples if s[1] >= 0.1 * args.collectives)
    end = samples[-1]
    second_half = [(issued, rss) for _, issued, rss in samples if issued >= 0.5 * args.collectives]
    slope = statistics.linear_regression(*zip(*second_half, strict=True)).slope  # bytes per collective
    seconds = end[0] - samples[0][0]
    return {
        "collectives_issued": int(end[1]),
        "collectives_completed": int(completed),
        "seconds": round(seconds, 1),
        "collectives_per_second": round(end[1] / seconds) if seconds else None,
        "scrapes": len(samples),
        "exporter_errors": sum(s.value for s in last if s.name == "flare_exporter_errors_total"),
        "dropped_events": sum(s.value for s in last if s.name == "flare_exporter_dropped_events_total"),
        "rss_start_mib": round(start[2] / 2**20, 2),
        "rss_end_mib": round(end[2] / 2**20, 2),
        "rss_max_mib": round(max(s[2] for s in samples) / 2**20, 2),
        "rss_slope_kib_per_million_collectives_second_half": round(slope * 1_000_000 / 1024, 1),
    }


def print_result(result: dict[str, object]) -> None:
    """The soak's figures, as lines."""
    issued, completed = result["collectives_issued"], result["collectives_completed"]
    print(f"soak: {issued} collectives issued, {completed} completed")
    print(f"  in {result['seconds']} s ({result['collectives_per_second']}/s), {result['scrapes']} scrapes")
    print(f"  exporter errors {result['exporter_errors']:.0f}, dropped events {result['dropped_events']:.0f}")
    print(
        f"  RSS at 10 %: {result['rss_start_mib']} MiB, at the end: {result['rss_end_mib']} MiB, "
        f"max {result['rss_max_mib']} MiB"
    )
    slope_kib = result["rss_slope_kib_per_million_collectives_second_half"]
    print(f"  RSS slope over the second half: {slope_kib:.1f} KiB per million collectives")


if __name__ == "__main__":
    sys.exit(main())
