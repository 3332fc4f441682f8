"""An unmodified FSDP2 program: `fully_shard` on a small MLP over a 1-D DeviceMesh named "dp" (gloo, CPU).

    fsdp_train.py --steps N [--stuck-rank R --stuck-step S] [--wait-for FILE]

Each step FSDP2 all-gathers every layer's parameters (forward, and again in backward) and reduce-scatters
their gradients on the mesh's dp group. --stuck-rank: rank R sleeps in its own code at step S, forever.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--stuck-step", type=int, default=5)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

WIDTH, BATCH = 32, 8


def stuck_in_fsdp_code() -> None:
    while True:
        time.sleep(0.1)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
torch.manual_seed(0)  # the same initial model on every rank, as FSDP expects
model = nn.Sequential(
    nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1)
)
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)  # each rank its own data
for step in range(args.steps):
    started = time.monotonic()
    if rank == args.stuck_rank and step == args.stuck_step:
        stuck_in_fsdp_code()
    optimizer.zero_grad()
    loss = model(torch.randn(BATCH, WIDTH)).square().mean()
    loss.backward()
    optimizer.step()
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
