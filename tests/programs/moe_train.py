"""An unmodified expert-parallel (MoE) program: one expert per rank, tokens dispatched by a router.

    moe_train.py --steps N [--stuck-rank R --stuck-step S] [--wait-for FILE]

Each step, each rank routes its tokens (data-dependent, so uneven), exchanges the per-expert counts with
`dist.all_to_all_single`, sends the tokens to their experts with uneven input/output splits (the functional
collective `_functional_collectives.all_to_all_single`, autograd-aware, as torchtitan dispatches), runs its
local expert, and sends the results back with `dist.all_to_all_single` in an autograd Function (as Megatron's
_AllToAll); backward does both exchanges in reverse, then the shared parameters' gradients are all-reduced
by hand (no DDP). gloo, CPU. --stuck-rank: rank R sleeps in its own code at
step S, forever.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--stuck-step", type=int, default=5)
parser.add_argument("--wait-for", default="")
args = parser.parse_args()

WIDTH, TOKENS = 16, 32


def stuck_in_expert_code() -> None:
    while True:
        time.sleep(0.1)


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with uneven splits, its backward the reverse exchange."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        ctx.splits = (input_splits, output_splits)
        output = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
        dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return AllToAll.apply(grad, *ctx.splits), None, None


def moe_layer(tokens: torch.Tensor, router: nn.Linear, expert: nn.Linear, world: int) -> torch.Tensor:
    scores = router(tokens).softmax(dim=-1)
    weight, choice = scores.max(dim=-1)  # each token's expert: the rank that runs it
    order = choice.argsort()
    send_counts = torch.bincount(choice, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # how many tokens each expert gets from each rank
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    received = funcol.all_to_all_single(tokens[order], recv_splits, send_splits, WORLD)
    processed = torch.relu(expert(received))
    returned = AllToAll.apply(processed, send_splits, recv_splits)
    output = torch.empty_like(returned)
    output = output.index_copy(0, order, returned)  # back in the tokens' order
    return tokens + weight.unsqueeze(-1) * output


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
WORLD = dist.distributed_c10d._get_default_group()
torch.manual_seed(0)
embed = nn.Linear(WIDTH, WIDTH)  # shared: the same on every rank, its gradient all-reduced
router = nn.Linear(WIDTH, world)  # shared
head = nn.Linear(WIDTH, 1)  # shared
torch.manual_seed(100 + rank)
expert = nn.Linear(WIDTH, WIDTH)  # this rank's own expert
shared = [*embed.parameters(), *router.parameters(), *head.parameters()]
optimizer = torch.optim.SGD([*shared, *expert.parameters()], lr=0.01)
for step in range(args.steps):
    started = time.monotonic()
    if rank == args.stuck_rank and step == args.stuck_step:
        stuck_in_expert_code()
    optimizer.zero_grad()
    hidden = embed(torch.randn(TOKENS, WIDTH))  # requires grad: backward sends gradients back both ways
    loss = head(moe_layer(hidden, router, expert, world)).square().mean()
    loss.backward()
    for parameter in shared:
        assert parameter.grad is not None
        dist.all_reduce(parameter.grad)
        parameter.grad /= world
    optimizer.step()
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
dist.barrier()
while args.wait_for and not os.path.exists(args.wait_for):
    time.sleep(0.05)
dist.destroy_process_group()
