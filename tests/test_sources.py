"""Snapshots from a real Prometheus, in rounds: as many queries whatever the number of ranks, the detail of
the named ranks only, and the same verdicts as when everything of every rank is read at once.

Two virtual clusters (flare_exporter.testing.virtual_cluster: every rank's page rendered by flare's own
collectors) of different sizes, each its own run, scraped every second by one Prometheus.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import flare_json

from flare_exporter import diagnosis, promql, sources, spec
from flare_exporter.prometheus_process import PrometheusProcess, wait_for
from flare_exporter.testing import virtual_cluster as vc

HANG_SECONDS = 30.0


@dataclass
class Cluster:
    run: str
    ranks: int
    straggler: int
    hung: int
    server: vc.ClusterServer
    hung_pages: list[bytes]


@dataclass
class Clusters:
    prometheus: PrometheusProcess
    small: Cluster
    large: Cluster


def await_count(prometheus: PrometheusProcess, expr: str, count: int) -> None:
    """Wait until the query `count(...)` `expr` answers `count`."""

    def reached() -> bool:
        answer = prometheus.query(expr)
        return bool(answer) and int(float(answer[0]["value"][1])) == count

    wait_for(reached, 60, f"{expr} == {count}")


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    """8 and 24 virtual ranks, a straggler in each (its GPU throttles), pages ready to hang one rank."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    work = tmp_path_factory.mktemp("sources")
    targets = str(work / "targets")
    built = []
    with contextlib.ExitStack() as servers:
        for run, ranks in (("rounds-small", 8), ("rounds-large", 24)):
            straggler, hung = ranks * 3 // 8, ranks * 5 // 8
            healthy, later, hung_pages = vc.render_phases(ranks, run, straggler, hung)
            server = servers.enter_context(vc.ClusterServer(healthy))
            vc.write_file_sd(targets, run, server.targets(), ranks)
            built.append((Cluster(run, ranks, straggler, hung, server, hung_pages), later))
        with PrometheusProcess(str(work / "prometheus"), targets) as prometheus:
            for cluster, later in built:
                await_count(prometheus, f'count(flare_rank_info{{run="{cluster.run}"}})', cluster.ranks)
                cluster.server.set_pages(later)  # the job makes progress: step counts increase
            for cluster, _ in built:
                steps = f'flare_step_duration_seconds_count{{run="{cluster.run}"}}'
                await_count(prometheus, f"count(increase({steps}[5m]) > 0)", cluster.ranks)
            yield Clusters(prometheus, built[0][0], built[1][0])


def test_every_metric_a_snapshot_reads_is_in_the_spec_and_asked_of_prometheus():
    assert sources.SNAPSHOT_METRICS - {"up"} <= spec.all_series_names()
    queries = " ".join(sources.PROMETHEUS_QUERIES.values())
    assert [name for name in sorted(sources.SNAPSHOT_METRICS) if name not in queries] == []
    # a direct scrape parses only those: no histogram buckets, no GPU series the rules never read
    assert not sources.read_by_snapshot("flare_collective_duration_seconds_bucket")
    assert not sources.read_by_snapshot("flare_gpu_power_watts")


def culprits(snapshot: diagnosis.Snapshot) -> set[int]:
    return {rank for verdict in diagnosis.diagnose(snapshot, HANG_SECONDS) for rank in verdict.ranks}


def in_rounds(url: str, run: str, monkeypatch: pytest.MonkeyPatch) -> tuple[diagnosis.Snapshot, list[str]]:
    """from_prometheus with the rules naming the detailed ranks, and every query it sent (to Prometheus)."""
    sent: list[str] = []
    query = promql.query

    def recorded(base_url: str, expr: str, *args: object) -> list:
        sent.append(expr)
        return query(base_url, expr, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(promql, "query", recorded)
    snapshot = sources.from_prometheus(url, run, detail_for=culprits)
    monkeypatch.setattr(promql, "query", query)
    return snapshot, sent


def test_as_many_queries_whatever_the_ranks_and_detail_only_of_the_named_ranks(clusters, monkeypatch):
    url = clusters.prometheus.url
    sent_by_run = {}
    for cluster in (clusters.small, clusters.large):
        snapshot, sent = in_rounds(url, cluster.run, monkeypatch)
        verdicts = diagnosis.diagnose(snapshot, HANG_SECONDS)
        assert [(v.kind, v.ranks) for v in verdicts] == [("straggler", (cluster.straggler,))]
        sent_by_run[cluster.run] = sent
        # faults and pace of every rank, then the detail of the straggler alone
        state = len(sources.FAULT_QUERIES) + len(sources.PACE_QUERIES)
        assert len(sent) == state + len(sources.DETAIL_QUERIES)
        assert not any("rank=~" in expr for expr in sent[:state])
        assert all(f'rank=~"{cluster.straggler}"' in expr for expr in sent[state:])
        assert snapshot.ranks[cluster.straggler].gpu is not None
        assert all(
            record.gpu is None for record in snapshot.ranks.values() if record.rank != cluster.straggler
        )
    assert len(sent_by_run["rounds-small"]) == len(sent_by_run["rounds-large"])


def test_a_straggler_verdict_is_the_same_in_rounds_as_all_at_once_with_its_gpu_reason(clusters, monkeypatch):
    cluster = clusters.large
    snapshot, _ = in_rounds(clusters.prometheus.url, cluster.run, monkeypatch)
    in_rounds_verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    everything = sources.from_prometheus(clusters.prometheus.url, cluster.run)
    assert in_rounds_verdicts == [v.to_json() for v in diagnosis.diagnose(everything, HANG_SECONDS)]
    # the throttled GPU, read in round 2 only, is in the verdict
    assert "hw_thermal_slowdown" in in_rounds_verdicts[0]["evidence"]["hardware"][str(cluster.straggler)]
    assert "hw_thermal_slowdown" in in_rounds_verdicts[0]["summary"]


def test_a_hang_names_the_culprit_with_its_frames_and_the_views_read_every_rank(clusters, monkeypatch):
    cluster = clusters.small
    cluster.server.set_pages(vc.hung_at(cluster.hung_pages, time.time() - 2 * HANG_SECONDS))
    in_flight = f'count(flare_collective_in_flight_info{{run="{cluster.run}"}})'
    await_count(clusters.prometheus, in_flight, cluster.ranks - 1)
    # each target is scraped at its own offset: the hung rank's stack sample may come after the others' hang
    stack = f'count(flare_rank_stack_info{{run="{cluster.run}", rank="{cluster.hung}", activity="compute"}})'
    await_count(clusters.prometheus, stack, 1)
    snapshot, sent = in_rounds(clusters.prometheus.url, cluster.run, monkeypatch)
    # no pace round: a hang is found from the faults alone
    assert len(sent) == len(sources.FAULT_QUERIES) + len(sources.DETAIL_QUERIES)
    (verdict,) = diagnosis.diagnose(snapshot, HANG_SECONDS)
    assert (verdict.kind, verdict.ranks, verdict.group) == ("hang", (cluster.hung,), "world")
    assert "model.py:212 forward" in verdict.summary  # the stack sample, read in the detail round
    everything = sources.from_prometheus(clusters.prometheus.url, cluster.run)
    (same,) = diagnosis.diagnose(everything, HANG_SECONDS)
    assert (same.kind, same.ranks, same.group) == (verdict.kind, verdict.ranks, verdict.group)
    assert without_ages(same.evidence["culprits"]) == without_ages(verdict.evidence["culprits"])
    # the CLI: the same verdict; `flare ranks` shows what every rank is doing
    url, run = clusters.prometheus.url, cluster.run
    code, report = flare_json("diagnose", "--prometheus", url, "--run", run, "--hang-seconds", "30")
    assert [(v["kind"], v["ranks"]) for v in report["verdicts"]] == [("hang", [cluster.hung])]
    assert "model.py:212 forward" in report["verdicts"][0]["summary"]
    code, report = flare_json("ranks", "--prometheus", url, "--run", run, "--hang-seconds", "30")
    assert {row["activity"] for row in report["ranks"]} == {"compute", "collective"}


def without_ages(culprits: dict) -> dict:
    return {
        rank: {name: value for name, value in found.items() if name != "heartbeat_age_seconds"}
        for rank, found in culprits.items()
    }


def test_a_dead_rank_is_the_same_verdict_in_rounds_as_all_at_once(clusters, monkeypatch):
    cluster = clusters.large
    dead = cluster.ranks - 1
    cluster.server.kill(dead)
    await_count(clusters.prometheus, f'count(up{{run="{cluster.run}", rank="{dead}"}} == 0)', 1)
    snapshot, sent = in_rounds(clusters.prometheus.url, cluster.run, monkeypatch)
    assert len(sent) == len(sources.FAULT_QUERIES) + len(sources.DETAIL_QUERIES)
    in_rounds_verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    everything = sources.from_prometheus(clusters.prometheus.url, cluster.run)
    assert in_rounds_verdicts == [v.to_json() for v in diagnosis.diagnose(everything, HANG_SECONDS)]
    assert [(v["kind"], v["ranks"]) for v in in_rounds_verdicts] == [("rank_down", [dead])]
    assert "target down" in in_rounds_verdicts[0]["summary"]
