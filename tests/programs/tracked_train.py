"""An unmodified DDP program that logs its loss to TensorBoard and, with --wandb, to a W&B run (offline).

    tracked_train.py --log-dir DIR [--wandb] [--step-seconds S] [--wait-for FILE]

It trains until FILE exists. At the end, with --wandb, it writes its run's summary (what the run's page
shows) to DIR/wandb-summary-rank<R>.json, as a person would read it there.
"""

import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
parser.add_argument("--log-dir", required=True)
parser.add_argument("--wandb", action="store_true")
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
writer = SummaryWriter(os.path.join(args.log_dir, f"rank{rank}"))
run = None
if args.wandb:
    import wandb

    run = wandb.init(mode="offline", dir=args.log_dir, project="tracked", name=f"rank{rank}")
torch.manual_seed(rank)
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in itertools.count():
    done = torch.tensor([float(os.path.exists(args.wait_for) if args.wait_for else step >= 20)])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    if done.item():
        break
    started = time.monotonic()
    optimizer.zero_grad()
    loss = model(torch.randn(8, 32)).square().mean()
    loss.backward()
    optimizer.step()
    writer.add_scalar("loss", loss.item(), step)
    if run is not None:
        run.log({"loss": loss.item()})
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
writer.close()
if run is not None:
    with open(os.path.join(args.log_dir, f"wandb-summary-rank{rank}.json"), "w") as out:
        json.dump(dict(run.summary), out)
    run.finish()
dist.barrier()
dist.destroy_process_group()
