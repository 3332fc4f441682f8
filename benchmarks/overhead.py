"""What the exporter costs a training job: the same DDP job without and with flare, in pairs.

    python benchmarks/overhead.py [--pairs 10] [--ranks 4] [--steps 200] [--warmup 20] [--batch 64] \
        [--device cpu|cuda] [--width N] [--scrape-interval 1] [--timeout 600] [--json OUT]

Each pair runs flare_exporter/local/workloads/train_ddp.py on `--ranks` local ranks twice: as a plain
`python script.py` (without) and under `python -m flare_exporter.launch` (with: every signal at its defaults,
every rank scraped once per `--scrape-interval` as Prometheus scrapes, gzip accepted), without first in odd
pairs and with first in even ones, so that the machine's drift cancels. A run's step time is the median over
ranks of each rank's median step, the first `--warmup` steps dropped; a pair's ratio is with / without.

Reported: the median ratio over pairs with a distribution-free 95 % interval (goal: <= 1.005), the same for
the training thread's CPU per step, and the exporter's own threads' CPU per step (each rank's `flare-*`
threads) as a share of a rank's process CPU. On `--device cuda` rank r trains on GPU r over NCCL and the
exporter reads NVML; on CPU the job runs over gloo and the exporter reads a fake NVML. FLARE_* variables set
for this command reach the exporter (FLARE_PORT and FLARE_ADDR excepted).

Exit status: 0 when every run completed (whatever the ratio), 1 when a run failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli_runs import median_ci, revision  # noqa: E402  (benchmarks/)

from flare_exporter.local.jobs import free_port, free_port_block  # noqa: E402

SCRIPT = REPO / "flare_exporter" / "local" / "workloads" / "train_ddp.py"
FAKE_NVML = "flare_exporter.local.testing.fake_nvml"
GOAL_RATIO = 1.005


class RunError(Exception):
    """A run that did not complete: one line naming the rank and its stderr's tail."""


class Scraper(threading.Thread):
    """Every port's /metrics once per `interval`, as Prometheus asks, until stopped; a failure counts once
    the rank has answered (before, it is still starting)."""

    def __init__(self, ports: list[int], interval: float) -> None:
        super().__init__(name="scraper", daemon=True)
        self.ports, self.interval = ports, interval
        self.answered: set[int] = set()
        self.done, self.failures = 0, list[str]()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            for port in self.ports:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/metrics", headers={"Accept-Encoding": "gzip"}
                )
                try:
                    with urllib.request.urlopen(request, timeout=5) as answer:
                        answer.read()
                    self.answered.add(port)
                    self.done += 1
                except OSError as error:
                    if port in self.answered:
                        self.failures.append(f"{port}: {error}")


def job(args: argparse.Namespace, with_exporter: bool) -> tuple[list[str], dict[str, str], list[int]]:
    """A job's command (each rank adds its --report), environment and exporter ports (none without it)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.ranks))
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    )
    env.pop("FLARE_FILE_SD_DIR", None)
    command = [str(SCRIPT), "--steps", str(args.steps), "--batch", str(args.batch), "--wait-for", "done"]
    command += ["--device", "cuda"] if args.device == "cuda" else []
    command += ["--width", str(args.width)] if args.width else []
    if not with_exporter:
        return [sys.executable, *command], env, []
    base_port = free_port_block(args.ranks)
    env.update(FLARE_PORT=str(base_port), FLARE_ADDR="127.0.0.1", FLARE_RUN=env.get("FLARE_RUN", "overhead"))
    if args.device == "cpu":  # every signal on: GPU health reads the fake NVML (on a GPU, NVML itself)
        env.setdefault("FLARE_NVML_MODULE", FAKE_NVML)
    ports = [base_port + rank for rank in range(args.ranks)]
    return [sys.executable, "-m", "flare_exporter.launch", *command], env, ports


def run_job(
    args: argparse.Namespace, with_exporter: bool, workdir: Path
) -> tuple[list[dict], Scraper | None]:
    """One job to its end: each rank's report (train_ddp.py --report) and, with the exporter, its scraper."""
    workdir.mkdir(parents=True)
    command, env, ports = job(args, with_exporter)
    procs = []
    for rank in range(args.ranks):
        rank_command = [*command, "--report", f"report{rank}.json"]
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        with open(workdir / f"rank{rank}.log", "wb") as log:  # its output, for a failure's tail
            started = subprocess.Popen(
                rank_command, env=rank_env, cwd=workdir, stdout=log, stderr=log, start_new_session=True
            )
            procs.append(started)
    scraper = Scraper(ports, args.scrape_interval) if ports and args.scrape_interval else None
    try:
        if scraper:
            scraper.start()
        await_reports(args, procs, workdir)
    finally:
        if scraper:
            scraper.stopping.set()
            scraper.join()
        (workdir / "done").touch()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [json.loads((workdir / f"report{rank}.json").read_text()) for rank in range(args.ranks)], scraper


def await_reports(args: argparse.Namespace, procs: list[subprocess.Popen], workdir: Path) -> None:
    """Until every rank has written its report; RunError if a rank fails or the run times out."""
    deadline = time.monotonic() + args.timeout
    while not all((workdir / f"report{rank}.json").exists() for rank in range(args.ranks)):
        failed = [(rank, proc.poll()) for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            rank, code = failed[0] if failed else (0, "none: timed out")
            tail = (workdir / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise RunError(f"{workdir.name}: rank {rank} exit code {code}; stderr: {' | '.join(tail)}")
        time.sleep(0.2)


def side(reports: list[dict], warmup: int) -> dict[str, Any]:
    """A run's step time, the training thread's and the process's CPU per step, and the exporter's threads'
    CPU per step by name (the medians over ranks)."""
    steps = len(reports[0]["step_times"])
    threads: dict[str, list[float]] = {}
    for report in reports:
        for name, seconds in report["threads_cpu"].items():
            if name.startswith("flare-"):
                threads.setdefault(name, []).append(seconds / steps)
    return {
        "step": statistics.median(statistics.median(r["step_times"][warmup:]) for r in reports),
        "thread_cpu": statistics.median(statistics.median(r["step_cpu"][warmup:]) for r in reports),
        "process_cpu": statistics.median(statistics.median(r["process_cpu"][warmup:]) for r in reports),
        "exporter_threads": {name: statistics.median(values) for name, values in sorted(threads.items())},
    }


def pair(args: argparse.Namespace, number: int, workdir: Path) -> dict[str, Any]:
    """Both runs of a pair, without first in odd pairs: the sides, the ratios and the scrapes."""
    sides: dict[str, Any] = {}
    scrapes = {"done": 0, "failed": []}
    for with_exporter in (False, True) if number % 2 else (True, False):
        name = "with" if with_exporter else "without"
        reports, scraper = run_job(args, with_exporter, workdir / f"pair{number}-{name}")
        sides[name] = side(reports, args.warmup)
        if scraper:
            scrapes = {"done": scraper.done, "failed": scraper.failures}
    with_, without = sides["with"], sides["without"]
    return {
        "pair": number,
        **sides,
        "ratio": with_["step"] / without["step"],
        "thread_cpu_ratio": with_["thread_cpu"] / without["thread_cpu"],
        "scrapes": scrapes,
    }


def summary(pairs: list[dict]) -> dict[str, Any]:
    """Medians over pairs with their intervals; the exporter's threads' CPU per step and its share."""
    out: dict[str, Any] = {}
    for key in ("ratio", "thread_cpu_ratio"):
        values = [p[key] for p in pairs]
        out[key] = {"median": statistics.median(values), "ci95": median_ci(values)}
    threads = statistics.median(sum(p["with"]["exporter_threads"].values()) for p in pairs)
    out["exporter_threads_cpu_per_step"] = threads
    out["exporter_share"] = threads / statistics.median(p["without"]["process_cpu"] for p in pairs)
    out["scrapes"] = {
        "done": sum(p["scrapes"]["done"] for p in pairs),
        "failed": sum(len(p["scrapes"]["failed"]) for p in pairs),
    }
    return out


def print_summary(out: dict[str, Any], pairs: int) -> None:
    def with_ci(figure: dict[str, Any]) -> str:
        ci = figure["ci95"]
        return f"{figure['median']:.4f}" + (
            f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else " (too few pairs for an interval)"
        )

    low, high = out["ratio"]["ci95"] or (0.0, math.inf)
    shown = "met" if high <= GOAL_RATIO else "missed" if low > GOAL_RATIO else "not shown"
    print(f"step time with / without over {pairs} pairs [95 % CI]: {with_ci(out['ratio'])}; goal: {shown}")
    print(f"training thread's CPU per step, with / without: {with_ci(out['thread_cpu_ratio'])}")
    threads, share, scrapes = out["exporter_threads_cpu_per_step"], out["exporter_share"], out["scrapes"]
    print(f"the exporter's threads, CPU per step: {threads * 1e6:.1f} µs, {share:.2%} of a rank's")
    print(f"scrapes: {scrapes['done']} answered, {scrapes['failed']} failed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default, says in (
        ("--pairs", int, 10, "A/B pairs"),
        ("--ranks", int, 4, "ranks per job"),
        ("--steps", int, 200, "training steps per run"),
        ("--warmup", int, 20, "first steps per rank dropped"),
        ("--batch", int, 64, "batch size per rank"),
        ("--width", int, 0, "the model's width (0: the script's)"),
        ("--scrape-interval", float, 1.0, "seconds between scrapes of each rank with the exporter (0: none)"),
        ("--timeout", float, 600.0, "seconds one run may take"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{says} (default {default})")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPU or NCCL on GPUs"
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    if (
        min(args.pairs, args.ranks, args.batch, args.timeout) <= 0
        or min(args.width, args.scrape_interval) < 0
    ):
        parser.error("--pairs, --ranks, --batch, --timeout must be > 0; --width, --scrape-interval >= 0")
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and smaller than --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        print(
            f"overhead: error: --device cuda with --ranks {args.ranks}: NCCL takes one rank per GPU, and "
            f"torch sees {torch.cuda.device_count()} GPU(s) here",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks reap the ranks
    flare_env = {k: v for k, v in os.environ.items() if k.startswith("FLARE_")}
    print(f"{args.pairs} pairs of {args.ranks}-rank jobs on {args.device}, {args.steps} steps; {flare_env}")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="flare-overhead-") as tmp:
        try:
            for number in range(1, args.pairs + 1):
                pairs.append(done := pair(args, number, Path(tmp)))
                print(
                    f"  pair {number}: {done['ratio']:.4f}, thread CPU {done['thread_cpu_ratio']:.4f}",
                    flush=True,
                )
        except RunError as error:
            print(f"overhead: run failed: {error}", file=sys.stderr)
            return 1
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    machine = dict(cpus=os.cpu_count(), platform=platform.platform(), torch=torch.__version__, gpu=gpu)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results: dict[str, Any] = dict(date=date, revision=revision(), machine=machine, config=vars(args))
    results.update(flare_env=flare_env, pairs=pairs, summary=summary(pairs))
    print_summary(results["summary"], len(pairs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
