"""An unmodified program that issues, each step, one of each collective entry point torch 2.13 offers
beyond the plain c10d calls: the functional collectives (torch.ops._c10d_functional, as DTensor and
torch.compile emit them, and their autograd forms), c10d's tensor collectives that reach ProcessGroup's
torchcomms-named methods (all_gather_into_tensor -> all_gather_single, ...), the coalescing manager, and
all_to_all_single with uneven input and output splits. gloo, CPU, 2 ranks (tests/rank/test_entry_points.py).

    entry_points.py --steps N [--stuck-rank R --stuck-step S] [--wait-for FILE]

Each case runs on a group of its own, `new_group(group_desc=group_desc(index))`, issues CASES[name][1]
collectives there (autograd cases: forward and backward), and checks what it received, so that a collective
delegated to the wrong method fails the run. --stuck-rank: rank R sleeps in its own code at step S, forever.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

c10d_functional = torch.ops._c10d_functional
functional_autograd = torch.ops._c10d_functional_autograd
SUMMED = [3.0] * 4  # the sum of mine() over ranks 0 and 1
BOTH = [1.0] * 4 + [2.0] * 4  # the all-gather of mine() from ranks 0 and 1
SPLITS = {0: [1, 2], 1: [4, 1]}  # rank -> what it sends each peer: uneven input and output splits


def wait(tensors: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    tensors = tensors if isinstance(tensors, list) else [tensors]
    return [c10d_functional.wait_tensor(tensor) for tensor in tensors]


def mine(rank: int, n: int = 4) -> torch.Tensor:
    return torch.full((n,), float(rank + 1))


def expect(got: torch.Tensor, want: torch.Tensor | list[float], case: str) -> None:
    want = want if isinstance(want, torch.Tensor) else torch.tensor(want)
    if not torch.equal(got.flatten(), want.flatten().to(got.dtype)):
        raise AssertionError(f"{case}: got {got.tolist()}, want {want.tolist()}")


def gradient(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None
    return tensor.grad


def a2a_input(rank: int) -> torch.Tensor:
    return rank * 10 + torch.arange(float(sum(SPLITS[rank])))


def a2a_expected(rank: int) -> torch.Tensor:
    chunks = []
    for peer, splits in SPLITS.items():
        start = sum(splits[:rank])
        chunks.append(a2a_input(peer)[start : start + splits[rank]])
    return torch.cat(chunks)


def a2a_splits(rank: int) -> tuple[list[int], list[int]]:
    """(output splits, input splits) of `rank`."""
    return [SPLITS[peer][rank] for peer in SPLITS], SPLITS[rank]


def functional_all_reduce(group: dist.ProcessGroup, rank: int) -> None:
    expect(wait(c10d_functional.all_reduce(mine(rank), "sum", group.group_name))[0], SUMMED, "all_reduce")


def functional_all_reduce_inplace(group: dist.ProcessGroup, rank: int) -> None:
    tensor = mine(rank)
    wait(c10d_functional.all_reduce_(tensor, "sum", group.group_name))
    expect(tensor, SUMMED, "all_reduce_")


def functional_all_reduce_coalesced(group: dist.ProcessGroup, rank: int) -> None:
    for out in wait(
        c10d_functional.all_reduce_coalesced([mine(rank), mine(rank, 2)], "sum", group.group_name)
    ):
        expect(out, [3.0] * len(out), "all_reduce_coalesced")


def functional_all_gather_into_tensor(group: dist.ProcessGroup, rank: int) -> None:
    out = wait(c10d_functional.all_gather_into_tensor(mine(rank), group.size(), group.group_name))[0]
    expect(out, BOTH, "all_gather_into_tensor")


def functional_all_gather_into_tensor_out(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(8)
    wait(c10d_functional.all_gather_into_tensor_out(mine(rank), group.size(), group.group_name, out=out))
    expect(out, BOTH, "all_gather_into_tensor_out")


def functional_all_gather_into_tensor_coalesced(group: dist.ProcessGroup, rank: int) -> None:
    inputs = [mine(rank), mine(rank)]
    for out in wait(c10d_functional.all_gather_into_tensor_coalesced(inputs, group.size(), group.group_name)):
        expect(out, BOTH, "all_gather_into_tensor_coalesced")


def functional_reduce_scatter_tensor(group: dist.ProcessGroup, rank: int) -> None:
    out = wait(c10d_functional.reduce_scatter_tensor(mine(rank, 8), "sum", group.size(), group.group_name))[0]
    expect(out, SUMMED, "reduce_scatter_tensor")


def functional_reduce_scatter_tensor_out(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(4)
    wait(
        c10d_functional.reduce_scatter_tensor_out(
            mine(rank, 8), "sum", group.size(), group.group_name, out=out
        )
    )
    expect(out, SUMMED, "reduce_scatter_tensor_out")


def functional_reduce_scatter_tensor_coalesced(group: dist.ProcessGroup, rank: int) -> None:
    inputs = [mine(rank, 8), mine(rank, 8)]
    outs = c10d_functional.reduce_scatter_tensor_coalesced(inputs, "sum", group.size(), group.group_name)
    for out in wait(outs):
        expect(out, SUMMED, "reduce_scatter_tensor_coalesced")


def functional_all_to_all_single(group: dist.ProcessGroup, rank: int) -> None:
    output_splits, input_splits = a2a_splits(rank)
    out = c10d_functional.all_to_all_single(a2a_input(rank), output_splits, input_splits, group.group_name)
    expect(wait(out)[0], a2a_expected(rank), "all_to_all_single")


def functional_broadcast(group: dist.ProcessGroup, rank: int) -> None:
    expect(wait(c10d_functional.broadcast(mine(rank), 0, group.group_name))[0], [1.0] * 4, "broadcast")


def functional_broadcast_inplace(group: dist.ProcessGroup, rank: int) -> None:
    tensor = mine(rank)
    wait(c10d_functional.broadcast_(tensor, 0, group.group_name))
    expect(tensor, [1.0] * 4, "broadcast_")


def autograd_all_to_all_single(group: dist.ProcessGroup, rank: int) -> None:
    """Forward, and the reverse exchange in backward (an MoE layer's dispatch)."""
    output_splits, input_splits = a2a_splits(rank)
    tensor = a2a_input(rank).requires_grad_()
    out = wait(functional_autograd.all_to_all_single(tensor, output_splits, input_splits, group.group_name))[
        0
    ]
    expect(out, a2a_expected(rank), "autograd all_to_all_single")
    out.sum().backward()
    expect(gradient(tensor), torch.ones(len(tensor)), "autograd all_to_all_single backward")


def autograd_all_gather_into_tensor(group: dist.ProcessGroup, rank: int) -> None:
    """Backward: a reduce-scatter."""
    tensor = mine(rank).requires_grad_()
    out = wait(functional_autograd.all_gather_into_tensor(tensor, group.size(), group.group_name))[0]
    expect(out, BOTH, "autograd all_gather_into_tensor")
    out.sum().backward()
    expect(gradient(tensor), [2.0] * 4, "autograd all_gather_into_tensor backward")


def autograd_reduce_scatter_tensor(group: dist.ProcessGroup, rank: int) -> None:
    """Backward: an all-gather."""
    tensor = mine(rank, 8).requires_grad_()
    out = wait(functional_autograd.reduce_scatter_tensor(tensor, "sum", group.size(), group.group_name))[0]
    expect(out, SUMMED, "autograd reduce_scatter_tensor")
    out.sum().backward()
    expect(gradient(tensor), torch.ones(8), "autograd reduce_scatter_tensor backward")


def c10d_all_to_all_single_uneven(group: dist.ProcessGroup, rank: int) -> None:
    output_splits, input_splits = a2a_splits(rank)
    out = torch.empty(sum(output_splits))
    dist.all_to_all_single(out, a2a_input(rank), output_splits, input_splits, group=group)
    expect(out, a2a_expected(rank), "dist.all_to_all_single")


def c10d_all_gather_into_tensor(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(8)
    dist.all_gather_into_tensor(out, mine(rank), group=group)
    expect(out, BOTH, "dist.all_gather_into_tensor")


def c10d_all_gather_into_tensor_async(group: dist.ProcessGroup, rank: int) -> None:
    """As FSDP2 issues its all-gathers."""
    out = torch.empty(8)
    work = dist.all_gather_into_tensor(out, mine(rank), group=group, async_op=True)
    assert work is not None
    work.wait()
    expect(out, BOTH, "dist.all_gather_into_tensor(async_op=True)")


def c10d_all_gather_single(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(8)
    dist.all_gather_single(out, mine(rank), group=group)
    expect(out, BOTH, "dist.all_gather_single")


def c10d_reduce_scatter_tensor(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, mine(rank, 8), group=group)
    expect(out, SUMMED, "dist.reduce_scatter_tensor")


def c10d_reduce_scatter_single(group: dist.ProcessGroup, rank: int) -> None:
    out = torch.empty(4)
    dist.reduce_scatter_single(out, mine(rank, 8), group=group)
    expect(out, SUMMED, "dist.reduce_scatter_single")


def coalesced_all_gather_into_tensor(group: dist.ProcessGroup, rank: int) -> None:
    outs = [torch.empty(8), torch.empty(8)]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        for out in outs:
            dist.all_gather_into_tensor(out, mine(rank), group=group)
    manager.wait()
    for out in outs:
        expect(out, BOTH, "coalesced all_gather_into_tensor")


def coalesced_reduce_scatter_tensor(group: dist.ProcessGroup, rank: int) -> None:
    outs = [torch.empty(4), torch.empty(4)]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        for out in outs:
            dist.reduce_scatter_tensor(out, mine(rank, 8), group=group)
    manager.wait()
    for out in outs:
        expect(out, SUMMED, "coalesced reduce_scatter_tensor")


# name -> (the case, the collectives it issues: autograd cases issue one in forward and one in backward)
CASES: dict[str, tuple[Callable[[dist.ProcessGroup, int], None], int]] = {
    case.__name__: (case, 2 if case.__name__.startswith("autograd_") else 1)
    for case in (
        functional_all_reduce,
        functional_all_reduce_inplace,
        functional_all_reduce_coalesced,
        functional_all_gather_into_tensor,
        functional_all_gather_into_tensor_out,
        functional_all_gather_into_tensor_coalesced,
        functional_reduce_scatter_tensor,
        functional_reduce_scatter_tensor_out,
        functional_reduce_scatter_tensor_coalesced,
        functional_all_to_all_single,
        functional_broadcast,
        functional_broadcast_inplace,
        autograd_all_to_all_single,
        autograd_all_gather_into_tensor,
        autograd_reduce_scatter_tensor,
        c10d_all_to_all_single_uneven,
        c10d_all_gather_into_tensor,
        c10d_all_gather_into_tensor_async,
        c10d_all_gather_single,
        c10d_reduce_scatter_tensor,
        c10d_reduce_scatter_single,
        coalesced_all_gather_into_tensor,
        coalesced_reduce_scatter_tensor,
    )
}


def group_desc(index: int) -> str:
    """The description of the group of the `index`-th case (short: flare keeps 32 characters of it)."""
    return f"entry_{index:02d}"


def stuck_in_entry_point_code() -> None:
    while True:
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stuck-rank", type=int, default=-1)
    parser.add_argument("--stuck-step", type=int, default=1)
    parser.add_argument("--wait-for", default="")
    args = parser.parse_args()

    warnings.filterwarnings("ignore", category=FutureWarning)  # the deprecated names are entry points too
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), list(range(dist.get_world_size()))
    groups = [dist.new_group(ranks, group_desc=group_desc(index)) for index in range(len(CASES))]
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)  # a step per step: flare counts them
    for step in range(args.steps):
        if rank == args.stuck_rank and step == args.stuck_step:
            stuck_in_entry_point_code()
        for group, (case, _) in zip(groups, CASES.values(), strict=True):
            case(group, rank)
        parameter.grad = torch.ones(1)
        optimizer.step()
    dist.barrier()
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
