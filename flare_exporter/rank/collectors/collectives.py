"""Collective durations, bytes and sequence numbers per process group; sends and receives per peer."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ... import label_values
from .. import progress
from ..state import FlareState
from ..timing import CollectiveRecord
from . import Families


class CollectivesCollector:
    name = "collectives"
    metrics = (
        "flare_collective_duration_seconds",
        "flare_collective_bytes_total",
        "flare_collective_last_issued_seq",
        "flare_collective_last_completed_seq",
        "flare_p2p_issued_total",
        "flare_p2p_completed_total",
        "flare_p2p_bytes_total",
        "flare_p2p_duration_seconds",
        "flare_p2p_in_flight_started_timestamp_seconds",
        "flare_p2p_in_flight_bytes",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        durations = families.new("flare_collective_duration_seconds")
        sent = families.new("flare_collective_bytes_total")
        for (group, op), stats in sorted(list(self.state.manager.stats.items())):
            families.add_histogram(durations, (group, op), stats.durations)
            sent.add_metric(families.labels(group, op), stats.bytes_total)
        issued = families.new("flare_collective_last_issued_seq")
        completed = families.new("flare_collective_last_completed_seq")
        for tracker in list(self.state.groups.values()):
            issued.add_metric(families.labels(tracker.name), tracker.last_issued_seq)
            completed.add_metric(families.labels(tracker.name), tracker.last_completed_seq)
        return [durations, sent, issued, completed, *self._point_to_point(families)]

    def _point_to_point(self, families: Families) -> list[Metric]:
        """Per (group, peer, direction): issued (completed + in flight), completed, bytes; per (group,
        direction): durations; per (group, peer, direction): the oldest send or receive in flight (a rank
        waits in one while older ones to other peers are unfinished: each has its own wait-for edge)."""
        stats = self.state.manager.point_to_point
        trackers = list(self.state.groups.values())
        if not stats.peers and not any(tracker.p2p_in_flight for tracker in trackers):
            return []  # a rank that never sent or received (DDP, FSDP): no families to build
        in_flight: dict[tuple[str, int, str], int] = {}
        oldest: dict[tuple[str, int, str], CollectiveRecord] = {}  # per (group, peer, direction)
        for tracker in trackers:
            for record in list(tracker.p2p_in_flight):  # oldest first
                key = (tracker.name, record.peer, label_values.point_to_point_direction(record.op))
                in_flight[key] = in_flight.get(key, 0) + 1
                oldest.setdefault(key, record)
        issued = families.new("flare_p2p_issued_total")
        completed = families.new("flare_p2p_completed_total")
        sent = families.new("flare_p2p_bytes_total")
        peers = dict(stats.peers)
        for key in sorted(set(peers) | set(in_flight)):
            group, peer, direction = key
            labels = families.labels(group, label_values.peer_label(peer), direction)
            counts = peers.get(key)
            done = counts.completed if counts is not None else 0
            issued.add_metric(labels, done + in_flight.get(key, 0))
            completed.add_metric(labels, done)
            sent.add_metric(labels, counts.bytes_total if counts is not None else 0)
        durations = families.new("flare_p2p_duration_seconds")
        for (group, direction), histogram in sorted(list(stats.durations.items())):
            families.add_histogram(durations, (group, direction), histogram)
        started = families.new("flare_p2p_in_flight_started_timestamp_seconds")
        nbytes = families.new("flare_p2p_in_flight_bytes")
        for (group, peer, direction), record in sorted(oldest.items()):
            labels = families.labels(group, label_values.peer_label(peer), direction)
            started.add_metric(labels, progress.wall_time(record.issued_at))
            nbytes.add_metric(labels, record.nbytes)
        return [issued, completed, sent, durations, started, nbytes]
