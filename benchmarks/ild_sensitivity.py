"""ILD sensitivity: the smallest per-op host delay detected within 10 steps, and false positives when healthy.

    python benchmarks/ild_sensitivity.py [--timer native|python] [--every N] [--window 2] [--trials 3] ...

One process trains train_ddp.py's small model on CPU (no process group) with the exporter's ILD state on the
optimizer step hook: sampling windows on one step in `--every`, a baseline of `--baseline` steps, a current
window of the last `--window` sampled steps, timed by `--timer` (native: the RecordFunction observer, built
if needed; python: the dispatch mode). After every step the timing manager drains and the engine's per-rank
rule (ild_verdicts.ild_shifted, the healthy peers' medians taken from a healthy run) says whether the rank's
host-dispatch latency has shifted. The delay is a busy-wait in every aten op (native: the op timer's own
injector; python: train_ddp's HostDelay, there from the start at 0 s), expressed as a share of the healthy
step: delay x ops per step / step time.

Printed: the healthy run's false positives in --healthy-steps steps, then per delay how many of --trials
trials detected it within --within steps, and the smallest delay detected in every trial.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flare_exporter.rank import cpp_recorder


def make_state(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from flare_exporter.config import Config
    from flare_exporter.rank.identity import RankIdentity
    from flare_exporter.rank.state import FlareState

    config = Config(
        ild_dispatch_every_steps=args.every,
        ild_warmup_steps=5,
        ild_baseline_steps=args.baseline,
        ild_window_steps=args.window,
        ild_min_samples=50,
        gpu_health=False,
    )
    state = FlareState.create(
        config, RankIdentity(rank=0, local_rank=0, world_size=1, run="bench", host="bench", pid=0)
    )
    assert state.ild is not None
    state.ild.install()
    state.steps.install()
    return state


class Trainer:
    def __init__(self, timer: str) -> None:
        import torch
        from torch import nn

        from flare_exporter.local.workloads import train_ddp

        torch.set_num_threads(1)
        self.torch, self.nn = torch, nn
        self.model = train_ddp.make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.generator = torch.Generator().manual_seed(0)
        self.native = cpp_recorder.load() if timer == "native" else None
        self.mode = None
        if self.native is not None:
            self.native.inject_delay(0.0)  # the injector's observer from the start, waiting 0 s
        else:
            self.mode = train_ddp.HostDelay(0.0)
            self.mode.__enter__()  # under the exporter's windows, which are pushed later, at step hooks
        self.width = train_ddp.WIDTH

    def delay(self, seconds: float) -> None:
        """Busy-wait `seconds` in every aten op from now on."""
        if self.native is not None:
            self.native.inject_delay(seconds)
        else:
            assert self.mode is not None
            self.mode.seconds = seconds

    def step(self) -> float:
        started = time.perf_counter()
        inputs = self.torch.randn(64, self.width, generator=self.generator)
        targets = self.torch.randint(0, 10, (64,), generator=self.generator)
        loss = self.nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.native is not None:
            self.native.inject_delay(-1)  # removed
        if self.mode is not None:
            self.mode.__exit__(None, None, None)


def run(args: argparse.Namespace, delay: float, healthy_steps: int, peers):  # type: ignore[no-untyped-def]
    """Train warm-up + baseline steps, then `healthy_steps` with `delay` per op; the drift after each."""
    from flare_exporter.engine.ild_verdicts import IldDrift, ild_shifted
    from flare_exporter.policies import IldPolicy

    policy = IldPolicy(op_shift_seconds=args.op_shift_ns * 1e-9) if args.op_shift_ns else IldPolicy()
    state = make_state(args)
    trainer = Trainer(args.timer)
    assert (state.ild.dispatch.native is not None) == (args.timer == "native")
    latency = state.ild.host_dispatch
    try:
        lead = 5 + args.baseline
        for _ in range(lead):
            trainer.step()
            state.manager.drain()
        trainer.delay(delay)
        drifts, fired, times = [], [], []
        for _ in range(healthy_steps):
            times.append(trainer.step())
            state.manager.drain()
            current, op_shift = latency.drift.current, latency.drift.op_shift
            drifts.append((current, op_shift))
            fired.append(current is not None and ild_shifted(IldDrift(*current, op_shift), peers, policy))
        windows = state.ild.dispatch.windows
        ops_per_window = sum(latency.histogram.counts) / max(1, windows)
        return drifts, fired, times, ops_per_window
    finally:
        state.steps.remove()
        state.ild.remove()
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timer", choices=("native", "python"), default="native", help="(default native)")
    for flag, kind, default, says in (
        ("--every", int, 0, "a window on one step in N (0: the exporter's default)"),
        ("--window", int, 2, "sampled steps in the current window"),
        ("--baseline", int, 0, "baseline steps after 5 warm-up (0: the exporter's default)"),
        ("--healthy-steps", int, 1000, "healthy steps checked"),
        ("--within", int, 10, "steps within which to detect"),
        ("--op-shift-ns", float, 0, "the rule's per-op shift threshold (0: the engine's default)"),
        ("--trials", int, 3, "trials per delay"),
        ("--shares", str, "0.25,0.5,1,2,4,8", "delays to try, in %% of the step time, comma-separated"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{says} (default {default})")
    args = parser.parse_args(argv)
    from flare_exporter.config import Config

    args.every = args.every or Config().ild_dispatch_every_steps
    args.baseline = args.baseline or Config().ild_baseline_steps
    if args.timer == "native":
        cpp_recorder.build()  # once per torch version, ~10-30 s
    else:
        cpp_recorder.load = lambda: None  # the exporter's dispatch-mode windows

    from flare_exporter.engine.ild_verdicts import IldPeers

    drifts, fired, times, ops = run(args, 0.0, args.healthy_steps, IldPeers(None, None))
    healthy_w1 = [current[1] for current, _ in drifts if current is not None]
    median_w1 = statistics.median(healthy_w1) if healthy_w1 else None
    healthy_shifts = [shift for _, shift in drifts if shift is not None]
    peers = IldPeers(median_w1, statistics.median(healthy_shifts) if healthy_shifts else None)
    # the healthy run again with the peers' medians known: false positives of the full rule
    drifts, fired, times, ops = run(args, 0.0, args.healthy_steps, peers)
    step_time = statistics.median(times)
    ks_values = [current[0] for current, _ in drifts if current is not None]
    shifts = sorted(shift for _, shift in drifts if shift is not None)
    print(
        f"ILD sensitivity (host dispatch latency, {args.timer} timer): window on 1 step in "
        f"{args.every}, current window "
        f"{args.window} sampled steps, baseline {args.baseline} steps; {ops:.0f} ops per step, median step "
        f"{step_time * 1e3:.3f} ms (windows included)"
    )
    print(
        f"healthy: {sum(fired)} false positives in {args.healthy_steps} steps; KS median "
        f"{statistics.median(ks_values):.3f}, max {max(ks_values):.3f}; W1 median "
        f"{(median_w1 or 0) * 1e6:.2f} µs; "
        + (
            f"per-op shift median {statistics.median(shifts) * 1e9:.1f} ns, 99th percentile "
            f"{shifts[int(0.99 * (len(shifts) - 1))] * 1e9:.1f} ns, max {shifts[-1] * 1e9:.1f} ns"
            if shifts
            else "no per-op shift (the native timer's only)"
        )
    )
    print(
        f"{'delay % of step':>16}  {'per op':>9}  detected within {args.within} steps  steps to detect"
        "  largest per-op shift (ns)"
    )
    smallest = None
    for share in [float(text) for text in args.shares.split(",")]:
        per_op = share / 100 * step_time / ops
        detected_at, largest_shift = [], []
        for _ in range(args.trials):
            drifts_now, fired_now, _, _ = run(args, per_op, args.within, peers)
            detected_at.append(fired_now.index(True) + 1 if True in fired_now else None)
            largest_shift.append(max((shift or 0.0 for _, shift in drifts_now), default=0.0))
        hits = [at for at in detected_at if at is not None]
        print(
            f"{share:15.2f}%  {per_op * 1e6:7.3f}µs  {len(hits)}/{args.trials}{'':27}"
            f"{', '.join(str(at) for at in detected_at):15}  "
            f"{', '.join(f'{shift * 1e9:.0f}' for shift in largest_shift)}"
        )
        if smallest is None and len(hits) == args.trials:
            smallest = share
    print(
        f"smallest delay detected in every trial within {args.within} steps: "
        + (f"{smallest:g}% of the step time" if smallest is not None else "none of those tried")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
