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
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from flare_exporter.local.jobs import free_port, free_port_block
from flare_exporter.local.testing import PROMETHEUS_SCRAPE_HEADERS
from flare_exporter.local.workloads import train_ddp

T = TypeVar("T")
GOAL_RATIO = 1.005
FAKE_NVML = "flare_exporter.local.testing.fake_nvml"
BURNER = REPO / "benchmarks" / "burner.py"
BURNER_THREAD = "burner"  # its thread's name (burner.py)
# A job's working directory (its ranks' --report and --start-after paths) by side: names of one length, so
# that neither job's ranks start with longer arguments than the other's
JOB_DIRS = {False: "job-a", True: "job-b"}
# Where a process's data lands within its pages follows from every byte it allocated before, its arguments
# and environment included, and shifts its speed by a per cent or two one way or the other for its whole
# life. Each job's ranks get an environment variable of a random length below this, so that the layout is
# drawn anew for every job rather than fixed by what tells the two sides apart: it becomes one more
# difference between jobs, which the pairs average out, rather than a bias.
LAYOUT_PAD_BYTES = 4096
SCRAPE_TIMEOUT_S = 2.0
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
# the scraper


@dataclass
class ScrapeCounts:
    done: int = 0  # attempts that returned flare metrics
    during_training: int = 0  # of those, the ones that started while the rank was taking its steps
    failed: int = 0  # attempts that failed between the rank's first answer and the end of its training
    startup: int = 0  # refused before the rank's endpoint first answered (the rank is still importing torch)
    shutdown: int = 0  # failed after the rank finished training (its endpoint closes as the process exits)
    never_answered: list[int] = field(default_factory=list)  # ranks that never answered in this run
    failures: list[str] = field(default_factory=list)  # first few failure reasons
    attempts: int = 0  # every attempt, whatever its outcome
    scraper_cpu_s: float = 0.0  # the scraper thread's CPU time: the benchmark's own, on the job's cores

    def add(self, other: ScrapeCounts) -> None:
        self.done += other.done
        self.during_training += other.during_training
        self.failed += other.failed
        self.startup += other.startup
        self.shutdown += other.shutdown
        self.never_answered += other.never_answered
        self.failures += other.failures[: max(0, 5 - len(self.failures))]
        self.attempts += other.attempts
        self.scraper_cpu_s += other.scraper_cpu_s


Span = tuple[float, float]  # (began, ended), wall time


READ_BYTES = 65536  # a socket read: below malloc's mmap threshold, and more than a rank's gzipped page
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a rank's page is tens of KiB; a larger Content-Length is not read


class ScrapeAnswerError(Exception):
    """An answer to a scrape that is not a whole HTTP response with a Content-Length."""


def scrape_request(port: int) -> bytes:
    """The bytes of a scrape of 127.0.0.1:`port`, as Prometheus asks: HTTP/1.1, its headers, gzip."""
    headers = "".join(f"{name}: {value}\r\n" for name, value in PROMETHEUS_SCRAPE_HEADERS.items())
    return f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}\r\n".encode("latin-1")


def exchange(connection: socket.socket, request: bytes) -> tuple[int, bytes, bool]:
    """Send `request` on a kept-alive connection and read the answer: (status, body, whether the connection
    stays open). The body is decompressed if it came gzipped.

    The scraper shares the job's cores, where Prometheus scrapes from another machine: so it reads the answer
    with as little work as it can (http.client parsed every header with the email package, and took about
    three times the CPU per scrape).
    """
    connection.sendall(request)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        if len(data) > READ_BYTES:
            raise ScrapeAnswerError("a response head over 64 KiB")
        chunk = connection.recv(READ_BYTES)
        if not chunk:
            raise ScrapeAnswerError("connection closed before a response")
        data += chunk
    status_line, _, fields = data[:end].decode("latin-1").partition("\r\n")
    body = data[end + 4 :]
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ScrapeAnswerError(f"not an HTTP response: {status_line[:80]!r}")
    lines = (line.partition(":") for line in fields.lower().split("\r\n"))
    header = {name.strip(): value.strip() for name, _, value in lines}
    if not header.get("content-length", "").isdigit():
        raise ScrapeAnswerError("a response without Content-Length")
    length = int(header["content-length"])
    if length > MAX_ANSWER_BYTES:
        raise ScrapeAnswerError(f"a body of {length} bytes, over {MAX_ANSWER_BYTES}")
    while len(body) < length:
        chunk = connection.recv(READ_BYTES)
        if not chunk:
            raise ScrapeAnswerError(f"truncated response: {length - len(body)} bytes missing")
        body += chunk
    if header.get("content-encoding") == "gzip":
        try:
            body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
        except zlib.error as error:
            raise ScrapeAnswerError(f"a gzip body that does not decompress: {error}") from None
    keep_alive = parts[0] == "HTTP/1.1" and header.get("connection") != "close"
    return int(parts[1]), body, keep_alive


class Scraper(threading.Thread):
    """Scrapes every rank's /metrics once per second until stopped, as Prometheus does: one kept-alive
    connection per rank, gzip and Prometheus's Accept header. Classifies failures afterwards."""

    def __init__(self, base_port: int, ranks: int, interval: float, gated: bool = False) -> None:
        super().__init__(name="overhead-scraper", daemon=True)
        self.interval = interval
        self.ports = [base_port + rank for rank in range(ranks)]
        self.connections: list[socket.socket | None] = [None] * ranks
        self.requests = [scrape_request(port) for port in self.ports]
        self.stop_event = threading.Event()
        # per rank: (wall time the attempt started, None if it succeeded else the reason)
        self.attempts: list[list[tuple[float, str | None]]] = [[] for _ in self.ports]
        self.cpu_seconds = 0.0  # this thread's own CPU: the benchmark's, on the same cores as the job
        self.rounds: list[Span] = []  # wall time each round's first request began, and its last ended
        # gated (interleaved runs): scrape only while the job runs, from resume() to pause(); a pause waits
        # for the round in flight, so that no request is left waiting on a paused rank
        self.running: threading.Event | None = threading.Event() if gated else None
        self._busy = threading.Lock()

    def resume(self) -> None:
        """The job runs again: scrape it (gated only)."""
        assert self.running is not None
        self.running.set()

    def pause(self, pause_job: Callable[[], None]) -> None:
        """Stop scraping, then `pause_job`, once the round in flight has its answers (gated only)."""
        assert self.running is not None
        with self._busy:
            self.running.clear()
            pause_job()

    def stop(self) -> None:
        """End the scrapes and wait for the thread (a round's requests time out in SCRAPE_TIMEOUT_S each)."""
        self.stop_event.set()
        if self.running is not None:
            self.running.set()  # out of its wait for a resume
        if self.is_alive():
            self.join(timeout=SCRAPE_TIMEOUT_S * len(self.ports) + 1)

    def run(self) -> None:
        # Prometheus scrapes from another machine; this thread shares the job's cores, so it takes their idle
        # time at the lowest priority rather than the ranks' (Linux: a thread's own nice value)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        started_cpu = time.thread_time()
        next_at = time.monotonic()
        while not self.stop_event.wait(max(0.0, next_at - time.monotonic())):
            if self.running is not None and not self.running.is_set():  # the job is paused
                self.running.wait()  # set by resume(), and by stop()
                next_at = time.monotonic() + self.interval / 2  # its first round half an interval in
                continue
            with self._busy:
                if self.stop_event.is_set() or (self.running is not None and not self.running.is_set()):
                    continue  # stopped, or paused, since the wait
                began, began_at = time.time(), time.monotonic()
                for rank in range(len(self.ports)):
                    self.attempts[rank].append((time.time(), self._scrape(rank)))
                self.rounds.append((began, time.time()))
            self.cpu_seconds = time.thread_time() - started_cpu
            # a round that began late (after a slow one) sets the pace from then on, rather than the next
            # ones catching up in a burst
            next_at = max(next_at, began_at) + self.interval
        for connection in self.connections:
            if connection is not None:
                connection.close()

    def _scrape(self, rank: int) -> str | None:
        connection = self.connections[rank]
        try:
            if connection is None:
                connection = socket.create_connection(("127.0.0.1", self.ports[rank]), SCRAPE_TIMEOUT_S)
                self.connections[rank] = connection
            status, body, keep_alive = exchange(connection, self.requests[rank])
        except (OSError, ScrapeAnswerError) as error:
            if connection is not None:
                connection.close()  # a new connection at the next attempt
            self.connections[rank] = None
            return f"{type(error).__name__}: {error}"
        if not keep_alive:
            connection.close()
            self.connections[rank] = None
        if status != 200:
            return f"HTTP {status}"
        if b"flare_" not in body:
            return "200 without flare_ metrics"
        return None

    def counts(self, training: list[tuple[float, float]]) -> ScrapeCounts:
        """Classify the attempts; `training` is each rank's (first step began, last step ended), wall time."""
        counts = ScrapeCounts(
            attempts=sum(len(attempts) for attempts in self.attempts), scraper_cpu_s=self.cpu_seconds
        )
        for rank, attempts in enumerate(self.attempts):
            answered = False
            trained_from, trained_until = training[rank]
            for at, failure in attempts:
                if failure is None:
                    answered = True
                    counts.done += 1
                    counts.during_training += trained_from <= at < trained_until
                elif not answered and "Refused" in failure:
                    counts.startup += 1
                elif at >= trained_until:
                    counts.shutdown += 1
                else:
                    counts.failed += 1
                    if len(counts.failures) < 5:
                        counts.failures.append(f"rank {rank}: {failure}")
            if not answered:
                counts.never_answered.append(rank)
        return counts


def scraper_cpu_text(scrapes: ScrapeCounts) -> str:
    """The benchmark's own scraper's CPU per attempt: what this machine's cores gave to Prometheus's part."""
    per_attempt = scrapes.scraper_cpu_s / max(1, scrapes.attempts)
    return f"the benchmark's scraper used {per_attempt * 1e6:.0f} us of CPU per attempt"


def scrape_cost(step_ends: list[float], rounds: list[Span], warmup: int) -> float | None:
    """Seconds of training that one scrape round cost a rank, measured within one run (so untouched by the
    machine's drift from run to run, unlike the ratio): per round, how much longer than the median step its
    steps that overlapped the round took, minus the same for a placebo round (the round moved halfway to
    the next, where nothing was scraped). The placebo takes out the measure's own bias: a long step is more
    likely to overlap any span than a short one. The ranks step together, so what delays one rank (its
    render, or another's that it waits for in a collective) shows in every rank's steps. `rounds`: wall
    time spans, in order, one after another. None if there is nothing to compare."""
    steps = list(itertools.pairwise(step_ends[warmup:]))
    if not steps or len(rounds) < 2:
        return None
    placebo = [
        (began + (after - began) / 2, ended + (after - began) / 2)
        for (began, ended), (after, _) in itertools.pairwise(rounds)
    ]
    typical = statistics.median(ended - began for began, ended in steps)
    scraped, unscraped = excess(steps, rounds[:-1], typical), excess(steps, placebo, typical)
    return None if scraped is None or unscraped is None else scraped - unscraped


def excess(steps: list[Span], spans: list[Span], typical: float) -> float | None:
    """Per span of `spans` (in order, one after another) that falls within `steps` ((began, ended) each):
    how much longer than `typical` the steps that overlapped a span took, summed. None if none falls."""
    starts = [began for began, _ in spans]
    total = 0.0
    for began, ended in steps:
        last = bisect_left(starts, ended) - 1  # the last span that began before the step ended
        if last >= 0 and spans[last][1] > began:
            total += ended - began - typical
    within = sum(1 for began, ended in spans if steps[0][0] < ended and began < steps[-1][1])
    return total / within if within else None


# ---------------------------------------------------------------------------------------------------------
# one run of the job


@dataclass
class RunResult:
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
    if with_exporter:
        prefix = [sys.executable, "-m", "flare_exporter.launch"]
    elif burn:
        in_interpreter = ["--interpreter"] if args.burn_in == "interpreter" else []
        prefix = [sys.executable, str(BURNER), *in_interpreter, repr(burn)]
    elif args.control == "loaded":
        prefix = [sys.executable, str(REPO / "benchmarks" / "loaded.py")]
    else:
        prefix = [sys.executable]
    # the pad recorded is the one its ranks get
    job = Job(label, workdir, [], base_port, [None] * args.ranks, len(env["OVERHEAD_LAYOUT_PAD"]))
    try:
        for rank in range(args.ranks):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            pinned = ["taskset", "--cpu-list", str(pinned_cpu(rank))] if args.pin else []
            command = [
                *pinned,
                *prefix,
                str(args.script),
                *("--steps", str(args.steps), "--batch", str(args.batch)),
                *("--report", str(workdir / f"report{rank}.json")),
                *(("--device", args.device) if args.device != "cpu" else ()),
                *(("--width", str(args.width)) if args.width else ()),
                *script_args,
            ]
            stdout, stderr = workdir / f"stdout{rank}.log", workdir / f"stderr{rank}.log"
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                job.procs.append(
                    subprocess.Popen(
                        command,
                        env=rank_env,
                        cwd=REPO,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
    except BaseException:
        job.kill()
        raise
    return job


def pinned_cpu(rank: int) -> int:
    """The CPU `--pin` puts `rank` on: rank r on the r-th (modulo) of the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[rank % len(cpus)]


def training_span(report: dict) -> Span:
    """(first step began, last step ended), wall time."""
    return report["step_ends"][0] - report["step_times"][0], report["step_ends"][-1]


def run_job(args: argparse.Namespace, with_exporter: bool, workdir: Path, label: str) -> RunResult:
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


def process_cpu_per_step(reports: list[dict], warmup: int) -> float:
    """Median over ranks of the whole process's mean CPU per step after the warm-up (every thread)."""
    return statistics.median(statistics.fmean(reported["process_cpu"][warmup:]) for reported in reports)


def threads_cpu_per_step(reports: list[dict]) -> dict[str, float]:
    """Median over ranks of each Python thread's CPU over the training steps, per step."""
    per_thread: dict[str, list[float]] = {}
    for reported in reports:
        for name, seconds in reported.get("threads_cpu", {}).items():
            per_thread.setdefault(name, []).append(seconds / len(reported["step_times"]))
    return {name: statistics.median(values) for name, values in per_thread.items()}


def thread_breakdown(threads_of_runs: list[dict[str, float]]) -> dict[str, float]:
    """Median over the runs with the exporter of each Python thread's CPU per step, busiest first."""
    per_thread: dict[str, list[float]] = {}
    for threads in threads_of_runs:
        for name, seconds in threads.items():
            per_thread.setdefault(name, []).append(seconds)
    medians = {name: statistics.median(values) for name, values in per_thread.items()}
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


# ---------------------------------------------------------------------------------------------------------
# statistics


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval for the median (order statistics); None if n is too small."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1.0 - confidence) / 2
    below = 0.0
    k = 0  # largest k with P(Binomial(n, 1/2) < k) <= tail
    for j in range(n + 1):
        below += math.comb(n, j) / 2**n
        if below > tail:
            break
        k = j + 1
    if k < 1:
        return None
    return ordered[k - 1], ordered[n - k]


# ---------------------------------------------------------------------------------------------------------
# micro-benchmarks of the hooks


def _time_once(body: Callable[[int], None], loops: int) -> float:
    """ns per iteration of one body(loops), with the GC off as timeit does."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter_ns()
        body(loops)
        return (time.perf_counter_ns() - started) / loops
    finally:
        if gc_was_enabled:
            gc.enable()


def micro(loops: int = 5000, repeats: int = 21) -> dict[str, float]:
    """ns per call of the collective hook (issue + track) and the step hook, net of an empty loop."""
    import torch

    from flare_exporter.rank.exporter_health import ExporterHealth
    from flare_exporter.rank.groups import GroupTracker
    from flare_exporter.rank.process_group import FlareProcessGroup
    from flare_exporter.rank.progress import StepTracker
    from flare_exporter.rank.timing import FutureTiming, TimingManager

    health = ExporterHealth()
    # Not started: each repetition's completions stay queued (room for all of them) and are drained after it.
    manager = TimingManager(health, queue_size=loops + 16, interval_seconds=1.0)
    from flare_exporter.rank import cpp_recorder

    # as the exporter does: completions stamped by flare's torch extension where built, else a Python callback
    extension = cpp_recorder.load()
    tracker = GroupTracker("world", 4, "gloo", FutureTiming(manager, extension), health)
    manager.add_group(tracker)  # each drain forgets its finished collectives, as in a job
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)

    class FakeWork:
        def get_future(self) -> torch.futures.Future:
            return future

    work = FakeWork()

    class FakeInner:  # the real backend, reduced to handing back the work
        def allreduce(self, *args: object, **kwargs: object) -> FakeWork:
            return work

    inner = FakeInner()
    bucket = [torch.empty(25 * 2**20 // 4)]  # one 25 MiB DDP bucket (only its size is read)
    wrapped = FlareProcessGroup(inner, 0, 4, tracker)
    steps = StepTracker(health)
    # the step hook as attach() installs it with every signal at its defaults: the ILD dispatch sampler's
    # listener opens a sampling window on one step in ild_dispatch_every_steps and closes it at the next
    from flare_exporter.config import Config
    from flare_exporter.rank.identity import RankIdentity
    from flare_exporter.rank.state import FlareState

    def with_all_signals(native: bool) -> tuple[FlareState, Callable[..., None]]:
        state = FlareState.create(Config(), RankIdentity(0, 0, 1, "micro", "localhost", os.getpid()))
        hook = state.steps.hook(native)
        assert state.ild is not None
        state.ild.install()
        return state, hook

    installed_hook = steps.hook()  # as attach() installs it: the extension's C function where built
    full, full_hook = with_all_signals(native=True)
    full_python, full_python_hook = with_all_signals(native=False)

    class FakeOptimizer:
        pass

    optimizer = FakeOptimizer()

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def hooks(n: int) -> None:
        issue, track = tracker.issue, tracker.track
        for _ in range(n):
            track(issue("allreduce", bucket), work)

    def direct(n: int) -> None:
        allreduce = inner.allreduce
        for _ in range(n):
            allreduce(bucket)

    def through_wrapper(n: int) -> None:
        allreduce = wrapped.allreduce
        for _ in range(n):
            allreduce(bucket)

    def calls(hook: Callable[..., None]) -> Callable[[int], None]:
        def loop(n: int) -> None:
            for _ in range(n):
                hook(optimizer, (), {})

        return loop

    step_hook, step_hook_all_signals = calls(installed_hook), calls(full_hook)
    step_hook_python = calls(full_python_hook)

    drain_ns: list[float] = []

    def drain() -> None:  # the timing manager's share, which runs on its own thread in a real job
        queued = len(manager.completed) + len(manager.polled)  # called back, or stamped and polled
        started = time.perf_counter_ns()
        manager.drain()
        if queued:
            drain_ns.append((time.perf_counter_ns() - started) / queued)

    # One call of each first: a hook that records nothing (say, its completion callback raises, which torch
    # only logs) would make every number below meaningless.
    checks = (("GroupTracker.issue + track", hooks), ("FlareProcessGroup.allreduce", through_wrapper))
    for name, body in checks:
        before = tracker.last_completed_seq
        body(1)
        manager.drain()
        if tracker.last_completed_seq != before + 1 or health.errors or health.dropped:
            raise RunError(
                f"micro: {name} did not record one completed collective for one completed future "
                f"(errors {dict(health.errors)}, drops {dict(health.dropped)}); see torch's "
                "messages above"
            )

    # Each repetition times every loop back to back and takes the differences within it, so that a slow
    # moment of a noisy machine weighs on both sides of a difference; the median over repetitions is reported.
    raw: dict[str, list[float]] = {
        name: [] for name in ("empty", "hooks", "direct", "wrapper", "step", "step_all", "step_python")
    }
    for _ in range(repeats):
        raw["empty"].append(_time_once(empty, loops))
        raw["hooks"].append(_time_once(hooks, loops))
        drain()
        raw["direct"].append(_time_once(direct, loops))
        raw["wrapper"].append(_time_once(through_wrapper, loops))
        drain()
        raw["step"].append(_time_once(step_hook, loops))
        raw["step_all"].append(_time_once(step_hook_all_signals, loops))
        raw["step_python"].append(_time_once(step_hook_python, loops))
    # the same hooks, each call alone after compute evicted the caches (see _cold_ns)
    issue, track = tracker.issue, tracker.track
    cold_collective_ns = _cold_ns(lambda: track(issue("allreduce", bucket), work), drain)
    cold_step_ns = _cold_ns(lambda: full_hook(optimizer, (), {}), full.manager.drain)
    cold_step_python_ns = _cold_ns(lambda: full_python_hook(optimizer, (), {}), full_python.manager.drain)
    cold_empty_ns = _cold_ns(lambda: None, full.manager.drain)  # the timed call itself, cold
    errors = dict(health.errors)
    for state in (full, full_python):
        assert state.ild is not None
        state.ild.remove()
        state.steps.report_errors()
        errors.update(state.health.errors)
    if errors or health.dropped:
        raise RunError(f"micro: hooks reported errors {errors}, drops {dict(health.dropped)}")
    result: dict[str, float] = {
        "loops": loops,
        "repeats": repeats,
        "empty_loop_ns": statistics.median(raw["empty"]),
        "manager_drain_ns": statistics.median(drain_ns),
        "completion_stamped": float(getattr(extension, "stamp_completion", None) is not None),
        "collective_hook_cold_ns": cold_collective_ns,
        "step_hook_all_signals_cold_ns": cold_step_ns,
        "step_hook_python_cold_ns": cold_step_python_ns,
        "empty_call_cold_ns": cold_empty_ns,
        "step_hook_native": float(full.steps.counter is not None),
    }
    if extension is not None:
        result.update(window_cost(extension, Config().ild_dispatch_every_steps))
    for key, timed, baseline in (
        ("collective_hook", "hooks", "empty"),
        ("wrapper_path", "wrapper", "direct"),
        ("step_hook", "step", "empty"),
        ("step_hook_all_signals", "step_all", "empty"),
        ("step_hook_python", "step_python", "empty"),
    ):
        # median of the differences within a repetition; best case as timeit gives it (min minus min)
        pairs = zip(raw[timed], raw[baseline], strict=True)
        result[key + "_ns"] = statistics.median([with_hook - without for with_hook, without in pairs])
        result[key + "_min_ns"] = min(raw[timed]) - min(raw[baseline])
    return result


COLD_CALLS = 501
WINDOW_STEPS = 600  # steps with a sampling window open, and as many without


def window_cost(extension: Any, every: int) -> dict[str, float]:
    """What a host-dispatch sampling window adds to a training step: the training script's model and
    optimizer in this process (no process group), the training thread's CPU time of steps with the native
    timer's window open against steps without, alternated; medians, and the ops a window timed. A window
    opens on one step in `every` (ild_dispatch_every_steps)."""
    import torch

    from flare_exporter import spec

    model = train_ddp.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(64, train_ddp.WIDTH), torch.randint(0, 10, (64,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(20):
        step()
    bounds = list(spec.ISSUE_LATENCY_BUCKETS)
    extension.take(bounds)
    plain, windowed, ops = [], [], 0
    for index in range(2 * WINDOW_STEPS):
        sampled = index % 2 == 1
        started = time.thread_time_ns()
        if sampled:
            extension.open_window(index)
        step()
        if sampled:
            extension.close_window()
        (windowed if sampled else plain).append(time.thread_time_ns() - started)
        if sampled:
            ops += sum(count for taken in extension.take(bounds) for _, count in taken.buckets)
    added = statistics.median(windowed) - statistics.median(plain)
    return {
        "ild_window_step_ns": added,
        "ild_window_ops": ops / WINDOW_STEPS,
        "ild_plain_step_cpu_ns": statistics.median(plain),
        "ild_dispatch_every_steps": every,
    }


def _cold_ns(hook: Callable[[], None], drain: Callable[[], None]) -> float:
    """ns of one call of `hook` right after compute has evicted the CPU caches, as in a training step.

    In a loop a hook's code and data stay in the caches; in a step, a collective comes after the backward
    pass's matrix products and the step hook after the optimizer's, which evict them, and every Python frame
    and call into torch then waits on memory. Each call is timed alone after 64 products of 256 x 256
    matrices (16 MiB of results, kept until after the call); median of COLD_CALLS. `drain` runs every 100
    calls, as the timing manager would.
    """
    import torch

    left, right = torch.randn(256, 256), torch.randn(256, 256)
    times = []
    for call in range(COLD_CALLS):
        products = [torch.mm(left, right) for _ in range(64)]  # 16 MiB written, as a backward pass does
        started = time.perf_counter_ns()
        hook()
        times.append(time.perf_counter_ns() - started)
        del products
        if call % 100 == 0:
            drain()
    drain()
    return statistics.median(times)


def print_micro(result: dict[str, float]) -> None:
    print(
        f"micro (ns per call on the training thread, net of the baseline loop; median [best] of "
        f"{result['repeats']} repetitions x {result['loops']} calls):"
    )
    step_hook = "C function" if result["step_hook_native"] else "StepTracker.on_step"
    rows = [
        (
            "collective hook",
            "GroupTracker.issue + track (completed Future: "
            + ("stamped in C++)" if result["completion_stamped"] else "Python callback inline)"),
            "collective_hook",
        ),
        ("wrapper path", "FlareProcessGroup.allreduce minus inner.allreduce", "wrapper_path"),
        ("step hook", f"StepTracker's hook ({step_hook}) vs. an empty loop", "step_hook"),
        (
            "step hook, all",
            "the same with every default signal's listener (ILD windows)",
            "step_hook_all_signals",
        ),
        ("step hook, Python", "StepTracker.on_step with the same listener", "step_hook_python"),
    ]
    for name, what, key in rows:
        print(f"  {name:17} {what:63} {result[key + '_ns']:7.0f} ns  [{result[key + '_min_ns']:6.0f}]")
    print(
        f"  {'collective hook, cold':22} the same, each call alone after compute evicted the caches "
        f"{result['collective_hook_cold_ns']:7.0f} ns  (median of {COLD_CALLS})"
    )
    print(
        f"  {'step hook, all, cold':22} the same for the step hook with every default signal's listener  "
        f"{result['step_hook_all_signals_cold_ns']:7.0f} ns"
    )
    print(
        f"  {'step hook, Python, cold':22} the same for StepTracker.on_step with the same listener      "
        f"{result['step_hook_python_cold_ns']:7.0f} ns"
    )
    if "ild_window_step_ns" in result:
        every, added = result["ild_dispatch_every_steps"], result["ild_window_step_ns"]
        ops, step_cpu = result["ild_window_ops"], result["ild_plain_step_cpu_ns"]
        print(
            f"  ILD window        a sampling window's {ops:.0f} ops timed, on the script's model "
            f"({step_cpu / 1e3:.0f} us of CPU a step): +{added / 1e3:.1f} us a window step, "
            f"{added / every / 1e3:.2f} us a step at 1 in {every:.0f} ({added / every / step_cpu:.2%})"
        )
    print(
        f"  (empty loop: {result['empty_loop_ns']:.0f} ns per iteration; an empty call, cold: "
        f"{result['empty_call_cold_ns']:.0f} ns; off the training thread, "
        f"the timing manager's drain: {result['manager_drain_ns']:.0f} ns per collective)"
    )


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--micro", action="store_true", help="only the hook micro-benchmarks, no job runs")
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="RESULTS",
        help="run nothing: pool the pairs of interleaved runs' --json files (the same job, code and machine) "
        "into one median and interval",
    )
    args = parser.parse_args(argv)
    if args.pool and args.micro:
        parser.error("--pool runs nothing: it takes no --micro")
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
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and smaller than --steps")
    if args.pin and not shutil.which("taskset"):
        parser.error("--pin needs taskset (util-linux)")
    if not args.micro and not args.script.is_file():
        parser.error(f"no training script at {args.script}")
    args.script = args.script.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pool:
        try:
            pooled = pool(args.pool)
        except PoolError as error:
            print(f"overhead: error: {error}", file=sys.stderr)
            return 2
        if args.json:
            Path(args.json).write_text(json.dumps(pooled, indent=2) + "\n")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks kill the ranks
    import torch

    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        print(
            f"overhead: error: --device cuda with --ranks {args.ranks}: NCCL takes one rank per GPU, and "
            f"torch sees {torch.cuda.device_count()} GPU(s) here",
            file=sys.stderr,
        )
        return 2

    flare_env = {
        key: value
        for key, value in sorted(os.environ.items())
        if key.startswith("FLARE_") and key not in ("FLARE_PORT", "FLARE_ADDR", "FLARE_FILE_SD_DIR")
    }
    results: dict[str, object] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
        },
        "config": run_config(args),
        "flare_env": flare_env,
        "revision": code_revision(),
        "code": code_digest(args.script, *([BURNER] if args.burn else [])),
    }
    print(
        f"flare-exporter overhead benchmark  {results['date']}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  python {platform.python_version()}"
    )
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
# and its control.
MEASURED_CODE = ("flare_exporter", "benchmarks/overhead.py", "benchmarks/loaded.py")


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


def ab(args: argparse.Namespace) -> dict[str, object]:
    print(
        f"job: {job_text(args)}; {args.pairs} pairs, "
        + (f"exporter scraped every {args.scrape_interval:g} s" if args.scrape_interval else "no scrapes")
        + job_note(args)
    )
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
            order = (False, True) if pair % 2 == 1 else (True, False)
            runs: dict[bool, RunResult] = {}
            for with_exporter in order:
                name = "with" if with_exporter else "without"
                label = f"pair {pair} run {name} exporter"
                runs[with_exporter] = retrying(
                    args.retries,
                    retried,
                    partial(run_job, args, with_exporter, label=label),
                    Path(tmp) / f"pair{pair}-{JOB_DIRS[with_exporter]}",
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
            pairs.append(
                {
                    "pair": pair,
                    "order": order_text,
                    "ratio": ratio,
                    "thread_cpu_ratio": thread_ratio,
                    "process_cpu_ratio": process_ratio,
                    "without": asdict(without),
                    "with": asdict(with_),
                }
            )

    ratios = [p["ratio"] for p in pairs]
    without_times = [p["without"]["step_time"] for p in pairs]
    with_times = [p["with"]["step_time"] for p in pairs]
    median_ratio = statistics.median(ratios)
    ci = median_ci(ratios)
    print("summary:")
    print(
        f"  step time without exporter: median {statistics.median(without_times) * 1e3:.3f} ms "
        f"over {len(without_times)} runs"
    )
    print(
        f"  step time with exporter:    median {statistics.median(with_times) * 1e3:.3f} ms "
        f"over {len(with_times)} runs"
    )
    ci_text = f", 95% CI of the median [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
    print(
        f"  ratio with/without: median {median_ratio:.4f} over {len(ratios)} pairs "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}{ci_text})"
    )
    print(
        f"  scrapes: {scrapes.done} done ({scrapes.during_training} while training), "
        f"{scrapes.failed} failed "
        f"(not counted: {scrapes.startup} refused before a rank's endpoint was up, "
        f"{scrapes.shutdown} after a rank's training ended); {scraper_cpu_text(scrapes)}"
    )
    costs = [p["with"]["scrape_cost_s"] for p in pairs if p["with"]["scrape_cost_s"] is not None]
    cost = statistics.median(costs) if costs else None
    if cost is not None:
        print(
            f"  training time one scrape round cost (steps overlapping a round, against a placebo round): "
            f"median {cost * 1e3:.2f} ms over {len(costs)} runs (min {min(costs) * 1e3:.2f}, max "
            f"{max(costs) * 1e3:.2f}); a round every {args.scrape_interval:g} s makes that "
            f"{cost / args.scrape_interval:.2%} of the run"
        )
    cpu_without = statistics.median(p["without"]["cpu_s"] for p in pairs)
    cpu_with = statistics.median(p["with"]["cpu_s"] for p in pairs)
    print(
        f"  CPU time per rank process (user + system, start-up and exit included): median "
        f"{cpu_without:.2f} s without, {cpu_with:.2f} s with ({cpu_with - cpu_without:+.2f} s)"
    )
    cpu_ratios = {}
    for key, what in (
        ("thread_cpu", "training thread's CPU per step"),
        ("process_cpu", "whole process's CPU per step (every thread)"),
    ):
        values = [p[f"{key}_ratio"] for p in pairs]
        interval = median_ci(values)
        cpu_ratios[key] = {
            "median_without": statistics.median(p["without"][key] for p in pairs),
            "median_with": statistics.median(p["with"][key] for p in pairs),
            "median_ratio": statistics.median(values),
            "median_ratio_ci95": list(interval) if interval else None,
        }
        found = cpu_ratios[key]
        interval_text = f", 95% CI [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""
        print(
            f"  {what}: median {found['median_without'] * 1e6:.1f} us without, "
            f"{found['median_with'] * 1e6:.1f} us with; "
            f"ratio median {found['median_ratio']:.4f}{interval_text}"
        )
    threads = thread_breakdown([pair["with"]["threads_cpu"] for pair in pairs])
    print(
        "  CPU per step of each Python thread, with the exporter (median over runs; all steps): "
        + ", ".join(f"{name} {seconds * 1e6:.1f} us" for name, seconds in threads.items())
    )
    if scrapes.never_answered:
        print(f"  WARNING: {len(scrapes.never_answered)} rank-runs never answered a scrape")
    for failure in scrapes.failures:
        print(f"  scrape failure: {failure}")
    if retried:
        without_count = sum("without exporter" in message for message in retried)
        print(
            f"  runs retried after a rank crashed while exiting: {len(retried)} "
            f"({without_count} without the exporter, {len(retried) - without_count} with it)"
        )
    print(f"  goal: median ratio <= {GOAL_RATIO}: {_verdict(median_ratio, ci)}")
    return {
        "pairs": pairs,
        "summary": {
            "median_step_time_without": statistics.median(without_times),
            "median_step_time_with": statistics.median(with_times),
            "median_ratio": median_ratio,
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "median_ratio_ci95": list(ci) if ci else None,
            "threads_cpu_with": threads,
            "scrape_cost_s": cost,
            "goal_ratio": GOAL_RATIO,
            "goal_met": median_ratio <= GOAL_RATIO,
            "scrapes": asdict(scrapes),
            "cpu_per_step": cpu_ratios,
            "retried": retried,
        },
    }


# ---------------------------------------------------------------------------------------------------------
# interleaved: both jobs at once, each paused while the other runs


SETTLE_S = 0.2  # after a job resumes, its steps are left out for this long (caches, queued wake-ups)
MIN_SLICE_STEPS = 10  # a slice needs this many whole steps on every rank to count


def slice_steps(report: dict, span: Span, warmup: int) -> tuple[list[float], list[float]]:
    """The step times and training-thread CPU per step of the steps that a rank took wholly within `span`
    (wall time), SETTLE_S after its start excepted, and after its first `warmup` steps."""
    began, ended = span
    times, cpus = [], []
    for index in range(warmup, len(report["step_times"])):
        step_ended, seconds = report["step_ends"][index], report["step_times"][index]
        if began + SETTLE_S <= step_ended - seconds and step_ended <= ended:
            times.append(seconds)
            cpus.append(report["step_cpu"][index])
    return times, cpus


def slice_step_time(reports: list[dict], span: Span, warmup: int) -> tuple[float, float] | None:
    """(step time, training thread's CPU per step) of one job in one slice: the median over ranks of each
    rank's median; None if a rank took fewer than MIN_SLICE_STEPS steps in it."""
    times, cpus = [], []
    for report in reports:
        rank_times, rank_cpus = slice_steps(report, span, warmup)
        if len(rank_times) < MIN_SLICE_STEPS:
            return None
        times.append(statistics.median(rank_times))
        cpus.append(statistics.median(rank_cpus))
    return statistics.median(times), statistics.median(cpus)


def slice_pairs(
    slices: list[tuple[bool, Span]], without: list[dict], with_: list[dict], warmup: int
) -> list[dict]:
    """One pair per slice that lies between two slices of the other job: its step time against the mean of
    theirs (so that a drift of the machine across the three cancels), with the exporter over without, and
    the same for the training thread's CPU per step. Slices of both jobs are weighed so, so that neither job
    is always the one in the middle. `slices`: (with the exporter, wall time span), in order."""
    measured = [
        slice_step_time(with_ if with_exporter else without, span, warmup) for with_exporter, span in slices
    ]
    pairs = []
    for index in range(1, len(slices) - 1):
        before, this, after = measured[index - 1 : index + 2]
        with_exporter = slices[index][0]
        if slices[index - 1][0] == with_exporter or slices[index + 1][0] == with_exporter:
            continue
        if before is None or this is None or after is None:
            continue
        around = ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
        with_times, without_times = (this, around) if with_exporter else (around, this)
        pairs.append(
            {
                "slice": index,
                "step_time_without": without_times[0],
                "step_time_with": with_times[0],
                "ratio": with_times[0] / without_times[0],
                "thread_cpu_ratio": with_times[1] / without_times[1],
            }
        )
    return pairs


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
    slices: list[tuple[bool, Span]] = []
    try:
        deadline = time.monotonic() + args.timeout
        # a rank writes the ready file once the job's group is formed: every rank of the job has started
        while waiting := [job for w, job in jobs.items() if not Path(f"{go[w]}.ready").exists()]:
            if any(job.poll() for job in jobs.values()):
                raise RunError(f"{next(j for j in jobs.values() if j.done).label}: ended before training")
            if time.monotonic() > deadline:
                raise waiting[0].timed_out(args.timeout)
            time.sleep(0.02)
        jobs[not with_first].signal(signal.SIGSTOP)
        for path in go.values():
            path.touch()
        if args.scrape_interval and not args.placebo:
            scraper = Scraper(jobs[True].base_port, args.ranks, args.scrape_interval, gated=True)
            scraper.start()
        running = with_first
        while True:
            job, other = jobs[running], jobs[not running]
            began = time.time()
            scraped = scraper if running else None  # only the exporter's job is scraped
            if scraped is not None:
                scraped.resume()
            while time.time() - began < args.interleave and not job.poll():
                if time.monotonic() > deadline:
                    raise job.timed_out(args.timeout)
                time.sleep(0.01)
            if other.done:
                slices.append((running, (began, time.time())))
                if job.done:
                    break
                continue  # the other has finished: this one runs on alone
            if scraped is not None:
                scraped.pause(partial(job.signal, signal.SIGSTOP))
            else:
                job.signal(signal.SIGSTOP)
            slices.append((running, (began, time.time())))
            other.signal(signal.SIGCONT)
            running = not running
    finally:
        if scraper is not None:
            scraper.stop()
        for job in jobs.values():
            job.signal(signal.SIGCONT)
            job.kill()
    return slices, jobs[False], jobs[True], scraper


def interleaved(args: argparse.Namespace) -> dict[str, object]:
    """`args.pairs` pairs of jobs, each pair run at once in turns, the job that starts and runs first
    alternating: a pair's ratio is the median over its slices of each against the two of the other job
    around it (slice_pairs). Within a pair the machine's drift cancels; what differs from one pair to the
    next (where each job's processes landed: their memory layout, drawn anew per job, and their cores)
    shows as the spread of the pairs' ratios, which the confidence interval covers."""
    print(
        f"job: {job_text(args)}; {args.pairs} pairs, each pair's two jobs at "
        f"once, taking turns of {args.interleave:g} s (the other paused), "
        + (
            "PLACEBO: neither with the exporter"
            + (f"; the side 'with' burns {args.burn:.2%} of each rank's CPU" if args.burn else "")
            + (" in the interpreter (GIL held)" if args.burn and args.burn_in == "interpreter" else "")
            if args.placebo
            else f"exporter scraped every {args.scrape_interval:g} s"
            if args.scrape_interval
            else "no scrapes"
        )
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
            with_first = pair % 2 == 0  # which job starts and runs first alternates from pair to pair
            slices, without, with_, scraper = retrying(
                args.retries,
                retried,
                partial(run_interleaved, args, with_first=with_first),
                Path(tmp) / f"pair{pair}",
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
            scrape_text = ""
            if scraper is not None:
                run_scrapes = scraper.counts([training_span(report) for report in reports_with])
                scrapes.add(run_scrapes)
                scraped_s = sum(ended - began for with_exporter, (began, ended) in slices if with_exporter)
                rate = result["scrape_rounds_per_second"] = len(scraper.rounds) / scraped_s
                result["scrape_cpu"] = scrape_cpu(reports_with, len(scraper.rounds))
                scrape_text = f"{run_scrapes.done:>6}/{run_scrapes.failed:<10}  {rate:.2f}"
            print(
                f"{pair:>4}  {result['first']:5}  {len(measured):>6}  "
                f"{result['step_time_without'] * 1e3:10.3f}  {result['step_time_with'] * 1e3:9.3f}  "
                f"{result['ratio']:7.4f}  "
                f"{result['thread_cpu_ratio']:10.4f}  {scrape_text}",
                flush=True,
            )
            pairs.append(result)
    summary = summarize(pairs, scrapes, args.placebo)
    return {"interleaved": {"pairs": pairs, "summary": summary, "retried": retried}}


def summarize(pairs: list[dict], scrapes: ScrapeCounts, placebo: bool) -> dict[str, object]:
    """Print the summary of interleaved pairs (one run's, or several runs' pooled) and return it."""
    ratios = [pair["ratio"] for pair in pairs]
    cpu_ratios = [pair["thread_cpu_ratio"] for pair in pairs]
    median_ratio, ci, cpu_ci = statistics.median(ratios), median_ci(ratios), median_ci(cpu_ratios)
    ci_text = f", 95% CI of the median [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
    cpu_ci_text = f", 95% CI [{cpu_ci[0]:.4f}, {cpu_ci[1]:.4f}]" if cpu_ci else ""
    print("summary:")
    print(
        f"  ratio with/without: median {median_ratio:.4f} over {len(ratios)} pairs "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}{ci_text}); "
        f"{sum(len(pair['slices']) for pair in pairs)} slices with the exporter weighed in all"
    )
    print(
        f"  training thread's CPU per step, with/without: median {statistics.median(cpu_ratios):.4f}"
        f"{cpu_ci_text}"
    )
    if scrapes.attempts:
        print(f"  scrapes: {scrapes.done} done, {scrapes.failed} failed; {scraper_cpu_text(scrapes)}")
    for failure in scrapes.failures:
        print(f"  scrape failure: {failure}")
    accounting = exporter_cpu_accounting(pairs)
    if accounting is not None:
        print(f"  {accounting_text(accounting)}")
    print(f"  goal: median ratio <= {GOAL_RATIO}: {_verdict(median_ratio, ci)}")
    return {
        "median_ratio": median_ratio,
        "median_ratio_ci95": list(ci) if ci else None,
        "thread_cpu_median_ratio": statistics.median(cpu_ratios),
        "thread_cpu_ratio_ci95": list(cpu_ci) if cpu_ci else None,
        "scrapes": asdict(scrapes),
        "exporter_cpu": accounting,
        "goal_ratio": GOAL_RATIO,
        "goal_met": median_ratio <= GOAL_RATIO,
        "placebo": placebo,
    }


# ---------------------------------------------------------------------------------------------------------
# pooling runs


class PoolError(Exception):
    """A results file that cannot be pooled with the others."""


POOLED_KEYS = ("machine", "config", "flare_env", "code")  # what every pooled run must share


def pool(paths: list[Path]) -> dict[str, object]:
    """The interleaved pairs of several runs (their --json files) as one sample: runs of the same job, the
    same code and the same machine, measured at different times, whose pairs together give the median a
    narrower interval than any one run's. Every run given counts: pool all the runs of the code, not the
    ones that came out well."""
    runs = [_pooled_run(path) for path in paths]
    first = {key: _pooled_value(runs[0], key) for key in POOLED_KEYS}
    for path, run in zip(paths[1:], runs[1:], strict=True):
        for key in POOLED_KEYS:
            ours = _pooled_value(run, key)
            if ours != first[key]:
                raise PoolError(
                    f"{path}: its {key} ({ours}) is not {paths[0]}'s ({first[key]}): only runs of the same "
                    "job, code and machine pool"
                )
    print(f"pooled: {len(runs)} runs of the same job (code {first['code'] or 'not recorded'})")
    pairs: list[dict] = []
    scrapes = ScrapeCounts()
    for path, run in zip(paths, runs, strict=True):
        summary = run["interleaved"]["summary"]
        print(
            f"  {path}: {run.get('date', '?')} (revision {run.get('revision') or '?'}), "
            f"{len(run['interleaved']['pairs'])} pairs, median {summary['median_ratio']:.4f}"
        )
        pairs += run["interleaved"]["pairs"]
        scrapes.add(ScrapeCounts(**summary["scrapes"]))
    return {
        "pooled": {
            "runs": [str(path) for path in paths],
            "summary": summarize(pairs, scrapes, first["config"]["placebo"]),
        }
    }


def _pooled_run(path: Path) -> dict[str, Any]:
    try:
        run = json.loads(path.read_text())
        pairs = run["interleaved"]["pairs"]
        if not pairs or not all(isinstance(pair["ratio"], float) for pair in pairs):
            raise PoolError(f"{path}: no interleaved pairs")
        return run
    except OSError as error:
        raise PoolError(f"{path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise PoolError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
    except (KeyError, TypeError):
        raise PoolError(
            f"{path}: not the results of an interleaved run (overhead.py --interleave S --json)"
        ) from None


def _pooled_value(run: dict[str, Any], key: str) -> Any:
    value = run.get(key)
    if key == "config":
        # how many pairs each run took does not matter; a setting a run did not record was the default
        value = {**run_config(parse_args([])), **(value or {})}
        del value["pairs"]
    return value


def exporter_threads(threads: dict[str, float]) -> dict[str, float]:
    """The exporter's own threads (flare-*) of a thread breakdown, or the burner that stands in for them in a
    placebo (--burn)."""
    return {name: s for name, s in threads.items() if name.startswith("flare-") or name == BURNER_THREAD}


def scrape_cpu(reports: list[dict], rounds: int) -> float | None:
    """Median over ranks of the endpoint thread's CPU per scrape (each round scrapes every rank once)."""
    if not rounds:
        return None
    return statistics.median(r.get("threads_cpu", {}).get("flare-http", 0.0) / rounds for r in reports)


def exporter_cpu_accounting(pairs: list[dict]) -> dict[str, Any] | None:
    """What the exporter's own threads cost per step, against a rank's CPU per step without the exporter:
    on a machine whose cores the ranks fill, about that share of the step time is theirs alone (the
    training thread's own extra CPU comes on top). None without the exporter (placebo)."""
    threads = thread_breakdown([pair["exporter_threads_cpu"] for pair in pairs])
    if not threads:
        return None
    total = sum(threads.values())
    process_without = statistics.median(pair["process_cpu_without"] for pair in pairs)
    scrapes = [pair["scrape_cpu"] for pair in pairs if pair.get("scrape_cpu") is not None]
    return {
        "threads_per_step": threads,
        "total_per_step": total,
        "process_cpu_without": process_without,
        "share": total / process_without,
        "scrape_cpu": statistics.median(scrapes) if scrapes else None,
    }


def accounting_text(accounting: dict[str, Any]) -> str:
    """exporter_cpu_accounting's summary line."""
    scrape = accounting["scrape_cpu"]
    per_scrape = f" ({scrape * 1e3:.2f} ms a scrape)" if scrape else ""
    parts = [
        f"{name} {seconds * 1e6:.1f} us" + (per_scrape if name == "flare-http" else "")
        for name, seconds in accounting["threads_per_step"].items()
    ]
    return (
        f"the exporter's own threads, CPU per step (median over pairs): {', '.join(parts)}: "
        f"{accounting['total_per_step'] * 1e6:.1f} us, {accounting['share']:.2%} of a rank process's CPU per "
        f"step without the exporter ({accounting['process_cpu_without'] * 1e3:.2f} ms); where the ranks fill "
        "the cores, that share of the step time is theirs, before the training thread's own"
    )


def _verdict(median_ratio: float, ci: tuple[float, float] | None) -> str:
    verdict = "met" if median_ratio <= GOAL_RATIO else "NOT met"
    if ci and ci[0] <= GOAL_RATIO < ci[1]:
        verdict += " (the goal lies inside the confidence interval: noise-limited, add --steps or --pairs)"
    return verdict


if __name__ == "__main__":
    sys.exit(main())
