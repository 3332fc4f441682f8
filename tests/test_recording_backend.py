"""flare's C++ recording backend (csrc/collectives.cpp) around real gloo groups: what it records, when.

Two ranks of a real gloo group live in this process, one thread each (their rendezvous and collectives
meet through a HashStore), so the tests see every record as the training thread leaves it.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import torch_extension

from flare_exporter.groups import GroupTracker, payload_bytes
from flare_exporter.health import ExporterHealth
from flare_exporter.process_group import WRAPPED_METHODS, FlareProcessGroup, WaitedWork
from flare_exporter.prometheus_process import wait_for
from flare_exporter.timing import FutureTiming, NativeTiming, TimingManager


def on_both(call: Callable[[int], Any]) -> list[Any]:
    """call(rank) for ranks 0 and 1 at once, each on its own thread; their results, or the first error."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = call(rank)
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def gloo_pair(timeout_seconds: float = 30) -> list[Any]:
    """Ranks 0 and 1 of a real gloo group (ProcessGroupGloo), created at once: their rendezvous meets."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_seconds)
    return on_both(lambda rank: dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, timeout))


def recorded_pair(capacity: int = 64, timeout_seconds: float = 30) -> tuple[list[Any], list[Any]]:
    """Two ranks of a gloo group, each wrapped in the recording backend: (backends, their logs)."""
    extension = torch_extension()
    logs = [extension.CollectiveLog(capacity) for _ in range(2)]
    backends = [
        extension.wrap_backend(gloo, log) for gloo, log in zip(gloo_pair(timeout_seconds), logs, strict=True)
    ]
    return backends, logs


def taken_until(log: Any, condition: Callable[[tuple], bool], what: str) -> tuple:
    """Take `log` until what was taken satisfies `condition` (completions are stamped on gloo's threads): the
    completed records and the counts of every take together, the rest as the last take says."""
    completed: list[tuple] = []
    counts = [0, 0]

    def taken() -> tuple | None:
        done, oldest, last_seq, last_issued_at, dropped, failed = log.take()
        completed.extend(done)
        counts[0] += dropped
        counts[1] += failed
        together = (list(completed), oldest, last_seq, last_issued_at, *counts)
        return together if condition(together) else None

    return wait_for(taken, 10, what)


def ones(n: int = 4) -> torch.Tensor:
    return torch.ones(n)


# Each collective the Python binding of a c10d Backend offers, as each rank calls it (gloo supports them all).
COLLECTIVES: dict[str, Callable[[int], tuple]] = {
    "allreduce": lambda rank: ([ones()],),
    "allreduce_coalesced": lambda rank: ([ones(), ones(2)],),
    "broadcast": lambda rank: ([ones()],),
    "reduce": lambda rank: ([ones()],),
    "allgather": lambda rank: ([[ones(), ones()]], [ones()]),
    "_allgather_base": lambda rank: (ones(8), ones()),
    "allgather_coalesced": lambda rank: ([[ones()], [ones()]], [ones()]),
    "gather": lambda rank: ([[ones(), ones()]] if rank == 0 else [], [ones()]),
    "scatter": lambda rank: ([ones()], [[ones(), ones()]] if rank == 0 else []),
    "reduce_scatter": lambda rank: ([ones()], [[ones(), ones()]]),
    "_reduce_scatter_base": lambda rank: (ones(), ones(8)),
    "alltoall": lambda rank: ([ones(), ones()], [ones(), ones()]),
    "alltoall_base": lambda rank: (ones(8), ones(8), [], []),
    "barrier": lambda rank: (),
}


def test_the_backend_labels_its_ops_as_the_python_hooks_do():
    assert torch_extension().COLLECTIVE_OPS == [method.lstrip("_") for method in WRAPPED_METHODS]


@pytest.mark.parametrize("method", sorted(COLLECTIVES))
def test_each_collective_is_recorded_with_the_bytes_the_python_hooks_count(method):
    backends, logs = recorded_pair()
    arguments = [COLLECTIVES[method](rank) for rank in (0, 1)]
    before = time.perf_counter()
    on_both(lambda rank: getattr(backends[rank], method)(*arguments[rank]).wait())
    after = time.perf_counter()
    payload_index = WRAPPED_METHODS[method]
    for rank in (0, 1):
        completed, oldest, last_seq, last_issued_at, dropped, failed = taken_until(
            logs[rank], lambda taken: bool(taken[0]), f"rank {rank}'s {method} to complete"
        )
        assert len(completed) == 1 and oldest is None and (dropped, failed) == (0, 0)
        op, nbytes, seq, issued_at, seconds = completed[0]
        expected = 0 if payload_index is None else payload_bytes(arguments[rank][payload_index])
        assert (op, nbytes, seq, last_seq) == (method.lstrip("_"), expected, 1, 1)
        assert before <= issued_at == last_issued_at <= issued_at + seconds <= after + 1.0


def test_a_collective_is_in_flight_until_its_peer_joins():
    backends, logs = recorded_pair()
    work = backends[0].allreduce([ones()])
    completed, oldest, last_seq, *_ = logs[0].take()
    assert completed == [] and oldest[:3] == ("allreduce", 16, 1) and last_seq == 1
    assert logs[0].take()[1] == oldest  # still the same collective: nothing else was issued
    joined_at = time.perf_counter()
    backends[1].allreduce([ones()]).wait()
    work.wait()
    completed, oldest, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the all-reduce to complete")
    (op, nbytes, seq, issued_at, seconds) = completed[0]
    assert oldest is None and (op, seq) == ("allreduce", 1)
    assert issued_at + seconds >= joined_at  # it completed after the peer joined, not when it was issued


def test_point_to_point_ops_have_no_sequence_number_and_complete_when_polled():
    backends, logs = recorded_pair()
    received = torch.zeros(3)
    on_both(
        lambda rank: (
            backends[0].send([torch.ones(3)], 1, 7) if rank == 0 else backends[1].recv([received], 0, 7)
        ).wait()
    )
    for rank, op in ((0, "send"), (1, "recv")):
        completed, oldest, last_seq, *_ = taken_until(logs[rank], lambda taken: bool(taken[0]), op)
        assert [(record[0], record[1], record[2]) for record in completed] == [(op, 12, 0)] and last_seq == 0
    assert received.tolist() == [1.0, 1.0, 1.0]


def test_a_collective_the_real_backend_rejects_is_not_left_in_flight():
    backends, logs = recorded_pair()
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        backends[0].allreduce([ones(4), ones(3)])
    assert logs[0].take()[:3] == ([], None, 1)  # its number was taken, as every rank takes it
    on_both(lambda rank: backends[rank].allreduce([ones()]).wait())
    completed, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the next all-reduce")
    assert [record[2] for record in completed] == [2]


def test_a_failed_collective_is_counted_once_and_stays_in_flight():
    backends, logs = recorded_pair(timeout_seconds=0.5)
    work = backends[0].allreduce([ones()])  # its peer never joins: gloo times it out
    with pytest.raises(RuntimeError):
        work.wait()
    completed, oldest, _, _, _, failed = taken_until(logs[0], lambda taken: taken[5] == 1, "the failure")
    assert completed == [] and oldest[:3] == ("allreduce", 16, 1)
    assert logs[0].take()[1:] == (oldest, 1, oldest[3], 0, 0)  # still in flight, counted once


def test_a_full_log_drops_and_counts_yet_numbers_every_collective():
    backends, logs = recorded_pair(capacity=16)
    for _ in range(20):
        on_both(lambda rank: backends[rank].barrier().wait())
    completed, oldest, last_seq, _, dropped, _ = taken_until(
        logs[0], lambda taken: len(taken[0]) == 16, "the recorded barriers"
    )
    assert [record[2] for record in completed] == list(range(1, 17)) and (last_seq, dropped) == (20, 4)
    on_both(lambda rank: backends[rank].barrier().wait())  # room again once taken
    completed, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the next barrier")
    assert [record[2] for record in completed] == [21]


def test_a_work_without_a_future_that_is_let_go_is_no_longer_in_flight():
    backends, logs = recorded_pair()
    arguments = [COLLECTIVES["reduce_scatter"](rank) for rank in (0, 1)]
    works = on_both(lambda rank: backends[rank].reduce_scatter(*arguments[rank]))
    works[1].wait()
    assert logs[0].take()[1] is not None  # gloo's reduce_scatter work never says it completed: not waited yet
    del works[0]  # the caller let it go without waiting
    completed, oldest, *_ = logs[0].take()
    assert [record[0] for record in completed] == ["reduce_scatter"] and oldest is None


def test_the_timing_manager_takes_the_log_into_the_group():
    extension = torch_extension()
    health = ExporterHealth()
    manager = TimingManager(health, queue_size=1024, interval_seconds=60)
    timing = NativeTiming(manager, extension)
    glooes = gloo_pair()
    backend = timing.wrap(glooes[0])
    peer = glooes[1]
    tracker = GroupTracker("world", 2, "gloo", timing, health)
    manager.add_group(tracker)
    manager.add_log(timing, tracker)

    work = backend.allreduce([ones()])
    manager.drain()
    in_flight = tracker.in_flight
    assert in_flight is not None
    assert (in_flight.op, in_flight.seq, in_flight.duration) == ("allreduce", 1, None)
    assert tracker.last_issued_seq == 1 and tracker.progress_at() == in_flight.issued_at
    backend.barrier()  # behind it, in flight too
    manager.drain()
    assert tracker.in_flight is in_flight  # the same record: the straggler windows follow it
    assert tracker.last_issued_seq == 2

    peer.allreduce([ones()]).wait()
    peer.barrier().wait()
    work.wait()
    wait_for(lambda: manager.drain() or tracker.last_completed_seq == 2, 10, "both collectives to complete")
    assert in_flight.duration is not None and in_flight.duration > 0  # the record seen in flight, completed
    assert tracker.in_flight is None and not tracker.pending
    assert sum(manager.stats[("world", "allreduce")].durations.counts) == 1
    assert manager.stats[("world", "allreduce")].bytes_total == 16
    assert sum(manager.stats[("world", "barrier")].durations.counts) == 1
    assert not health.dropped and not health.errors


def test_the_python_hooks_complete_a_reduce_scatter_once_it_is_waited_for():
    """The same for the Python hooks (no extension, or native_collectives off): gloo's reduce_scatter work has
    no future and never says it completed, so the hooks hand back a work whose wait() completes the record."""
    health = ExporterHealth()
    manager = TimingManager(health, queue_size=1024, interval_seconds=60)
    glooes = gloo_pair()
    tracker = GroupTracker("world", 2, "gloo", FutureTiming(manager, None, WaitedWork), health)
    manager.add_group(tracker)
    hooked = FlareProcessGroup(glooes[0], 0, 2, tracker)
    arguments = [COLLECTIVES["reduce_scatter"](rank) for rank in (0, 1)]
    work = hooked.reduce_scatter(*arguments[0])
    glooes[1].reduce_scatter(*arguments[1]).wait()
    manager.drain()
    assert tracker.in_flight is not None and tracker.in_flight.op == "reduce_scatter"  # not waited for yet
    work.wait()
    manager.drain()
    assert tracker.in_flight is None and tracker.last_completed_seq == 1
    assert sum(manager.stats[("world", "reduce_scatter")].durations.counts) == 1
    assert arguments[0][0][0].tolist() == [2.0] * 4  # the real collective ran: the sum of both ranks' ones
