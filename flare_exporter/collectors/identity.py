"""flare_rank_info and flare_process_group_info: who this rank is and which groups it is in."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from ..state import FlareState
from . import Families


class IdentityCollector:
    name = "identity"
    metrics = ("flare_rank_info", "flare_process_group_info")

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        info = self.state.identity.info_labels()
        rank_info = families.new("flare_rank_info")
        rank_info.add_metric(families.labels(*info.values()), 1)
        group_info = families.new("flare_process_group_info")
        for tracker in list(self.state.groups.values()):
            group_info.add_metric(
                families.labels(tracker.name, tracker.role, str(tracker.size), tracker.timing.recorder), 1
            )
        return [rank_info, group_info]
