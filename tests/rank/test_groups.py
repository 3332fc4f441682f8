"""Process groups: stable names, roles, payload sizes, and the tracker that issues sequence numbers."""

from __future__ import annotations

import pytest
import torch

from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.groups import GroupTracker, group_name, group_role, payload_bytes
from flare_exporter.rank.timing import CollectiveRecord


class RecordingTiming:
    """A stand-in timing backend that keeps what it was asked to track."""

    def __init__(self) -> None:
        self.tracked: list[tuple[CollectiveRecord, object]] = []

    def track(self, record: CollectiveRecord, work: object) -> None:
        self.tracked.append((record, work))


def make_tracker(name: str = "dp-0123abcd", timing=None) -> GroupTracker:
    return GroupTracker(name, 4, "gloo", timing or RecordingTiming(), ExporterHealth())


def test_default_group_is_world():
    assert group_name("default_pg", [0, 1, 2, 3]) == "world"
    assert group_name("anything", []) == "world"


def test_same_ranks_in_any_order_give_the_same_name():
    assert group_name("mesh_dp", [3, 1, 2]) == group_name("mesh_dp", [1, 2, 3])


def test_different_rank_sets_give_different_names():
    names = {group_name("mesh_dp", ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3])}
    assert len(names) == 5


def test_different_descriptions_give_different_names():
    assert group_name("mesh_dp", [0, 1]) != group_name("mesh_tp", [0, 1])


def test_name_keeps_description_words():
    name = group_name("TENSOR_MODEL_PARALLEL_GROUP", [0, 1])
    assert name.startswith("tensor_model_parallel_group-")


@pytest.mark.parametrize(
    "description",
    ["x" * 10_000, "Ä ö/€ \n\t" * 100, "!!!", "undefined", "", "a-b-c" * 50],
    ids=["long", "unicode", "punctuation", "undefined", "empty", "dashes"],
)
def test_name_is_bounded_and_label_safe(description):
    name = group_name(description, list(range(4096)))
    assert len(name) <= 41
    assert all(c.isascii() and (c.isalnum() or c in "_-") for c in name)


def test_undescribed_group_is_named_group():
    assert group_name("undefined", [0, 1]).startswith("group-")
    assert group_name("", [0, 1]).startswith("group-")


@pytest.mark.parametrize(
    ("description", "role"),
    [
        ("mesh_dp", "dp"),
        ("DATA_PARALLEL_GROUP", "dp"),
        ("fsdp_shard", "dp"),
        ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
        ("mesh_tp", "tp"),
        ("pipeline", "pp"),
        ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"),
        ("EXPERT_MODEL_PARALLEL_GROUP", "ep"),
        ("mesh_cp", "cp"),
        ("CONTEXT_PARALLEL_GROUP", "cp"),
        ("foo", "other"),
        ("undefined", "other"),
        ("deeper", "other"),  # no role word inside a longer word
    ],
)
def test_group_role_from_description(description, role):
    assert group_role(group_name(description, [0, 1])) == role


def test_world_role():
    assert group_role(group_name("default_pg", [0, 1])) == "world"


def test_payload_bytes_of_tensors():
    assert payload_bytes(torch.zeros(4, dtype=torch.float32)) == 16
    nested = [
        torch.zeros(3, dtype=torch.float16),
        [torch.zeros(2, 2, dtype=torch.int64), torch.zeros(5, dtype=torch.uint8)],
        (torch.zeros(0, dtype=torch.float64),),
    ]
    assert payload_bytes(nested) == 3 * 2 + 4 * 8 + 5 * 1
    assert payload_bytes([]) == 0


def test_issue_increments_seq_for_collectives_only():
    tracker = make_tracker()
    first = tracker.issue("allreduce", torch.zeros(8))
    send = tracker.issue("send", torch.zeros(8))
    recv = tracker.issue("recv", [torch.zeros(8)])
    second = tracker.issue("broadcast", [torch.zeros(2, dtype=torch.int32)])
    assert (first.seq, send.seq, recv.seq, second.seq) == (1, 0, 0, 2)
    assert tracker.last_issued_seq == 2
    assert (first.nbytes, second.nbytes) == (32, 8)
    assert first.group is tracker
    assert first.op == "allreduce"
    assert tracker.last_progress_at > 0


def test_issue_without_payload():
    record = make_tracker().issue("barrier", None)
    assert record.nbytes == 0
    assert record.seq == 1


def test_issue_never_raises():
    tracker = make_tracker()
    assert tracker.issue("allreduce", object()) is None
    assert tracker.health.errors["collective_hook"] == 1
    assert tracker.issue("allreduce", [object()]) is None
    assert tracker.health.errors["collective_hook"] == 2


def test_track_hands_record_to_timing():
    timing = RecordingTiming()
    tracker = make_tracker(timing=timing)
    record = tracker.issue("allreduce", torch.zeros(1))
    tracker.track(record, "work")
    tracker.track(None, "ignored")
    assert timing.tracked == [(record, "work")]


def test_track_never_raises():
    class FailingTiming:
        def track(self, record, work):
            raise RuntimeError("backend broke")

    tracker = make_tracker(timing=FailingTiming())
    tracker.track(tracker.issue("allreduce", torch.zeros(1)), "work")
    assert tracker.health.errors["collective_timing"] == 1


def test_tracker_role_and_size():
    tracker = make_tracker(group_name("mesh_tp", [0, 1, 2, 3]))
    assert tracker.role == "tp"
    assert tracker.size == 4
