"""Overhead A/B: the same gloo DDP job without and with flare-exporter attached, plus hook micro-costs.

    python benchmarks/overhead.py [--pairs 10] [--ranks 4] [--steps 60] [--warmup 10] [--batch 64] \
                                  [--timeout 300] [--retries 2] [--scrape-interval 1] [--script PATH] \
                                  [--control plain|loaded] [--pin] [--json OUT]
    python benchmarks/overhead.py --micro          # only the per-call hook costs (a few seconds)
    python benchmarks/overhead.py --pool a.json b.json ...   # interleaved runs' pairs pooled, nothing run

Each pair runs flare_exporter/local/workloads/train_ddp.py twice on `--ranks` local ranks: once as a plain
`python
script.py` (A, without) and once as `python -m flare_exporter.launch script.py` (B, with), in the order A/B
for odd pairs and B/A for even ones, so that slow drift of the machine cancels out. During a B run a
background thread here scrapes every rank's /metrics once per `--scrape-interval` (1 s), as Prometheus
would, and counts the scrapes that failed between a rank's first answer and the end of its training.
With `--control loaded`, A runs `benchmarks/loaded.py script.py` instead: flare's modules and extension
loaded, nothing attached, so that the ratio is what the exporter does rather than also what loading it does.
With `--placebo --burn SHARE` (interleaved), neither job has flare but the side "with" runs beside a thread
that spends SHARE of each rank's CPU once a second without the GIL (benchmarks/burner.py; in bytecode, holding
the GIL, with --burn-in interpreter): what the exporter's threads' CPU alone costs the job. With `--pin`, rank
r of both jobs runs on CPU r modulo the CPUs (taskset), so that where the ranks run does not change from job
to job. FLARE_* variables set for this command reach the exporter (FLARE_PORT and FLARE_ADDR excepted: each
run gets free loopback ports).

A run's step time is the median over ranks of each rank's median step time, the first `--warmup` steps
dropped. A pair's ratio is with / without; the summary gives the median ratio over pairs (goal: <= 1.005)
with a distribution-free 95% confidence interval, and each rank process's CPU time (user + system). Each
rank also reports its training thread's and its whole process's CPU time per step; the summary gives their
with / without ratios the same way (steadier than step times on a shared machine). And within each B run,
what one scrape round cost the training (scrape_cost): the steps that overlapped a round against those
that overlapped a placebo round, where nothing was scraped; the ratio's noise from run to run does not
touch it.

The micro section times, on this thread, what a hook adds to one collective (GroupTracker.issue + track on a
fake work whose real torch Future is already complete, so the completion callback runs inline too) and to
one optimizer step (StepTracker.on_step), against an empty loop; then both again, each call timed alone
right after matrix products that evict the CPU caches, as in a training step ("cold"). And, with flare's
extension built, what a host-dispatch sampling window adds to a step of the training script's model: the
training thread's CPU time of steps with the native timer's window open against steps without.

With `--pool`, nothing runs: the pairs of several `--interleave` runs' `--json` files, which must share
the job, the machine, the FLARE_* settings and the code they ran (each file records a digest of the
package, this benchmark and the training script, and its git commit for the reader), are pooled into one
median and interval, so that runs made at different times, in different sessions and commits of the same
code, weigh in together; pool every run of the code, not a chosen few (benchmarks/results/ keeps them).

Exit status: 0 when every run completed (whatever the ratio), 1 when a run failed, 2 for bad arguments
(and for files that cannot be pooled).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from overhead_jobs import BURNER, JOB_DIRS, Job, RunError, pinned_cpu, retrying, start_job, training_span
from overhead_micro import micro, print_micro
from overhead_scraper import ScrapeCounts, Scraper, Span
from overhead_stats import (
    MIN_SLICE_STEPS,
    PoolError,
    exporter_threads,
    interleaved_summary,
    pool,
    process_cpu_per_step,
    scrape_cost,
    scrape_cpu,
    sequential_summary,
    slice_pairs,
    threads_cpu_per_step,
)

from flare_exporter.local.workloads import train_ddp

# ---------------------------------------------------------------------------------------------------------
# the command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: exit 2 on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_options(parser)
    add_run_options(parser)
    add_side_options(parser)
    add_mode_options(parser)
    args = parser.parse_args(argv)
    if args.pool and args.micro:
        parser.error("--pool runs nothing: it takes no --micro")
    check_counts(parser, args)
    check_sides(parser, args)
    check_job(parser, args)
    args.script = args.script.resolve()
    return args


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """The job each side runs: its ranks, steps, batch and device, and how long a run may take."""
    parser.add_argument("--pairs", type=int, default=10, help="A/B pairs to run (default 10)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps per rank dropped (default 10)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per rank (default 64)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the job trains: cpu (gloo, the default) or cuda (NCCL, rank r on GPU r modulo the GPUs; "
        "the exporter reads NVML itself rather than the fake)",
    )
    parser.add_argument(
        "--width", type=int, default=0, help="the model's width, passed to the script (default: the script's)"
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """How the runs go: retries, the results file, the scrapes, the training script."""
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a run (interleaved: of a pair) whose rank crashed while exiting, after all its steps "
        "(default 2)",
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="scrape every rank this often during B runs (default 1; 0: no scrapes, the exporter alone)",
    )
    parser.add_argument(
        "--script",
        type=Path,
        default=Path(train_ddp.__file__),
        help="the training script (default flare_exporter/local/workloads/train_ddp.py)",
    )


def add_side_options(parser: argparse.ArgumentParser) -> None:
    """How the two sides run and what tells them apart: turns, a placebo and its burner, the control, pins."""
    parser.add_argument(
        "--interleave",
        type=float,
        default=0.0,
        metavar="S",
        help="run both jobs at once, taking turns of S seconds, the other paused (default 0: in turn)",
    )
    parser.add_argument(
        "--placebo",
        action="store_true",
        help="with --interleave: both jobs without the exporter (what the method reads where there is "
        "nothing to find)",
    )
    parser.add_argument(
        "--burn",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --placebo: the side 'with' runs beside a thread that spends SHARE of each rank's CPU, "
        "once a second, without the GIL unless --burn-in says otherwise (benchmarks/burner.py): what that "
        "much CPU, spent as the exporter's threads spend theirs (its runs' exporter_cpu share), costs the "
        "job with no exporter at all",
    )
    parser.add_argument(
        "--burn-in",
        choices=("cores", "interpreter"),
        default="cores",
        help="with --burn: burn without the GIL (cores, the default) or in Python bytecode, holding the GIL "
        "as a render does (interpreter)",
    )
    parser.add_argument(
        "--control",
        choices=("plain", "loaded"),
        default="plain",
        help="the side without the exporter: the plain script (default), or 'loaded': flare's modules and "
        "extension loaded, nothing attached (benchmarks/loaded.py), so that the ratio is what the exporter "
        "does rather than what it loads",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin rank r of every job to CPU r modulo the CPUs this process may use (taskset), so that the "
        "ranks' placement on the cores is the same in every job rather than the scheduler's choice",
    )


def add_mode_options(parser: argparse.ArgumentParser) -> None:
    """The modes that run no A/B: the micro section alone, or pooling earlier runs."""
    parser.add_argument("--micro", action="store_true", help="only the hook micro-benchmarks, no job runs")
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="RESULTS",
        help="run nothing: pool the pairs of interleaved runs' --json files (the same job, code and machine) "
        "into one median and interval",
    )


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts and durations in range, or exit 2."""
    if (
        args.pairs < 1
        or args.ranks < 1
        or args.batch < 1
        or args.width < 0
        or args.timeout <= 0
        or args.retries < 0
        or args.scrape_interval < 0
        or args.interleave < 0
    ):
        parser.error(
            "--pairs, --ranks, --batch, --timeout must be > 0; --retries, --scrape-interval, --interleave, "
            "--width ≥ 0"
        )


def check_sides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A placebo, its burner and the control only where they make sense together, or exit 2."""
    if args.placebo and not args.interleave:
        parser.error("--placebo needs --interleave (a placebo compares two jobs run in turns)")
    if not 0 <= args.burn < 1:
        parser.error("--burn must be a share of a rank's CPU: at least 0 and below 1")
    if args.burn_in != "cores" and not args.burn:
        parser.error("--burn-in says how --burn burns: give --burn too")
    if args.burn and not args.placebo:
        parser.error("--burn needs --placebo (it stands in for the exporter on the side 'with')")
    if args.placebo and args.control != "plain":
        parser.error("--placebo runs both jobs as plain scripts: it takes no --control")


def check_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Warm-up within the steps, taskset for --pin, a training script that is there; or exit 2."""
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and smaller than --steps")
    if args.pin and not shutil.which("taskset"):
        parser.error("--pin needs taskset (util-linux)")
    if not args.micro and not args.script.is_file():
        parser.error(f"no training script at {args.script}")


# ---------------------------------------------------------------------------------------------------------
# the command


def main(argv: list[str] | None = None) -> int:
    """The benchmark: its pairs and the micro section, --micro alone, or --pool; the exit status."""
    args = parse_args(argv)
    if args.pool:
        return pool_command(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks kill the ranks
    import torch

    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        print(
            f"overhead: error: --device cuda with --ranks {args.ranks}: NCCL takes one rank per GPU, and "
            f"torch sees {torch.cuda.device_count()} GPU(s) here",
            file=sys.stderr,
        )
        return 2
    results = run_record(args, torch.__version__, torch.cuda.is_available())
    print(
        f"flare-exporter overhead benchmark  {results['date']}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  python {platform.python_version()}"
    )
    flare_env = results["flare_env"]
    if flare_env:
        print("exporter settings from the environment: " + " ".join(f"{k}={v}" for k, v in flare_env.items()))
    try:
        if not args.micro:
            results.update(interleaved(args) if args.interleave else ab(args))
        micro_result = micro()
        print_micro(micro_result)
        results["micro"] = micro_result
    except RunError as error:
        print(f"overhead: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def pool_command(args: argparse.Namespace) -> int:
    """--pool: the runs' pairs pooled and summarized (and written with --json); 2 if they do not pool."""
    try:
        pooled = pool(args.pool, run_config(parse_args([])))
    except PoolError as error:
        print(f"overhead: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(pooled, indent=2) + "\n")
    return 0


def run_record(args: argparse.Namespace, torch_version: str, cuda: bool) -> dict[str, object]:
    """What a run's results start with: when, on what machine, the job, the FLARE_* settings, the code."""
    flare_env = {
        key: value
        for key, value in sorted(os.environ.items())
        if key.startswith("FLARE_") and key not in ("FLARE_PORT", "FLARE_ADDR", "FLARE_FILE_SD_DIR")
    }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch_version,
            "cuda": cuda,
        },
        "config": run_config(args),
        "flare_env": flare_env,
        "revision": code_revision(),
        "code": code_digest(args.script, *([BURNER] if args.burn else [])),
    }


def cpu_model() -> str | None:
    """The CPU's model name (Linux), part of the machine a run was measured on."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(
                (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None
            )
    except OSError:
        return None


def run_config(args: argparse.Namespace) -> dict[str, object]:
    """The settings that make a run's job what it is (the results' "config")."""
    settings = (
        "pairs",
        "ranks",
        "steps",
        "warmup",
        "batch",
        "device",
        "width",
        "control",
        "scrape_interval",
        "interleave",
        "placebo",
        "burn",
        "burn_in",
        "pin",
    )
    return {**{name: getattr(args, name) for name in settings}, "script": os.path.relpath(args.script, REPO)}


def _git(*arguments: str) -> str:
    command = ["git", "-C", str(REPO), *arguments]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def code_revision() -> str | None:
    """The checkout measured: its git commit, and where the tracked files differ from it "+" and a digest of
    the difference; None outside git. Recorded for the reader; --pool compares `code_digest`."""
    try:
        commit, changes = _git("rev-parse", "--short=12", "HEAD").strip(), _git("diff", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + (f"+{hashlib.sha256(changes.encode()).hexdigest()[:12]}" if changes else "")


# What a run executes besides torch and the training script: the package (its Python and C++), this benchmark
# (overhead.py and its modules, overhead_*.py) and its control.
MEASURED_CODE = ("flare_exporter", "benchmarks/overhead*.py", "benchmarks/loaded.py")


def code_digest(script: Path, *extra: Path) -> str | None:
    """A digest of the files a run executes, as they are on disk (committed or not), and of the training
    script (and `extra` files: a placebo's burner): two runs pool when it is the same, whatever else changed
    between them (notes, tests, other benchmarks, results). None outside git."""
    try:
        listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *MEASURED_CODE)
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {path: REPO / path for path in listed.split("\0") if path}
    files["script:" + script.name] = script
    files.update({"extra:" + path.name: path for path in extra})
    digest = hashlib.sha256()
    for name, file in sorted(files.items()):
        if file.is_file():  # a tracked file deleted in the working tree is not run
            digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:16]


def job_text(args: argparse.Namespace) -> str:
    """The job line's start: the script, its ranks and where they train, its steps and batch."""
    where = "NCCL ranks on the GPU" if args.device == "cuda" else "gloo ranks"
    width = f", width {args.width}" if args.width else ""
    return (
        f"{os.path.relpath(args.script, REPO)} on {args.ranks} {where}, {args.steps} steps "
        f"({args.warmup} warm-up dropped), batch {args.batch}{width}"
    )


def job_note(args: argparse.Namespace) -> str:
    """The job line's notes: what the side without the exporter runs, where it is not the plain script, and
    where the ranks are pinned."""
    note = ""
    if args.control == "loaded":
        note += "; the side without: flare's code loaded, nothing attached (benchmarks/loaded.py)"
    if args.pin:
        note += "; ranks pinned to CPUs " + ",".join(str(pinned_cpu(rank)) for rank in range(args.ranks))
    return note


def scrapes_text(args: argparse.Namespace) -> str:
    """The job line's word on the scrapes of the side with the exporter."""
    return f"exporter scraped every {args.scrape_interval:g} s" if args.scrape_interval else "no scrapes"


def sides_text(args: argparse.Namespace) -> str:
    """The job line's word on the side 'with' of interleaved pairs: a placebo (and what it burns), or the
    exporter's scrapes."""
    if not args.placebo:
        return scrapes_text(args)
    text = "PLACEBO: neither with the exporter"
    if args.burn:
        text += f"; the side 'with' burns {args.burn:.2%} of each rank's CPU"
        if args.burn_in == "interpreter":
            text += " in the interpreter (GIL held)"
    return text


# ---------------------------------------------------------------------------------------------------------
# A/B: a pair's two runs one after the other


@dataclass
class RunResult:
    """One run of the job, one side of a sequential pair: medians over its ranks."""

    with_exporter: bool
    step_time: float  # median over ranks of the per-rank median step time, seconds
    rank_medians: list[float]
    wall_s: float
    cpu_s: float  # median over ranks of the CPU time (user + system) of the whole rank process
    # CPU per step after the warm-up, median over ranks: the training thread's (median over steps) and the
    # whole process's (mean over steps: background threads work in bursts). Much steadier than step times
    # on a shared machine, where a run's steps wait for cores; what flare adds to them is its cost.
    thread_cpu: float
    process_cpu: float
    scrapes: ScrapeCounts | None
    # CPU per step of each Python thread by name (the exporter's flare-* threads), median over ranks
    threads_cpu: dict[str, float] = field(default_factory=dict)
    scrape_cost_s: float | None = None  # median over ranks of scrape_cost; None without scrapes


def run_job(args: argparse.Namespace, with_exporter: bool, workdir: Path, label: str) -> RunResult:
    """Run the job once to its end, scraped if `with_exporter` (and --scrape-interval), and measure it."""
    scraper = None
    started = time.monotonic()
    job = start_job(args, with_exporter, workdir, label)
    try:
        if with_exporter and args.scrape_interval:
            scraper = Scraper(job.base_port, args.ranks, args.scrape_interval)
            scraper.start()
        deadline = started + args.timeout
        while not job.poll():
            if time.monotonic() > deadline:
                raise job.timed_out(args.timeout)
            time.sleep(0.02)
        wall = time.monotonic() - started
    finally:
        if scraper is not None:
            scraper.stop()
        job.kill()

    reports = job.reports(args.warmup)
    rank_medians, thread_cpu, costs = [], [], []
    for reported in reports:
        times = reported["step_times"]
        rank_medians.append(statistics.median(times[args.warmup :]))
        thread_cpu.append(statistics.median(reported["step_cpu"][args.warmup :]))
        if scraper is not None:
            cost = scrape_cost(reported["step_ends"], scraper.rounds, args.warmup)
            if cost is not None:
                costs.append(cost)
    scrapes = scraper.counts([training_span(r) for r in reports]) if scraper is not None else None
    return RunResult(
        with_exporter,
        statistics.median(rank_medians),
        rank_medians,
        wall,
        statistics.median(cpu for cpu in job.cpu_s if cpu is not None),
        statistics.median(thread_cpu),
        process_cpu_per_step(reports, args.warmup),
        scrapes,
        threads_cpu_per_step(reports),
        statistics.median(costs) if costs else None,
    )


def ab(args: argparse.Namespace) -> dict[str, object]:
    """`args.pairs` pairs of runs, one job after the other, the order alternating from pair to pair."""
    print(f"job: {job_text(args)}; {args.pairs} pairs, " + scrapes_text(args) + job_note(args))
    print(
        f"{'pair':>4}  {'order':5}  {'without ms':>10}  {'with ms':>9}  {'ratio':>7}  "
        f"{'cpu s without/with':18}  {'thread cpu':>10}  {'process cpu':>11}  scrapes ok/failed  "
        "ms per round"
    )
    pairs = []
    scrapes = ScrapeCounts()
    retried: list[str] = []
    with tempfile.TemporaryDirectory(prefix="flare-overhead-") as tmp:
        for pair in range(1, args.pairs + 1):
            pairs.append(sequential_pair(args, pair, Path(tmp), scrapes, retried))
    return {"pairs": pairs, "summary": sequential_summary(pairs, scrapes, retried, args.scrape_interval)}


def sequential_pair(
    args: argparse.Namespace, pair: int, tmp: Path, scrapes: ScrapeCounts, retried: list[str]
) -> dict[str, object]:
    """Pair `pair`'s two runs, A/B in odd pairs and B/A in even ones, so that slow drift of the machine
    cancels out: its line printed, its scrapes added to `scrapes`, its figures returned."""
    order = (False, True) if pair % 2 == 1 else (True, False)
    runs: dict[bool, RunResult] = {}
    for with_exporter in order:
        name = "with" if with_exporter else "without"
        label = f"pair {pair} run {name} exporter"
        runs[with_exporter] = retrying(
            args.retries,
            retried,
            partial(run_job, args, with_exporter, label=label),
            tmp / f"pair{pair}-{JOB_DIRS[with_exporter]}",
        )
    without, with_ = runs[False], runs[True]
    run_scrapes = with_.scrapes or ScrapeCounts()  # none when --scrape-interval is 0
    scrapes.add(run_scrapes)
    ratio = with_.step_time / without.step_time
    thread_ratio = with_.thread_cpu / without.thread_cpu
    process_ratio = with_.process_cpu / without.process_cpu
    order_text = "A/B" if not order[0] else "B/A"
    silent = run_scrapes.never_answered
    note = f"  (never answered: ranks {silent})" if silent else ""
    if with_.scrape_cost_s is not None:
        note = f"  {with_.scrape_cost_s * 1e3:11.2f}{note}"
    print(
        f"{pair:>4}  {order_text:5}  {without.step_time * 1e3:10.3f}  "
        f"{with_.step_time * 1e3:9.3f}  {ratio:7.4f}  {without.cpu_s:6.2f}/{with_.cpu_s:6.2f}  "
        f"{thread_ratio:10.4f}  {process_ratio:11.4f}  {run_scrapes.done}/{run_scrapes.failed}{note}",
        flush=True,
    )
    return {
        "pair": pair,
        "order": order_text,
        "ratio": ratio,
        "thread_cpu_ratio": thread_ratio,
        "process_cpu_ratio": process_ratio,
        "without": asdict(without),
        "with": asdict(with_),
    }


# ---------------------------------------------------------------------------------------------------------
# interleaved: both jobs at once, each paused while the other runs


def run_interleaved(
    args: argparse.Namespace, tmp: Path, with_first: bool
) -> tuple[list[tuple[bool, Span]], Job, Job, Scraper | None]:
    """Start both jobs, hold each at its first step until both are ready, then run them in turn for
    `args.interleave` seconds each, the other paused (SIGSTOP) meanwhile, until both have finished. The job
    with the exporter is started first and runs first if `with_first`, else the one without."""
    go = {with_exporter: tmp / f"go-{name}" for with_exporter, name in JOB_DIRS.items()}
    jobs = {
        with_exporter: start_job(
            args,
            with_exporter and not args.placebo,
            tmp / JOB_DIRS[with_exporter],
            f"interleaved run {'with' if with_exporter else 'without'} exporter",
            "--start-after",
            str(go[with_exporter]),
            burn=args.burn if with_exporter and args.placebo else 0.0,
        )
        for with_exporter in (with_first, not with_first)
    }
    scraper = None
    try:
        deadline = time.monotonic() + args.timeout
        wait_until_ready(jobs, go, deadline, args.timeout)
        jobs[not with_first].signal(signal.SIGSTOP)
        for path in go.values():
            path.touch()
        if args.scrape_interval and not args.placebo:
            scraper = Scraper(jobs[True].base_port, args.ranks, args.scrape_interval, gated=True)
            scraper.start()
        slices = take_turns(jobs, with_first, scraper, args.interleave, deadline, args.timeout)
    finally:
        if scraper is not None:
            scraper.stop()
        for job in jobs.values():
            job.signal(signal.SIGCONT)
            job.kill()
    return slices, jobs[False], jobs[True], scraper


def wait_until_ready(jobs: dict[bool, Job], go: dict[bool, Path], deadline: float, timeout: float) -> None:
    """Wait until every rank of both jobs has started: a rank writes the ready file once its job's group is
    formed."""
    while waiting := [job for w, job in jobs.items() if not Path(f"{go[w]}.ready").exists()]:
        if any(job.poll() for job in jobs.values()):
            raise RunError(f"{next(j for j in jobs.values() if j.done).label}: ended before training")
        if time.monotonic() > deadline:
            raise waiting[0].timed_out(timeout)
        time.sleep(0.02)


def take_turns(
    jobs: dict[bool, Job],
    running: bool,
    scraper: Scraper | None,
    turn_s: float,
    deadline: float,
    timeout: float,
) -> list[tuple[bool, Span]]:
    """Run the jobs in turns of `turn_s` seconds, the job `running` (with the exporter, or not) first, the
    other paused, until both have finished; only the exporter's job is scraped, and only while it runs.
    Returns each turn: (with the exporter, wall time span), in order."""
    slices: list[tuple[bool, Span]] = []
    while True:
        job, other = jobs[running], jobs[not running]
        began = time.time()
        scraped = scraper if running else None  # only the exporter's job is scraped
        if scraped is not None:
            scraped.resume()
        while time.time() - began < turn_s and not job.poll():
            if time.monotonic() > deadline:
                raise job.timed_out(timeout)
            time.sleep(0.01)
        if other.done:
            slices.append((running, (began, time.time())))
            if job.done:
                return slices
            continue  # the other has finished: this one runs on alone
        if scraped is not None:
            scraped.pause(partial(job.signal, signal.SIGSTOP))
        else:
            job.signal(signal.SIGSTOP)
        slices.append((running, (began, time.time())))
        other.signal(signal.SIGCONT)
        running = not running


def interleaved(args: argparse.Namespace) -> dict[str, object]:
    """`args.pairs` pairs of jobs, each pair run at once in turns, the job that starts and runs first
    alternating: a pair's ratio is the median over its slices of each against the two of the other job
    around it (slice_pairs). Within a pair the machine's drift cancels; what differs from one pair to the
    next (where each job's processes landed: their memory layout, drawn anew per job, and their cores)
    shows as the spread of the pairs' ratios, which the confidence interval covers."""
    print(
        f"job: {job_text(args)}; {args.pairs} pairs, each pair's two jobs at "
        f"once, taking turns of {args.interleave:g} s (the other paused), "
        + sides_text(args)
        + job_note(args)
    )
    print(
        f"{'pair':>4}  {'first':5}  {'slices':>6}  {'without ms':>10}  {'with ms':>9}  {'ratio':>7}  "
        f"{'thread cpu':>10}  scrapes ok/failed  rounds a second"
    )
    pairs = []
    scrapes = ScrapeCounts()
    retried: list[str] = []
    with tempfile.TemporaryDirectory(prefix="flare-overhead-") as tmp:
        for pair in range(1, args.pairs + 1):
            pairs.append(interleaved_pair(args, pair, Path(tmp), scrapes, retried))
    summary = interleaved_summary(pairs, scrapes, args.placebo)
    return {"interleaved": {"pairs": pairs, "summary": summary, "retried": retried}}


def interleaved_pair(
    args: argparse.Namespace, pair: int, tmp: Path, scrapes: ScrapeCounts, retried: list[str]
) -> dict[str, object]:
    """Pair `pair`'s two jobs run at once in turns, the one with the exporter first in even pairs: its line
    printed, its scrapes added to `scrapes`, its figures returned."""
    with_first = pair % 2 == 0  # which job starts and runs first alternates from pair to pair
    slices, without, with_, scraper = retrying(
        args.retries,
        retried,
        partial(run_interleaved, args, with_first=with_first),
        tmp / f"pair{pair}",
    )
    reports_with, reports_without = with_.reports(args.warmup), without.reports(args.warmup)
    measured = slice_pairs(slices, reports_without, reports_with, args.warmup)
    if not measured:
        raise RunError(
            f"pair {pair}: no slice with the exporter lay between two without it with "
            f"{MIN_SLICE_STEPS} steps each: add --steps or --interleave"
        )
    result = {
        "pair": pair,
        "first": "B" if with_first else "A",
        "turns": "".join("B" if with_exporter else "A" for with_exporter, _ in slices),
        "layout_pads": {"without": without.layout_pad, "with": with_.layout_pad},
        "slices": measured,
        "step_time_without": statistics.median(m["step_time_without"] for m in measured),
        "step_time_with": statistics.median(m["step_time_with"] for m in measured),
        "ratio": statistics.median(m["ratio"] for m in measured),
        "thread_cpu_ratio": statistics.median(m["thread_cpu_ratio"] for m in measured),
        "process_cpu_without": process_cpu_per_step(reports_without, args.warmup),
        "exporter_threads_cpu": exporter_threads(threads_cpu_per_step(reports_with)),
        "rank_cpus": {  # the CPUs each rank could run on, by rank
            side: [report.get("cpus") for report in reports]
            for side, reports in (("without", reports_without), ("with", reports_with))
        },
    }
    scrape_text = "" if scraper is None else scrape_figures(result, scraper, slices, reports_with, scrapes)
    print(
        f"{pair:>4}  {result['first']:5}  {len(measured):>6}  "
        f"{result['step_time_without'] * 1e3:10.3f}  {result['step_time_with'] * 1e3:9.3f}  "
        f"{result['ratio']:7.4f}  "
        f"{result['thread_cpu_ratio']:10.4f}  {scrape_text}",
        flush=True,
    )
    return result


def scrape_figures(
    result: dict[str, object],
    scraper: Scraper,
    slices: list[tuple[bool, Span]],
    reports_with: list[dict],
    scrapes: ScrapeCounts,
) -> str:
    """Add to a pair's `result` its scrape rounds a second and the endpoint's CPU per scrape, and its
    counts to `scrapes`; returns the pair line's scrape columns."""
    run_scrapes = scraper.counts([training_span(report) for report in reports_with])
    scrapes.add(run_scrapes)
    scraped_s = sum(ended - began for with_exporter, (began, ended) in slices if with_exporter)
    rate = result["scrape_rounds_per_second"] = len(scraper.rounds) / scraped_s
    result["scrape_cpu"] = scrape_cpu(reports_with, len(scraper.rounds))
    return f"{run_scrapes.done:>6}/{run_scrapes.failed:<10}  {rate:.2f}"


if __name__ == "__main__":
    sys.exit(main())
