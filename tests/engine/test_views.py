"""`flare ranks` at thousands of ranks: --problems, --sort and --top (engine/views.py), on snapshots built by
hand and through the command on a hung virtual cluster of 64 ranks."""

from __future__ import annotations

import time

import pytest
from conftest import flare_json

from flare_exporter.config import Config
from flare_exporter.engine import views
from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.rule_types import GroupState, InFlight, RankRecord, Snapshot
from flare_exporter.local.testing import virtual_cluster as vc

NOW = 1_700_000_000.0
HANG = 30.0


def waiting(seq: int, age: float = 60.0) -> GroupState:
    return GroupState(seq, seq - 1, InFlight("all_reduce", seq, 4096, "started", NOW - age))


def job() -> Snapshot:
    """Rank 2 stuck in compute (behind, stalled), rank 5 gone, the others waiting in the world group;
    steps and heartbeats differ so that each sort has one answer."""
    records = [
        RankRecord(r, steps=100 + r, heartbeat=NOW - 60 - r, groups={"world": waiting(8, age=60 + r)})
        for r in (0, 1, 3, 4, 6, 7)
    ]
    records.append(
        RankRecord(2, steps=99, heartbeat=NOW - 90, groups={"world": GroupState(7, 7)}, activity="compute")
    )
    records.append(RankRecord(5, up=False, down_reason="connection refused"))
    return Snapshot({record.rank: record for record in records}, NOW, "r", 8)


def shown(selection: views.RankSelection, snapshot: Snapshot | None = None) -> list[int]:
    snapshot = snapshot or job()
    rows, lines = views.ranks_view(snapshot, diagnose(snapshot, HANG), HANG, selection)
    assert len(lines) == len(rows) + 1  # a header and a line per row
    return [row["rank"] for row in rows]


def test_every_rank_by_default_in_rank_order_with_its_problems():
    snapshot = job()
    rows, _ = views.ranks_view(snapshot, diagnose(snapshot, HANG), HANG)
    assert [row["rank"] for row in rows] == list(range(8))
    problems = {row["rank"]: row["problems"] for row in rows}
    # the gone rank explains the world group's wait: the verdict names rank 5, no hang names rank 2
    assert problems[2] == ["stalled", "behind:world"]
    assert problems[5] == ["down", "named:rank_down"]
    assert problems[0] == [] and problems[7] == []


def test_problems_keeps_the_down_the_stalled_the_behind_and_the_named():
    assert shown(views.RankSelection(problems=True)) == [2, 5]


def test_sort_and_top():
    assert shown(views.RankSelection(sort="steps", top=3)) == [2, 0, 1]  # fewest steps first; 5 has none
    assert shown(views.RankSelection(sort="heartbeat", top=2)) == [2, 7]  # oldest heartbeat first
    assert shown(views.RankSelection(sort="in-flight", top=2)) == [7, 6]  # the longest wait first
    assert shown(views.RankSelection(sort="steps"))[-1] == 5  # a rank without a number comes last


@pytest.mark.parametrize("bad", [["--top", "0"], ["--top", "x"], ["--sort", "bytes"]])
def test_bad_selection_flags_are_usage_errors(bad, tmp_path):
    targets = tmp_path / "targets.txt"
    targets.write_text("127.0.0.1:1\n")
    code, _ = flare_json("ranks", "--targets", str(targets), *bad)
    assert code == 2


def test_the_command_lists_the_problem_ranks_of_a_hung_cluster_of_64(tmp_path):
    world, hung = 64, 37
    _, _, pages = vc.render_phases(world, "views", None, hung, config=Config(hang_seconds=4))
    with vc.ClusterServer(vc.hung_at(pages, time.time() - 10)) as server:
        targets = tmp_path / "targets.txt"
        targets.write_text("\n".join(server.targets()) + "\n")
        code, everything = flare_json("ranks", "--targets", str(targets))
        assert (code, everything["ranks_total"], len(everything["ranks"])) == (1, world, world)
        code, report = flare_json("ranks", "--targets", str(targets), "--problems", "--top", "5")
    assert code == 1
    assert [row["rank"] for row in report["ranks"]] == [hung]
    assert "behind:world" in report["ranks"][0]["problems"]
    assert "named:hang" in report["ranks"][0]["problems"]
