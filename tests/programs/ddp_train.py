"""An unmodified DDP program: a small MLP wrapped in DistributedDataParallel (gloo, CPU).

    ddp_train.py --steps N [--stuck-rank R --stuck-step S] [--wait-for FILE]

Each step DDP's reducer all-reduces the gradient bucket from C++. --stuck-rank: rank R sleeps in its own
code at step S, forever.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--stuck-step", type=int, default=5)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

WIDTH, BATCH = 32, 8


def stuck_in_ddp_code() -> None:
    while True:
        time.sleep(0.1)


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)
for step in range(args.steps):
    started = time.monotonic()
    if rank == args.stuck_rank and step == args.stuck_step:
        stuck_in_ddp_code()
    optimizer.zero_grad()
    loss = model(torch.randn(BATCH, WIDTH)).square().mean()
    loss.backward()
    optimizer.step()
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
