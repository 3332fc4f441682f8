"""The hardware canary where flare answers: the `canary` verdict of `flare diagnose` (engine/canary.py,
diagnosis.canary_verdicts), the view `flare canary`, and the MCP tools `canary` and `perf`.

Hand-built snapshots for the rules; then a virtual cluster of 16 ranks on two hosts whose pages are rendered
by the ranks' own collectors from canary states set as rank/canary.py leaves them (rank 5 slow at compute,
the link within host node-1 slow, rank 2's storage slow, rank 3's compute drifting in flight), read by a
direct scrape and by a real Prometheus.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import flare_json, queries_sent

from flare_exporter import spec
from flare_exporter.config import Config
from flare_exporter.engine import (
    canary,
    cli,
    mcp_policy,
    mcp_server,
    prometheus_source,
    records,
    verdict_causes,
)
from flare_exporter.engine.canary import CanaryReading, CanaryState
from flare_exporter.engine.diagnosis import diagnose
from flare_exporter.engine.rule_types import GroupState, InFlight, RankRecord, Snapshot
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.rank.canary import Canary, CanarySnapshot
from flare_exporter.rank.perf import PerfMonitor

NOW = 1_700_000_000.0
GEMM, BUSBW, STORAGE = ("gemm_flops", "device"), ("allreduce_busbw", "intra_host"), ("storage_read", "path0")

# ---------------------------------------------------------------------------------------------------------
# the rules, over hand-built records


def reading(value: float, median: float = 1e10, **fields: Any) -> CanaryReading:
    return CanaryReading(preflight=value, relative=value / median, **fields)


def ranked(rank: int, host: str, **readings: CanaryReading) -> RankRecord:
    keys = {"gemm": GEMM, "busbw": BUSBW, "storage": STORAGE, "inter": ("allreduce_busbw", "inter_host")}
    state = CanaryState({keys[name]: value for name, value in readings.items()}, passed=False)
    return RankRecord(rank, host=host, canary=state)


def verdicts_of(*records: RankRecord) -> list[dict[str, Any]]:
    snapshot = Snapshot({record.rank: record for record in records}, NOW, "r", len(records))
    return [verdict.to_json() for verdict in diagnose(snapshot, 30.0)]


def test_a_rank_that_failed_its_preflight_is_named_with_its_value_and_the_jobs_median():
    healthy = [ranked(rank, f"node-{rank // 2}", gemm=reading(1e10)) for rank in (0, 1, 3)]
    (verdict,) = verdicts_of(*healthy, ranked(2, "node-1", gemm=reading(2.5e9, failed=("preflight",))))
    assert (verdict["kind"], verdict["ranks"], verdict["domain"], verdict["cause"]) == (
        "canary",
        [2],
        "rank",
        "straggler",
    )
    assert verdict["summary"] == (
        "rank 2 (host node-1): failed the canary's gemm_flops [device] before the first step: "
        "2.5e+09 FLOP/s, 0.25 of the job's median 1e+10 FLOP/s"
    )
    evidence = verdict["evidence"]
    assert (evidence["check"], evidence["measurement"], evidence["scope"]) == ("preflight", *GEMM)
    assert evidence["ranks"]["2"] == {
        "host": "node-1",
        "value": 2.5e9,
        "baseline": 1e10,
        "preflight_value": 2.5e9,
        "in_flight_value": None,
        "relative": 0.25,
        "job_median": 1e10,
        "ewma_ratio": None,
        "also_failed": [],
    }


def test_several_ranks_of_one_host_failing_one_measurement_name_the_host_not_a_host_fault():
    slow = reading(3e9, failed=("preflight",))
    records = [ranked(0, "a", gemm=slow), ranked(1, "a", gemm=slow), ranked(2, "b", gemm=reading(1e10))]
    records.append(ranked(3, "c", gemm=slow))  # alone on its host: named as a rank
    host, alone = verdicts_of(*records)
    assert (host["kind"], host["domain"], host["ranks"], host["evidence"]["host"]) == (
        "canary",
        "host",
        [0, 1],
        "a",
    )
    assert host["summary"].startswith("host a (ranks 0, 1): failed the canary's gemm_flops [device]")
    assert (alone["domain"], alone["ranks"]) == ("rank", [3])


def test_bus_bandwidth_names_the_link_within_a_host_or_across_hosts_as_communication():
    slow_link = reading(2e8, median=1e9, failed=("preflight",))
    records = [ranked(rank, "a", busbw=reading(1e9, median=1e9)) for rank in (0, 1)]
    records += [ranked(rank, "b", busbw=slow_link) for rank in (2, 3)]
    records += [ranked(rank, "c", busbw=slow_link) for rank in (4, 5)]
    records += [ranked(6, "d", inter=slow_link), ranked(7, "e", inter=slow_link)]
    found = verdicts_of(*records)
    assert [(v["domain"], v["ranks"], v["evidence"]["host"], v["cause"]) for v in found] == [
        ("link", [2, 3], "b", "communication"),
        ("link", [4, 5], "c", "communication"),
        ("link", [6, 7], None, "communication"),
    ]
    assert found[0]["summary"].startswith("the intra-host link of host b (ranks 2, 3): failed")
    assert found[2]["summary"].startswith("the inter-host link of hosts d, e (ranks 6, 7): failed")


def test_a_rank_slow_at_compute_is_named_for_compute_and_a_slow_mount_alone_for_storage():
    slow_storage = reading(1e7, median=1e9, failed=("preflight",))
    whole = ranked(0, "a", gemm=reading(2e9, failed=("preflight",)), storage=slow_storage)
    mount = ranked(1, "b", gemm=reading(1e10), storage=slow_storage)
    compute, storage = verdicts_of(whole, mount, ranked(2, "c", gemm=reading(1e10)))
    assert (compute["ranks"], compute["evidence"]["measurement"], compute["cause"]) == (
        [0],
        "gemm_flops",
        "straggler",
    )
    assert compute["evidence"]["ranks"]["0"]["also_failed"] == ["storage_read [path0] preflight"]
    assert (storage["ranks"], storage["evidence"]["measurement"], storage["cause"]) == (
        [1],
        "storage_read",
        "storage",
    )


def test_in_flight_checks_and_drift_are_judged_against_the_ranks_own_preflight():
    dropped = reading(1e10, in_flight=4e9, ewma_ratio=0.7, failed=("in_flight",), drift=True)
    drifting = reading(1e10, in_flight=8e9, ewma_ratio=0.75, drift=True)
    in_flight, drift = verdicts_of(ranked(0, "a", gemm=dropped), ranked(1, "b", gemm=drifting))
    assert (in_flight["ranks"], in_flight["evidence"]["check"]) == ([0], "in_flight")
    assert in_flight["evidence"]["ranks"]["0"]["also_failed"] == ["gemm_flops [device] drift"]
    assert in_flight["summary"] == (
        "rank 0 (host a): its in-flight gemm_flops [device] measured 4e+09 FLOP/s, 0.40 of its preflight "
        "1e+10 FLOP/s"
    )
    assert (drift["ranks"], drift["evidence"]["check"]) == ([1], "drift")
    assert drift["evidence"]["ranks"]["1"]["value"] == pytest.approx(7.5e9)
    assert drift["evidence"]["ranks"]["1"]["baseline"] == 1e10
    assert "moving average at 0.75 of its preflight 1e+10 FLOP/s" in drift["summary"]


def test_a_canary_verdict_masks_neither_a_hang_nor_a_gone_rank_and_names_no_gone_rank():
    stuck = InFlight("allreduce", 8, 8, "started", NOW - 60)
    slow = reading(2e9, failed=("preflight",))
    records = [
        RankRecord(0, host="a", groups={"world": GroupState(8, 7, stuck)}, canary=CanaryState({GEMM: slow})),
        RankRecord(1, host="a", groups={"world": GroupState(7, 7)}, canary=CanaryState({GEMM: slow})),
        RankRecord(2, host="b", groups={"world": GroupState(8, 7, stuck)}),
        RankRecord(3, host="b", up=False, down_reason="refused", canary=CanaryState({GEMM: slow})),
    ]
    kinds = [(v["kind"], v["ranks"], v["domain"]) for v in verdicts_of(*records)]
    assert kinds == [("rank_down", [3], "rank"), ("canary", [0, 1], "host")]
    records[3] = RankRecord(3, host="b", groups={"world": GroupState(8, 7, stuck)})
    kinds = [(v["kind"], v["ranks"], v["domain"]) for v in verdicts_of(*records)]
    assert kinds == [("hang", [1], "rank"), ("canary", [0, 1], "host")]


def test_a_straggler_is_still_judged_beside_a_canary_verdict():
    def worker(rank: int, wait: float, **fields: Any) -> RankRecord:
        return RankRecord(rank, step_count=20, step_seconds=20.0, collective_seconds=wait * 20, **fields)

    waits = [0.40, 0.42, 0.41, 0.05, 0.43, 0.39]
    records = [worker(rank, wait) for rank, wait in enumerate(waits)]
    records[3] = worker(3, 0.05, canary=CanaryState({GEMM: reading(2e9, failed=("preflight",))}))
    assert [(v["kind"], v["ranks"]) for v in verdicts_of(*records)] == [("straggler", [3]), ("canary", [3])]


def test_the_canary_cause_follows_the_measurement():
    for measurement, cause in [
        ("gemm_flops", "straggler"),
        ("allgather_busbw", "communication"),
        ("storage_read", "storage"),
        ("d2h_copy", "straggler"),
        ("gpu_clock_ok", "straggler"),
    ]:
        assert verdict_causes.cause_of("canary", "rank", [], {"measurement": measurement}) == cause


def test_records_read_the_canary_series_and_a_healthy_canary_is_no_verdict():
    def row(rank: int, value: float, **labels: str) -> tuple[dict[str, str], float]:
        return {"rank": str(rank), "run": "r", **labels}, value

    series: dict[str, records.Series] = {
        "flare_rank_info": [row(rank, 1, host="h", world_size="2") for rank in (0, 1)],
        "flare_canary_value": [
            row(0, 1e10, measurement="gemm_flops", scope="device", phase="preflight"),
            row(0, 9e9, measurement="gemm_flops", scope="device", phase="in_flight"),
            row(1, 3e9, measurement="gemm_flops", scope="device", phase="preflight"),
        ],
        "flare_canary_relative": [row(0, 1.5, measurement="gemm_flops", scope="device")],
        "flare_canary_failed": [
            row(0, 0, measurement="gemm_flops", scope="device", phase="preflight"),
            row(0, 0, measurement="gemm_flops", scope="device", phase="in_flight"),
            row(1, 1, measurement="gemm_flops", scope="device", phase="preflight"),
        ],
        "flare_canary_ewma_ratio": [row(0, 0.9, measurement="gemm_flops", scope="device")],
        "flare_canary_drift": [row(0, 0, measurement="gemm_flops", scope="device")],
        "flare_canary_preflight_passed": [row(0, 0), row(1, 0)],
    }
    snapshot = records.build_snapshot(series, {}, NOW, "r")
    assert snapshot.ranks[0].canary == CanaryState(
        {GEMM: CanaryReading(1e10, 9e9, 1.5, (), 0.9, False)}, False
    )
    assert snapshot.ranks[1].canary == CanaryState({GEMM: CanaryReading(3e9, failed=("preflight",))}, False)
    assert set(canary.METRICS) <= records.SNAPSHOT_METRICS  # a direct scrape asks the ranks for them
    # read from the spec: every canary metric but the canary's bookkeeping, which the spec declares too
    assert set(canary.METRICS) == set(series) - {"flare_rank_info"}
    assert set(canary.BOOKKEEPING) <= set(spec.BY_NAME)
    (verdict,) = diagnose(snapshot, 30.0)
    assert (verdict.kind, verdict.ranks) == ("canary", (1,))
    assert "3e+09 FLOP/s" in verdict.summary and "median" not in verdict.summary  # no relative: no median
    del series["flare_canary_failed"][2]
    assert diagnose(records.build_snapshot(series, {}, NOW, "r"), 30.0) == []


# ---------------------------------------------------------------------------------------------------------
# a virtual cluster: 16 ranks on node-0 (0-7) and node-1 (8-15), pages rendered by the ranks' collectors

WORLD, RUN = 16, "canary-cluster"
SLOW_RANK, SLOW_STORAGE, DRIFTING = 5, 2, 3
SLOW_LINK_RANKS = list(range(8, 16))  # node-1


def measured(rank: int, faulty: bool) -> dict[tuple[str, str], float]:
    """The rank's preflight values, distinct per rank (a bottom few well defined); the faults if `faulty`."""
    spread = 1 + 0.01 * rank
    gemm = 2.5e9 if faulty and rank == SLOW_RANK else 1e10 * spread
    busbw = 2e8 * spread if faulty and rank in SLOW_LINK_RANKS else 1e9 * spread
    storage = 1e7 if faulty and rank == SLOW_STORAGE else 5e8 * spread
    return {GEMM: gemm, BUSBW: busbw, STORAGE: storage}


def canary_snapshots(faulty: bool) -> list[CanarySnapshot]:
    """Every rank's canary as rank/canary.py leaves it after its preflight (floor 0.5 of the job's median)
    and in-flight runs (band 0.2 below the preflight value)."""
    values = [measured(rank, faulty) for rank in range(WORLD)]
    medians = {key: statistics.median(found[key] for found in values) for key in values[0]}
    snapshots = []
    for rank, found in enumerate(values):
        relative = {key: value / medians[key] for key, value in found.items()}
        failed = {(*key, "preflight") for key, ratio in relative.items() if ratio < 0.5}
        ewma = 0.75 if faulty and rank == DRIFTING else 1 - 0.001 * rank
        snapshots.append(
            CanarySnapshot(
                preflight=found,
                relative=relative,
                failed=frozenset(failed),
                passed=not faulty,
                in_flight={GEMM: found[GEMM] * ewma},
                ewma_ratio={GEMM: ewma},
                drift={GEMM: ewma < 0.8},
                runs={"preflight": 1, "in_flight": 3},
                durations={"preflight": 0.8, "in_flight": 0.1},
            )
        )
    return snapshots


def pages(faulty: bool) -> list[bytes]:
    found = []
    perf_now = time.perf_counter()
    for rank, snapshot in enumerate(canary_snapshots(faulty)):
        state = vc.rank_state(rank, WORLD, RUN, perf_now)
        state.canary = Canary(
            Config(canary="warn"), lambda state=state: state.identity, state.health, lambda: 0
        )
        state.canary.snapshot = snapshot
        state.perf = PerfMonitor(None, Config(model_flops_per_step=1e9, peak_flops=1e11))
        for step in (2, 3, 4):  # a step breakdown for `flare perf`: 0.125 s steps, 40 ms in collectives
            state.perf.on_step(step, 0.125, 0.04)
        found.append(vc.render(state))
    return found


EXPECTED = [  # (domain, ranks, measurement, check, cause), most severe first
    ("rank", [SLOW_RANK], "gemm_flops", "preflight", "straggler"),
    ("link", SLOW_LINK_RANKS, "allreduce_busbw", "preflight", "communication"),
    ("rank", [SLOW_STORAGE], "storage_read", "preflight", "storage"),
    ("rank", [DRIFTING], "gemm_flops", "drift", "straggler"),
]


def canary_verdicts(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (v["domain"], v["ranks"], v["evidence"]["measurement"], v["evidence"]["check"], v["cause"])
        for v in report["verdicts"]
        if v["kind"] == "canary"
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[vc.ClusterServer, str]]:
    """The faulty cluster served, and its file_sd directory."""
    directory = str(tmp_path_factory.mktemp("canary_targets"))
    with vc.ClusterServer(pages(faulty=True)) as server:
        vc.write_file_sd(directory, RUN, server.targets(), WORLD)
        yield server, directory


def test_diagnose_over_a_direct_scrape_names_the_rank_the_link_the_storage_and_the_drift(cluster):
    _, targets = cluster
    code, report = flare_json("diagnose", "--targets", targets)
    assert code == cli.EXIT_ANOMALY and report["ranks_seen"] == WORLD
    assert canary_verdicts(report) == EXPECTED, report["verdicts"]
    slow = report["verdicts"][[v["kind"] for v in report["verdicts"]].index("canary")]
    assert slow["summary"].startswith(f"rank {SLOW_RANK} (host node-0): failed the canary's gemm_flops")
    link = next(v for v in report["verdicts"] if v["domain"] == "link")
    assert link["evidence"]["host"] == "node-1" and "intra-host link of host node-1" in link["summary"]
    # the views about other things show none of them
    _, hang = flare_json("hang", "--targets", targets)
    assert [v["kind"] for v in hang["verdicts"]] == []


def test_flare_canary_shows_every_rank_and_measurement_failing_first(cluster, capsys):
    _, targets = cluster
    code, report = flare_json("canary", "--targets", targets)
    assert code == cli.EXIT_ANOMALY
    assert (report["preflight_passed"], report["every_rank"]) == (False, True)
    assert canary_verdicts(report) == EXPECTED
    rows = report["canary"]
    assert len(rows) == WORLD * 3
    assert set(rows[0]) == {
        "rank", "host", "measurement", "scope", "preflight_value", "relative", "in_flight_value",
        "ewma_ratio", "failed", "drift",
    }  # fmt: skip
    flagged = {(row["rank"], row["measurement"]) for row in rows if row["failed"] or row["drift"]}
    assert flagged == {
        (SLOW_RANK, "gemm_flops"),
        (SLOW_STORAGE, "storage_read"),
        (DRIFTING, "gemm_flops"),
        *((rank, "allreduce_busbw") for rank in SLOW_LINK_RANKS),
    }
    assert {(row["rank"], row["measurement"]) for row in rows[: len(flagged)]} == flagged
    slow = next(row for row in rows if (row["rank"], row["measurement"]) == (SLOW_RANK, "gemm_flops"))
    assert slow["failed"] == ["preflight"] and slow["relative"] < 0.25
    drifting = next(row for row in rows if (row["rank"], row["measurement"]) == (DRIFTING, "gemm_flops"))
    assert (drifting["failed"], drifting["drift"], drifting["ewma_ratio"]) == ([], True, 0.75)
    # for people: the preflight's outcome, a row per rank and measurement, the verdicts
    assert cli.main(["canary", "--targets", targets]) == cli.EXIT_ANOMALY
    text = capsys.readouterr().out
    assert "preflight: failed" in text and f"CANARY (rank: rank {SLOW_RANK})" in text
    assert f"\n{DRIFTING:>5} node-0" in text and "drift" in text


def test_a_healthy_canary_is_no_verdict(tmp_path):
    with vc.ClusterServer(pages(faulty=False)) as server:
        vc.write_file_sd(str(tmp_path), RUN, server.targets(), WORLD)
        _, report = flare_json("diagnose", "--targets", str(tmp_path))
        assert canary_verdicts(report) == []
        code, report = flare_json("canary", "--targets", str(tmp_path))
    assert (code, report["preflight_passed"], len(report["canary"])) == (cli.EXIT_OK, True, WORLD * 3)


def test_the_mcp_tools_canary_and_perf_answer_as_the_commands(cluster, tmp_path_factory):
    _, targets = cluster
    policy = mcp_policy.policy([str(tmp_path_factory.getbasetemp())], {})
    failed, texts, found = mcp_server.call(cli.answer, "canary", {"targets": targets, "timeout": 2}, policy)
    assert not failed and canary_verdicts(found) == EXPECTED
    _, printed = flare_json("canary", "--targets", targets)
    assert found["canary"] == printed["canary"]
    failed, _, found = mcp_server.call(cli.answer, "perf", {"targets": targets}, policy)
    assert not failed and (found["run"], found["ranks_seen"]) == (RUN, WORLD)
    _, printed = flare_json("perf", "--targets", targets)
    assert found.keys() == printed.keys()
    # perf judges nothing: it takes no threshold, no post-mortem source
    failed, texts, _ = mcp_server.call(cli.answer, "perf", {"targets": targets, "hang_seconds": 3}, policy)
    assert failed and "no argument 'hang_seconds'" in texts[0]


# ---------------------------------------------------------------------------------------------------------
# the same cluster scraped by a real Prometheus


def canary_queries(sent: list[str]) -> list[str]:
    return [expr for expr in sent if "flare_canary" in expr]


@pytest.mark.prometheus
def test_from_prometheus_the_same_verdicts_in_one_more_query_and_the_view_bounded(
    cluster, tmp_path, monkeypatch
):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    _, targets = cluster
    _, direct = flare_json("diagnose", "--targets", targets)
    _, direct_view = flare_json("canary", "--targets", targets)
    with PrometheusProcess(str(tmp_path / "prometheus"), targets) as prometheus:

        def count(expr: str) -> int:
            answer = prometheus.query(f"count({expr})")
            return int(float(answer[0]["value"][1])) if answer else 0

        flagged = f'flare_canary_failed{{run="{RUN}"}} == 1 or flare_canary_drift{{run="{RUN}"}} == 1'
        wait_for(lambda: count(f'flare_rank_info{{run="{RUN}"}}') == WORLD, 60, "every rank scraped")
        wait_for(lambda: count(flagged) == len(SLOW_LINK_RANKS) + 3, 60, "every failed check scraped")
        url = prometheus.url
        with queries_sent(monkeypatch) as sent:
            code, report = flare_json("diagnose", "--prometheus", url)
        assert code == cli.EXIT_ANOMALY and canary_verdicts(report) == EXPECTED
        assert [v["summary"] for v in report["verdicts"]] == [v["summary"] for v in direct["verdicts"]]
        assert canary_queries(sent) == [
            prometheus_source.CANARY_FAILING_QUERY.replace("{sel", f'{{run="{RUN}"')
        ]

        with queries_sent(monkeypatch) as sent:
            code, view = flare_json("canary", "--prometheus", url)
        assert code == cli.EXIT_ANOMALY and view["every_rank"] and len(canary_queries(sent)) == 2
        assert sorted(view["canary"], key=row_key) == sorted(direct_view["canary"], key=row_key)

        # beyond CANARY_EVERY_RANK ranks: the failing ranks, and the bottom few of each measurement
        monkeypatch.setattr(prometheus_source, "CANARY_EVERY_RANK", WORLD - 1)
        code, view = flare_json("canary", "--prometheus", url)
    assert not view["every_rank"] and canary_verdicts(view) == EXPECTED
    shown = {row["rank"] for row in view["canary"]}
    assert shown == bottom_few(direct_view["canary"]) and len(shown) < WORLD


def row_key(row: dict[str, Any]) -> tuple[int, str, str]:
    return row["rank"], row["measurement"], row["scope"]


def bottom_few(rows: list[dict[str, Any]]) -> set[int]:
    """The ranks that failed or drift, and the CANARY_BOTTOM lowest of each measurement and scope by their
    share of the job's median and by their moving average."""
    shown = {row["rank"] for row in rows if row["failed"] or row["drift"]}
    for key in {(row["measurement"], row["scope"]) for row in rows}:
        of_key = [row for row in rows if (row["measurement"], row["scope"]) == key]
        for figure in ("relative", "ewma_ratio"):
            ranked = sorted((row[figure], row["rank"]) for row in of_key if row[figure] is not None)
            shown |= {rank for _, rank in ranked[: prometheus_source.CANARY_BOTTOM]}
    return shown
