"""flare_rank_info and flare_process_group_info: who this rank is and which groups it is in."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from prometheus_client.core import Metric

from ..identity import RankIdentity
from ..state import FlareState
from . import Families


class IdentityCollector:
    name = "identity"
    metrics = ("flare_rank_info", "flare_process_group_info")

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        rank_info = families.new("flare_rank_info")
        rank_info.add_metric(families.labels(*_info_values(self.state.identity)), 1)
        group_info = families.new("flare_process_group_info")
        for tracker in list(self.state.groups.values()):
            size, recorder = str(tracker.size), tracker.timing.recorder
            group_info.add_metric(families.labels(tracker.name, tracker.role, size, recorder), 1)
        return [rank_info, group_info]


@lru_cache(maxsize=1)  # the same str objects at every scrape until the identity changes (collectors/__init__)
def _info_values(identity: RankIdentity) -> tuple[str, ...]:
    return tuple(identity.info_labels().values())
