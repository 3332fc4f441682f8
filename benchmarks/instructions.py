"""What flare-exporter adds to a training step, in instructions: counted by valgrind, not timed.

    python benchmarks/instructions.py                       # 1 rank, 40 and 240 steps, three sides
    python benchmarks/instructions.py --short 20 --long 120 --json out.json --keep DIR  # callgrind's files

Step times on a shared 2-core machine differ by a few per cent from run to run; instructions do not depend on
what else the machine runs. Each run executes flare_exporter/local/workloads/train_ddp.py as one gloo rank
(world size 1) under `valgrind --tool=callgrind --separate-threads=yes`, instrumentation off until the rank
is ready to train (`--start-after`), and reads each thread's total when it exits, the training thread's up
to the interpreter's exit (`--dump-before=Py_FinalizeEx`: the exit's collections over the whole heap cost
more the longer the run lasted in wall time). Each side runs `--short` and `--long` steps; the difference
over the difference in steps is the instructions per step of each thread, start-up cancelled. The sides:

- without: `python train_ddp.py`; with: under `python -m flare_exporter.launch`, every signal at its
  defaults, nothing scraping it;
- scraped: the same, the rank GETting its own /metrics every `--scrape-every` steps (`train_ddp.py
  --scrape-every`), so that each render covers the same steps. Beyond `with`, the exporter's threads'
  instructions per scrape are a scrape's cost; weighed per step of a job scraped every
  `--job-steps-per-scrape` steps (125: a second of 8 ms steps), its share of a step;
- `--loaded`: under `benchmarks/loaded.py` (flare's code loaded, nothing attached);
- `--variant NAME:FLARE_KEY=VALUE[,...]` (repeatable): with the exporter and those variables, against `with`.

The exporter's other threads wake on the clock, not per step, and a step takes about a hundred times longer
under valgrind: their count per step here overstates them (overhead.py's CPU per thread is their cost), and
a scrape's count is an upper bound. valgrind runs threads one at a time: what they cost the training thread
through shared cores is not counted. `--cache-sim` adds callgrind's cache and branch simulation and prints
the training thread's misses and mispredictions per step and a cycle estimate, CEst = Ir + 10 × (L1 misses
+ mispredicted branches).

Exit status: 0 when every run completed, 1 when one failed (valgrind missing, a rank that exited non-zero),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from flare_exporter.local.jobs import free_port, free_port_block

SCRIPT = REPO / "flare_exporter" / "local" / "workloads" / "train_ddp.py"
EVENTS = re.compile(rb"^events: (.+)$", re.MULTILINE)
TOTALS = re.compile(rb"^totals: (.+)$", re.MULTILINE)
# callgrind's events with --cache-sim=yes --branch-sim=yes: instructions (Ir), data reads and writes (Dr, Dw);
# L1 misses (I1mr, D1mr, D1mw) and last-level misses (ILmr, DLmr, DLmw); conditional and indirect branches
# (Bc, Bi) and their mispredictions (Bcm, Bim)
L1_MISSES = ("I1mr", "D1mr", "D1mw")
MISPREDICTIONS = ("Bcm", "Bim")
SIDES = ("without", "loaded", "with")  # what runs the script: python, benchmarks/loaded.py, the launcher
READY_TIMEOUT_S = 600.0
COLLECTOR = re.compile(rb"^\s*([\d,]+) .*gcmodule\.c:gc_collect_main \[", re.MULTILINE)


class RunError(RuntimeError):
    """A run could not be measured; the message names the run and why."""


def thread_events(out_dir: Path, pid: int) -> dict[int, dict[str, int]]:
    """Each thread's event totals (1: the main thread, up to the interpreter's exit) from callgrind's
    per-thread output files, the part dumped before Py_FinalizeEx (cg.PID.1-NN) and the rest (cg.PID-NN):
    {"Ir": n} alone, or every simulated event with --cache-sim."""
    counts: dict[int, dict[str, int]] = {}
    for path in [*out_dir.glob(f"cg.{pid}.1-*"), *out_dir.glob(f"cg.{pid}-*")]:
        data = path.read_bytes()
        events, totals = EVENTS.search(data), TOTALS.search(data)
        thread = int(path.name.rsplit("-", 1)[1])
        if not (events and totals) or (thread == 1 and ".1-" not in path.name and 1 in counts):
            continue  # the training thread's exit is left out
        names, values = events.group(1).decode().split(), map(int, totals.group(1).split())
        part = dict(zip(names, values, strict=True))
        counts[thread] = {name: counts.get(thread, {}).get(name, 0) + value for name, value in part.items()}
    return counts


def collector_instructions(out_dir: Path, pid: int) -> int | None:
    """The training thread's instructions in CPython's collector (gc_collect_main's, inclusive); None where
    callgrind_annotate is missing or fails. Collections fall due after every thread's allocations: the
    exporter's, which wake on the clock (~100 times more per step under valgrind), bring some forward."""
    paths = [*out_dir.glob(f"cg.{pid}.1-01"), *out_dir.glob(f"cg.{pid}-01")]
    if not paths or shutil.which("callgrind_annotate") is None:
        return None
    annotate = ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(paths[0])]
    annotated = subprocess.run(annotate, capture_output=True, timeout=600)
    found = COLLECTOR.search(annotated.stdout)
    return int(found.group(1).replace(b",", b"")) if found else (None if annotated.returncode else 0)


def cycle_estimate(events: dict[str, float]) -> float:
    """kcachegrind's cycle estimate of callgrind's simulated events, less its last-level term: Ir + 10 x (L1
    misses + mispredicted branches). The simulated last level (this host's, hundreds of MiB) misses only on
    a line's first touch, which differs from run to run by more than the training thread's misses per step."""
    l1 = sum(events.get(name, 0) for name in L1_MISSES)
    mispredicted = sum(events.get(name, 0) for name in MISPREDICTIONS)
    return events["Ir"] + 10 * (l1 + mispredicted)


def training_events_per_step(
    short: dict[int, dict[str, int]], long: dict[int, dict[str, int]], steps: int
) -> dict[str, float]:
    """The training thread's events per step between the two runs, with its cycle estimate (CEst)."""
    per_step = {name: (long[1][name] - short[1].get(name, 0)) / steps for name in long[1]}
    if "Bcm" in per_step:
        per_step["CEst"] = cycle_estimate(per_step)
    return per_step


class Side(NamedTuple):
    """What one side runs as (one of SIDES), its steps between scrapes (0: none), and the environment it adds
    (a --variant's FLARE_* variables)."""

    runs_as: str
    scrape_every: int = 0
    env: tuple[tuple[str, str], ...] = ()


def run(
    side: Side, steps: int, workdir: Path, timeout: float, cache_sim: bool = False
) -> dict[int, dict[str, int]]:
    """One rank of `steps` steps under callgrind, counted from its first step: events per thread
    (thread_events). With `side.scrape_every`, the rank GETs its exporter's /metrics every that many
    steps."""
    with_exporter = side.runs_as == "with"
    label = (
        "flare loaded" if side.runs_as == "loaded" else f"{side.runs_as} the exporter"
    ) + f", {steps} steps"
    if side.scrape_every:
        label += f", scraped every {side.scrape_every}"
    if side.env:
        label += ", " + ", ".join(f"{name}={value}" for name, value in side.env)
    workdir.mkdir(parents=True)
    start = workdir / "start"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    if with_exporter:
        env.update(FLARE_PORT=str(free_port_block(1)), FLARE_ADDR="127.0.0.1", FLARE_RUN="instructions")
        env.setdefault("FLARE_NVML_MODULE", "flare_exporter.local.testing.fake_nvml")
        env.update(side.env)
    prefix = {
        "without": [],
        "loaded": [str(REPO / "benchmarks" / "loaded.py")],
        "with": ["-m", "flare_exporter.launch"],
    }
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
    valgrind += ["--cache-sim=yes", "--branch-sim=yes"] if cache_sim else []
    command = [*valgrind, f"--callgrind-out-file={workdir}/cg.%p", sys.executable, *prefix[side.runs_as]]
    command += [str(SCRIPT), "--steps", str(steps), "--start-after", str(start)]
    command += ["--scrape-every", str(side.scrape_every)] if side.scrape_every else []
    log = workdir / "log.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        ready = Path(f"{start}.ready")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RunError(f"{label}: the rank never got ready to train; log: {_tail(log)}")
            time.sleep(0.1)  # polling a file the rank writes: there is nothing to wait on instead
        control = subprocess.run(
            ["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        if control.returncode != 0:
            raise RunError(f"{label}: callgrind_control failed: {control.stderr.strip() or control.stdout}")
        start.touch()
        if proc.wait(timeout=timeout) != 0:
            raise RunError(f"{label}: the rank exited with code {proc.returncode}; log: {_tail(log)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    counts = thread_events(workdir, proc.pid)
    if 1 not in counts:
        raise RunError(f"{label}: callgrind wrote no count for the main thread; log: {_tail(log)}")
    if (collector := collector_instructions(workdir, proc.pid)) is not None:
        counts[1]["GC"] = collector
    return counts


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:]) if lines else "(empty)"


def per_step(short: dict[int, int], long: dict[int, int], steps: int) -> tuple[float, float]:
    """(training thread, every other thread) instructions per step between the two runs."""
    main = (long[1] - short[1]) / steps
    others = (sum(long.values()) - long[1] - (sum(short.values()) - short[1])) / steps
    return main, others


Runs = tuple[dict[int, int], dict[int, int]]  # a side's (short run, long run): instructions per thread


def thread_growth_per_scrape(unscraped: Runs, scraped: Runs, scrapes: int) -> dict[int, float]:
    """Each thread's instructions per scrape beyond the unscraped side's (both with the exporter), between
    the short and the long runs ((short, long) per side; threads numbered by callgrind in the order they
    start, the same on both sides). The training thread's (1) are the GET it makes (a Prometheus's,
    elsewhere); the others' sum is what a scrape costs the exporter (the render, its drain, the server's
    side of the HTTP exchange). The endpoint's thread runs for scrapes only: its growth is a scrape's own,
    the steady measure; threads that wake on the clock (the timing manager, the samplers) move from run to
    run. The drain's work on each collective and sample is done on both sides (by the timing manager on
    its clock where nothing scrapes): it counts only as far as draining more often costs more."""

    def growth(runs: Runs, thread: int) -> int:
        return runs[1].get(thread, 0) - runs[0].get(thread, 0)

    threads = sorted(set(unscraped[1]) | set(scraped[1]))
    return {thread: (growth(scraped, thread) - growth(unscraped, thread)) / scrapes for thread in threads}


def instructions_of(events: dict[int, dict[str, int]]) -> dict[int, int]:
    """Each thread's instructions, of its events."""
    return {thread: counts["Ir"] for thread, counts in events.items()}


SIMULATED = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw", "Bcm", "Bim", "CEst")


def print_simulated(training: dict[str, dict[str, float]]) -> None:
    """The training thread's simulated events per step on each side, and each side's ratios to without."""
    print("  the training thread per step, simulated (L1: 32 KiB each; last level: first touches only;")
    print("  mispredicted conditional and indirect branches; CEst: Ir + 10 x (L1 misses + mispredictions)):")
    print("  " + f"{'':8}" + "".join(f"{name:>11}" for name in SIMULATED))
    without = training["without"]
    for side, events in training.items():
        print(f"  {side:8}" + "".join(f"{events[name]:11,.0f}" for name in SIMULATED))
        if side != "without":
            ratios = [
                events[name] / without[name] if without[name] > 0 else float("nan") for name in SIMULATED
            ]
            print(f"  {'  / without':8}" + "".join(f"{ratio:11.4f}" for ratio in ratios))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: exit 2 on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default, says in (
        ("--short", int, 40, "steps of the short runs"),
        ("--long", int, 240, "steps of the long runs"),
        ("--timeout", float, 1200.0, "seconds one run may take"),
        ("--scrape-every", int, 20, "steps between two scrapes in the scraped runs (0: no scraped runs)"),
        (
            "--job-steps-per-scrape",
            int,
            125,
            "steps of a real job between two scrapes (a second of 8 ms steps)",
        ),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{says} (default {default})")
    parser.add_argument("--cache-sim", action="store_true", help="also simulate the caches and branches")
    parser.add_argument(
        "--loaded", action="store_true", help="add a side with flare's code loaded, not attached"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=variant,
        metavar="NAME:FLARE_KEY=VALUE[,...]",
        help="add a side with the exporter and these FLARE_* variables set, compared with `with` "
        "(repeatable; e.g. perf_off:FLARE_PERF=0)",
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument(
        "--keep", default="", metavar="DIR", help="keep callgrind's files in DIR (for callgrind_annotate)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.short < args.long:
        parser.error(f"--short ({args.short}) must be positive and below --long ({args.long})")
    if args.scrape_every < 0 or (args.scrape_every and not scrapes_between(args)):
        parser.error(
            f"--scrape-every ({args.scrape_every}) must leave the long runs more scrapes than the short"
        )
    if args.job_steps_per_scrape <= 0:
        parser.error(f"--job-steps-per-scrape ({args.job_steps_per_scrape}) must be positive")
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names):
        parser.error(f"--variant names must differ ({', '.join(names)})")
    return args


VARIANT = re.compile(r"^(\w+):(FLARE_\w+=[^,]*(?:,FLARE_\w+=[^,]*)*)$")


def variant(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """--variant's value: its name and its (variable, value) pairs."""
    found = VARIANT.match(text)
    if found is None or found.group(1) in (*SIDES, "scraped"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME:FLARE_KEY=VALUE[,FLARE_KEY=VALUE...] with a NAME of its own"
        )
    pairs = tuple(
        (name, value) for name, _, value in (pair.partition("=") for pair in found.group(2).split(","))
    )
    return found.group(1), pairs


def scrapes_between(args: argparse.Namespace) -> int:
    """The scrapes a long scraped run makes beyond a short one's (0: no scraped side)."""
    return args.long // args.scrape_every - args.short // args.scrape_every if args.scrape_every > 0 else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scrapes = scrapes_between(args)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions: error: valgrind (callgrind_control) is not installed", file=sys.stderr)
        return 1
    print(
        f"flare instruction-count benchmark: 1 gloo rank, {args.short} and {args.long} steps per side"
        + (", caches and branches simulated" if args.cache_sim else "")
    )
    sides = {side: Side(side) for side in SIDES if side != "loaded" or args.loaded}
    if scrapes:
        sides["scraped"] = Side("with", args.scrape_every)
    sides |= {name: Side("with", env=env) for name, env in args.variant}
    try:
        results, runs, training = run_sides(args, sides)
    except RunError as error:
        print(f"instructions: error: {error}", file=sys.stderr)
        return 1
    if args.cache_sim:
        print_simulated(training)
    without, with_ = results["without"], results["with"]
    thread_ratio = with_["training_thread"] / without["training_thread"]
    print(
        f"  training thread: with / without {thread_ratio:.4f} "
        f"({with_['training_thread'] - without['training_thread']:+,.0f} instructions per step)"
    )
    print(
        "  (the other threads wake on the clock, not per step, and a step takes ~100 times longer under "
        "valgrind:\n   their count per step here is not what they cost at full speed; see overhead.py's "
        "CPU per thread)"
    )
    summary: dict[str, Any] = {"thread_ratio": thread_ratio}
    if args.cache_sim:
        summary["training_thread_events"] = training
    if scrapes:
        summary |= scrape_summary(args, runs, scrapes, without["training_thread"])
    if args.variant:
        summary["variants"] = variant_summary(results, [name for name, _ in args.variant])
    if args.json:
        Path(args.json).write_text(json.dumps({**results, **summary}, indent=2))
    return 0


def variant_summary(results: dict[str, dict[str, float]], names: list[str]) -> dict[str, dict[str, float]]:
    """Each --variant's training thread against the side `with` (the exporter at its defaults): the ratio and
    the instructions per step it adds (printed)."""
    with_ = results["with"]["training_thread"]
    summary = {}
    for name in names:
        training = results[name]["training_thread"]
        summary[name] = {"ratio_to_with": training / with_, "instructions_beyond_with": training - with_}
        print(f"  training thread: {name} / with {training / with_:.4f} ({training - with_:+,.0f} per step)")
    return summary


def run_sides(
    args: argparse.Namespace, sides: dict[str, Side]
) -> tuple[dict[str, dict[str, float]], dict[str, Runs], dict[str, dict[str, float]]]:
    """Each side's short and long runs: its instructions per step (training thread, other threads; printed),
    its runs' instructions per thread, and its training thread's events per step."""
    steps = args.long - args.short
    results: dict[str, dict[str, float]] = {}
    runs: dict[str, Runs] = {}
    training: dict[str, dict[str, float]] = {}  # the training thread's events per step, per side
    with tempfile.TemporaryDirectory(prefix="flare-instructions-") as scratch:
        tmp = args.keep or scratch
        for side, how in sides.items():
            short, long = (
                run(how, count, Path(tmp) / f"{side}-{name}", args.timeout, args.cache_sim)
                for name, count in (("short", args.short), ("long", args.long))
            )
            runs[side] = instructions_of(short), instructions_of(long)
            training[side] = training_events_per_step(short, long, steps)
            main_thread, others = per_step(*runs[side], steps)
            results[side] = {"training_thread": main_thread, "other_threads": others}
            if (collector := training[side].get("GC")) is not None:
                results[side]["training_thread_collector"] = collector
            gc = f" (collector {collector:,.0f})" if collector is not None else ""
            print(
                f"  {side:8} training thread {main_thread:12,.0f} instructions per step{gc}, "
                f"other threads {others:10,.0f} ({len(long)} threads)"
            )
    return results, runs, training


def scrape_summary(
    args: argparse.Namespace, runs: dict[str, Runs], scrapes: int, training_without: float
) -> dict[str, Any]:
    """A scrape's instructions, in the exporter's threads and in the GET, and its share of a step at one
    every `--job-steps-per-scrape`; each thread's growth per scrape (printed)."""
    by_thread = thread_growth_per_scrape(runs["with"], runs["scraped"], scrapes)
    scraper = by_thread.pop(1)  # the training thread's GET
    scrape = sum(by_thread.values())
    share = scrape / args.job_steps_per_scrape / training_without
    print(
        f"  a scrape (every {args.scrape_every} steps): {scrape:,.0f} instructions in the exporter's "
        f"threads (and {scraper:,.0f} in the GET, the scraper's);\n   one every "
        f"{args.job_steps_per_scrape} steps adds {100 * share:.2f} % to the training thread's "
        "instructions per step without the exporter"
    )
    endpoint = max(by_thread, key=lambda thread: by_thread[thread])
    others = ", ".join(
        f"thread {thread} {by_thread[thread]:+,.0f}"
        for thread in sorted(by_thread, key=lambda thread: -abs(by_thread[thread]))
        if thread != endpoint
    )
    print(
        f"  per thread, per scrape: the endpoint's (thread {endpoint}) {by_thread[endpoint]:+,.0f}, "
        f"the scrape's own; the others, which wake on the clock: {others}"
    )
    return {
        "endpoint_thread_instructions": by_thread[endpoint],
        "scrape_instructions": scrape,
        "scraper_instructions": scraper,
        "scrape_share_per_step": share,
    }


if __name__ == "__main__":
    sys.exit(main())
