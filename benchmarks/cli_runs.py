"""What the benchmarks share: `flare` run timed, in-process or as a command, its JSON verdicts read back
with one-line errors; a process's CPU, a commit, Prometheus's version, times summarized."""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flare_exporter.engine import cli
from flare_exporter.local.prometheus import find_binary

REPO = Path(__file__).resolve().parents[1]


class BenchError(Exception):
    """A failure of a benchmark or a wrong verdict; the message is one line."""


def one_line(text: str, chars: int = 300) -> str:
    line = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip()) or "(empty)"
    return line if len(line) <= chars else line[:chars] + "..."


def verdicts_of(code: int, output: str, where: str) -> tuple[dict[str, Any], str]:
    """`flare ... --json`'s result and a one-line summary of its verdicts; BenchError if it is not JSON."""
    try:
        result = json.loads(output)
    except ValueError:
        raise BenchError(f"{where}: exit code {code}, output is not JSON: {one_line(output)}") from None
    verdicts = result.get("verdicts", [])
    summary = "; ".join(f"{v.get('kind')} {v.get('ranks')} [{v.get('group')}]" for v in verdicts) or "none"
    return result, summary


def first_verdict(code: int, output: str, kind: str, rank: int, where: str) -> str:
    """The first verdict of `flare diagnose --json` must be `kind` naming exactly `rank`; a one-line summary
    of all of them, BenchError otherwise."""
    result, summary = verdicts_of(code, output, where)
    first = (result.get("verdicts") or [{}])[0]
    if code != cli.EXIT_ANOMALY or (first.get("kind"), first.get("ranks")) != (kind, [rank]):
        raise BenchError(f"{where}: exit code {code}, verdicts {summary} (expected {kind} [{rank}] first)")
    return f"{summary}; {result.get('ranks_seen')} ranks seen"


def faulty_ranks(ranks: int) -> dict[str, int]:
    """The rank each fault of scale.py and direct_scrape.py strikes in a virtual cluster of `ranks`."""
    return {"straggler": ranks * 3 // 8, "hang": ranks * 777 // 1024, "dead": ranks * 5 // 8}


def in_process(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, exit code, output) of `flare ARGV` in this process."""
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return time.perf_counter() - started, code, out.getvalue() or err.getvalue()


@functools.cache
def installed_env() -> dict[str, str]:
    """The environment of a timed command: this one, with flare's modules byte-compiled as in an install
    (pip compiles them when it installs). Where this environment forbids writing bytecode
    (PYTHONDONTWRITEBYTECODE, set on the test machines), every command would compile each module again,
    about 65 ms of a diagnosis; their bytecode then goes to a directory of the benchmark's, written by one
    untimed command before the first timed one."""
    env = dict(os.environ)
    if env.pop("PYTHONDONTWRITEBYTECODE", "") or sys.dont_write_bytecode:
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="flare-bench-bytecode-")
        atexit.register(shutil.rmtree, env["PYTHONPYCACHEPREFIX"], ignore_errors=True)
        subprocess.run([sys.executable, "-c", "import flare_exporter.cli"], cwd=REPO, env=env, check=True)
    return env


def command(arguments: list[str], timeout: float) -> tuple[float, int, str, float]:
    """(wall seconds, exit code, output, CPU seconds) of `python ARGUMENTS` run from the repository, with
    flare's modules byte-compiled (installed_env)."""
    env = installed_env()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"python {' '.join(arguments[:4])} ... timed out after {timeout:.0f} s") from None
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, done.returncode, done.stdout or done.stderr, cpu


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval for the median (order statistics); None if n is too small."""
    ordered = sorted(values)
    n = len(ordered)
    below, k = 0.0, 0  # k: the largest with P(Binomial(n, 1/2) < k) <= the tail
    for j in range(n + 1):
        below += math.comb(n, j) / 2**n
        if below > (1.0 - confidence) / 2:
            break
        k = j + 1
    return (ordered[k - 1], ordered[n - k]) if k >= 1 else None


def stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def seconds_text(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 0.1 else f"{value:.3f} s"


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process so far, from /proc (clock ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def revision() -> str:
    """The checkout's commit, short."""
    done = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def prometheus_version() -> str:
    try:
        out = subprocess.run([find_binary() or "prometheus", "--version"], capture_output=True, text=True)
    except OSError:
        return "?"
    words = (out.stdout or out.stderr).split()
    return words[2] if len(words) > 2 else "?"
