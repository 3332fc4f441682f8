"""Straggler detection: delay (steps), smallest slowdown detected reliably, false positives when healthy.

    python benchmarks/straggler.py [--ranks 4] [--seeds 10] [--jitter 0.02] [--comm 0.3] [--onset 100]
                                   [--slowdowns 0.01,0.02,0.03,0.05,0.1,0.3] [--healthy-steps 1000]
                                   [--job-slowdown 0.6] [--json OUT]

A synthetic timing model of a synchronous data-parallel job feeds flare-exporter's own code: each rank's
WindowRing (the exporter's windows, stragglers.py, with the default 5-step windows, 4 kept) and, after
every step, diagnosis.diagnose over a Snapshot of those windows (the engine, default StragglerPolicy), as
if every rank were scraped after every step. What it leaves out is what the real-job tests
(tests/rank/test_stragglers.py) cover: the hooks, the exposition, Prometheus, and a scrape interval (which
adds its own latency in seconds, not steps).

The model, per step: rank r computes C * (1 + s_r) * exp(jitter * N(0,1)) (C = 1; s_r the slowdown of the
slowed rank from step `--onset`, 0 otherwise), then issues the step's all-reduce; the all-reduce completes
when the last rank has issued it plus T = comm * C * exp(jitter * N(0,1)); rank r waits (completion - its
issue) and its step ends at the completion plus a small optimizer time (C/20, jittered). Every rank's step
time is the same up to that jitter; the straggler waits least.

Reported, over `--seeds` seeds each:
- per slowdown of one rank: how many seeds named exactly that rank within 20 steps of the onset, the
  detection delay in steps (median and worst), and false verdicts before the onset;
- the smallest slowdown detected within 20 steps in every seed;
- a healthy run of `--healthy-steps` steps: verdicts of any kind (false positives);
- every rank slowed by `--job-slowdown` from the onset: steps until the job-wide verdict (domain job).

Exit status 0 when the goal holds (a 5% slowdown of one rank within 20 steps in every seed, no false
positive in the healthy runs), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass

from flare_exporter.config import Config
from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.rule_types import RankRecord, Snapshot, Verdict
from flare_exporter.policies import StragglerPolicy
from flare_exporter.rank.straggler_windows import WindowRing

GOAL_SLOWDOWN = 0.05
GOAL_STEPS = 20


@dataclass
class Run:
    first_verdict_step: int | None  # first step (from the onset) at which the expected verdict appeared
    false_verdicts: int  # steps with any other verdict


def simulate(
    ranks: int,
    steps: int,
    seed: int,
    jitter: float,
    comm: float,
    slowdown: float,
    slowed: list[int],
    onset: int,
    expected: tuple[tuple[int, ...], str] | None,
    policy: StragglerPolicy,
) -> Run:
    """Run the model for `steps` steps; diagnose after each; compare with `expected` (ranks, domain)."""
    rng = random.Random(seed)
    config = Config()
    rings = [WindowRing(config.straggler_window_steps, config.straggler_windows) for _ in range(ranks)]
    first = None
    false = 0
    for step in range(2, steps + 2):
        factor = [1 + (slowdown if rank in slowed and step >= onset else 0.0) for rank in range(ranks)]
        issued = [factor[rank] * math.exp(jitter * rng.gauss(0, 1)) for rank in range(ranks)]
        done = max(issued) + comm * math.exp(jitter * rng.gauss(0, 1))
        for rank, ring in enumerate(rings):
            step_seconds = done + 0.05 * math.exp(jitter * rng.gauss(0, 1))
            ring.add_step(step, step_seconds, done - issued[rank])
        verdicts = diagnose(snapshot(rings, step), 300.0, policy)
        if matches(verdicts, expected) and step >= onset:
            if first is None:
                first = step - onset + 1
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
    verdict = verdicts[0]
    return verdict.kind == "straggler" and (verdict.ranks, verdict.domain) == expected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The model's and the run's settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--jitter", type=float, default=0.02)
    parser.add_argument("--comm", type=float, default=0.3)
    parser.add_argument("--onset", type=int, default=100)
    parser.add_argument("--slowdowns", default="0.01,0.02,0.03,0.05,0.1,0.3")
    parser.add_argument("--healthy-steps", type=int, default=1000)
    parser.add_argument("--job-slowdown", type=float, default=1.0)
    parser.add_argument("--json", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policy = StragglerPolicy()
    results: dict[str, object] = {
        "model": {"ranks": args.ranks, "jitter": args.jitter, "comm": args.comm, "onset": args.onset},
        "policy": policy.__dict__,
    }
    print(
        f"{args.ranks} ranks, compute jitter {args.jitter:.0%} per rank and step, all-reduce {args.comm:.0%} "
        f"of compute, slowdown from step {args.onset}, {args.seeds} seeds; windows of "
        f"{Config().straggler_window_steps} steps, verdict held over {policy.hold_windows}"
    )
    print(f"{'slowdown':>9} {'named<=20':>9} {'named':>6} {'delay med':>10} {'delay max':>10} {'false':>6}")
    reliable = None  # the smallest slowdown named within GOAL_STEPS in every seed
    per_slowdown = {}
    for slowdown in [float(text) for text in args.slowdowns.split(",")]:
        per_slowdown[slowdown] = found = one_rank_slowed(args, policy, slowdown)
        if found["named_within_20"] == args.seeds and reliable is None:
            reliable = slowdown
    false_positives = sum(run.false_verdicts for run in healthy_runs(args, policy))
    job = every_rank_slowed(args, policy)
    job_delays = [run.first_verdict_step for run in job if run.first_verdict_step is not None]
    print(
        f"smallest slowdown named within {GOAL_STEPS} steps in all {args.seeds} seeds: "
        f"{'-' if reliable is None else f'{reliable:.0%}'}"
    )
    print(f"healthy: {false_positives} steps with a verdict in {args.seeds} x {args.healthy_steps} steps")
    print(
        f"every rank {args.job_slowdown:.0%} slower: job-wide verdict in {len(job_delays)}/{args.seeds} "
        f"seeds, after {statistics.median(job_delays) if job_delays else '-'} steps (median), "
        f"{max(job_delays) if job_delays else '-'} (worst); "
        f"other verdicts: {sum(r.false_verdicts for r in job)}"
    )
    goal = per_slowdown.get(GOAL_SLOWDOWN)
    ok = (
        goal is not None
        and goal["named_within_20"] == args.seeds
        and goal["false"] == 0
        and false_positives == 0
    )
    print(
        f"goal (5% within {GOAL_STEPS} steps, no false positive in {args.healthy_steps} healthy steps): "
        f"{'met' if ok else 'NOT met'}"
    )
    results.update(
        slowdowns={str(k): v for k, v in per_slowdown.items()},
        smallest_reliable=reliable,
        healthy_false_positives=false_positives,
        job_wide_delays=job_delays,
        goal_met=ok,
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0 if ok else 1


def one_rank_slowed(args: argparse.Namespace, policy: StragglerPolicy, slowdown: float) -> dict[str, object]:
    """Every seed with the middle rank slowed by `slowdown` from the onset: how many named it within
    GOAL_STEPS, the delays, the other verdicts; printed as the table's row."""
    slowed_rank = args.ranks // 2
    runs = [
        simulate(
            args.ranks,
            args.onset + 60,
            seed,
            args.jitter,
            args.comm,
            slowdown,
            [slowed_rank],
            args.onset,
            ((slowed_rank,), "rank"),
            policy,
        )
        for seed in range(args.seeds)
    ]
    delays = [run.first_verdict_step for run in runs if run.first_verdict_step is not None]
    in_goal = sum(1 for delay in delays if delay <= GOAL_STEPS)
    false = sum(run.false_verdicts for run in runs)
    print(
        f"{slowdown:>9.0%} {in_goal:>5}/{args.seeds:<3} {len(delays):>6} "
        f"{statistics.median(delays) if delays else '-':>10} "
        f"{max(delays) if delays else '-':>10} {false:>6}"
    )
    return {"named_within_20": in_goal, "named": len(delays), "delays": delays, "false": false}


def healthy_runs(args: argparse.Namespace, policy: StragglerPolicy) -> list[Run]:
    """Every seed of `--healthy-steps` steps with no rank slowed: any verdict is a false positive."""
    return [
        simulate(
            args.ranks, args.healthy_steps, 1000 + seed, args.jitter, args.comm, 0.0, [], 0, None, policy
        )
        for seed in range(args.seeds)
    ]


def every_rank_slowed(args: argparse.Namespace, policy: StragglerPolicy) -> list[Run]:
    """Every seed with every rank slowed by `--job-slowdown` from the onset: the job-wide verdict expected."""
    return [
        simulate(
            args.ranks,
            args.onset + 60,
            2000 + seed,
            args.jitter,
            args.comm,
            args.job_slowdown,
            list(range(args.ranks)),
            args.onset,
            ((), "job"),
            policy,
        )
        for seed in range(args.seeds)
    ]


if __name__ == "__main__":
    sys.exit(main())
