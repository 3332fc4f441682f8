"""Run a training script beside a thread that spends a set share of the process's CPU, and nothing else.

    python benchmarks/burner.py [--interpreter] SHARE script.py [args]

The side "with" of `overhead.py --placebo --burn SHARE`: no exporter, but a daemon thread that, once a
second, spends in one burst what keeps its own CPU at SHARE of the process's (its own included), as a rank's
exporter spends its share in a scrape a second (`exporter_cpu` in overhead.py's results: 0.44 %). It burns
without the GIL (SHA-256 over a slice of a buffer, sized to what it owes: CPython hashes more than 2 KiB
without the GIL), so that it takes cores, not the interpreter, from training; a paused job (SIGSTOP) uses no
CPU and so owes none. The script runs through runpy, as flare's launcher runs it. Against the plain script,
the ratio is what that much CPU off the training thread costs the job on this machine: the part of the
exporter's cost that is its CPU. With --interpreter it burns in Python bytecode instead, holding the GIL as
an exporter's render does (the interpreter hands it over every switch interval, 5 ms, to a thread that asks):
what taking that much of the interpreter, at a moment of its own choosing, costs.
"""

from __future__ import annotations

import hashlib
import runpy
import sys
import threading
import time

BURST_EVERY_SECONDS = 1.0
BUFFER = bytes(8 << 20)  # hashed in slices without the GIL: CPython releases it for more than 2 KiB


def hashing_rate() -> float:
    """Bytes this thread hashes per second of its CPU (SHA-256)."""
    started = time.thread_time()
    hashlib.sha256(BUFFER)
    return len(BUFFER) / max(time.thread_time() - started, 1e-6)


def burn(share: float, in_interpreter: bool) -> None:
    """Forever: every BURST_EVERY_SECONDS, burn until this thread's CPU is `share` of the process's: in as few
    hashes as that takes (each needs the GIL only to start: a training thread that holds it a lot delays a
    burst, not the burning), or in bytecode."""
    rate = 0.0 if in_interpreter else hashing_rate()
    while True:
        time.sleep(BURST_EVERY_SECONDS)
        while (owed := share * time.process_time() - time.thread_time()) > 0:
            if in_interpreter:
                for _ in range(200):  # about 5 µs of bytecode between two looks at the clocks
                    pass
            else:
                size = min(len(BUFFER), max(4096, int(owed * rate)))
                hashlib.sha256(memoryview(BUFFER)[:size])


def main() -> None:
    arguments = sys.argv[1:]
    in_interpreter = arguments[:1] == ["--interpreter"]
    arguments = arguments[1:] if in_interpreter else arguments
    try:
        share = float(arguments[0])
        if not 0 < share < 1:
            raise ValueError
        script = arguments[1]
    except (IndexError, ValueError):
        print(
            "burner: error: usage: burner.py [--interpreter] SHARE script.py [args], 0 < SHARE < 1",
            file=sys.stderr,
        )
        sys.exit(2)
    threading.Thread(target=burn, args=(share, in_interpreter), name="burner", daemon=True).start()
    sys.argv = arguments[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
