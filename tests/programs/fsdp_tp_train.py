"""An unmodified 2-D parallel program: tensor parallel on the "tp" dimension of a 2x2 DeviceMesh ("dp", "tp")
(`parallelize_module`, ColwiseParallel then RowwiseParallel), FSDP2 `fully_shard` on its "dp" dimension.
4 ranks, gloo, CPU.

    fsdp_tp_train.py --steps N [--stuck-rank R --stuck-step S] [--wait-for FILE]

Each step: DTensor's all-reduces (and FSDP2's all-gathers of the TP-sharded parameters) on the tp groups;
FSDP2's all-gathers and reduce-scatters on the dp groups. --stuck-rank: rank R sleeps in its own code at
step S, forever.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--stuck-step", type=int, default=5)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

WIDTH, HIDDEN, BATCH = 16, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def stuck_in_parallel_code() -> None:
    while True:
        time.sleep(0.1)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)  # the same initial model on every rank
model = nn.Sequential(Block(), Block())
for block in model:
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
# the ranks of one tp group see the same batch; each dp replica its own
torch.manual_seed(1 + mesh.get_local_rank("dp"))
for step in range(args.steps):
    started = time.monotonic()
    if rank == args.stuck_rank and step == args.stuck_step:
        stuck_in_parallel_code()
    optimizer.zero_grad()
    loss = model(torch.randn(BATCH, WIDTH)).square().mean()
    loss.backward()
    optimizer.step()
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
