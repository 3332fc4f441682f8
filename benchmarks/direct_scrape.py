"""Direct scrape at scale: `flare diagnose --targets` over thousands of virtual ranks, no store.

    python benchmarks/direct_scrape.py [--ranks 6144] [--repeats 5] [--json OUT]

The virtual ranks (every signal on, each on its own loopback port) are served by a child process, as real
ranks serve from their own hosts; nothing else shares the machine. Phases, a fault on one rank each (as in
scale.py): a straggler; a hang two minutes old; a dead rank (its endpoint closed). In each, `flare diagnose
--targets DIR --hang-seconds 60 --json` runs as a command `--repeats` times, its first verdict checked.
Then the client alone: `scrape.scrape_all` of every rank, its thread's CPU per rank with the parse and
without it. Goal: < 3 s at 6,144 ranks.

Exit status: 0 when every verdict was right (whatever the times), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli_runs import BenchError, command, faulty_ranks, first_verdict  # noqa: E402  (benchmarks/)

from flare_exporter.engine import rank_client, scrape
from flare_exporter.engine.records import SNAPSHOT_METRICS
from flare_exporter.engine.targets import read_targets
from flare_exporter.local.testing import virtual_cluster as vc

RUN = "bench-direct"
GOAL_S = 3.0  # at 6,144 ranks
HANG_AGO_S = 120.0
PHASES = {"straggler": "straggler", "hang": "hang", "dead": "rank_down"}  # phase -> verdict kind


# ---------------------------------------------------------------------------------------------------------
# the ranks, served by a child process: `--serve`, told each phase on its stdin


def serve(ranks: int, targets_dir: str) -> None:
    """Render and serve every rank (healthy); on each stdin line `hang UNIX_TIME` or `dead RANK`, serve that
    phase's pages, and answer `ok`."""
    faults = faulty_ranks(ranks)
    pages = vc.render_pages(ranks, RUN, faults["straggler"], faults["hang"])
    with vc.ClusterServer(pages.healthy) as server:
        vc.write_file_sd(targets_dir, RUN, server.targets(), ranks)
        print("ready", flush=True)
        for line in sys.stdin:
            phase, value = line.split()
            if phase == "hang":
                server.set_pages(vc.hung_at(pages.hung, float(value)))
            else:
                server.set_pages(pages.later)
                server.kill(int(value))
            print("ok", flush=True)


class Ranks:
    """The child serving the ranks."""

    def __init__(self, ranks: int, targets_dir: str) -> None:
        argv = [sys.executable, __file__, "--serve", "--ranks", str(ranks), "--targets-dir", targets_dir]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        self._expect("ok")

    def _expect(self, word: str) -> None:
        assert self.process.stdout is not None
        answer = self.process.stdout.readline().strip()
        if answer != word:
            raise BenchError(f"the ranks' server said {answer!r}, not {word!r} (exit {self.process.poll()})")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


# ---------------------------------------------------------------------------------------------------------
# measuring


def diagnose(targets_dir: str, phase: str, rank: int, repeats: int) -> dict[str, Any]:
    """`flare diagnose --targets` as a command, `repeats` times: wall and CPU seconds, verdict checked."""
    argv = ["-m", "flare_exporter.cli", "diagnose", "--targets", targets_dir, "--json"]
    argv += ["--hang-seconds", "60", "--run", RUN]
    walls, cpus, summary = [], [], ""
    for index in range(repeats):
        wall, code, output, cpu = command(argv, 300)
        summary = first_verdict(code, output, PHASES[phase], rank, f"{phase}: run {index + 1}")
        walls.append(wall)
        cpus.append(cpu)
    print(
        f"  {phase}: {statistics.median(walls):.2f} s wall, {statistics.median(cpus):.2f} s CPU "
        f"(median of {repeats}; {min(walls):.2f}-{max(walls):.2f} s); verdict: {summary}"
    )
    return {"wall_seconds": walls, "cpu_seconds": cpus, "verdicts": summary}


def client_alone(targets_dir: str, repeats: int) -> dict[str, Any]:
    """scrape.scrape_all's thread CPU per rank (microseconds, median), with the parse and without it;
    the cyclic collector off, as in a command."""
    targets = [target.address for target in read_targets(targets_dir)]
    out: dict[str, Any] = {}
    for name, parse in (("with_parse", rank_client.parse), ("http_only", lambda text, *_: text)):
        per_rank = []
        with mock.patch.object(rank_client, "parse", parse):
            for _ in range(repeats):
                gc.collect()
                gc.disable()
                started = time.thread_time()
                results = scrape.scrape_all(targets, wanted=SNAPSHOT_METRICS)
                per_rank.append((time.thread_time() - started) / len(targets) * 1e6)
                gc.enable()
                if sum(isinstance(r, scrape.ScrapeError) for r in results.values()) > 1:
                    raise BenchError(f"client alone: more than the dead rank did not answer ({name})")
        out[name] = {"microseconds_a_rank": per_rank, "median": statistics.median(per_rank)}
    print(
        f"  the client alone: {out['with_parse']['median']:.0f} µs of CPU a rank, "
        f"{out['http_only']['median']:.0f} µs without the parse (median of {repeats})"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--targets-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks < 16 or args.repeats < 1:
        parser.error("--ranks >= 16 and --repeats >= 1")
    if args.serve:
        serve(args.ranks, args.targets_dir)
        return 0
    faults = faulty_ranks(args.ranks)
    results: dict[str, Any] = {"ranks": args.ranks, "faults": faults, "phases": {}}
    print(f"direct scrape of {args.ranks} virtual ranks (rendering them takes a while)")
    with tempfile.TemporaryDirectory(prefix="flare-direct-") as work:
        targets_dir = str(Path(work) / "targets")
        ranks = Ranks(args.ranks, targets_dir)
        try:
            for phase in PHASES:
                if phase == "hang":
                    ranks.tell(f"hang {time.time() - HANG_AGO_S}")
                elif phase == "dead":
                    ranks.tell(f"dead {faults['dead']}")
                results["phases"][phase] = diagnose(targets_dir, phase, faults[phase], args.repeats)
            results["client_alone"] = client_alone(targets_dir, args.repeats)
        except BenchError as error:
            print(f"direct_scrape: error: {error}", file=sys.stderr)
            return 1
        finally:
            ranks.close()
    worst = max(statistics.median(p["wall_seconds"]) for p in results["phases"].values())
    results["worst_median_wall_seconds"] = worst
    verdict = "PASS" if worst < GOAL_S else "MISS"
    print(f"  goal < {GOAL_S:g} s (set at 6,144 ranks) at {args.ranks} ranks: {verdict} ({worst:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
