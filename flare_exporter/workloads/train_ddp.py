"""A small, ordinary DDP training script; it knows nothing about flare-exporter.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python flare_exporter/workloads/train_ddp.py

--wait-for PATH keeps the ranks alive after training until PATH exists (tests scrape them then);
--report PATH writes this rank's step times as JSON (the overhead benchmark reads them).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 256


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--wait-for", default="")
    parser.add_argument("--report", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    step_times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        inputs = torch.randn(args.batch, WIDTH, generator=generator)
        targets = torch.randint(0, 10, (args.batch,), generator=generator)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
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
