"""flare's C++ recording backend (csrc/collectives.cpp) around real gloo groups: what it records, when.

Two ranks of a real gloo group live in this process, one thread each (their rendezvous and collectives
meet through a HashStore), so the tests see every record as the training thread leaves it.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import torch_extension

from flare_exporter.config import Config
from flare_exporter.label_values import COLLECTIVE_DURATION_BUCKETS, COLLECTIVE_OPS
from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank import process_group
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.groups import GroupTracker, payload_bytes
from flare_exporter.rank.histogram import Histogram
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.process_group import WRAPPED_METHODS, FlareProcessGroup, WaitedWork
from flare_exporter.rank.state import FlareState
from flare_exporter.rank.timing import FutureTiming, NativeTiming, TimingManager

COLLECTIVES_CPP = Path(process_group.__file__).parent / "csrc" / "collectives.cpp"


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
        done, _, oldest, _, last_seq, last_issued_at, dropped, failed = log.take(COLLECTIVE_DURATION_BUCKETS)
        completed.extend(done)
        counts[0] += dropped
        counts[1] += failed
        together = (list(completed), oldest, last_seq, last_issued_at, *counts)
        return together if condition(together) else None

    return wait_for(taken, 10, what)


def recorded_into(manager: TimingManager, health: ExporterHealth) -> tuple[Any, Any, GroupTracker]:
    """Rank 0 of a gloo pair wrapped in a recording backend whose log `manager` takes into the group `world`
    at every drain: (that backend, rank 1's plain gloo backend, the group's tracker)."""
    timing = NativeTiming(manager, torch_extension())
    glooes = gloo_pair()
    tracker = GroupTracker("world", 2, "gloo", timing, health)
    manager.add_group(tracker)
    manager.add_log(timing, tracker)
    return timing.wrap(glooes[0]), glooes[1], tracker


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
    assert torch_extension().COLLECTIVE_OPS == list(COLLECTIVE_OPS)


def test_the_python_hooks_wrap_each_collective_op_once():
    assert [method.lstrip("_") for method in WRAPPED_METHODS] == list(COLLECTIVE_OPS)


def cpp_op_names(source: str) -> tuple[list[str], list[str]]:
    """collectives.cpp's op labels (kOpNames) and, from its `enum Op`, each entry's name in snake case
    (kAllgatherBase -> allgather_base), in their order."""
    labels = re.search(r"kOpNames\[kOpCount\] = \{(.*?)\};", source, re.DOTALL)
    entries = re.search(r"enum Op : uint8_t \{(.*?)\};", source, re.DOTALL)
    assert labels and entries, "collectives.cpp no longer declares kOpNames and enum Op as this reads them"
    names = re.findall(r"\bk(\w+)", entries.group(1))
    assert names[-1] == "OpCount"
    snake = [re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower() for name in names[:-1]]
    return re.findall(r'"(\w+)"', labels.group(1)), snake


def test_the_cpp_recorder_names_the_collective_ops_of_label_values():
    """Without building it: the source's op labels, and its enum in their order, are COLLECTIVE_OPS."""
    labels, enum = cpp_op_names(COLLECTIVES_CPP.read_text(encoding="utf-8"))
    assert labels == list(COLLECTIVE_OPS)
    assert enum == list(COLLECTIVE_OPS)


def test_the_cpp_op_check_finds_a_missing_or_misplaced_op():
    source = COLLECTIVES_CPP.read_text(encoding="utf-8")
    labels, enum = cpp_op_names(source.replace('"recv_anysource", ', "", 1))
    assert "recv_anysource" not in labels and enum == list(COLLECTIVE_OPS)
    labels, enum = cpp_op_names(source.replace("  kSend,\n  kRecv,\n", "  kRecv,\n  kSend,\n", 1))
    assert labels == list(COLLECTIVE_OPS) and enum != list(COLLECTIVE_OPS)


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
        issued_at, seconds, op, nbytes, seq, peer = completed[0]
        expected = 0 if payload_index is None else payload_bytes(arguments[rank][payload_index])
        assert (op, nbytes, seq, last_seq) == (method.lstrip("_"), expected, 1, 1)
        assert before <= issued_at == last_issued_at <= issued_at + seconds <= after + 1.0


def test_a_collective_is_in_flight_until_its_peer_joins():
    backends, logs = recorded_pair()
    work = backends[0].allreduce([ones()])
    completed, _, oldest, _, last_seq, *_ = logs[0].take(COLLECTIVE_DURATION_BUCKETS)
    assert completed == [] and oldest[:3] == ("allreduce", 16, 1) and last_seq == 1
    assert logs[0].take(COLLECTIVE_DURATION_BUCKETS)[2] == oldest  # the same collective: nothing else issued
    joined_at = time.perf_counter()
    backends[1].allreduce([ones()]).wait()
    work.wait()
    completed, oldest, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the all-reduce to complete")
    (issued_at, seconds, op, nbytes, seq, _) = completed[0]
    assert oldest is None and (op, seq) == ("allreduce", 1)
    assert issued_at + seconds >= joined_at  # it completed after the peer joined, not when it was issued


def test_point_to_point_ops_carry_their_peer_and_complete_when_waited_for():
    backends, logs = recorded_pair()
    received = torch.zeros(3)
    send = backends[0].send([torch.ones(3)], 1, 7)
    in_flight = logs[0].take(COLLECTIVE_DURATION_BUCKETS)[3]
    assert [flight[:3] for flight in in_flight] == [("send", 12, 1)]  # in flight until waited for
    waited_at = {}

    def exchange(rank: int) -> None:
        if rank == 0:
            time.sleep(0.2)  # the receive waits for the send's wait, which stamps its completion
            send.wait()
        else:
            backends[1].recv([received], 0, 7).wait()
        waited_at[rank] = time.perf_counter()

    on_both(exchange)
    for rank, op, peer in ((0, "send", 1), (1, "recv", 0)):
        completed, oldest, last_seq, *_ = taken_until(logs[rank], lambda taken: bool(taken[0]), op)
        assert [record[2:] for record in completed] == [(op, 12, 0, peer)] and last_seq == 0
        issued_at, seconds = completed[0][:2]
        assert issued_at + seconds <= waited_at[rank]  # stamped by the wait, not by a later take
        assert oldest is None and logs[rank].take(COLLECTIVE_DURATION_BUCKETS)[3] == []
    assert received.tolist() == [1.0, 1.0, 1.0]


def test_a_collective_the_real_backend_rejects_is_not_left_in_flight():
    backends, logs = recorded_pair()
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        backends[0].allreduce([ones(4), ones(3)])
    assert logs[0].take(COLLECTIVE_DURATION_BUCKETS)[:5] == (
        [],
        [],
        None,
        [],
        1,
    )  # its number taken, as every rank's
    on_both(lambda rank: backends[rank].allreduce([ones()]).wait())
    completed, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the next all-reduce")
    assert [record[4] for record in completed] == [2]


def test_a_failed_collective_is_counted_once_and_stays_in_flight():
    backends, logs = recorded_pair(timeout_seconds=0.5)
    work = backends[0].allreduce([ones()])  # its peer never joins: gloo times it out
    with pytest.raises(RuntimeError):
        work.wait()
    completed, oldest, _, _, _, failed = taken_until(logs[0], lambda taken: taken[5] == 1, "the failure")
    assert completed == [] and oldest[:3] == ("allreduce", 16, 1)
    assert logs[0].take(COLLECTIVE_DURATION_BUCKETS)[2:] == (
        oldest,
        [],
        1,
        oldest[3],
        0,
        0,
    )  # in flight, counted once


def test_a_full_log_drops_and_counts_yet_numbers_every_collective():
    backends, logs = recorded_pair(capacity=16)
    for _ in range(20):
        on_both(lambda rank: backends[rank].barrier().wait())
    completed, oldest, last_seq, _, dropped, _ = taken_until(
        logs[0], lambda taken: len(taken[0]) == 16, "the recorded barriers"
    )
    assert [record[4] for record in completed] == list(range(1, 17)) and (last_seq, dropped) == (20, 4)
    on_both(lambda rank: backends[rank].barrier().wait())  # room again once taken
    completed, *_ = taken_until(logs[0], lambda taken: bool(taken[0]), "the next barrier")
    assert [record[4] for record in completed] == [21]


def test_the_log_counts_each_ops_collectives_as_the_histogram_would():
    """take() counts what completed per op (buckets, bytes, seconds, last number) in C++, so that a drain's
    Python work does not grow with the collectives: the same counts as each completed record observed."""
    backends, logs = recorded_pair()
    for _ in range(5):
        on_both(lambda rank: backends[rank].allreduce([ones()]).wait())
    for _ in range(3):
        on_both(lambda rank: backends[rank].barrier().wait())
    completed: list[tuple] = []
    counted: list[tuple] = []

    def all_taken() -> bool:
        done, per_op, *_ = logs[0].take(COLLECTIVE_DURATION_BUCKETS)
        completed.extend(done)
        counted.extend(per_op)
        return len(completed) == 8

    wait_for(all_taken, 10, "the eight collectives to complete")
    expected: dict[str, tuple[Histogram, int, int]] = {}
    for _, seconds, op, nbytes, seq, _ in completed:
        histogram, total_bytes, last_seq = expected.get(op) or (Histogram(COLLECTIVE_DURATION_BUCKETS), 0, 0)
        histogram.observe(seconds)
        expected[op] = (histogram, total_bytes + nbytes, max(last_seq, seq))
    got: dict[str, tuple[Histogram, int, int]] = {}
    for op, collectives, nbytes, seconds, buckets, last_seq in counted:
        histogram, total_bytes, seq = got.get(op) or (Histogram(COLLECTIVE_DURATION_BUCKETS), 0, 0)
        for index, count in buckets:
            histogram.counts[index] += count
        histogram.sum += seconds
        assert collectives == sum(count for _, count in buckets)
        got[op] = (histogram, total_bytes + nbytes, max(seq, last_seq))
    assert sorted(got) == ["allreduce", "barrier"]
    for op, (histogram, total_bytes, last_seq) in expected.items():
        assert got[op][0].counts == histogram.counts and got[op][0].sum == pytest.approx(histogram.sum)
        assert got[op][1:] == (total_bytes, last_seq)
    assert expected["allreduce"][1:] == (5 * 16, 5) and expected["barrier"][2] == 8


def test_a_work_without_a_future_that_is_let_go_is_no_longer_in_flight():
    backends, logs = recorded_pair()
    arguments = [COLLECTIVES["reduce_scatter"](rank) for rank in (0, 1)]
    works = on_both(lambda rank: backends[rank].reduce_scatter(*arguments[rank]))
    works[1].wait()
    assert logs[0].take(COLLECTIVE_DURATION_BUCKETS)[2] is not None  # gloo's reduce_scatter: not waited yet
    del works[0]  # the caller let it go without waiting
    completed, _, oldest, *_ = logs[0].take(COLLECTIVE_DURATION_BUCKETS)
    assert [record[2] for record in completed] == ["reduce_scatter"] and oldest is None


def test_the_timing_manager_takes_the_log_into_the_group():
    health = ExporterHealth()
    manager = TimingManager(health, queue_size=1024, interval_seconds=60)
    backend, peer, tracker = recorded_into(manager, health)

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


class Waiting(threading.Thread):
    """`call()` on its own thread, started at once: `result` once it returns, `returned_at` (perf_counter)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.result: Any = None
        self.returned_at = 0.0
        self.start()

    def run(self) -> None:
        self.result = self.call()
        self.returned_at = time.perf_counter()


def waiting_for_a_collective(extension: Any, call: Callable[[], Any]) -> Waiting:
    """`call` started on its own thread, once it waits in wait_for_collective."""
    waiting = Waiting(call)
    wait_for(lambda: extension.collective_waiters() == 1 or not waiting.is_alive(), 10, "the wait to begin")
    assert waiting.is_alive() and extension.collective_waiters() == 1
    return waiting


def test_a_scrape_waits_for_the_next_collective_issued():
    extension = torch_extension()
    backends, _ = recorded_pair()
    waiting = waiting_for_a_collective(extension, lambda: extension.wait_for_collective(60))
    issued_at = time.perf_counter()
    work = backends[0].allreduce([ones()])  # in flight: its peer has not joined
    waiting.join(timeout=10)
    assert not waiting.is_alive() and waiting.result is True
    assert waiting.returned_at >= issued_at  # woken by the collective, not before
    assert extension.collective_waiters() == 0
    backends[1].allreduce([ones()]).wait()
    work.wait()


def test_a_scrape_waits_for_a_collective_no_longer_than_its_timeout():
    extension = torch_extension()
    started = time.perf_counter()
    assert extension.wait_for_collective(0.05) is False
    assert time.perf_counter() - started >= 0.05 and extension.collective_waiters() == 0


def test_the_timing_manager_waits_only_on_a_rank_that_issued_a_collective_recently():
    extension = torch_extension()
    manager = TimingManager(ExporterHealth(), queue_size=1024, interval_seconds=60)
    assert manager.await_collective(60) == "at once"  # no recording backend: nothing would wake it
    backend, peer, _ = recorded_into(manager, ExporterHealth())
    assert manager.await_collective(60) == "at once"  # none issued yet: a rank not (yet) training
    first = backend.allreduce([ones()])
    assert manager.await_collective(0) == "at once"  # waiting turned off
    assert manager.await_collective(0.01) == "timeout"

    waiting = waiting_for_a_collective(extension, lambda: manager.await_collective(60))
    second = backend.allreduce([ones()])
    waiting.join(timeout=10)
    assert waiting.result == "issued"
    peer.allreduce([ones()]).wait()
    peer.allreduce([ones()]).wait()
    first.wait()
    second.wait()


def test_a_scrape_renders_once_the_rank_issues_its_next_collective():
    """A registry's scrape waits (scrape_wait_seconds) for the next collective, then drains and renders."""
    extension = torch_extension()
    identity = RankIdentity(rank=0, local_rank=0, world_size=2, run="r", host="h", pid=os.getpid())
    state = FlareState.create(Config(scrape_wait_seconds=60), identity)
    backend, peer, tracker = recorded_into(state.manager, state.health)
    registry = build_registry(state)
    on_both(lambda rank: (backend if rank == 0 else peer).allreduce([ones()]).wait())

    scrape = waiting_for_a_collective(extension, lambda: list(registry.collect()))
    assert tracker.last_issued_seq == 0  # not drained yet: the scrape waits before it drains
    work = backend.allreduce([ones()])
    scrape.join(timeout=10)
    assert not scrape.is_alive() and tracker.last_issued_seq == 2  # it drained after the second was issued
    assert any(family.name == "flare_collective_duration_seconds" for family in scrape.result)
    peer.allreduce([ones()]).wait()
    work.wait()
