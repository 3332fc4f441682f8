"""What flare's collective path costs a real DDP step, measured inside one process: wrapped and plain groups
alternated in blocks of steps.

    python benchmarks/collective_path.py                        # 4 ranks, 40 pairs of blocks of 50 steps
    python benchmarks/collective_path.py --ranks 1 --blocks 60 --json out.json
    python benchmarks/collective_path.py --recorder python      # the Python hooks instead of the C++ backend

Two processes (overhead.py's A/B) differ by a few per cent on a shared machine; here every rank holds two
copies of one DDP model: one reduces over the plain gloo world group (created before `attach()`), the other
over a group created after it, which flare wraps (recorded by flare's C++ backend, or with `--recorder
python` by FlareProcessGroup's Python hooks). Each rank trains them in alternating blocks of `--block-steps`
steps (A/B, then B/A), in lockstep with the others, timing each step's wall time and its training thread's
CPU; the process, threads, heap and flare's other hooks are the same for both.

Per block pair and rank: the difference of the blocks' median step times (wrapped minus plain); the summary
gives the median difference with a distribution-free 95 % interval and the ratio of the medians. Exit
status: 0 when every rank finished and the wrapped group recorded every collective its model issued and
the plain one none, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli_runs import median_ci  # noqa: E402  (benchmarks/)

from flare_exporter.local.jobs import free_port

SIDES = ("plain", "wrapped")


def rank_main(rank: int, args: argparse.Namespace, master_port: int, out: str) -> None:
    """One rank: both models, the blocks, the check; writes its blocks as JSON to `out`."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1"
    )
    os.environ.update(MASTER_PORT=str(master_port), FLARE_RUN="collective-path")
    os.environ["FLARE_PORT"] = (
        "0"  # nothing scrapes here: the endpoint is the end-to-end benchmark's business
    )
    os.environ["FLARE_NATIVE_COLLECTIVES"] = str(args.recorder == "cpp").lower()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import flare_exporter
    from flare_exporter.local.workloads.train_ddp import WIDTH, make_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # before attach(): the world group stays plain
    attachment = flare_exporter.attach()
    groups = {"plain": dist.group.WORLD, "wrapped": dist.new_group(backend="gloo")}
    recorders = [tracker.timing.recorder for tracker in attachment.state.groups.values()]
    if recorders != [args.recorder]:  # flare saw one group, the wrapped one, and records it as asked
        raise SystemExit(f"collective_path: flare records {recorders} groups, not one with {args.recorder}")
    models = {side: DistributedDataParallel(make_model(), process_group=groups[side]) for side in SIDES}
    # One optimizer for both: flare's step hook counts the steps of one optimizer (a second one in the same
    # iteration is not a step), so with one each, only one side would pay for the hook and its listeners.
    # zero_grad() leaves the gradients of the model not trained None, and SGD skips those parameters.
    optimizer = torch.optim.SGD([*models["plain"].parameters(), *models["wrapped"].parameters()], lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(args.batch, WIDTH, generator=generator) for _ in range(16)]
    targets = [torch.randint(0, 10, (args.batch,), generator=generator) for _ in range(16)]
    steps_taken = dict.fromkeys(SIDES, 0)

    def block(side: str, steps: int) -> tuple[float, float]:
        """Median wall and training-thread CPU seconds per step over `steps` steps of `side`'s model."""
        model = models[side]
        walls, cpus = [], []
        for step in range(steps):
            started, cpu_started = time.perf_counter(), time.thread_time()
            loss = nn.functional.cross_entropy(model(inputs[step % 16]), targets[step % 16])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            walls.append(time.perf_counter() - started)
            cpus.append(time.thread_time() - cpu_started)
        steps_taken[side] += steps
        return statistics.median(walls), statistics.median(cpus)

    for side in SIDES:
        block(side, args.warmup)
    blocks = []
    for number in range(args.blocks):
        order = SIDES if number % 2 == 0 else SIDES[::-1]
        measured = {side: block(side, args.block_steps) for side in order}
        blocks.append({side: {"wall": measured[side][0], "cpu": measured[side][1]} for side in SIDES})
    attachment.state.manager.drain()
    (tracker,) = attachment.state.groups.values()  # the wrapped group is the only one flare saw
    recorded = tracker.last_completed_seq
    dist.barrier(group=groups["plain"])
    dist.destroy_process_group()
    Path(out).write_text(
        json.dumps({"rank": rank, "blocks": blocks, "recorded": recorded, "steps": steps_taken})
    )


def summarize(args: argparse.Namespace, reports: list[dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {
        key: getattr(args, key) for key in ("ranks", "blocks", "block_steps", "recorder")
    }
    for measure, what in (("wall", "step time"), ("cpu", "training thread's CPU per step")):
        differences = [
            block["wrapped"][measure] - block["plain"][measure]
            for report in reports
            for block in report["blocks"]
        ]
        plain, wrapped = (
            statistics.median(block[side][measure] for report in reports for block in report["blocks"])
            for side in SIDES
        )
        difference = statistics.median(differences)
        interval = median_ci(differences)
        results[measure] = dict(median_plain=plain, median_wrapped=wrapped, median_difference=difference)
        results[measure] |= {
            "median_difference_ci95": list(interval) if interval else None,
            "ratio": wrapped / plain,
        }
        interval_text = f", 95% CI [{interval[0] * 1e6:+.2f}, {interval[1] * 1e6:+.2f}]" if interval else ""
        print(
            f"  {what}: median {plain * 1e6:.1f} us plain, {wrapped * 1e6:.1f} us wrapped (ratio "
            f"{wrapped / plain:.4f}); wrapped minus plain per block: median {difference * 1e6:+.2f} us"
            f"{interval_text} over {len(differences)} blocks"
        )
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--blocks", type=int, default=40, help="pairs of blocks (default 40)")
    parser.add_argument("--block-steps", type=int, default=50, help="steps per block (default 50)")
    parser.add_argument("--warmup", type=int, default=100, help="steps of each model before the blocks")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--recorder",
        choices=("cpp", "python"),
        default="cpp",
        help="what records the wrapped group's collectives: flare's C++ backend (default; built if need be) "
        "or the Python hooks",
    )
    parser.add_argument("--json", default="", metavar="OUT", help="also write every number as JSON to OUT")
    args = parser.parse_args(argv)
    for name in ("ranks", "blocks", "block_steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"collective path, in-process A/B: {args.ranks} gloo ranks, {args.blocks} pairs of blocks of "
        f"{args.block_steps} steps (batch {args.batch}), plain world group vs flare-wrapped group, "
        f"recorded by {'the C++ backend' if args.recorder == 'cpp' else 'the Python hooks'}"
    )
    if args.recorder == "cpp":
        from flare_exporter.rank import cpp_recorder

        try:
            cpp_recorder.build()
        except (cpp_recorder.BuildError, OSError) as error:
            print(f"collective_path: error: {error}", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory(prefix="flare-collective-path-") as tmp:
        outs = [str(Path(tmp) / f"rank{rank}.json") for rank in range(args.ranks)]
        try:
            context = mp.start_processes(
                _spawned, args=(args, free_port(), outs), nprocs=args.ranks, start_method="spawn", join=False
            )
            while not context.join():
                pass
        except Exception as error:  # a rank's failure, with its traceback's last line
            print(f"collective_path: error: {str(error).strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        reports = [json.loads(Path(out).read_text()) for out in outs]
    wrong = [
        f"rank {report['rank']}: {report['recorded']} recorded in {report['steps']['wrapped']} steps"
        for report in reports
        if report["recorded"] < report["steps"]["wrapped"]
    ]
    if wrong:
        print(
            "collective_path: error: the wrapped group missed collectives: " + "; ".join(wrong),
            file=sys.stderr,
        )
        return 1
    print("summary (median over ranks and blocks):")
    results = summarize(args, reports)
    results["recorded_collectives"] = [report["recorded"] for report in reports]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _spawned(index: int, args: argparse.Namespace, master_port: int, outs: list[str]) -> None:
    rank_main(index, args, master_port, outs[index])


if __name__ == "__main__":
    sys.exit(main())
