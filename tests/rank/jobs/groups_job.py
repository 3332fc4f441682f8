"""Plain torch.distributed script: two subgroups (ranks 0,1 and 2,3), an all-reduce in each, then waits."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
pairs = [
    dist.new_group([0, 1], group_desc="data_parallel"),
    dist.new_group([2, 3], group_desc="data_parallel"),
]
mine = pairs[dist.get_rank() // 2]
for _ in range(3):
    dist.all_reduce(torch.ones(1000), group=mine)
dist.broadcast(torch.ones(10), src=0)
assert dist.get_backend(mine) == "gloo" and dist.get_backend() == "gloo"
dist.barrier()
while not os.path.exists(sys.argv[sys.argv.index("--wait-for") + 1]):
    time.sleep(0.05)
dist.destroy_process_group()
