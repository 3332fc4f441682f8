"""Harnesses that load a host, for tests and benchmarks (local tools): every core busy, and one process's CPU
throttled from outside on a duty cycle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


class BusyCores:
    """`count` processes spinning on the CPU (default: one per core and one more, a run queue longer than
    the cores) until close(), each ending by itself after `seconds` at most."""

    def __init__(self, count: int = 0, seconds: float = 300.0) -> None:
        self.count = count or (os.cpu_count() or 1) + 1
        self.spinners = [
            subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(self.count)
        ]

    def close(self) -> None:
        for spinner in self.spinners:
            spinner.kill()
            spinner.wait(timeout=10)

    def __enter__(self) -> BusyCores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


THROTTLER = """
import os, select, signal, sys

pid, stopped, running = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])


def wait(seconds):  # a new "stopped running" line on stdin cuts it short; its end stops the throttler
    global stopped, running
    if select.select([0], [], [], seconds)[0]:
        lines = os.read(0, 4096)
        if not lines:
            raise SystemExit
        stopped, running = map(float, lines.splitlines()[-1].split())


try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        wait(stopped)
        os.kill(pid, signal.SIGCONT)
        wait(running)
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


class DutyCycle:
    """Stops process `pid` for `stopped` seconds out of every `stopped + running`, until stop(): its CPU time
    throttled from outside, as a cgroup quota would. From a process of its own: a thread of the test's
    would stop and continue it late whenever the test's other threads hold the interpreter's lock."""

    def __init__(self, pid: int, stopped: float = 0.09, running: float = 0.01) -> None:
        self.pid = pid
        command = [sys.executable, "-c", THROTTLER, str(pid), str(stopped), str(running)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)

    def throttle(self, share: float, period: float = 0.1) -> None:
        """From now on, let the process run `share` of every `period` seconds."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{(1 - share) * period} {share * period}\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait(timeout=30)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
