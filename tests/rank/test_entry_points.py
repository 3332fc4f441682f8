"""Every entry point torch offers to communicate reaches flare, with and without the C++ recorder.

The C++ recorder (csrc/collectives.cpp) is a c10d Backend: every ProcessGroup method and every dispatcher op
ends in a call of it. The Python hooks (native_collectives off, or no extension) are FlareProcessGroup, a
`dist.ProcessGroup` subclass: a call reaches them only where it resolves to one of its Python methods, by
name from Python or through torch's trampoline (PyProcessGroup) from C++. So a ProcessGroup method torch adds
or renames (torch 2.13 named its tensor collectives as torchcomms does: all_gather_single, ...) is missed
until flare wraps it, as FSDP2's all-gathers and reduce-scatters were (issue 54).

- The communication entry points of torch's ProcessGroup and Backend, and the functional collectives, are
  each wrapped or deliberately left alone, so that a new one in a future torch fails here.
- FlareProcessGroup records the renamed methods and delegates them, on a gloo pair in this process.
- A 2-rank job under the launcher (tests/programs/entry_points.py) issues each functional collective and the
  renamed c10d calls, all_to_all_single with uneven splits among them, on both recorders: each group counts
  what its case issued, and both recorders label it alike.
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from conftest import torch_extension
from test_recording_backend import on_both

from flare_exporter.engine import scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.groups import GroupTracker, group_name
from flare_exporter.rank.process_group import RENAMED_METHODS, WRAPPED_METHODS, FlareProcessGroup, WaitedWork
from flare_exporter.rank.timing import FutureTiming, TimingManager

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "entry_points.py"

# Communication that flare deliberately leaves alone, on both recorders.
LEFT_ALONE = {
    # gloo's debugging barrier: the backend's own sends and receives inside one call, which
    # csrc/collectives.cpp delegates unrecorded as well; not a collective of the training
    "monitored_barrier",
    # brackets around collectives (NCCL groups them into one launch); each collective between them is
    # recorded as it is issued, through its own method
    "_start_coalescing",
    "_end_coalescing",
    # make a new group from this one's backend (NCCL's comm split, a merge): a group, not a collective; the
    # group they return is the real backend's, not a flare one (DeviceMesh splits so on NCCL when the default
    # group is bound to a device)
    "split_group",
    "merge_remote_group",
    "shrink",
    # NCCL's eager communicator set-up, before any collective
    "eager_connect_single_device",
    # rank 0 hands out the group's sequence number through the store, not the backend
    "_set_sequence_number_for_group",
}

# Neither communicates: accessors, settings, lifecycle, hooks, memory.
NOT_COMMUNICATION = {
    "BackendType",
    "Options",
    "_backend_id",
    "_device_types",
    "_enable_collectives_timing",
    "_get_backend",
    "_get_backend_name",
    "_get_sequence_number_for_group",
    "_has_hooks",
    "_id",
    "_pybind11_conduit_v1_",
    "_register_backend",
    "_register_on_completion_hook",
    "_set_default_backend",
    "_set_group_desc",
    "_set_group_name",
    "_wait_for_pending_works",
    "abort",
    "allocate_tensor",
    "bound_device_id",
    "boxed",
    "get_group_store",
    "group_desc",
    "group_name",
    "mem_allocator",
    "memory_stats",
    "name",
    "rank",
    "resume",
    "setUsePgForSymmMemRendezvous",
    "set_timeout",
    "shutdown",
    "size",
    "supports_coalescing",
    "supports_shrinking",
    "supports_splitting",
    "supports_tensor_alloc",
    "supports_time_estimate",
    "suspend",
    "unbox",
    "use_pg_for_symm_mem_rendezvous",
}

# Each functional collective (torch.ops._c10d_functional, _c10d_functional_autograd: DTensor, torch.compile,
# funcol) -> the case of tests/programs/entry_points.py that issues it.
FUNCTIONAL_OPS = {
    "_c10d_functional::all_reduce": "functional_all_reduce",
    "_c10d_functional::all_reduce_": "functional_all_reduce_inplace",
    "_c10d_functional::all_reduce_coalesced": "functional_all_reduce_coalesced",
    # the in-place form of the above: the same C++ path (allreduce_coalesced)
    "_c10d_functional::all_reduce_coalesced_": "functional_all_reduce_coalesced",
    "_c10d_functional::all_gather_into_tensor": "functional_all_gather_into_tensor",
    "_c10d_functional::all_gather_into_tensor_out": "functional_all_gather_into_tensor_out",
    "_c10d_functional::all_gather_into_tensor_coalesced": "functional_all_gather_into_tensor_coalesced",
    "_c10d_functional::reduce_scatter_tensor": "functional_reduce_scatter_tensor",
    "_c10d_functional::reduce_scatter_tensor_out": "functional_reduce_scatter_tensor_out",
    "_c10d_functional::reduce_scatter_tensor_coalesced": "functional_reduce_scatter_tensor_coalesced",
    "_c10d_functional::all_to_all_single": "functional_all_to_all_single",
    "_c10d_functional::broadcast": "functional_broadcast",
    "_c10d_functional::broadcast_": "functional_broadcast_inplace",
    "_c10d_functional_autograd::all_to_all_single": "autograd_all_to_all_single",
    "_c10d_functional_autograd::all_gather_into_tensor": "autograd_all_gather_into_tensor",
    "_c10d_functional_autograd::reduce_scatter_tensor": "autograd_reduce_scatter_tensor",
}
# Functional ops that are no collective of a group's sequence: waiting, and the point-to-point ops (their
# own kind, per peer, recorded through send and recv).
FUNCTIONAL_OTHERS = {
    "_c10d_functional::wait_tensor",
    "_c10d_functional::isend",
    "_c10d_functional::irecv",
    "_c10d_functional::batch_p2p_ops",
}

# Entry points the Python hooks cannot see, and why; the C++ recorder sees them. A C++ caller of a
# ProcessGroup method that torch's trampoline (PyProcessGroup) does not forward to Python reaches the real
# backend directly; `all_gather_into_tensor_out` (inductor's preallocated all-gathers) calls
# ProcessGroup::all_gather_single from C++.
PYTHON_HOOKS_MISS = {"functional_all_gather_into_tensor_out"}


def program() -> ModuleType:
    """tests/programs/entry_points.py as a module (its cases; importing it runs nothing)."""
    spec = importlib.util.spec_from_file_location("entry_points_program", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def methods(cls: type) -> set[str]:
    """The names `cls` offers, less Python's own and the BackendType values it re-exports."""
    return {
        name
        for name in dir(cls)
        if not name.startswith("__") and not isinstance(getattr(cls, name), dist.ProcessGroup.BackendType)
    }


def test_every_communication_method_of_torch_is_wrapped_or_deliberately_left_alone():
    backend = torch._C._distributed_c10d.Backend
    offered = methods(dist.ProcessGroup) | methods(backend)
    known = set(WRAPPED_METHODS) | set(RENAMED_METHODS) | LEFT_ALONE | NOT_COMMUNICATION
    assert offered - known == set(), (
        "torch offers methods flare does not know: wrap the ones that communicate (process_group.py's "
        "WRAPPED_METHODS, or RENAMED_METHODS for a new name of a wrapped one) or list them here"
    )
    # each name listed is still torch's: a list that names what torch dropped hides nothing, but is stale
    assert known - offered == set()


def test_flare_process_group_overrides_every_wrapped_and_renamed_method():
    for name in [*WRAPPED_METHODS, *RENAMED_METHODS]:
        assert name in vars(FlareProcessGroup), name
    # a renamed method is recorded and delegated as the method it renames, as the C++ recorder sees it
    assert set(RENAMED_METHODS.values()) <= set(WRAPPED_METHODS)


def test_every_functional_collective_is_issued_by_a_case_of_the_program():
    ops = {
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.split("::")[0] in ("_c10d_functional", "_c10d_functional_autograd")
    }
    assert ops - set(FUNCTIONAL_OPS) - FUNCTIONAL_OTHERS == set(), "a new functional collective: add a case"
    assert set(FUNCTIONAL_OPS.values()) <= set(program().CASES)
    assert PYTHON_HOOKS_MISS <= set(program().CASES)


# --- FlareProcessGroup on a real gloo pair in this process: a thread per rank ---


def hooked_pair() -> tuple[list[FlareProcessGroup], list[GroupTracker], TimingManager]:
    """Ranks 0 and 1 of a real gloo group, each in a FlareProcessGroup with its own tracker."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=30)
    glooes = on_both(lambda rank: dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, timeout))
    manager = TimingManager(ExporterHealth(), queue_size=1024, interval_seconds=60)
    trackers = [
        GroupTracker("world", 2, "gloo", FutureTiming(manager, None, WaitedWork), ExporterHealth())
        for _ in glooes
    ]
    for tracker in trackers:
        manager.add_group(tracker)
    groups = [FlareProcessGroup(gloo, rank, 2, trackers[rank]) for rank, gloo in enumerate(glooes)]
    return groups, trackers, manager


def ones(n: int, rank: int) -> torch.Tensor:
    return torch.full((n,), float(rank + 1))


# renamed method -> (its arguments on rank r, the tensors it leaves there, what they hold on rank 0 and 1)
RENAMED_CALLS: dict[str, tuple[Callable[[int], tuple], Callable[[tuple], list], list[list[list[float]]]]] = {
    "all_gather_single": (
        lambda rank: (torch.empty(4), ones(2, rank), c10d.AllgatherOptions()),
        lambda args: [args[0]],
        [[[1, 1, 2, 2]]] * 2,
    ),
    "all_gather_single_coalesced": (
        lambda rank: (
            [torch.empty(4), torch.empty(2)],
            [ones(2, rank), ones(1, rank)],
            c10d.AllgatherOptions(),
        ),
        lambda args: args[0],
        [[[1, 1, 2, 2], [1, 2]]] * 2,
    ),
    "reduce_scatter_single": (
        lambda rank: (torch.empty(2), ones(4, rank), c10d.ReduceScatterOptions()),
        lambda args: [args[0]],
        [[[3, 3]]] * 2,
    ),
    "reduce_scatter_single_coalesced": (
        lambda rank: (
            [torch.empty(2), torch.empty(1)],
            [ones(4, rank), ones(2, rank)],
            c10d.ReduceScatterOptions(),
        ),
        lambda args: args[0],
        [[[3, 3], [3]]] * 2,
    ),
    # uneven: rank 0 sends [0] and [1, 2], rank 1 sends [10, 11, 12] and [13]
    "all_to_all_single": (
        lambda rank: (
            torch.empty([4, 3][rank]),
            torch.arange(float([3, 4][rank])) + 10 * rank,
            [[1, 3], [2, 1]][rank],
            [[1, 2], [3, 1]][rank],
            c10d.AllToAllOptions(),
        ),
        lambda args: [args[0]],
        [[[0, 10, 11, 12]], [[1, 2, 13]]],
    ),
}


@pytest.mark.parametrize("name", sorted(RENAMED_METHODS))
def test_a_renamed_method_is_recorded_as_the_method_it_renames_and_delegated(name):
    groups, trackers, manager = hooked_pair()
    make_arguments, outputs, expected = RENAMED_CALLS[name]
    arguments = [make_arguments(rank) for rank in (0, 1)]
    on_both(lambda rank: getattr(groups[rank], name)(*arguments[rank]).wait())
    manager.drain()
    for tracker in trackers:
        assert (tracker.last_issued_seq, tracker.last_completed_seq, tracker.in_flight) == (1, 1, None)
    op = RENAMED_METHODS[name].lstrip("_")
    assert sum(manager.stats[("world", op)].durations.counts) == 2  # both ranks', one each
    assert [[tensor.tolist() for tensor in outputs(arguments[rank])] for rank in (0, 1)] == expected


# --- a 2-rank job under the launcher, both recorders ---

STEPS = 2


def finished(targets: list[str]) -> dict[str, list[scrape.Sample]] | None:
    """Every rank's samples once it took STEPS steps and its closing barrier completed."""
    results = scrape.scrape_all(targets, timeout=2)
    done = {}
    for target, samples in results.items():
        if isinstance(samples, scrape.ScrapeError) or scrape.value(samples, "flare_steps_total") != STEPS:
            return None
        if scrape.value(samples, "flare_collective_last_completed_seq", group="world") != 1:
            return None
        done[target] = samples
    return done


@pytest.fixture(scope="module")
def entry_point_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[scrape.Sample]]]:
    """recorder (`cpp`, `python`) -> each rank's samples after tests/programs/entry_points.py ran under it."""
    torch_extension()  # built, so that native_collectives on records in C++
    jobs = {}
    for recorder, native in (("cpp", "true"), ("python", "false")):
        work = tmp_path_factory.mktemp(f"entry_points_{recorder}")
        env = {"FLARE_NATIVE_COLLECTIVES": native, "FLARE_GPU_HEALTH": "false"}
        job = ObservedJob(str(work), str(PROGRAM), ["--steps", str(STEPS)], 2, "test-entry-points", env=env)
        with job:
            try:
                samples = wait_for(partial(finished, job.targets), 120, f"the {recorder} job to finish")
            finally:
                job.release()
            codes = job.wait(timeout=60)
            logs = "\n".join(job.log_tail(rank) for rank in range(2))
            assert codes == [0, 0], logs  # each case checks what it received
        jobs[recorder] = samples
    return jobs


def case_groups() -> dict[str, str]:
    """case -> the flare name of the group it runs on."""
    module = program()
    return {case: group_name(module.group_desc(index), [0, 1]) for index, case in enumerate(module.CASES)}


def ops_of(samples: list[scrape.Sample], group: str) -> dict[str, float]:
    return {
        s.labels["op"]: s.value
        for s in samples
        if s.name == "flare_collective_duration_seconds_count" and s.labels.get("group") == group
    }


@pytest.mark.multirank
@pytest.mark.parametrize("recorder", ["cpp", "python"])
def test_each_entry_point_is_counted_on_its_group(entry_point_jobs, recorder):
    cases = program().CASES
    for samples in entry_point_jobs[recorder].values():
        info = {
            s.labels["group"]: s.labels["recorder"] for s in samples if s.name == "flare_process_group_info"
        }
        assert set(info.values()) == {recorder}
        for case, group in case_groups().items():
            issued = scrape.value(samples, "flare_collective_last_issued_seq", group=group)
            completed = scrape.value(samples, "flare_collective_last_completed_seq", group=group)
            expected = STEPS * cases[case][1]
            if recorder == "python" and case in PYTHON_HOOKS_MISS:
                expected = 0  # if torch now forwards it to Python: take it off PYTHON_HOOKS_MISS
            assert (issued, completed) == (expected, expected), case


@pytest.mark.multirank
def test_both_recorders_label_each_entry_point_alike(entry_point_jobs):
    for case, group in case_groups().items():
        if case in PYTHON_HOOKS_MISS:
            continue
        by_recorder = [
            [ops_of(samples, group) for samples in entry_point_jobs[recorder].values()]
            for recorder in ("cpp", "python")
        ]
        assert by_recorder[0] == by_recorder[1], case
        assert sum(by_recorder[0][0].values()) == STEPS * program().CASES[case][1], case


@pytest.mark.multirank
def test_the_entry_point_jobs_report_no_exporter_errors(entry_point_jobs):
    for jobs in entry_point_jobs.values():
        for samples in jobs.values():
            assert not [s for s in samples if s.name == "flare_exporter_errors_total"]
