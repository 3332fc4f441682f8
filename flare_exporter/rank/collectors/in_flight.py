"""What is in flight: each group's oldest unfinished collective and the hang threshold it is judged against
(flare_hang_threshold_seconds, the rank's hang_seconds), a stalled training thread, and what is ending the
rank (an exception, a termination signal)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from .. import progress
from ..state import FlareState
from . import Families


class InFlightCollector:
    name = "in_flight"
    metrics = (
        "flare_collective_in_flight_info",
        "flare_collective_in_flight_seq",
        "flare_collective_in_flight_bytes",
        "flare_collective_in_flight_started_timestamp_seconds",
        "flare_hang_threshold_seconds",
        "flare_rank_stack_info",
        "flare_rank_exception_info",
        "flare_rank_exception_timestamp_seconds",
        "flare_rank_terminated_timestamp_seconds",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        info = families.new("flare_collective_in_flight_info")
        seq = families.new("flare_collective_in_flight_seq")
        nbytes = families.new("flare_collective_in_flight_bytes")
        started = families.new("flare_collective_in_flight_started_timestamp_seconds")
        for group in list(self.state.groups.values()):
            record = group.in_flight
            if record is None:
                continue
            state = "started" if record.started else "issued"
            info.add_metric(families.labels(group.name, record.op, state), 1)
            seq.add_metric(families.labels(group.name), record.seq)
            nbytes.add_metric(families.labels(group.name), record.nbytes)
            started.add_metric(families.labels(group.name), progress.wall_time(record.issued_at))
        threshold = families.new("flare_hang_threshold_seconds")
        threshold.add_metric(families.labels(), self.state.config.hang_seconds)
        stack = families.new("flare_rank_stack_info")
        sample = self.state.stack
        if sample is not None:
            stack.add_metric(families.labels(sample.activity, sample.frames_label()), 1)
        exception_info = families.new("flare_rank_exception_info")
        exception_time = families.new("flare_rank_exception_timestamp_seconds")
        raised = self.state.exception
        if raised is not None:
            exception_info.add_metric(families.labels(raised.type, raised.cause), 1)
            exception_time.add_metric(families.labels(), raised.timestamp_seconds)
        terminated = families.new("flare_rank_terminated_timestamp_seconds")
        termination = self.state.terminated
        if termination is not None:
            terminated.add_metric(
                families.labels(termination.signal, termination.sender), termination.timestamp_seconds
            )
        return [info, seq, nbytes, started, threshold, stack, exception_info, exception_time, terminated]
