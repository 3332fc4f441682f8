"""Two ranks exchange a tensor N times; rank 0 sleeps a known delay before each send, rank 1 receives at once.

    p2p_delay.py --rounds N --delay-seconds D [--wait-for FILE]

Each round starts at a barrier, so rank 1's receive is issued when rank 0 starts its delay: the receive takes
the delay (and a little), the send almost nothing (its peer already waits). Rounds alternate `send`/`recv`
with `isend`/`irecv` and `batch_isend_irecv`, the three ways torch issues them.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--delay-seconds", type=float, default=0.1)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
tensor = torch.ones(1024)
for round_ in range(args.rounds):
    dist.barrier()
    way = round_ % 3
    if rank == 0:
        time.sleep(args.delay_seconds)
        if way == 0:
            dist.send(tensor, 1)
        elif way == 1:
            dist.isend(tensor, 1).wait()
        else:
            [work] = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, 1)])
            work.wait()
    elif way == 0:
        dist.recv(tensor, 0)
    elif way == 1:
        dist.irecv(tensor, 0).wait()
    else:
        [work] = dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, 0)])
        work.wait()
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
