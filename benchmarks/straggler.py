"""Straggler detection: delay (steps), smallest slowdown detected reliably, false positives when healthy.

    python benchmarks/straggler.py [--ranks 4] [--seeds 10] [--jitter 0.02] [--comm 0.3] [--onset 100]
                                   [--slowdowns 0.01,0.02,0.03,0.05,0.1,0.3] [--healthy-steps 1000]
                                   [--job-slowdown 1.0] [--json OUT]

A timing model of a synchronous data-parallel job feeds flare's own code: each rank's WindowRing (the
exporter's straggler windows at their defaults) and, after every step, diagnosis.diagnose over a Snapshot
of them (the engine's default StragglerPolicy), as if every rank were scraped every step. Per step, rank r
computes (1 + s_r) * exp(jitter * N(0,1)) (s_r the slowdown of a slowed rank from `--onset`), issues the
all-reduce, which completes `comm` (jittered) after the last rank issued it; its step ends then, plus a
jittered optimizer time of 0.05. The real-job side (hooks, exposition, scrapes) is
tests/rank/test_stragglers.py's.

Reported, over `--seeds` seeds: per slowdown of one rank, the seeds that named exactly that rank within 20
steps, the delay and the false verdicts; a healthy run's verdicts (false positives); every rank slowed by
`--job-slowdown`: steps to the job-wide verdict. Exit status 0 when a 5 % slowdown is named within 20 steps
in every seed and no healthy step has a verdict, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from flare_exporter.config import Config
from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.rule_types import RankRecord, Snapshot, Verdict
from flare_exporter.policies import StragglerPolicy
from flare_exporter.rank.straggler_windows import WindowRing

GOAL_SLOWDOWN = 0.05
GOAL_STEPS = 20


@dataclass
class Model:
    """The job's timing model and what a run of it expects: the ranks slowed by `slowdown` from `onset`
    and the verdict (ranks, domain) expected then; None: a healthy run, where any verdict is false."""

    ranks: int
    jitter: float
    comm: float
    slowdown: float = 0.0
    slowed: tuple[int, ...] = ()
    onset: int = 0
    expected: tuple[tuple[int, ...], str] | None = None


@dataclass
class Run:
    first_verdict_step: int | None  # first step (from the onset) at which the expected verdict appeared
    false_verdicts: int  # steps with any other verdict


def simulate(model: Model, steps: int, seed: int, policy: StragglerPolicy) -> Run:
    """Run the model for `steps` steps; diagnose after each; compare with the verdict it expects."""
    rng = random.Random(seed)
    config = Config()
    rings = [WindowRing(config.straggler_window_steps, config.straggler_windows) for _ in range(model.ranks)]
    first, false = None, 0

    def jittered(seconds: float) -> float:
        return seconds * math.exp(model.jitter * rng.gauss(0, 1))

    for step in range(2, steps + 2):
        slowed = [rank in model.slowed and step >= model.onset for rank in range(model.ranks)]
        issued = [jittered(1 + model.slowdown * slow) for slow in slowed]
        done = max(issued) + jittered(model.comm)
        for rank, ring in enumerate(rings):
            ring.add_step(step, done + jittered(0.05), done - issued[rank])
        verdicts = diagnose(snapshot(rings, step), 300.0, policy)
        if matches(verdicts, model.expected) and step >= model.onset:
            first = step - model.onset + 1 if first is None else first
        elif verdicts:
            false += 1
    return Run(first, false)


def snapshot(rings: list[WindowRing], step: int) -> Snapshot:
    records = {
        rank: RankRecord(
            rank,
            steps=step,
            step_count=step - 1,
            step_seconds=0.0,
            collective_seconds=0.0,
            step_windows={w.number: (w.step_seconds, w.wait_seconds) for w in ring.windows},
            best_step_seconds=ring.best_step_seconds,
        )
        for rank, ring in enumerate(rings)
    }
    return Snapshot(records, 0.0, "bench", len(rings))


def matches(verdicts: list[Verdict], expected: tuple[tuple[int, ...], str] | None) -> bool:
    if expected is None or len(verdicts) != 1:
        return False
    return verdicts[0].kind == "straggler" and (verdicts[0].ranks, verdicts[0].domain) == expected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The model's and the run's settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind, default in (
        ("--ranks", int, 4),
        ("--seeds", int, 10),
        ("--jitter", float, 0.02),
        ("--comm", float, 0.3),
        ("--onset", int, 100),
        ("--slowdowns", str, "0.01,0.02,0.03,0.05,0.1,0.3"),
        ("--healthy-steps", int, 1000),
        ("--job-slowdown", float, 1.0),
        ("--json", str, ""),
    ):
        parser.add_argument(flag, type=kind, default=default)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policy = StragglerPolicy()
    base = Model(args.ranks, args.jitter, args.comm, onset=args.onset)
    print(
        f"{args.ranks} ranks, compute jitter {args.jitter:.0%} per rank and step, all-reduce {args.comm:.0%} "
        f"of compute, slowdown from step {args.onset}, {args.seeds} seeds; windows of "
        f"{Config().straggler_window_steps} steps, verdict held over {policy.hold_windows}"
    )
    print(f"{'slowdown':>9} {'named<=20':>9} {'named':>6} {'delay med':>10} {'delay max':>10} {'false':>6}")
    per_slowdown = {}
    middle = args.ranks // 2
    for slowdown in [float(text) for text in args.slowdowns.split(",")]:
        model = replace(base, slowdown=slowdown, slowed=(middle,), expected=((middle,), "rank"))
        runs = [simulate(model, args.onset + 60, seed, policy) for seed in range(args.seeds)]
        per_slowdown[slowdown] = found = tally(runs)
        print(
            f"{slowdown:>9.0%} {found['named_within_20']:>5}/{args.seeds:<3} {found['named']:>6} "
            f"{found['delay_median']:>10} {found['delay_max']:>10} {found['false']:>6}"
        )
    reliable = next((s for s, found in per_slowdown.items() if found["named_within_20"] == args.seeds), None)
    healthy = replace(base, onset=0)
    false_positives = sum(
        simulate(healthy, args.healthy_steps, 1000 + seed, policy).false_verdicts
        for seed in range(args.seeds)
    )
    everyone = replace(
        base, slowdown=args.job_slowdown, slowed=tuple(range(args.ranks)), expected=((), "job")
    )
    job = tally([simulate(everyone, args.onset + 60, 2000 + seed, policy) for seed in range(args.seeds)])
    print(
        f"smallest slowdown named within {GOAL_STEPS} steps in all {args.seeds} seeds: "
        f"{'-' if reliable is None else f'{reliable:.0%}'}"
    )
    print(f"healthy: {false_positives} steps with a verdict in {args.seeds} x {args.healthy_steps} steps")
    print(
        f"every rank {args.job_slowdown:.0%} slower: job-wide verdict in {job['named']}/{args.seeds} seeds, "
        f"after {job['delay_median']} steps (median), {job['delay_max']} (worst); other verdicts: "
        f"{job['false']}"
    )
    goal = per_slowdown.get(GOAL_SLOWDOWN)
    ok = (
        goal is not None
        and goal["named_within_20"] == args.seeds
        and goal["false"] == 0
        and not false_positives
    )
    print(
        f"goal (5% within {GOAL_STEPS} steps, no false positive in {args.healthy_steps} healthy steps): "
        f"{'met' if ok else 'NOT met'}"
    )
    if args.json:
        results = {
            "model": vars(base),
            "policy": policy.__dict__,
            "slowdowns": {str(k): v for k, v in per_slowdown.items()},
        }
        results.update(
            smallest_reliable=reliable, healthy_false_positives=false_positives, job_wide=job, goal_met=ok
        )
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def tally(runs: list[Run]) -> dict[str, object]:
    """How many runs gave the expected verdict (within GOAL_STEPS of the onset), after how many steps, and
    the other verdicts."""
    delays = [run.first_verdict_step for run in runs if run.first_verdict_step is not None]
    return {
        "named_within_20": sum(1 for delay in delays if delay <= GOAL_STEPS),
        "named": len(delays),
        "delays": delays,
        "delay_median": statistics.median(delays) if delays else "-",
        "delay_max": max(delays) if delays else "-",
        "false": sum(run.false_verdicts for run in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
