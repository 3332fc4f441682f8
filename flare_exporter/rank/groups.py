"""Process groups as flare sees them: a stable name every member computes alike, a role, sequence numbers."""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..group_roles import group_role
from ..label_values import POINT_TO_POINT_OPS
from .exporter_health import ExporterHealth
from .timing import CollectiveRecord, TimingBackend

WORLD = "world"
__all__ = ["WORLD", "GroupTracker", "group_name", "group_role", "payload_bytes"]


def group_name(description: str, global_ranks: Sequence[int]) -> str:
    """`world` for the default group, else the description plus a hash of the sorted member ranks.

    Every member computes the same name from facts they share, and the hash keeps it short whatever
    the group's size, so the label stays bounded.
    """
    if description == "default_pg" or not global_ranks:
        return WORLD
    digest = hashlib.sha1(",".join(map(str, sorted(global_ranks))).encode()).hexdigest()[:8]
    words = re.sub(r"[^a-z0-9]+", "_", description.lower()).strip("_")[:32]
    if not words or words == "undefined":
        words = "group"
    return f"{words}-{digest}"


def payload_bytes(tensors: Any) -> int:
    """Bytes of a tensor or of nested lists of tensors."""
    if isinstance(tensors, (list, tuple)):
        if len(tensors) == 1 and not isinstance(tensors[0], (list, tuple)):
            return tensors[0].nbytes  # most collectives (DDP's buckets): one frame on the training thread
        return sum(payload_bytes(item) for item in tensors)
    # one attribute of the tensor: on the training thread, each frame and each call into torch costs
    # microseconds, because a collective comes after compute that evicted them from the CPU caches
    return tensors.nbytes


class GroupTracker:
    """One process group on this rank: issues sequence numbers and hands works to the timing backend."""

    def __init__(
        self,
        name: str,
        size: int,
        backend_name: str,
        timing: TimingBackend,
        health: ExporterHealth,
        max_pending: int = 65536,
        global_ranks: Sequence[int] = (),
        group_rank: int = 0,
    ) -> None:
        self.name = name
        self.group_rank = group_rank  # this rank's rank in the group
        self.global_ranks = tuple(global_ranks)  # group rank -> global rank (empty: the same)
        self.role = group_role(name)
        self.size = size
        self.backend_name = backend_name
        self.timing = timing
        self.health = health
        self._next_seq = itertools.count(1)  # next() is atomic in CPython: safe from any thread
        self.last_issued_seq = 0
        self.last_completed_seq = 0  # written by the timing manager only
        self.last_progress_at = 0.0  # perf_counter time of the last issue, for the heartbeat
        # Issued collectives not yet seen finished, oldest first: the training thread appends, the timing
        # manager (under its drain lock) forgets the finished ones at the front and publishes the oldest
        # unfinished one as `in_flight`. A failed collective never finishes: it stays in flight.
        self.pending: deque[CollectiveRecord] = deque()
        self.max_pending = max_pending
        self.in_flight: CollectiveRecord | None = None
        # Sends and receives not yet seen finished, apart from the collectives: they finish in any order.
        # The hooks append to `p2p_pending`; the manager publishes the unfinished ones, oldest first.
        self.p2p_pending: deque[CollectiveRecord] = deque()
        self.p2p_in_flight: list[CollectiveRecord] = []

    def issue(self, op: str, tensors: Any, peer: int = -1) -> CollectiveRecord | None:
        """Record a collective about to be issued (a send or receive: with its peer's group rank, -1 for
        any source); never raises into training code."""
        try:
            seq = 0
            if op not in POINT_TO_POINT_OPS:
                seq = next(self._next_seq)
                self.last_issued_seq = seq
            else:
                peer = self.peer_rank(peer)
            nbytes = payload_bytes(tensors) if tensors is not None else 0
            now = time.perf_counter()
            self.last_progress_at = now
            return CollectiveRecord(self, op, nbytes, seq, now, peer)
        except Exception as error:
            self.health.error("collective_hook", error)
            return None

    def track(self, record: CollectiveRecord | None, work: Any) -> Any:
        """Hand the issued work to the timing backend; the work to return to the caller (`work`, or one that
        tells the backend when it was waited for). Never raises into training code."""
        if record is None:
            return work
        try:
            self.remember(record)
            return self.timing.track(record, work)
        except Exception as error:
            self.health.error("collective_timing", error)
            return work

    def remember(self, record: CollectiveRecord) -> None:
        """Queue `record` in `pending` (by the hook on the training thread, or the manager: C++ backend)."""
        pending = self.p2p_pending if record.point_to_point else self.pending
        if len(pending) < self.max_pending:
            pending.append(record)
        else:
            self.health.drop("in_flight_collectives")

    def peer_rank(self, group_rank: int) -> int:
        """The global rank of the member `group_rank` (-1 stays -1: any source)."""
        if group_rank < 0 or not self.global_ranks or group_rank >= len(self.global_ranks):
            return group_rank
        return self.global_ranks[group_rank]

    def point_to_point_in_flight(self, records: list[CollectiveRecord]) -> None:
        """The sends and receives in flight now, oldest first (the manager: C++ backend's, at its drain)."""
        self.p2p_in_flight = records

    def progress_at(self) -> float:
        """perf_counter time of the newest collective issued (0: none yet); any thread."""
        return self.timing.last_issued_at(self)

    def forget_finished(self) -> None:
        """Drop finished collectives from the front of `pending`; publish the oldest unfinished one.

        Called by the timing manager only, under its drain lock.
        """
        pending = self.pending
        while pending and pending[0].duration is not None:
            pending.popleft()
        self.in_flight = pending[0] if pending else None
        if self.p2p_pending:
            unfinished = [record for record in self.p2p_pending if record.duration is None]
            self.p2p_pending = deque(unfinished)
            self.p2p_in_flight = unfinished
