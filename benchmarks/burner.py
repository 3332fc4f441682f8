"""Run a training script beside a thread that spends a set share of the process's CPU, and nothing else.

    python benchmarks/burner.py SHARE script.py [args]

The side "with" of `overhead.py --placebo --burn SHARE`: no exporter, but a daemon thread that, once a
second, spends SHARE of the CPU the process used since (its own included) in one burst, as a rank's
exporter spends its share in a scrape a second (`exporter_cpu` in overhead.py's results: 0.44 %). It burns
without the GIL (hashlib over a buffer large enough that CPython releases the GIL), so that it takes cores,
not the interpreter, from training; a paused job (SIGSTOP) uses no CPU and so owes none. The script runs
through runpy, as flare's launcher runs it. Against the plain script, the ratio is what that much CPU off
the training thread costs the job on this machine: the part of the exporter's cost that is its CPU.
"""

from __future__ import annotations

import hashlib
import runpy
import sys
import threading
import time

BURST_EVERY_SECONDS = 1.0
CHUNK = bytes(1 << 16)  # hashed without the GIL (CPython releases it above 2 KiB); ~40 µs a chunk


def burn(share: float) -> None:
    """Forever: every BURST_EVERY_SECONDS, burn until this thread's CPU is `share` of the process's."""
    while True:
        time.sleep(BURST_EVERY_SECONDS)
        while time.thread_time() < share * time.process_time():
            hashlib.sha256(CHUNK)


def main() -> None:
    try:
        share = float(sys.argv[1])
        if not 0 < share < 1:
            raise ValueError
        script = sys.argv[2]
    except (IndexError, ValueError):
        print("burner: error: usage: burner.py SHARE script.py [args], 0 < SHARE < 1", file=sys.stderr)
        sys.exit(2)
    threading.Thread(target=burn, args=(share,), name="burner", daemon=True).start()
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
