"""flare_rank_info, flare_world_size, flare_process_group_info and flare_exporter_build_info: who this rank
is, how many ranks its job has, which groups it is in, and what it runs."""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterable
from functools import lru_cache

from prometheus_client.core import Metric

from ... import __version__
from ..identity import RankIdentity
from ..state import FlareState
from . import Families


class IdentityCollector:
    name = "identity"
    metrics = (
        "flare_rank_info",
        "flare_world_size",
        "flare_process_group_info",
        "flare_exporter_build_info",
    )

    def __init__(self, state: FlareState) -> None:
        self.state = state

    def collect(self, families: Families) -> Iterable[Metric]:
        rank_info = families.new("flare_rank_info")
        rank_info.add_metric(families.labels(*_info_values(self.state.identity)), 1)
        world_size = families.new("flare_world_size")
        world_size.add_metric(families.labels(), self.state.identity.world_size)
        group_info = families.new("flare_process_group_info")
        for tracker in list(self.state.groups.values()):
            size, recorder = str(tracker.size), tracker.timing.recorder
            position = str(tracker.group_rank)
            group_info.add_metric(families.labels(tracker.name, tracker.role, size, recorder, position), 1)
        build_info = families.new("flare_exporter_build_info")
        torch_version = getattr(sys.modules.get("torch"), "__version__", "")
        build_info.add_metric(families.labels(*build_values(str(torch_version), cpp_recorder_loaded())), 1)
        return [rank_info, world_size, group_info, build_info]


@lru_cache(maxsize=1)  # the same str objects at every scrape until the identity changes (collectors/__init__)
def _info_values(identity: RankIdentity) -> tuple[str, ...]:
    return tuple(identity.info_labels().values())


def cpp_recorder_loaded() -> bool:
    """Whether flare's C++ recorder (cpp_recorder.py) is loaded: it is, once built, from the first scrape on
    (the text format loads it). Never imports torch for a process that has not."""
    if "torch" not in sys.modules:
        return False
    from .. import cpp_recorder

    return cpp_recorder.load() is not None


@lru_cache(maxsize=4)  # the same str objects at every scrape: the values change once at most (loaded)
def build_values(torch_version: str, cpp_recorder: bool) -> tuple[str, str, str, str]:
    """Labels of flare_exporter_build_info beyond rank and run: version, torch, python, cpp_recorder."""
    return __version__, torch_version, platform.python_version(), "cpp" if cpp_recorder else "python"
