"""The wait-for graph (wait_for.py) and the verdicts on sends and receives that hang (diagnosis.py):
hand-built snapshots of a pipeline, pure."""

from __future__ import annotations

from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.rule_types import GroupState, InFlight, PointToPoint, RankRecord, Snapshot
from flare_exporter.engine.wait_for import wait_graph

NOW = 1_700_000_000.0
HANG = 30.0


def stage(rank: int, done: dict, issued: dict | None = None, flight=None, **fields) -> RankRecord:
    """A pipeline stage in group `world`: its sends and receives done per (direction, peer), issued (done plus
    those in flight), and in flight: one (direction, peer, age in seconds) or a list, oldest first."""
    issued = dict(issued if issued is not None else done)
    flights = [] if flight is None else flight if isinstance(flight, list) else [flight]
    for direction, peer, _ in flights if issued == done else []:
        issued[(direction, peer)] = done.get((direction, peer), 0) + 1
    in_flight = tuple((direction, peer, NOW - age) for direction, peer, age in flights)
    state = GroupState(1, 1, p2p=PointToPoint(issued, done, in_flight))
    return RankRecord(rank, groups={"world": state}, **fields)


def snapshot(*records: RankRecord) -> Snapshot:
    return Snapshot({record.rank: record for record in records}, NOW, run="pp", world_size=len(records))


def four_stages_with_stage_2_stuck() -> list[RankRecord]:
    """Stage 2 stopped in its own code after 10 microbatches: stage 1's 11th send to it and stage 3's 11th
    receive from it wait; stage 0 waits in its send to stage 1, which is blocked."""
    return [
        stage(0, {("send", 1): 11}, flight=("send", 1, 50)),
        stage(1, {("recv", 0): 11, ("send", 2): 10}, flight=("send", 2, 60)),
        stage(2, {("recv", 1): 10, ("send", 3): 10}, frames="t.py:9 stuck_in_stage_code", activity="compute"),
        stage(3, {("recv", 2): 10}, flight=("recv", 2, 61)),
    ]


def test_a_stage_that_never_issues_its_side_is_the_one_culprit_of_every_waiting_stage():
    [verdict] = diagnose(snapshot(*four_stages_with_stage_2_stuck()), HANG)
    assert (verdict.kind, verdict.ranks, verdict.group) == ("hang", (2,), "world")
    assert verdict.evidence["held_up"] == [0, 1, 3] and verdict.evidence["roles"] == {"world": "world"}
    assert "stuck_in_stage_code" in verdict.summary
    edges = {(edge["rank"], edge["waits_on"], edge["in"]) for edge in verdict.evidence["wait_for"]}
    assert edges == {(0, 1, "send"), (1, 2, "send"), (3, 2, "recv")}


def test_a_stage_waiting_in_a_receive_behind_an_older_unfinished_send_waits_for_that_receive():
    """GPipe's backward: stage 1 sent microbatch 0's gradient to stage 0 (that send is waited only at the end
    of the step, so it is older and unfinished) and waits to receive microbatch 1's from stage 2, which is
    stuck. Judging stage 1 by its oldest op alone (matched by stage 0) named it the culprit."""
    records = [
        stage(0, {("recv", 1): 1}, flight=("recv", 1, 40)),
        stage(1, {("send", 0): 0, ("recv", 2): 1}, flight=[("send", 0, 45), ("recv", 2, 41)]),
        stage(2, {("send", 1): 1}, frames="t.py:9 stuck_in_stage_code", activity="compute"),
    ]
    [verdict] = diagnose(snapshot(*records), HANG)
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    edges = {(edge["rank"], edge["waits_on"], edge["in"]) for edge in verdict.evidence["wait_for"]}
    assert edges == {(0, 1, "recv"), (1, 2, "recv")}  # stage 1's send to 0: inside the transfer, no edge


def test_a_wait_shorter_than_the_threshold_is_no_verdict():
    records = four_stages_with_stage_2_stuck()
    young = [stage(r.rank, r.groups["world"].p2p.completed, r.groups["world"].p2p.issued) for r in records]
    young[3] = stage(3, {("recv", 2): 10}, flight=("recv", 2, 5))
    assert diagnose(snapshot(*young), HANG) == []


def test_two_stages_that_both_send_first_are_a_deadlock_of_exactly_them():
    records = [
        stage(0, {("send", 1): 4}, flight=("send", 1, 40)),
        stage(1, {("recv", 0): 4, ("send", 2): 3}, flight=("send", 2, 45)),
        stage(2, {("recv", 1): 3, ("send", 1): 3}, flight=("send", 1, 45)),
        stage(3, {("recv", 2): 3}, flight=("recv", 2, 44)),
    ]
    [verdict] = diagnose(snapshot(*records), HANG)
    assert (verdict.kind, verdict.ranks, verdict.cause) == ("hang", (1, 2), "deadlock")
    assert verdict.evidence["cycle"] == [1, 2] and verdict.evidence["held_up"] == [0, 3]
    assert verdict.summary.startswith("deadlock: ranks 1, 2 wait for each other")


def test_a_transfer_both_sides_issued_points_at_neither():
    # stage 1's send and stage 2's receive are the same transfer: 2 issued its 4th receive from 1
    records = [
        stage(1, {("send", 2): 3}, flight=("send", 2, 60)),
        stage(2, {("recv", 1): 3}, flight=("recv", 1, 60)),
    ]
    graph = wait_graph(snapshot(*records), [1, 2])
    assert graph.edges == [] and graph.ends == [1, 2] and graph.cycles == []


def test_a_receive_waits_for_a_peer_that_sent_fewer_times():
    records = [
        stage(1, {("send", 2): 3}),  # idle, computing: sent 3, the receiver waits for a 4th
        stage(2, {("recv", 1): 3}, flight=("recv", 1, 60)),
    ]
    graph = wait_graph(snapshot(*records), [2])
    assert [(edge.rank, edge.waits_on, edge.how) for edge in graph.edges] == [(2, 1, "recv")]
    assert graph.ends == [1]


def test_a_chain_through_a_gone_stage_is_the_rank_down_verdict_alone():
    records = four_stages_with_stage_2_stuck()
    records[2] = RankRecord(2, up=False, down_reason="connection refused")
    verdicts = diagnose(snapshot(*records), HANG)
    assert [(verdict.kind, verdict.ranks) for verdict in verdicts] == [("rank_down", (2,))]


def test_a_long_chain_is_followed_without_recursion():
    ranks = 3000  # a pipeline this deep does not exist; the graph's walk must not care
    records = [stage(r, {("send", r + 1): 1}, flight=("send", r + 1, 60)) for r in range(ranks - 1)]
    records.append(stage(ranks - 1, {("recv", ranks - 2): 1}))
    graph = wait_graph(snapshot(*records), range(ranks - 1))
    assert graph.ends == [ranks - 1] and len(graph.edges) == ranks - 1


def test_one_verdict_per_culprit_lists_every_group_it_holds_up_with_their_mesh_roles():
    """FSDP2 with tensor parallel on a 2x2 mesh: rank 2, stuck in its own code, holds up its tp group (rank 3)
    and its dp group (rank 0), and through rank 0 the other tp group (rank 1): one verdict, three groups."""

    def waiting(seq: int) -> GroupState:
        return GroupState(seq, seq - 1, InFlight("allgather_base", seq, 64, "started", NOW - 60))

    def done(seq: int) -> GroupState:
        return GroupState(seq, seq)

    dp_a, dp_b, tp_a, tp_b = "mesh_dp-aaaa0000", "mesh_dp-bbbb1111", "mesh_tp-cccc2222", "mesh_tp-dddd3333"
    records = [
        RankRecord(0, groups={dp_a: waiting(9), tp_a: done(6)}),
        RankRecord(1, groups={dp_b: done(9), tp_a: waiting(7)}),
        RankRecord(2, groups={dp_a: done(8), tp_b: done(6)}, frames="t.py:3 stuck_in_parallel_code"),
        RankRecord(3, groups={dp_b: done(9), tp_b: waiting(7)}),
    ]
    [verdict] = diagnose(snapshot(*records), HANG)
    assert (verdict.kind, verdict.ranks) == ("hang", (2,))
    assert verdict.evidence["groups"] == [dp_a, tp_a, tp_b]
    assert verdict.evidence["roles"] == {dp_a: "dp", tp_a: "tp", tp_b: "tp"}
