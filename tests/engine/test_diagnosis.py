"""The rules engine (diagnosis.py): hand-built snapshots in, verdicts out. Pure, no processes, no network."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flare_exporter import causes, spec
from flare_exporter.engine import records
from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.hang_verdicts import follow_chain
from flare_exporter.engine.ild_verdicts import IldDrift, IldPeers, ild_shifted
from flare_exporter.engine.rule_types import (
    GpuState,
    GroupState,
    InFlight,
    RankRecord,
    Snapshot,
    Verdict,
    WindowSummary,
)
from flare_exporter.engine.straggler_verdicts import (
    LEAVE_ONE_OUT_RANKS,
    decided_by_last_windows,
    hardware_reasons,
    straggler_scores,
)
from flare_exporter.engine.verdict_terms import KINDS
from flare_exporter.policies import IldPolicy, StragglerPolicy

NOW = 1_700_000_000.0
HANG = 30.0  # hang_seconds for every test

# ---------------------------------------------------------------------------------------------------------
# builders


def waiting(seq: int, op: str = "all_reduce", nbytes: int = 4096, state: str = "started", age: float = 60.0):
    """A group in which collective `seq` was issued `age` seconds ago and has not finished."""
    return GroupState(seq, seq - 1, InFlight(op, seq, nbytes, state, NOW - age))


def done(seq: int) -> GroupState:
    """A group whose collectives up to `seq` all finished; nothing in flight."""
    return GroupState(seq, seq)


def rank(r: int, world: GroupState | None = None, **fields) -> RankRecord:
    """A live rank; `world` is its view of group "world", other groups go in `groups=`."""
    groups = dict(fields.pop("groups", {}))
    if world is not None:
        groups["world"] = world
    return RankRecord(r, groups=groups, **fields)


def vanished(r: int, reason: str = "connection refused", **fields) -> RankRecord:
    return RankRecord(r, up=False, down_reason=reason, **fields)


def raised(r: int, ago: float, exception: str = "RuntimeError", **fields) -> RankRecord:
    return RankRecord(r, exception=exception, exception_at=NOW - ago, **fields)


def worker(r: int, wait: float, step: float = 1.0, steps: float = 20) -> RankRecord:
    """A rank that took `steps` steps of `step` seconds, waiting `wait` seconds per step in collectives."""
    return RankRecord(r, step_count=steps, step_seconds=step * steps, collective_seconds=wait * steps)


def snapshot(*records: RankRecord) -> Snapshot:
    return Snapshot({record.rank: record for record in records}, NOW, run="test", world_size=len(records))


def diag(*records: RankRecord, **kwargs) -> list[Verdict]:
    return diagnose(snapshot(*records), HANG, **kwargs)


def only(verdicts: list[Verdict]) -> Verdict:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def in_group(verdicts: list[Verdict], group: str) -> Verdict:
    [verdict] = [verdict for verdict in verdicts if verdict.group == group]
    return verdict


# ---------------------------------------------------------------------------------------------------------
# healthy and below the threshold


def test_healthy_snapshot_has_no_verdicts():
    assert diag(*(rank(r, world=done(7), steps=100) for r in range(4))) == []


def test_no_hang_below_the_threshold():
    # rank 2 is behind and the others wait, but only for 10 s of the 30 s threshold
    records = [rank(r, world=waiting(5, age=10.0)) for r in (0, 1, 3)] + [rank(2, world=done(4))]
    assert diag(*records) == []


def test_hang_at_exactly_the_threshold():
    records = [rank(r, world=waiting(5, age=HANG)) for r in (0, 1, 3)] + [rank(2, world=done(4))]
    assert only(diag(*records)).ranks == (2,)


# ---------------------------------------------------------------------------------------------------------
# rank_down


def test_vanished_rank_is_down_and_explains_the_hang():
    records = [rank(r, world=waiting(5)) for r in (0, 1, 3)] + [vanished(2, host="node-1")]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("rank_down", (2,), "rank")
    assert "rank 2 is gone (connection refused)" in verdict.summary
    assert verdict.evidence["followed_by"] == []
    assert verdict.evidence["hung_groups"] == ["world"]
    assert verdict.evidence["ranks"]["2"]["host"] == "node-1"


def test_rank_with_an_exception_is_down():
    records = [rank(r, world=done(5)) for r in (0, 2, 3)] + [raised(1, ago=5.0, exception="ValueError")]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("rank_down", (1,))
    assert "raised ValueError" in verdict.summary
    assert verdict.evidence["ranks"]["1"]["exception_age_seconds"] == 5.0


def test_killed_rank_is_the_culprit_not_the_survivors_that_raised_after_it():
    records = [
        raised(0, ago=8.0, exception="DistBackendError"),
        vanished(1, reason="killed", heartbeat=NOW - 20.0),
        raised(2, ago=9.0, exception="DistBackendError"),
        raised(3, ago=7.0, exception="DistBackendError"),
    ]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("rank_down", (1,))
    assert verdict.evidence["followed_by"] == [2, 0, 3]  # in the order they raised
    assert set(verdict.evidence["ranks"]) == {"0", "1", "2", "3"}
    assert "failed after it" in verdict.summary


def test_only_exceptions_the_earliest_is_the_culprit():
    records = [
        raised(0, ago=3.0),
        raised(1, ago=2.0),
        raised(2, ago=4.0, exception="torch.OutOfMemoryError"),
        rank(3, world=done(5)),
    ]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("rank_down", (2,))
    assert verdict.evidence["followed_by"] == [0, 1]
    assert "raised torch.OutOfMemoryError" in verdict.summary


# ---------------------------------------------------------------------------------------------------------
# hang: ranks behind the group's highest issued sequence number


def test_rank_behind_is_the_hang_culprit_with_its_frames():
    records = [rank(r, world=waiting(5)) for r in (0, 1, 3)]
    records.append(rank(2, world=done(4), activity="data", frames="next < _fetch < train_step"))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain, verdict.group) == ("hang", (2,), "rank", "world")
    assert verdict.evidence["max_issued_seq"] == 5
    assert verdict.evidence["last_issued_seq"] == {"2": 4}  # the members below the front, not the group
    assert verdict.evidence["ranks_at_max_issued_seq"] == 3
    assert verdict.evidence["culprits"]["2"]["frames"] == "next < _fetch < train_step"
    assert "rank 2 never issued it" in verdict.summary
    assert "rank 2 is in data at next" in verdict.summary


def test_hang_culprit_at_rank_0():
    records = [rank(0, world=done(4), frames="forward < step")] + [
        rank(r, world=waiting(5)) for r in (1, 2, 3)
    ]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("hang", (0,))
    assert "rank 0 is in compute at forward" in verdict.summary


def test_two_ranks_behind_on_two_hosts_stay_rank_level():
    records = [rank(r, world=waiting(9), host=f"node-{r // 2}") for r in (0, 2, 4)]
    records += [rank(1, world=done(8), host="node-0"), rank(5, world=done(8), host="node-2")]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("hang", (1, 5), "rank")


def seen_before_stall(state: GroupState) -> GroupState:
    """`state` as Prometheus holds it of a rank scraped late: read before the group's newest issue."""
    return state._replace(seen_before_stall=True)


def test_a_rank_scraped_before_the_stall_is_not_judged_behind():
    # rank 1's scrape came before the others issued 5: its 4 says nothing of whether it issued 5
    # (rank 3's, scraped before it too, shows it issued 5: it is judged, and not listed)
    records = [rank(0, world=waiting(5)), rank(3, world=seen_before_stall(waiting(5)))]
    records += [rank(1, world=seen_before_stall(done(4))), rank(2, world=done(4))]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    assert verdict.evidence["seen_before_stall"] == [1]


def test_a_rank_scraped_after_the_newest_issue_but_before_the_hang_is_not_judged_behind():
    # the others issued 5 at NOW-60, hung from NOW-30 (HANG 30 s); rank 1's number, scraped at NOW-40 (a
    # lagging shard), is after their issue but before the hang: it is not judged, as in the alerts
    records = [rank(0, world=waiting(5)), rank(3, world=waiting(5))]
    records += [
        rank(1, world=done(4)._replace(seen_at=NOW - 40)),
        rank(2, world=done(4)._replace(seen_at=NOW)),
    ]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    assert verdict.evidence["seen_before_stall"] == [1]
    # scraped once the group was hung, its 4 is evidence
    records[2] = rank(1, world=done(4)._replace(seen_at=NOW - 30))
    assert only(diag(*records)).ranks == (1, 2)


def test_right_after_the_hang_the_ranks_behind_since_the_newest_issue_are_judged():
    # a scrape interval after the hang began no number is yet from after it: rank 2's, scraped after the
    # others issued 5, still names it (not "every rank inside the collective": a communication fault)
    records = [rank(0, world=waiting(5)), rank(3, world=waiting(5))]
    records += [rank(1, world=waiting(5)), rank(2, world=done(4)._replace(seen_at=NOW - 40))]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    assert "seen_before_stall" not in verdict.evidence


def test_late_scrapes_of_most_ranks_do_not_make_the_ranks_ahead_a_mismatch():
    # five of eight ranks were last scraped before the stall: counted behind, they would be a majority
    records = [rank(r, world=seen_before_stall(done(4))) for r in (0, 1, 2, 3, 4)]
    records += [rank(5, world=done(4)), rank(6, world=waiting(5)), rank(7, world=waiting(5))]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("hang", (5,))


def test_a_mismatch_names_the_ranks_ahead_not_those_scraped_before_the_stall():
    # rank 0 issued collective 6, which ranks 1-3 never will; rank 4's number is from before the stall
    records = [rank(0, world=waiting(6, op="broadcast"))] + [rank(r, world=done(5)) for r in (1, 2, 3)]
    records.append(rank(4, world=seen_before_stall(done(4))))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks) == ("mismatch", (0,))
    assert verdict.evidence["seen_before_stall"] == [4]


def test_a_chain_does_not_follow_a_rank_scraped_before_the_stall():
    # in tp-x, rank 4's number is from before the stall: only rank 2, scraped since, is behind there
    records = [rank(r, world=waiting(5)) for r in (0, 3)]
    records += [
        rank(1, world=done(4), groups={"tp-x": waiting(3)}),
        rank(2, groups={"tp-x": done(2)}),
        rank(4, groups={"tp-x": seen_before_stall(done(2))}),
    ]
    verdict = in_group(diag(*records), "world")
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))


# ---------------------------------------------------------------------------------------------------------
# mismatch


def test_one_rank_ahead_of_a_behind_majority_is_a_mismatch():
    # rank 0 issued collective 6 that ranks 1-3 never will: they are "behind", but they are the majority
    records = [rank(0, world=waiting(6, op="broadcast"))] + [rank(r, world=done(5)) for r in (1, 2, 3)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain, verdict.group) == ("mismatch", (0,), "rank", "world")
    assert verdict.evidence["in_flight"]["0"]["op"] == "broadcast"
    assert "other 3 ranks never issued" in verdict.summary


def test_same_seq_different_op_odd_one_out_at_rank_0():
    records = [rank(0, world=waiting(5, op="all_gather"))] + [rank(r, world=waiting(5)) for r in (1, 2, 3)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("mismatch", (0,), "rank")
    assert verdict.evidence["in_flight"]["0"]["op"] == "all_gather"
    assert "rank 0: all_gather of 4096 bytes" in verdict.summary


def test_same_seq_different_size_odd_one_out():
    records = [rank(r, world=waiting(5, nbytes=4096)) for r in (0, 1, 3)]
    records.append(rank(2, world=waiting(5, nbytes=8192)))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("mismatch", (2,), "rank")
    assert verdict.evidence["in_flight"]["2"]["bytes"] == 8192


def test_mismatch_tie_suspects_every_rank_in_the_group_domain():
    records = [rank(r, world=waiting(5, op="all_reduce")) for r in (0, 1)]
    records += [rank(r, world=waiting(5, op="reduce_scatter")) for r in (2, 3)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("mismatch", (0, 1, 2, 3), "group")


# ---------------------------------------------------------------------------------------------------------
# everyone inside the collective: not started, or a communication fault


def test_collective_not_started_on_one_rank_is_a_hang_on_it():
    records = [rank(r, world=waiting(5, state="started")) for r in (0, 1, 3)]
    records.append(rank(2, world=waiting(5, state="issued")))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("hang", (2,), "rank")
    assert verdict.evidence["in_flight"]["2"]["state"] == "issued"
    assert "has not started on rank 2" in verdict.summary


def test_everyone_started_is_a_communication_fault_in_the_group():
    verdict = only(diag(*(rank(r, world=waiting(5)) for r in range(4))))
    assert (verdict.kind, verdict.ranks, verdict.domain, verdict.group) == ("hang", (), "group", "world")
    assert set(verdict.evidence["in_flight"]) == {"0", "1", "2", "3"}
    assert "communication fault" in verdict.summary


# ---------------------------------------------------------------------------------------------------------
# following the chain across groups


def test_chain_leads_from_world_to_the_rank_that_waits_on_nobody():
    # rank 1 is behind in world because it waits in tp-x, where rank 2 (computing, waiting on nobody) is
    # behind: rank 2 is the culprit, not rank 1
    records = [
        rank(0, world=waiting(5)),
        rank(1, world=done(4), groups={"tp-x": waiting(3)}),
        rank(2, world=done(4), groups={"tp-x": done(2)}, frames="backward < step"),
        rank(3, world=waiting(5)),
    ]
    verdict = in_group(diag(*records), "world")
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    assert {"group": "world", "rank": 1, "waits_in": ["tp-x"]} in verdict.evidence["chain"]
    assert {"group": "tp-x", "rank": 2, "waits_in": []} in verdict.evidence["chain"]
    assert list(verdict.evidence["culprits"]) == ["2"]


def test_chain_reaches_a_rank_outside_the_hung_group():
    # rank 4 is not in world's records at all; only the chain through tp-x finds it
    records = [rank(r, world=waiting(5)) for r in (0, 2, 3)]
    records += [rank(1, world=done(4), groups={"tp-x": waiting(3)}), rank(4, groups={"tp-x": done(2)})]
    verdict = in_group(diag(*records), "world")
    assert verdict.ranks == (4,)
    assert verdict.evidence["chain"] == [
        {"group": "world", "rank": 1, "waits_in": ["tp-x"]},
        {"group": "tp-x", "rank": 4, "waits_in": []},
    ]


def test_chain_ending_at_a_gone_rank():
    # rank 2 (only ever seen in tp-x) is down: the world hang is traced to it through tp-x
    records = [rank(r, world=waiting(5)) for r in (0, 3)]
    records += [rank(1, world=done(4), groups={"tp-x": waiting(3)}), vanished(2, groups={"tp-x": done(2)})]
    verdicts = diag(*records)
    assert [v.kind for v in verdicts] == ["rank_down", "hang"]
    assert verdicts[0].ranks == (2,)
    hang = in_group(verdicts, "world")
    assert hang.ranks == (2,)
    assert hang.evidence["chain"][-1] == {"group": "tp-x", "rank": 2, "waits_in": []}


def _cycle() -> Snapshot:
    # rank 1 is behind in world and waits in tp-x; rank 2 is behind in tp-x and waits in world
    return snapshot(
        rank(0, world=waiting(5)),
        rank(1, world=done(4), groups={"tp-x": waiting(3)}),
        rank(2, world=waiting(5), groups={"tp-x": done(2)}),
        rank(3, world=waiting(5)),
    )


def test_a_cycle_in_the_waits_terminates():
    _, chain = follow_chain(_cycle(), "world", [1])
    assert chain == [
        {"group": "world", "rank": 1, "waits_in": ["tp-x"]},
        {"group": "tp-x", "rank": 2, "waits_in": ["world"]},
    ]


def test_a_cycle_in_the_waits_names_the_ranks_in_it():
    verdicts = diagnose(_cycle(), HANG)
    world = in_group(verdicts, "world")
    assert world.kind == "hang"
    assert world.ranks == (1, 2) and world.evidence["deadlock"] is True


# ---------------------------------------------------------------------------------------------------------
# host_fault


def test_two_culprits_on_one_host_is_a_host_fault():
    records = [rank(r, world=waiting(9), host=f"node-{r // 2}") for r in (0, 1, 4, 5)]
    records += [rank(r, world=done(8), host="node-1") for r in (2, 3)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain, verdict.group) == (
        "host_fault",
        (2, 3),
        "host",
        "world",
    )
    assert verdict.evidence["host"] == "node-1"
    assert verdict.evidence["ranks_on_host"] == [2, 3]
    assert verdict.evidence["kind"] == "hang"
    assert verdict.summary.startswith("host node-1: ")


def test_two_vanished_ranks_on_one_host_is_a_host_fault():
    records = [rank(0, world=waiting(5), host="a"), rank(1, world=waiting(5), host="b")]
    records += [vanished(2, host="b"), vanished(3, host="b")]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("host_fault", (2, 3), "host")
    assert verdict.evidence["ranks_on_host"] == [1, 2, 3]
    assert verdict.evidence["kind"] == "rank_down"


def test_vanished_ranks_on_two_hosts_stay_rank_down():
    verdict = only(diag(vanished(0, host="a"), vanished(1, host="b"), rank(2, world=done(3), host="a")))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("rank_down", (0, 1), "rank")


# ---------------------------------------------------------------------------------------------------------
# straggler


def test_straggler_waits_least_and_is_named():
    records = [worker(r, wait) for r, wait in enumerate([0.40, 0.42, 0.41, 0.05, 0.43, 0.39])]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("straggler", (3,), "rank")
    assert set(verdict.evidence["ranks"]) == {"3"}
    assert verdict.evidence["ranks"]["3"]["wait_seconds_per_step"] == pytest.approx(0.05)


def test_healthy_spread_has_no_straggler():
    assert diag(*(worker(r, wait) for r, wait in enumerate([0.40, 0.42, 0.41, 0.38, 0.43, 0.39]))) == []


def test_tiny_difference_with_zero_spread_is_no_straggler():
    # the MAD is 0, so the z-score is huge, but 0.01 s of a 1 s step is below min_share_of_step
    assert diag(*(worker(r, wait) for r, wait in enumerate([0.50, 0.50, 0.49, 0.50]))) == []


def test_straggler_needs_three_ranks():
    assert diag(worker(0, 0.5), worker(1, 0.01)) == []


def test_straggler_needs_enough_steps():
    records = [worker(r, wait, steps=5) for r, wait in enumerate([0.40, 0.42, 0.05, 0.41])]
    assert diag(*records) == []
    records = [worker(r, wait, steps=10) for r, wait in enumerate([0.40, 0.42, 0.05, 0.41])]
    assert only(diag(*records)).ranks == (2,)


def test_half_the_ranks_are_not_stragglers():
    policy = StragglerPolicy(robust_z=0.5, min_share_of_step=0.1)
    records = [worker(r, wait) for r, wait in enumerate([0.5, 0.1, 0.5, 0.1])]
    # each of ranks 1 and 3 passes the score on its own ...
    assert all(straggler_scores(snapshot(*records))[r]["score"] >= policy.robust_z for r in (1, 3))
    # ... but when half the ranks "straggle" there is no one to blame
    assert diag(*records, stragglers=policy) == []


def test_no_straggler_verdict_while_something_worse_is_found():
    records = [worker(r, wait) for r, wait in enumerate([0.40, 0.42, 0.41, 0.05, 0.43])]
    records.append(vanished(5))
    assert [v.kind for v in diag(*records)] == ["rank_down"]


# ---------------------------------------------------------------------------------------------------------
# the returned list and the JSON form


def _many_faults() -> list[Verdict]:
    # in group-name order the engine finds: rank_down, then a-mis (mismatch), b-hang (hang), c-host (host)
    records = [vanished(9)]
    records += [rank(r, groups={"a-mis": waiting(3)}) for r in (0, 1)]
    records.append(rank(2, groups={"a-mis": waiting(3, op="broadcast")}))
    records += [rank(r, groups={"b-hang": waiting(7)}) for r in (3, 4)]
    records.append(rank(5, groups={"b-hang": done(6)}))
    records += [rank(r, groups={"c-host": waiting(2)}, host="h0") for r in (10, 11, 12)]
    records += [rank(r, groups={"c-host": done(1)}, host="h1") for r in (13, 14)]
    return diag(*records)


def test_verdicts_are_sorted_by_severity():
    verdicts = _many_faults()
    assert [(v.kind, v.ranks) for v in verdicts] == [
        ("host_fault", (13, 14)),
        ("rank_down", (9,)),
        ("mismatch", (2,)),
        ("hang", (5,)),
    ]
    assert [KINDS.index(v.kind) for v in verdicts] == sorted(KINDS.index(v.kind) for v in verdicts)


def test_to_json_keys_and_serialisable():
    verdicts = _many_faults()
    for verdict in verdicts:
        data = verdict.to_json()
        assert set(data) == {"kind", "severity", "cause", "ranks", "domain", "group", "summary", "evidence"}
        assert data["severity"] == "page"  # the faults of _many_faults: no busy host
        assert data["cause"] in causes.CAUSES and data["cause"] != "unknown"
        assert json.loads(json.dumps(data)) == data
    assert verdicts[0].to_json()["ranks"] == [13, 14]
    assert verdicts[0].to_json()["group"] == "c-host"


def test_every_verdict_uses_a_known_kind_and_domain():
    for verdict in _many_faults():
        assert verdict.kind in KINDS
        assert verdict.domain in ("rank", "host", "group", "job")


# ---------------------------------------------------------------------------------------------------------
# stragglers from the exported windows, the job-wide case, and hardware reasons


def windowed(r: int, waits: list[float], steps: list[float] | None = None, best: float = 1.0, **fields):
    """A rank that exported windows 10, 11, ... with these mean waits (and step times) per step."""
    steps = steps or [1.0] * len(waits)
    windows = {10 + i: (step, wait) for i, (step, wait) in enumerate(zip(steps, waits, strict=True))}
    return RankRecord(
        r, step_count=100, step_seconds=100.0, collective_seconds=40.0, step_windows=windows,
        best_step_seconds=best, **fields,
    )  # fmt: skip


def test_windows_of_a_single_rank_are_compared_with_no_one():
    # early in a run only one live rank may have closed windows yet: nothing to score it against
    records = [windowed(0, [0.40, 0.41, 0.39]), rank(1, step_count=0)]
    assert diag(*records) == []


def test_windowed_straggler_named_when_it_holds_over_the_windows():
    records = [windowed(r, [0.40, 0.41, 0.39]) for r in (0, 1, 3)] + [windowed(2, [0.30, 0.31, 0.29])]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("straggler", (2,), "rank")
    assert verdict.evidence["windows"] == [10, 11, 12]
    assert verdict.evidence["ranks"]["2"]["gap"] == pytest.approx(0.10, abs=0.01)
    assert "hardware" not in verdict.evidence


def exported(r: int, last: int, windows: list[tuple[float, float]], best: float | None = 1.0) -> RankRecord:
    """A rank that closed window `last` and exports the windows before it, newest first (ago 0, 1, ...)."""
    numbered = {last - ago: window for ago, window in enumerate(windows)}
    return RankRecord(r, step_count=100, step_windows=numbered, best_step_seconds=best)


def last_windows(record: RankRecord, hold: int) -> RankRecord:
    """The record with only its last `hold` windows (ago below it), as a source that reads those first."""
    last = max(record.step_windows, default=0)
    recent = {number: w for number, w in record.step_windows.items() if number > last - hold}
    return dataclasses.replace(record, step_windows=recent)


HEALTHY = [(1.0, 0.40), (1.0, 0.41), (1.0, 0.39), (0.5, 0.10)]  # newest first; the fourth the fastest


def test_the_last_windows_decide_only_when_every_rank_closed_the_same_one_and_exports_its_best():
    policy = StragglerPolicy()
    straggler = [(1.0, 0.30), (1.0, 0.31), (1.0, 0.29), (1.0, 0.3)]
    records = [exported(r, 12, HEALTHY) for r in (0, 1, 3)] + [exported(2, 12, straggler)]
    assert decided_by_last_windows(snapshot(*records), policy)
    assert decided_by_last_windows(snapshot(*[last_windows(r, 3) for r in records]), policy)
    ahead = [*records[:3], exported(2, 13, straggler)]  # it closed one more: the shared ones are 10-12
    assert not decided_by_last_windows(snapshot(*ahead), policy)  # its 10 is older than its last three
    assert not decided_by_last_windows(snapshot(*[last_windows(r, 3) for r in ahead]), policy)
    no_best = [*records[:3], exported(2, 12, straggler, best=None)]  # its fastest window stands in
    assert not decided_by_last_windows(snapshot(*[last_windows(r, 3) for r in no_best]), policy)
    too_few = [*records[:3], exported(2, 12, straggler[:2])]
    assert not decided_by_last_windows(snapshot(*too_few), policy)
    assert not decided_by_last_windows(snapshot(*records), StragglerPolicy(hold_windows=0))  # every window


_window = st.tuples(st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.02, 0.3, 0.4, 0.41]))


@given(
    ranks=st.lists(
        st.tuples(
            st.integers(min_value=11, max_value=12),  # the last window each closed
            st.lists(_window, min_size=1, max_size=5),  # its windows, newest first
            st.none() | st.sampled_from([0.0, 0.5, 1.0]),  # its best step time
        ),
        min_size=3,
        max_size=7,
    ),
    hold=st.integers(min_value=1, max_value=4),
)
@example(  # a straggler, named from the last three of four windows
    ranks=[(12, HEALTHY, 1.0)] * 3 + [(12, [(2.0, 0.02)] * 4, 1.0)], hold=3
)
@example(  # the job-wide case: every rank twice as slow as its best in the last three windows
    ranks=[(12, [(2.0, 0.4)] * 3 + [(1.0, 0.4)], 1.0)] * 4, hold=3
)
@example(  # a straggler without its best step time: its oldest window, the fastest, stands in
    ranks=[(12, HEALTHY, 1.0)] * 3 + [(12, [(2.0, 0.02)] * 3 + [(0.5, 0.02)], None)], hold=3
)
def test_windows_older_than_the_last_change_no_verdict_where_the_last_decide(ranks, hold):
    """The Prometheus source leaves the older windows unread when the last decide: so they must."""
    policy = StragglerPolicy(hold_windows=hold)
    records = [exported(r, last, windows, best) for r, (last, windows, best) in enumerate(ranks)]
    recent = snapshot(*[last_windows(record, hold) for record in records])
    if decided_by_last_windows(recent, policy):
        every = [v.to_json() for v in diagnose(snapshot(*records), HANG, policy)]
        assert [v.to_json() for v in diagnose(recent, HANG, policy)] == every


def summarised(records: list[RankRecord], policy: StragglerPolicy) -> Snapshot | None:
    """What prometheus_source.from_prometheus makes of Prometheus's figures
    (straggler_rules.straggler_summary_rules) over `records`, which closed the same windows: the figures,
    and the windows of the ranks the screen names (pace_queries.summary_candidates); None where the
    figures do not stand for every rank's windows."""
    windows = sorted(records[0].step_windows)[-policy.hold_windows :]
    steps = {r.rank: [r.step_windows[w] for w in windows] for r in records}
    slowest = min(
        min(step for step, _ in found) / r.best_step_seconds
        for r, found in zip(records, steps.values(), strict=True)
    )
    if len(records) <= LEAVE_ONE_OUT_RANKS or round(slowest, 4) >= 1 + policy.job_slowdown:
        return None

    def robust(shares: list[float]) -> tuple[float, float]:  # quantile(0.5, ...), as PromQL computes it
        median = statistics.median(shares)
        return median, 1.4826 * statistics.median(abs(share - median) for share in shares)

    per_window = tuple(
        robust([wait / step for step, wait in (found[i] for found in steps.values())])
        for i in range(len(windows))
    )
    pooled = {rank: sum(w for _, w in found) / sum(s for s, _ in found) for rank, found in steps.items()}
    median, spread = robust(list(pooled.values()))
    distance = max(0.999 * policy.pooled_z * max(spread, 0.005), 0.999 * policy.min_wait_gap)
    named = [r for r in records if pooled[r.rank] <= median - distance]
    kept = {r.rank: r if r in named else dataclasses.replace(r, step_windows={}) for r in records}
    summary = WindowSummary(tuple(windows), len(records), per_window, (median, spread), NOW - 30)
    return dataclasses.replace(snapshot(*kept.values()), window_summary=summary)


@settings(max_examples=40, deadline=None)
@given(
    healthy=st.lists(
        st.sampled_from([(1.0, 0.40), (1.0, 0.41), (1.0, 0.38), (1.2, 0.45)]), min_size=3, max_size=3
    ),
    slow=st.lists(
        st.sampled_from([(1.0, 0.02), (1.5, 0.05), (1.0, 0.39), (2.0, 0.3)]), min_size=3, max_size=3
    ),
    stragglers=st.integers(min_value=0, max_value=3),
    ranks=st.integers(min_value=LEAVE_ONE_OUT_RANKS + 1, max_value=LEAVE_ONE_OUT_RANKS + 40),
    best=st.sampled_from([0.5, 1.0]),
)
@example(healthy=[(1.0, 0.40)] * 3, slow=[(1.0, 0.02)] * 3, stragglers=1, ranks=100, best=1.0)
def test_figures_for_every_rank_and_the_windows_of_the_ranks_they_name_give_the_same_verdicts(
    healthy, slow, stragglers, ranks, best
):
    """At thousands of ranks, prometheus_source.from_prometheus gives the rules Prometheus's figures over
    every rank's windows in place of them, with the windows of the ranks that could be named: the same
    verdicts."""
    policy = StragglerPolicy()
    records = [
        exported(r, 12, (slow if r % 17 == 5 and r // 17 < stragglers else healthy)[::-1], best)
        for r in range(ranks)
    ]
    # the healthy ones differ a little, as ranks do
    records = [
        dataclasses.replace(
            r,
            step_windows={w: (s, x * (1 + 0.01 * (r.rank % 5 - 2))) for w, (s, x) in r.step_windows.items()},
        )
        for r in records
    ]
    every = [v.to_json() for v in diagnose(snapshot(*records), HANG, policy)]
    summary = summarised(records, policy)
    assume(summary is not None)  # else the source reads every rank's windows
    assert [v.to_json() for v in diagnose(summary, HANG, policy)] == every


def test_windowed_straggler_not_named_when_one_window_does_not_hold():
    records = [windowed(r, [0.40, 0.41, 0.39]) for r in (0, 1, 3)] + [windowed(2, [0.30, 0.405, 0.29])]
    assert diag(*records) == []


def test_windowed_straggler_needs_the_hold_windows_on_every_rank():
    records = [windowed(r, [0.40, 0.41, 0.39]) for r in (0, 1, 3)] + [windowed(2, [0.30, 0.31])]
    assert diag(*records) == []  # rank 2 closed only two of them: nothing is decided yet


def test_windows_are_aligned_by_number_not_position():
    records = [windowed(r, [0.40, 0.41, 0.39, 0.40]) for r in (0, 1, 3)]
    late = windowed(2, [0.30, 0.31, 0.29])  # windows 10..12 while the others have 10..13
    verdict = only(diag(*records, late))
    assert verdict.ranks == (2,) and verdict.evidence["windows"] == [10, 11, 12]


def test_small_gap_is_no_windowed_straggler():
    records = [windowed(r, [0.40, 0.40, 0.40]) for r in (0, 1, 3)] + [windowed(2, [0.39, 0.39, 0.39])]
    assert diag(*records) == []  # 1% of the step below the others: below min_wait_gap


def test_job_wide_slowdown_is_a_job_verdict_without_culprit():
    records = [windowed(r, [0.40, 0.41, 0.40], steps=[1.7, 1.8, 1.7]) for r in range(4)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("straggler", (), "job")
    assert verdict.evidence["slowdown_ratio"]["0"] == [1.7, 1.8, 1.7]
    assert "job-wide" in verdict.summary


def test_job_wide_needs_every_window_slow():
    records = [windowed(r, [0.40, 0.41, 0.40], steps=[1.7, 1.2, 1.7]) for r in range(4)]
    assert diag(*records) == []


def test_one_straggler_slowing_the_job_is_not_job_wide():
    records = [windowed(r, [0.40, 0.41, 0.39], steps=[1.7] * 3) for r in (0, 1, 3)]
    records.append(windowed(2, [0.30, 0.31, 0.29], steps=[1.7] * 3))
    verdict = only(diag(*records))
    assert (verdict.ranks, verdict.domain) == ((2,), "rank")
    assert verdict.evidence["ranks"]["2"]["slowdown_ratio"] == [1.7, 1.7, 1.7]


def test_straggler_that_does_not_hold_yet_blocks_the_job_verdict():
    records = [windowed(r, [0.40, 0.41, 0.39], steps=[1.7] * 3) for r in (0, 1, 3)]
    records.append(windowed(2, [0.40, 0.20, 0.20], steps=[1.7] * 3))  # stands out, but not in window 10
    assert diag(*records) == []


def test_straggler_verdict_carries_its_gpus_hardware_reasons():
    hot = GpuState(
        up=True,
        clock_events=("gpu_idle", "hw_thermal_slowdown"),
        sm_clock_hertz=1100e6,
        sm_clock_max_hertz=1980e6,
        pcie_link_generation=4,
        pcie_link_generation_max=5,
        pcie_link_width=16,
        pcie_link_width_max=16,
    )
    healthy = GpuState(up=True, clock_events=("gpu_idle",), sm_clock_hertz=1980e6, sm_clock_max_hertz=1980e6)
    records = [windowed(r, [0.40, 0.41, 0.39], gpu=healthy) for r in (0, 1, 3)]
    records.append(windowed(2, [0.30, 0.31, 0.29], gpu=hot))
    verdict = only(diag(*records))
    assert verdict.ranks == (2,)
    assert verdict.evidence["hardware"] == {
        "2": ["hw_thermal_slowdown", "SM clock 1100 MHz of 1980 MHz max", "PCIe link Gen4 x16 (max Gen5 x16)"]
    }
    assert "rank 2's GPU shows hw_thermal_slowdown" in verdict.summary


def test_cumulative_straggler_also_carries_hardware_reasons():
    records = [worker(r, wait) for r, wait in enumerate([0.40, 0.42, 0.41, 0.05])]
    records[3] = RankRecord(3, step_count=20, step_seconds=20.0, collective_seconds=1.0, gpu=GpuState(
        up=True, clock_events=("sw_power_cap",)))  # fmt: skip
    verdict = only(diag(*records))
    assert verdict.ranks == (3,) and verdict.evidence["hardware"] == {"3": ["sw_power_cap"]}


@pytest.mark.parametrize(
    ("gpu", "reasons"),
    [
        (None, []),
        (GpuState(up=False, clock_events=("hw_slowdown",)), []),  # not read: no claim
        (GpuState(up=True, clock_events=("gpu_idle", "applications_clocks_setting", "sync_boost")), []),
        (GpuState(up=True, sm_clock_hertz=1900e6, sm_clock_max_hertz=1980e6), []),  # within 10 %
        (
            GpuState(
                up=True,
                pcie_link_generation=5,
                pcie_link_generation_max=5,
                pcie_link_width=8,
                pcie_link_width_max=16,
            ),
            ["PCIe link Gen5 x8 (max Gen5 x16)"],
        ),  # fmt: skip
        (GpuState(up=True, xid_events=2, last_xid=79), ["2 XID events (last XID 79)"]),
        (GpuState(up=True, row_remap_failed=1), ["row remapping failed"]),
    ],
)
def test_hardware_reasons(gpu, reasons):
    assert hardware_reasons(gpu) == reasons


# ---------------------------------------------------------------------------------------------------------
# issue latency (ILD)


def drifted(r: int, ks: float, wasserstein: float = 1e-3, distribution: str = "host_dispatch", **fields):
    """A live rank whose `distribution` drifted from its baseline by (ks, wasserstein)."""
    return RankRecord(r, ild_ks={distribution: ks}, ild_wasserstein={distribution: wasserstein}, **fields)


def test_ild_shift_on_one_rank_names_it():
    verdict = only(
        diag(drifted(0, 0.02, 1e-6), drifted(1, 0.6), drifted(2, 0.03, 1e-6), drifted(3, 0.01, 1e-6))
    )
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("ild_regression", (1,), "rank")
    assert verdict.evidence["shifted"]["1"]["host_dispatch"]["ks"] == 0.6


def test_ild_partial_shift_that_moves_far_names_the_rank():
    records = [drifted(r, 0.05, 2e-5) for r in (0, 2, 3)] + [drifted(1, 0.18, 2e-3)]
    assert only(diag(*records)).ranks == (1,)
    near = [drifted(r, 0.05, 2e-5) for r in (0, 2, 3)] + [drifted(1, 0.18, 3e-5)]
    assert diag(*near) == []  # a partial shift that does not move far is noise


def test_every_op_slower_on_one_rank_names_it_by_its_per_op_shift():
    """A delay added to every op: KS and W1 barely move, the per-op shift crosses its threshold."""
    threshold = IldPolicy().op_shift_seconds
    records = [drifted(r, 0.05, 2e-7, ild_op_shift={"host_dispatch": 0.1 * threshold}) for r in (0, 2, 3)]
    records.insert(1, drifted(1, 0.06, 3e-7, ild_op_shift={"host_dispatch": 3 * threshold}))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("ild_regression", (1,), "rank")
    assert verdict.evidence["shifted"]["1"]["host_dispatch"]["op_shift_seconds"] == 3 * threshold
    assert "every op +1.2 µs" in verdict.summary
    under = [drifted(r, 0.05, 2e-7, ild_op_shift={"host_dispatch": 0.9 * threshold}) for r in range(4)]
    assert diag(*under) == []
    # a shift counts beyond the ranks' median: every rank slower alike is the machine, not one rank
    alike = [drifted(r, 0.05, 2e-7, ild_op_shift={"host_dispatch": 3 * threshold}) for r in range(4)]
    assert diag(*alike) == []
    alike[1] = drifted(1, 0.05, 2e-7, ild_op_shift={"host_dispatch": 4.5 * threshold})
    assert only(diag(*alike)).ranks == (1,)  # 1.5 thresholds beyond the median (3.0, 3.0, 3.0, 4.5)
    two = [drifted(r, 0.05, 2e-7, ild_op_shift={"host_dispatch": 3 * threshold}) for r in range(2)]
    assert diag(*two) == []  # no median of peers (3+ ranks): the machine could have slowed both


def test_ild_shift_on_every_rank_is_job_wide():
    verdict = only(diag(*[drifted(r, 0.5, distribution="kernel_issue") for r in range(4)]))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("ild_regression", (), "job")
    assert verdict.evidence["ranks_with_data"] == 4


def test_ild_shift_on_two_ranks_of_one_host_is_a_host_fault():
    records = [drifted(r, 0.01, 1e-6, host=f"node-{r // 2}") for r in range(6)]
    records[2] = drifted(2, 0.7, host="node-1")
    records[3] = drifted(3, 0.7, host="node-1")
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.domain, verdict.evidence["kind"]) == (
        "host_fault",
        "host",
        "ild_regression",
    )


def test_no_ild_verdict_without_drift_or_while_hung():
    assert diag(*[drifted(r, 0.05, 1e-6) for r in range(4)]) == []
    hung = [
        rank(r, waiting(5), ild_ks={"host_dispatch": 0.9}, ild_wasserstein={"host_dispatch": 1.0})
        for r in range(3)
    ]
    hung.append(rank(3, done(4)))
    assert [v.kind for v in diag(*hung)] == ["hang"]


# drift values and thresholds: any in range, exactly the thresholds' defaults, or NaN (a 0/0 in a gauge)
_drift_value = st.floats(min_value=-1e-3, max_value=1.0) | st.sampled_from([0.0, 1e-7, 4e-7, math.nan])


@given(
    drift=st.builds(IldDrift, _drift_value, _drift_value, st.none() | _drift_value),
    peers=st.builds(IldPeers, st.none() | _drift_value, st.none() | _drift_value),
    policy=st.builds(
        IldPolicy,
        ks=_drift_value,
        min_wasserstein_seconds=_drift_value,
        partial_ks=_drift_value,
        far_factor=st.floats(min_value=0.0, max_value=100.0),
        op_shift_seconds=_drift_value,
    ),
)
@example(  # a partial shift that moves far: KS between partial_ks and ks
    drift=IldDrift(0.2, 1e-3, None), peers=IldPeers(1e-6, None), policy=IldPolicy()
)
def test_a_drift_counts_as_shifted_only_at_or_above_the_policy_floors(drift, peers, policy):
    """The Prometheus source reads no rank's drift when none reaches the floors: they must hold always."""
    op_shift, ks, wasserstein = policy.floors()
    if ild_shifted(drift, peers, policy):
        reaches_op_shift = drift.op_shift is not None and drift.op_shift >= op_shift
        assert reaches_op_shift or (drift.ks >= ks and not drift.wasserstein < wasserstein)


def test_every_metric_the_records_read_is_one_a_direct_scrape_asks_for():
    """A direct scrape asks the ranks for SNAPSHOT_METRICS alone and parses only those: a series the
    records read (a name records.py looks up in the spec, alone, in a tuple or in a table) but a scrape does
    not ask for would be missing from every direct diagnosis, silently."""
    read = set()
    for value in vars(records).values():
        values = value.values() if isinstance(value, dict) else value
        values = values if isinstance(values, (tuple, type({}.values()))) else (values,)
        read |= {name for name in values if isinstance(name, str) and name in spec.all_series_names()}
    assert len(read) > 30
    assert sorted(read - records.SNAPSHOT_METRICS) == []
