"""Native shim: the cost of an intercepted kernel launch, against the fake CUDA runtime (no GPU).

    python benchmarks/native_launch.py [--launches N] [--sampled-launches N] [--repeats N] [--json OUT]

Builds cuda_hooks/ into a temporary directory (make, gcc) and times one thread calling cudaLaunchKernel in
a loop (launch_driver's `bench` mode): without the shim; the shim preloaded with sampling off; at its
default rate (1 launch in 64); every launch sampled (in bursts within the event pool). Each repeat gives
ns per launch after a first, unreported one (one-time set-up); the summary the medians and the overhead
against "without". On a GPU, cudaEventRecord adds a microsecond or two per sampled launch. Exit status 0
(whatever the numbers), 1 if the build fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGURATIONS: tuple[tuple[str, bool, dict[str, str], str], ...] = (  # name, preload, settings, launch count
    ("without", False, {}, "launches"),
    ("unsampled", True, {"FLARE_SHIM_SAMPLE_EVERY": "0"}, "launches"),
    ("default", True, {}, "launches"),
    (
        "sampled",
        True,
        {"FLARE_SHIM_SAMPLE_EVERY": "1", "FLARE_SHIM_EVENTS": "20000", "FLARE_SHIM_QUEUE": "32768"},
        "sampled_launches",
    ),  # noqa: E501
)


def build(directory: Path) -> Path:
    """The shim, fakes and driver built into `directory`; returns it."""
    make = ["make", "-s", "-C", str(REPO / "cuda_hooks"), f"BUILD={directory}", "testing"]
    subprocess.run(make, check=True, capture_output=True, text=True)
    return directory


def run(build_dir: Path, preload: bool, settings: dict[str, str], launches: int, repeats: int) -> list[float]:
    """ns per launch of each repeat."""
    ring_dir = tempfile.mkdtemp(prefix="flare-bench-ring-")
    environ = {**os.environ, **settings, "FLARE_SHIM_RING_DIR": ring_dir, "FAKE_CUDA_EVENT_DELAY_NS": "0"}
    environ.pop("LD_PRELOAD", None)
    if preload:
        environ["LD_PRELOAD"] = str(build_dir / "libflare_hooks.so")
    driver = [str(build_dir / "launch_driver"), str(build_dir / "fakes"), "cudart", "bench"]
    try:
        command = [*driver, str(launches), str(repeats)]
        result = subprocess.run(command, env=environ, capture_output=True, text=True, check=True, timeout=600)
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)
    return json.loads(result.stdout.splitlines()[0])["ns_per_launch"][1:]  # the first: one-time setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200_000, help="launches per repeat (default 200000)")
    parser.add_argument(
        "--sampled-launches",
        type=int,
        default=8192,
        help="launches per repeat, all sampled (default 8192, at most 10000: the event pool is 20000)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="repeats per configuration (default 15)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    if min(args.launches, args.sampled_launches, args.repeats) < 1 or args.sampled_launches > 10000:
        parser.error(
            "--launches, --sampled-launches and --repeats must be positive; --sampled-launches <= 10000"
        )
    if shutil.which("gcc") is None or shutil.which("make") is None:
        print("native_launch: gcc and make are needed to build cuda_hooks/", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="flare-bench-build-") as directory:
        try:
            build_dir = build(Path(directory))
        except subprocess.CalledProcessError as error:
            print(f"native_launch: build failed:\n{error.stderr}", file=sys.stderr)
            return 1
        counts = {"launches": args.launches, "sampled_launches": args.sampled_launches}
        results = {}
        for name, preload, settings, count in CONFIGURATIONS:
            results[name] = run(build_dir, preload, settings, counts[count], args.repeats)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(
        f"cudaLaunchKernel against the fake runtime, one thread, {platform.processor() or platform.machine()}"
    )
    print(f"{'configuration':<12} {'median ns/launch':>17} {'overhead ns':>12}   repeats (ns/launch)")
    for name, values in results.items():
        overhead = medians[name] - medians["without"]
        shown = " ".join(f"{value:.1f}" for value in values)
        print(f"{name:<12} {medians[name]:>17.1f} {overhead:>12.1f}   {shown}")
    if args.json_out:
        report = {"ns_per_launch": results, "median": medians, "repeats": args.repeats}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
