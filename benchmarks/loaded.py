"""Run a training script as flare's launcher would, with flare's code loaded but nothing attached.

    python benchmarks/loaded.py script.py [args]

The control side of `overhead.py --control loaded`: the modules the exporter imports (prometheus_client,
the HTTP server, every collector) and flare's torch extension are loaded, and the script runs as the
launcher runs it (`flare_exporter.launch.run_script`); but no hook, backend, thread or endpoint is set up.
Against it, the side with the exporter differs by what the exporter does, not by what it loads.
"""

from __future__ import annotations

import sys

from flare_exporter.rank import (  # noqa: F401
    attach,
    cpp_recorder,
    dispatch,
    exposition,
    gpu_health,
    http_server,
)
from flare_exporter.rank.launch import run_script


def main() -> None:
    if len(sys.argv) < 2:
        print("loaded: error: give a script to run", file=sys.stderr)
        sys.exit(2)
    if cpp_recorder.load() is None:
        print(f"loaded: error: flare's extension is not loaded: {cpp_recorder.load_error}", file=sys.stderr)
        sys.exit(2)
    run_script(sys.argv[1:])


if __name__ == "__main__":
    main()
