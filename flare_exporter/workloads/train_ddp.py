"""A small, ordinary DDP training script; it knows nothing about flare-exporter.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python flare_exporter/workloads/train_ddp.py

--wait-for PATH keeps the ranks alive after training until PATH exists (tests scrape them then);
--report PATH writes this rank's step times as JSON (the overhead benchmark reads them).
--fault KIND --fault-rank R --fault-step S makes rank R misbehave at step S, the way real jobs do:
  stuck     R loops in Python before its next collective, forever (a livelock in its own code);
  mismatch  every rank syncs a metric with one extra collective, R with broadcast instead of all_reduce;
  raise     R raises an exception out of the training loop and dies.
--step-seconds T paces each step to at least T seconds (a steadier job to watch than a flat-out one).
Signals (SIGKILL, SIGSTOP) are sent from outside, by the demo or the tests.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 256
FAULTS = ("none", "stuck", "mismatch", "raise")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )


def stuck_in_compute() -> None:
    """A rank's own code that never finishes (think: a retry loop around a dead file system)."""
    total = 0
    while True:
        total += sum(range(1000))
        time.sleep(0.01)


def sync_metric(value: torch.Tensor, rank: int, odd_rank: int) -> None:
    """Average a metric over the ranks; the odd rank calls the wrong collective (a classic bug)."""
    if rank == odd_rank:
        dist.broadcast(value, src=0)
    else:
        dist.all_reduce(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--wait-for", default="")
    parser.add_argument("--report", default="")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    step_times = []
    for step in range(args.steps):
        started = time.perf_counter()
        if step == args.fault_step:
            if args.fault == "stuck" and rank == args.fault_rank:
                stuck_in_compute()
            if args.fault == "raise" and rank == args.fault_rank:
                raise RuntimeError(f"injected fault on rank {rank} at step {step}")
            if args.fault == "mismatch":
                sync_metric(torch.ones(16), rank, args.fault_rank)
        inputs = torch.randn(args.batch, WIDTH, generator=generator)
        targets = torch.randint(0, 10, (args.batch,), generator=generator)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_seconds:
            time.sleep(max(0.0, args.step_seconds - (time.perf_counter() - started)))
        step_times.append(time.perf_counter() - started)
    if args.report:
        with open(args.report, "w") as out:
            json.dump({"rank": rank, "step_times": step_times}, out)
    dist.barrier()
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
