"""A script that attaches from code, then breaks flare's collective hook on purpose: training must go on.

Prints one JSON line with what its own registry says, for the test to check.
"""

import json

import torch
import torch.distributed as dist
from prometheus_client import generate_latest

import flare_exporter
from flare_exporter.engine.scrape import parse, value
from flare_exporter.rank import groups

attachment = flare_exporter.attach()
dist.init_process_group("gloo")


def broken_payload_bytes(tensors):
    raise RuntimeError("injected fault in the hook")


for _ in range(2):
    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # observed normally
groups.payload_bytes = broken_payload_bytes  # from now on the hook fails on every collective
sums = []
for _ in range(3):
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    sums.append(float(tensor.sum()))
attachment.state.manager.drain()
samples = parse(generate_latest(attachment.registry).decode())
print(
    json.dumps(
        {
            "sums": sums,
            "hook_errors": value(samples, "flare_exporter_errors_total", component="collective_hook"),
            "allreduce_count": value(samples, "flare_collective_duration_seconds_count", op="allreduce"),
        }
    )
)
dist.destroy_process_group()
