"""An unmodified torch.distributed.pipelining program: one stage per rank, GPipe or 1F1B.

    pipeline_train.py --schedule gpipe|1f1b --steps N [--stuck-rank R --stuck-step S] [--deadlock]
                      [--wait-for FILE]

--stuck-rank: rank R sleeps in its own code at step S, forever. --deadlock: at step S stages 1 and 2 both
send to each other before receiving, which blocks on gloo (a send completes when its peer receives).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", default="gpipe")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--stuck-step", type=int, default=5)
parser.add_argument("--deadlock", action="store_true")
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

WIDTH, MICROBATCHES, BATCH = 64, 4, 16


def stuck_in_stage_code() -> None:
    while True:
        time.sleep(0.1)


def exchange_both_ways_sending_first(rank: int) -> None:
    peer = 3 - rank  # stages 1 and 2
    dist.send(torch.ones(256), peer)
    dist.recv(torch.ones(256), peer)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
stage = PipelineStage(module, rank, world, torch.device("cpu"))
schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
schedule = schedules[args.schedule](stage, n_microbatches=MICROBATCHES, loss_fn=nn.MSELoss())
optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
for step in range(args.steps):
    started = time.monotonic()
    if rank == args.stuck_rank and step == args.stuck_step:
        stuck_in_stage_code()
    if args.deadlock and step == args.stuck_step and rank in (1, 2):
        exchange_both_ways_sending_first(rank)
    optimizer.zero_grad()
    if rank == 0:
        schedule.step(torch.randn(BATCH, WIDTH))
    elif rank == world - 1:
        schedule.step(target=torch.randn(BATCH, WIDTH))
    else:
        schedule.step()
    optimizer.step()
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
