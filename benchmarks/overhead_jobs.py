"""The overhead benchmark's jobs: a job's rank processes, started, paused, reaped and killed as one.

Imported by overhead.py, which puts the checkout on sys.path first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from overhead_scraper import Span

from flare_exporter.local.jobs import free_port, free_port_block

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
FAKE_NVML = "flare_exporter.local.testing.fake_nvml"
BURNER = REPO / "benchmarks" / "burner.py"
LOADED = REPO / "benchmarks" / "loaded.py"
# A job's working directory (its ranks' --report and --start-after paths) by side: names of one length, so
# that neither job's ranks start with longer arguments than the other's
JOB_DIRS = {False: "job-a", True: "job-b"}
# Where a process's data lands within its pages follows from every byte it allocated before, its arguments
# and environment included, and shifts its speed by a per cent or two one way or the other for its whole
# life. Each job's ranks get an environment variable of a random length below this, so that the layout is
# drawn anew for every job rather than fixed by what tells the two sides apart: it becomes one more
# difference between jobs, which the pairs average out, rather than a bias.
LAYOUT_PAD_BYTES = 4096
REPORT_KEYS = ("step_times", "step_cpu", "process_cpu", "step_ends")  # per step, from train_ddp.py --report


class RunError(Exception):
    """A run that did not complete; the message is one line naming the rank and its stderr tail.

    `at_exit`: every step was taken and reported, and a rank then died while exiting (gloo's teardown
    occasionally aborts under heavy CPU contention, seen in plain runs too); such a run may be retried.
    """

    def __init__(self, message: str, at_exit: bool = False) -> None:
        super().__init__(message)
        self.at_exit = at_exit


def retrying(retries: int, retried: list[str], run: Callable[[Path], T], workdir: Path) -> T:
    """`run` in `workdir`-1, and again in `workdir`-2, ... up to `retries` more times while it fails only
    because a rank crashed while exiting after all its steps (RunError.at_exit); each such failure is noted in
    `retried`. Any other failure ends the benchmark."""
    for attempt in itertools.count(1):
        try:
            return run(workdir.with_name(f"{workdir.name}-{attempt}"))
        except RunError as error:
            if not error.at_exit or attempt > retries:
                raise
            retried.append(str(error))
            print(f"      retrying: {error}", flush=True)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------------
# ports and processes


def _tail(path: Path, lines: int = 3, chars: int = 400) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no stderr file)"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    tail = " | ".join(kept) or "(stderr empty)"
    return tail if len(tail) <= chars else "..." + tail[-chars:]


def _reap(proc: subprocess.Popen) -> float | None:
    """If the rank has exited: reap it, set its returncode and return its CPU seconds; else None."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a rank and anything it started (each rank leads its own session); only while it is alive."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------------------------------------------
# a job


@dataclass
class Job:
    """One job's rank processes, each leading its own session (so that a signal reaches all it started)."""

    label: str
    workdir: Path
    procs: list[subprocess.Popen]
    base_port: int
    cpu_s: list[float | None]  # per rank, once it has exited: its CPU seconds (user + system)
    layout_pad: int = 0  # bytes of OVERHEAD_LAYOUT_PAD in its ranks' environment

    @property
    def done(self) -> bool:
        return all(cpu is not None for cpu in self.cpu_s)

    def poll(self) -> bool:
        """Reap the ranks that have exited; True once all have. A rank that failed raises RunError."""
        for rank, proc in enumerate(self.procs):
            if self.cpu_s[rank] is None and (cpu := _reap(proc)) is not None:
                self.cpu_s[rank] = cpu
                if proc.returncode != 0:
                    finished = (self.workdir / f"report{rank}.json").exists()
                    when = "after its last step, while exiting" if finished else "before its last step"
                    raise RunError(
                        f"{self.label}: rank {rank} exited with code {proc.returncode} {when}; "
                        f"stderr: {_tail(self.workdir / f'stderr{rank}.log')}",
                        at_exit=finished,
                    )
        return self.done

    def signal(self, signum: int) -> None:
        """Send `signum` to every rank still running (SIGSTOP / SIGCONT: pause and resume the whole job)."""
        for rank, proc in enumerate(self.procs):
            if self.cpu_s[rank] is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def timed_out(self, timeout: float) -> RunError:
        rank = next(r for r, cpu in enumerate(self.cpu_s) if cpu is None)
        return RunError(
            f"{self.label}: rank {rank} still running after the {timeout:.0f} s timeout; "
            f"stderr: {_tail(self.workdir / f'stderr{rank}.log')}"
        )

    def kill(self) -> None:
        for proc in self.procs:
            _kill_group(proc)

    def reports(self, warmup: int) -> list[dict]:
        """Each rank's report (train_ddp.py --report), checked to hold steps after the warm-up."""
        reports = []
        for rank in range(len(self.procs)):
            report = self.workdir / f"report{rank}.json"
            try:
                reported = json.loads(report.read_text())
                missing = [key for key in REPORT_KEYS if key not in reported]
                if missing:
                    raise KeyError(", ".join(missing))
            except (OSError, ValueError, KeyError) as error:
                raise RunError(
                    f"{self.label}: rank {rank} exited 0 but its report {report.name} is unusable "
                    f"({error}); stderr: {_tail(self.workdir / f'stderr{rank}.log')}"
                ) from None
            if len(reported["step_times"]) <= warmup:
                raise RunError(
                    f"{self.label}: rank {rank} reported {len(reported['step_times'])} steps, none after "
                    f"{warmup} warm-up steps"
                )
            reports.append(reported)
        return reports


def start_job(
    args: argparse.Namespace,
    with_exporter: bool,
    workdir: Path,
    label: str,
    *script_args: str,
    burn: float = 0.0,
) -> Job:
    """Start the job's ranks: the training script, under flare's launcher if `with_exporter`, else beside a
    thread that spends `burn` of each rank's CPU if that is set (benchmarks/burner.py, in the interpreter
    with `--burn-in interpreter`)."""
    workdir.mkdir(parents=True)
    master_port, base_port = free_port(), free_port_block(args.ranks)
    env = job_env(args, with_exporter, master_port, base_port)
    prefix = command_prefix(args, with_exporter, burn)
    # the pad recorded is the one its ranks get
    job = Job(label, workdir, [], base_port, [None] * args.ranks, len(env["OVERHEAD_LAYOUT_PAD"]))
    try:
        for rank in range(args.ranks):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            job.procs.append(
                start_rank(rank_command(args, prefix, workdir, rank, script_args), rank_env, workdir, rank)
            )
    except BaseException:
        job.kill()
        raise
    return job


def job_env(
    args: argparse.Namespace, with_exporter: bool, master_port: int, base_port: int
) -> dict[str, str]:
    """The environment every rank of a job shares: this one's, the group's rendezvous, a layout pad of a
    random length, and the exporter's settings if `with_exporter`."""
    env = dict(os.environ)  # FLARE_* settings pass through to the exporter (see the header line)
    env.pop("FLARE_FILE_SD_DIR", None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(args.ranks),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
        OVERHEAD_LAYOUT_PAD="." * random.randrange(LAYOUT_PAD_BYTES),
    )
    if with_exporter:
        env.update(FLARE_PORT=str(base_port), FLARE_ADDR="127.0.0.1")
        env.setdefault("FLARE_RUN", "overhead")
        # every signal on at its defaults: without a GPU, GPU health reads the fake NVML (its reader thread
        # polls every gpu_health_interval_seconds, as with a real GPU); on a GPU, NVML itself
        if args.device == "cpu":
            env.setdefault("FLARE_NVML_MODULE", FAKE_NVML)
    return env


def command_prefix(args: argparse.Namespace, with_exporter: bool, burn: float) -> list[str]:
    """What runs the training script: flare's launcher, the burner, the loaded control or plain Python."""
    if with_exporter:
        return [sys.executable, "-m", "flare_exporter.launch"]
    if burn:
        in_interpreter = ["--interpreter"] if args.burn_in == "interpreter" else []
        return [sys.executable, str(BURNER), *in_interpreter, repr(burn)]
    if args.control == "loaded":
        return [sys.executable, str(LOADED)]
    return [sys.executable]


def rank_command(
    args: argparse.Namespace, prefix: list[str], workdir: Path, rank: int, script_args: tuple[str, ...]
) -> list[str]:
    """One rank's command line: pinned with taskset if `--pin`, the training script and its arguments."""
    pinned = ["taskset", "--cpu-list", str(pinned_cpu(rank))] if args.pin else []
    return [
        *pinned,
        *prefix,
        str(args.script),
        *("--steps", str(args.steps), "--batch", str(args.batch)),
        *("--report", str(workdir / f"report{rank}.json")),
        *(("--device", args.device) if args.device != "cpu" else ()),
        *(("--width", str(args.width)) if args.width else ()),
        *script_args,
    ]


def start_rank(command: list[str], env: dict[str, str], workdir: Path, rank: int) -> subprocess.Popen:
    """Start one rank as the leader of its own session, its output in the job's directory."""
    stdout, stderr = workdir / f"stdout{rank}.log", workdir / f"stderr{rank}.log"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        return subprocess.Popen(
            command,
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def pinned_cpu(rank: int) -> int:
    """The CPU `--pin` puts `rank` on: rank r on the r-th (modulo) of the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[rank % len(cpus)]


def training_span(report: dict) -> Span:
    """(first step began, last step ended), wall time."""
    return report["step_ends"][0] - report["step_times"][0], report["step_ends"][-1]
