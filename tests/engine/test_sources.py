"""Snapshots from a real Prometheus, in rounds: as many queries whatever the number of ranks, the detail of
the named ranks only, and the same verdicts as when everything of every rank is read at once.

Two virtual clusters (flare_exporter.local.testing.virtual_cluster: every rank's page rendered by flare's own
collectors) of different sizes, each its own run, scraped every second by one Prometheus.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from conftest import flare_json, queries_sent

from flare_exporter import policies, record_names, spec
from flare_exporter.engine import (
    cli,
    diagnosis,
    pace_queries,
    prometheus_source,
    promql,
    records,
    rule_types,
    straggler_verdicts,
)
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.mixin import rule_model, rules_render

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
    # more ranks than straggler_verdicts.LEAVE_ONE_OUT_RANKS: the rules' straggler figures stand in
    huge: Cluster


def await_count(prometheus: PrometheusProcess, expr: str, count: int) -> None:
    """Wait until the query `count(...)` `expr` answers `count`."""

    def reached() -> bool:
        answer = prometheus.query(expr)
        return bool(answer) and int(float(answer[0]["value"][1])) == count

    wait_for(reached, 60, f"{expr} == {count}")


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    """8, 24 and 96 virtual ranks, a straggler in each (its GPU throttles), pages ready to hang one rank;
    Prometheus evaluates flare's rules every second."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    work = tmp_path_factory.mktemp("sources")
    targets = str(work / "targets")
    built = []
    with contextlib.ExitStack() as servers:
        for run, ranks in (("rounds-small", 8), ("rounds-large", 24), ("rounds-huge", 96)):
            straggler, hung = ranks * 3 // 8, ranks * 5 // 8
            healthy, later, hung_pages = vc.render_phases(ranks, run, straggler, hung)
            server = servers.enter_context(vc.ClusterServer(healthy))
            vc.write_file_sd(targets, run, server.targets(), ranks)
            built.append((Cluster(run, ranks, straggler, hung, server, hung_pages), later))
        rules_file = work / "flare.rules.yml"
        rules_file.write_text(
            rules_render.render(rule_model.Thresholds(hang_seconds=HANG_SECONDS, slow_interval=""))
        )
        with PrometheusProcess(str(work / "prometheus"), targets, rule_files=[str(rules_file)]) as prometheus:
            for cluster, later in built:
                await_count(prometheus, f'count(flare_rank_info{{run="{cluster.run}"}})', cluster.ranks)
                cluster.server.set_pages(later)  # the job makes progress: step counts increase
            for cluster, _ in built:
                steps = f'flare_step_duration_seconds_count{{run="{cluster.run}"}}'
                await_count(prometheus, f"count(increase({steps}[5m]) > 0)", cluster.ranks)
            # the rules' figures over the pages every rank serves now: every rank's last window, the same
            huge = built[2][0]
            (last,) = prometheus.query(f'max(flare_straggler_last_window{{run="{huge.run}"}})')
            figure = f'{record_names.LAST_WINDOW}:min{{run="{huge.run}"}} == {last["value"][1]}'
            await_count(prometheus, f"count({figure})", 1)
            yield Clusters(prometheus, *(cluster for cluster, _ in built))


def test_every_metric_a_snapshot_reads_is_in_the_spec_and_asked_of_prometheus():
    assert records.SNAPSHOT_METRICS - {"up"} <= spec.all_series_names()
    # the run's hang threshold is asked on its own, before the snapshot (resolve_hang_threshold)
    queries = " ".join(
        [*prometheus_source.PROMETHEUS_QUERIES.values(), prometheus_source.hang_threshold_query("r", "5m")]
    )
    assert [name for name in sorted(records.SNAPSHOT_METRICS) if name not in queries] == []
    # a direct scrape asks for and parses only those: no histogram buckets, no GPU series the rules never read
    assert "flare_collective_duration_seconds_bucket" not in records.SNAPSHOT_METRICS
    assert "flare_gpu_power_watts" not in records.SNAPSHOT_METRICS


def culprits(snapshot: rule_types.Snapshot) -> set[int]:
    return {rank for verdict in diagnosis.diagnose(snapshot, HANG_SECONDS) for rank in verdict.ranks}


def rounds_and_all_at_once(
    fake_prometheus: dict,
) -> tuple[rule_types.Snapshot, rule_types.Snapshot, list[dict]]:
    """The fake job read all at once, then in rounds (fake_prometheus["asked"] holds the rounds' queries
    alone): both snapshots, and the rounds' verdicts, asserted to be all at once's."""
    everything = prometheus_source.from_prometheus("http://x", "r")
    fake_prometheus["asked"].clear()
    snapshot = prometheus_source.from_prometheus(
        "http://x", "r", detail_for=culprits, hang_seconds=HANG_SECONDS
    )
    verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    assert verdicts == [v.to_json() for v in diagnosis.diagnose(everything, HANG_SECONDS)]
    return everything, snapshot, verdicts


def in_rounds(url: str, run: str, monkeypatch: pytest.MonkeyPatch) -> tuple[rule_types.Snapshot, list[str]]:
    """from_prometheus with the rules naming the detailed ranks, and every query it sent (to Prometheus)."""
    with queries_sent(monkeypatch) as sent:
        snapshot = prometheus_source.from_prometheus(url, run, detail_for=culprits, hang_seconds=HANG_SECONDS)
    return snapshot, sent


def test_without_a_run_named_several_runs_are_an_error_that_names_them(clusters, capsys):
    url = clusters.prometheus.url
    runs = [clusters.huge.run, clusters.large.run, clusters.small.run]
    assert promql.label_values(url, "run", "flare_rank_info", time.time() - 300, time.time()) == runs
    assert cli.main(["diagnose", "--prometheus", url]) == cli.EXIT_UNDECIDED
    error = capsys.readouterr().err.strip()
    several = f"several runs ({', '.join(runs)}); choose one with --run"
    assert error == f"flare: cannot decide: Prometheus at {url}: {several}"
    assert cli.main(["diagnose", "--prometheus", url, "--window", "5 minutes"]) == cli.EXIT_USAGE
    assert "flag --window: '5 minutes' is not a Prometheus duration" in capsys.readouterr().err


def test_as_many_queries_whatever_the_ranks_and_detail_only_of_the_named_ranks(clusters, monkeypatch):
    url = clusters.prometheus.url
    sent_by_run = {}
    for cluster in (clusters.small, clusters.large):
        snapshot, sent = in_rounds(url, cluster.run, monkeypatch)
        verdicts = diagnosis.diagnose(snapshot, HANG_SECONDS)
        assert [(v.kind, v.ranks) for v in verdicts] == [("straggler", (cluster.straggler,))]
        sent_by_run[cluster.run] = sent
        # faults and pace of every rank (no rank's ILD drift reaches IldPolicy's floors: not read), then the
        # detail of the straggler alone
        state = len(prometheus_source.FAULT_QUERIES) + len(prometheus_source.PACE_QUERIES) + 1
        assert len(sent) == state + len(prometheus_source.NAMED_DETAIL_QUERIES)
        assert not any("rank=~" in expr for expr in sent[:state])
        assert all(f'rank=~"{cluster.straggler}"' in expr for expr in sent[state:])
        assert snapshot.ranks[cluster.straggler].gpu is not None
        assert all(
            record.gpu is None for record in snapshot.ranks.values() if record.rank != cluster.straggler
        )
    assert len(sent_by_run["rounds-small"]) == len(sent_by_run["rounds-large"])


def test_beyond_leave_one_out_ranks_the_rules_figures_stand_in_for_every_ranks_windows(clusters, monkeypatch):
    """With more ranks than one median serves (straggler_verdicts.LEAVE_ONE_OUT_RANKS), the straggler rules
    weigh Prometheus's figures of every rank's windows (mixin straggler_rules.straggler_summary_rules) and the
    windows of the ranks the figures could name: the same verdict as every rank's windows, in as many queries
    whatever the number of ranks, none of them over every rank's windows."""
    cluster = clusters.huge
    snapshot, sent = in_rounds(clusters.prometheus.url, cluster.run, monkeypatch)
    summary = snapshot.window_summary
    assert summary is not None and summary.ranks == cluster.ranks
    assert summary.at <= snapshot.now
    verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
    assert everything.window_summary is None
    assert verdicts == [v.to_json() for v in diagnosis.diagnose(everything, HANG_SECONDS)]
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("straggler", [cluster.straggler])]
    assert "hw_thermal_slowdown" in verdicts[0]["summary"]
    # faults; the figures' time; the figures and the ranks they name; those ranks' windows; the ILD
    # candidates; the straggler's detail
    figures = 1 + 2 + len(prometheus_source.PACE_QUERIES) + 1
    assert len(sent) == len(prometheus_source.FAULT_QUERIES) + figures + len(
        prometheus_source.NAMED_DETAIL_QUERIES
    )
    windows = [expr for expr in sent if "flare_straggler_window_wait_seconds" in expr]
    assert len(windows) == 1 and f'rank=~"{cluster.straggler}"' in windows[0]
    # and the windows are those of the figures' time, not of now
    assert sorted(snapshot.ranks[cluster.straggler].step_windows)[-3:] == list(summary.windows)


def test_a_straggler_verdict_is_the_same_in_rounds_as_all_at_once_with_its_gpu_reason(clusters, monkeypatch):
    cluster = clusters.large
    snapshot, _ = in_rounds(clusters.prometheus.url, cluster.run, monkeypatch)
    in_rounds_verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
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
    # no pace round: a hang is found from the faults (and the groups, asked for because of the hang) alone
    assert len(sent) == len(prometheus_source.FAULT_QUERIES) + len(prometheus_source.GROUP_QUERIES) + len(
        prometheus_source.NAMED_DETAIL_QUERIES
    )
    (verdict,) = diagnosis.diagnose(snapshot, HANG_SECONDS)
    assert (verdict.kind, verdict.ranks, verdict.group) == ("hang", (cluster.hung,), "world")
    assert "model.py:212 forward" in verdict.summary  # the stack sample, read in the detail round
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
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
    assert len(sent) == len(prometheus_source.FAULT_QUERIES) + len(prometheus_source.NAMED_DETAIL_QUERIES)
    in_rounds_verdicts = [v.to_json() for v in diagnosis.diagnose(snapshot, HANG_SECONDS)]
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
    assert in_rounds_verdicts == [v.to_json() for v in diagnosis.diagnose(everything, HANG_SECONDS)]
    assert [(v["kind"], v["ranks"]) for v in in_rounds_verdicts] == [("rank_down", [dead])]
    assert "target down" in in_rounds_verdicts[0]["summary"]


# ---------------------------------------------------------------------------------------------------------
# the rounds without Prometheus: each query answered from hand-built series, as Prometheus would

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    "floors",
    [
        (2e-9, 1.0, 0.0),  # op shifts of 2 ns and more: ranks whose rank % 11 is 7 or more
        (1.0, 0.043, 1e-6),  # KS 0.043 and more (rank % 7 >= 3), where W1 is 1e-6 or more (kernel issue)
        (1.0, 0.043, 1e-3),  # ... no W1 that far: none
        (0.0, 0.0, 0.0),  # every rank
    ],
)
def test_the_ild_screen_names_the_ranks_whose_drift_reaches_the_floors(clusters, floors):
    cluster = clusters.large
    op_shift, ks, wasserstein = floors
    policy = policies.IldPolicy(
        ks=ks, partial_ks=ks, min_wasserstein_seconds=wasserstein, op_shift_seconds=op_shift
    )
    assert policy.floors() == floors
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
    expected = set()
    for rank, record in everything.ranks.items():
        for distribution, drift_ks in record.ild_ks.items():
            drift_w1 = record.ild_wasserstein.get(distribution)
            shift = record.ild_op_shift.get(distribution)
            if (shift is not None and shift >= op_shift) or (
                drift_ks >= ks and not (drift_w1 is not None and drift_w1 < wasserstein)
            ):
                expected.add(rank)
    matchers = f'run="{cluster.run}"'
    found = prometheus_source._fetch(
        clusters.prometheus.url, pace_queries.ild_screen(policy), matchers, "5m", 10.0, time.time()
    )
    assert {int(labels["rank"]) for labels, _ in found.get("ild_screen", [])} == expected
    assert 0 < len(expected) < cluster.ranks or floors in ((1.0, 0.043, 1e-3), (0.0, 0.0, 0.0))
    # the pace round's candidates: the same floors but W1's, so every rank the screen names and more
    candidates = {
        rank
        for rank, record in everything.ranks.items()
        if any(shift >= op_shift for shift in record.ild_op_shift.values())
        or any(drift_ks >= ks for drift_ks in record.ild_ks.values())
    }
    found = prometheus_source._fetch(
        clusters.prometheus.url, pace_queries.ild_candidates(policy), matchers, "5m", 10.0, time.time()
    )
    assert {int(labels["rank"]) for labels, _ in found.get("ild_candidates", [])} == candidates >= expected
    assert candidates != expected or floors != (1.0, 0.043, 1e-3)


def test_the_recent_and_the_older_straggler_windows_are_every_window_once(clusters):
    """The pace round's straggler windows in two parts (the last hold_windows, then the older ones only
    when the rules would weigh them): together every window a rank exports, each in one part only."""
    cluster = clusters.large
    everything = prometheus_source.from_prometheus(clusters.prometheus.url, cluster.run)
    matchers = f'run="{cluster.run}"'
    parts = []
    for queries in pace_queries.recent_windows(policies.StragglerPolicy()):
        found = prometheus_source._fetch(clusters.prometheus.url, queries, matchers, "5m", 10.0, time.time())
        parts.append(
            {(labels["rank"], labels["ago"], name) for name, rows in found.items() for labels, _ in rows}
        )
    recent, older = parts
    assert {ago for _, ago, _ in recent} == {"0", "1", "2"} and {ago for _, ago, _ in older} == {"3"}
    windows = {
        (str(rank), str(ago), name)
        for rank, record in everything.ranks.items()
        for ago in range(len(record.step_windows))
        for name in pace_queries.WINDOW_METRICS
    }
    assert recent | older == windows and not recent & older


def test_a_query_names_the_run_as_given_whatever_placeholder_text_its_name_holds(monkeypatch):
    sent: list[str] = []
    monkeypatch.setattr(promql, "query", lambda url, expr, *args: sent.append(expr) or [])
    queries = {
        **pace_queries.CUMULATIVE_QUERIES,
        **pace_queries.recent_windows(policies.StragglerPolicy())[0],
    }
    prometheus_source._fetch("http://x", queries, prometheus_source.matcher("a{sel}{window}"), "5m", 1.0, NOW)
    run = 'run="a{sel}{window}"'
    assert sorted(sent) == sorted(
        [
            f"sum by (rank) (increase(flare_step_duration_seconds_sum{{{run}}}[5m]))",
            f"sum by (rank) (increase(flare_collective_duration_seconds_sum{{{run}}}[5m]))",
            f'max by (rank, ago) (flare_straggler_window_step_seconds{{{run}, ago=~"0|1|2"}})',
            f'max by (rank, ago) (flare_straggler_window_wait_seconds{{{run}, ago=~"0|1|2"}})',
        ]
    )


def series_of(*rows: tuple[str, dict, float]) -> dict[str, list]:
    """Series by metric name from (name, labels, value) rows; every rank's labels get `rank` as a string."""
    found: dict[str, list] = {}
    for name, labels, value in rows:
        found.setdefault(name, []).append(({k: str(v) for k, v in labels.items()}, value))
    return found


def job(fault: str, ild_shifted: bool = True) -> dict[str, list]:
    """Six ranks in groups `world` and `tp0`..`tp2`. Rank 3 raised, restarted and goes on (its heartbeat is
    newer than its exception). `hang`: rank 1 is down (its target too: only the lookback shows it), rank 2
    raised and stopped, the others but 4 wait in collective 8 of `world` for 400 s. `straggler`: nothing
    waits, rank 5 waits least in each straggler window, its GPU's clock is low and (`ild_shifted`) its ILD
    shifted."""
    shifted = 5 if ild_shifted else -1
    rows: list[tuple[str, dict, float]] = []
    for rank in range(6):
        groups = ("world", f"tp{rank // 2}")
        rows += [("flare_process_group_info", {"rank": rank, "group": group}, 1.0) for group in groups]
        if fault == "hang" and rank == 1:
            info = {"rank": rank, "host": "h0", "world_size": 6}
            rows += [("flare_rank_info", info, 1.0), ("up", {"rank": rank}, 0.0)]
            continue
        rows += [
            ("flare_rank_info", {"rank": rank, "host": f"h{rank // 2}", "world_size": 6}, 1.0),
            ("up", {"rank": rank}, 1.0),
            ("flare_heartbeat_timestamp_seconds", {"rank": rank}, NOW - 40 if rank == 2 else NOW - 1 - rank),
            ("flare_steps_total", {"rank": rank}, 100.0 + rank),
            ("flare_rank_stack_info", {"rank": rank, "activity": "compute", "frames": f"m.py:{rank} f"}, 1.0),
            ("flare_gpu_health_up", {"rank": rank}, 1.0),
            ("flare_gpu_sm_clock_hertz", {"rank": rank}, 1.0e9 if rank == 5 else 1.9e9),
            ("flare_gpu_sm_clock_max_hertz", {"rank": rank}, 2.0e9),
            ("flare_straggler_last_window", {"rank": rank}, 9.0),
            ("flare_straggler_best_step_seconds", {"rank": rank}, 0.1),
            ("flare_step_duration_seconds_count", {"rank": rank}, 50.0),
            (
                "flare_ild_drift_ks",
                {"rank": rank, "distribution": "kernel_issue"},
                0.9 if rank == shifted else 0.01,
            ),
            (
                "flare_ild_drift_wasserstein_seconds",
                {"rank": rank, "distribution": "kernel_issue"},
                1e-3 if rank == shifted else 1e-6,
            ),
        ]
        for ago in range(4):
            wait = 0.01 if rank == 5 else 0.05 + 0.001 * ((rank + ago) % 3)
            rows += [
                ("flare_straggler_window_step_seconds", {"rank": rank, "ago": ago}, 0.2),
                ("flare_straggler_window_wait_seconds", {"rank": rank, "ago": ago}, wait),
            ]
        hung = fault == "hang" and rank != 4
        for group, seq in (("world", 8 if hung else 7), (f"tp{rank // 2}", 3)):
            rows.append(("flare_collective_last_issued_seq", {"rank": rank, "group": group}, float(seq)))
            rows.append(("flare_collective_last_completed_seq", {"rank": rank, "group": group}, seq - 1.0))
        if hung:
            flight = {"rank": rank, "group": "world"}
            rows += [
                ("flare_collective_in_flight_info", {**flight, "op": "all_reduce", "state": "started"}, 1.0),
                ("flare_collective_in_flight_seq", flight, 8.0),
                ("flare_collective_in_flight_bytes", flight, 4096.0),
                ("flare_collective_in_flight_started_timestamp_seconds", flight, NOW - 400),
            ]
    for rank, at in ((2, NOW - 30), (3, NOW - 200)) if fault == "hang" else ((3, NOW - 200),):
        rows += [
            ("flare_rank_exception_info", {"rank": rank, "type": "RuntimeError"}, 1.0),
            ("flare_rank_exception_timestamp_seconds", {"rank": rank}, at),
        ]
    return series_of(*rows)


def screened(everything: dict[str, list], ranks: set[str] | None, name: str) -> dict[str, list]:
    """What Prometheus answers to pace_queries.ild_screen (`name` "ild_screen", IldPolicy's floors)
    or to pace_queries.ild_candidates (the same without the W1 floor): a series per rank reaching
    them, of the ranks named (all if None)."""
    op_shift, ks, wasserstein = policies.IldPolicy().floors()
    if name == "ild_candidates":
        wasserstein = -math.inf

    def drifts(metric: str) -> dict[tuple[str, str], float]:
        return {
            (labels["rank"], labels["distribution"]): value for labels, value in everything.get(metric, [])
        }

    shifts, kss = drifts("flare_ild_op_shift_seconds"), drifts("flare_ild_drift_ks")
    w1s = drifts("flare_ild_drift_wasserstein_seconds")
    found = {key[0] for key, value in shifts.items() if value >= op_shift}
    found |= {
        key[0] for key, value in kss.items() if value >= ks and not w1s.get(key, math.inf) < wasserstein
    }
    return {name: [({"rank": rank}, 1.0) for rank in sorted(found) if ranks is None or rank in ranks]}


def answer(
    everything: dict[str, list], template: str, ranks: set[str] | None, groups: set[str] | None = None
) -> dict[str, list]:
    """What Prometheus answers to query `template` (of sources' queries): the series of the metrics it names
    (left of `unless`), of the ranks named (all if None), in the groups named (all), of the windows its
    `ago` matcher selects (all without one)."""
    expr = template.split(" unless ")[0]
    ago = re.search(r'ago(=~|!~)"([^"]*)"', expr)

    def selected(labels: dict[str, str]) -> bool:
        if ago is None:
            return True
        return (labels.get("ago", "") in ago.group(2).split("|")) == (ago.group(1) == "=~")

    return {
        metric: [
            (dict(labels), value)
            for labels, value in found
            if (ranks is None or labels["rank"] in ranks)
            and (groups is None or labels.get("group") in groups)
            and selected(labels)
        ]
        for metric, found in everything.items()
        if re.search(rf"(?<!\w){metric}(?!\w)", expr)
    }


def named_in(matchers: str, label: str) -> set[str] | None:
    """The values a `label=~"a|b"` matcher names (unescaped), None without one."""
    found = re.search(rf'{label}=~"((?:[^"\\]|\\.)*)"', matchers)
    if found is None:
        return None
    pattern = found.group(1).replace("\\\\", "\\")  # the PromQL string's escapes, then the regex's
    return {re.sub(r"\\(.)", r"\1", name) for name in re.split(r"(?<!\\)\|", pattern)}


@pytest.fixture
def fake_prometheus(monkeypatch: pytest.MonkeyPatch) -> dict:
    """prometheus_source._fetch answering from state["job"]; state["asked"] gets each round's query names
    and the ranks it names (None: every rank)."""
    state: dict = {"asked": []}

    def fetch(base_url, queries, matchers, window, timeout, now):  # noqa: ARG001 (prometheus_source._fetch's)
        named, groups = named_in(matchers, "rank"), named_in(matchers, "group")
        state["asked"].append((set(queries), named, groups))
        found: dict[str, list] = {}
        for name, template in queries.items():
            if name in ("ild_screen", "ild_candidates"):
                got = screened(state["job"], named, name)
            else:
                got = answer(state["job"], template, named, groups)
            for metric, rows in got.items():
                found.setdefault(metric, []).extend(rows)
        return found

    monkeypatch.setattr(prometheus_source, "_fetch", fetch)
    monkeypatch.setattr(prometheus_source.time, "time", lambda: NOW)
    return state


def read(record: rule_types.RankRecord, field: str, windows: Sequence[int] = ()) -> object:
    """A field of a record as the rules read it: a group's name for the record's state in that group (its
    last issued number and since when it has had a collective in flight, not the last completed: only views
    read that; which collective, only where a hang's verdict weighs it: see
    test_which_collective_is_in_flight_is_read_only_where_the_hang_verdict_weighs_it); of its straggler
    windows, the `windows` the rules weigh (the rounds leave older ones unread)."""
    if field not in rule_types.RankRecord.__dataclass_fields__:
        state = record.groups.get(field)
        if state is None:
            return None
        return state.last_issued, None if state.in_flight is None else state.in_flight.started_at
    if field == "step_windows":
        return {window: record.step_windows.get(window) for window in windows}
    return getattr(record, field)


FAULT_FIELDS = ("rank", "up", "down_reason", "host", "exception", "exception_at")
# the faults round (prometheus_source._faults_round): every rank's starts, and at once its other faults
STARTED_ROUND = ({records.FLIGHT_STARTED}, None, None)
OTHER_FAULTS_ROUND = (set(prometheus_source.FAULT_QUERIES) - {records.FLIGHT_STARTED}, None, None)


def but(asked: list, at_once: list) -> list:
    """The rounds `asked` but `at_once`, which were each asked once, in any order among the others (from
    the threads of the faults round)."""
    assert [asked.count(round) for round in at_once] == [1] * len(at_once)
    return [round for round in asked if round not in at_once]


@pytest.mark.parametrize("fault, ild_shifted", [("hang", True), ("straggler", True), ("straggler", False)])
def test_the_rounds_build_the_same_records_as_all_at_once_where_the_verdicts_read_them(
    fake_prometheus, fault, ild_shifted
):
    fake_prometheus["job"] = job(fault, ild_shifted)
    everything, snapshot, verdicts = rounds_and_all_at_once(fake_prometheus)
    named = {rank for verdict in verdicts for rank in verdict["ranks"]}
    # rank 3 restarted: its heartbeat, read in the progress round of the ranks that raised, says so
    assert not snapshot.ranks[3].gone and snapshot.ranks[3].heartbeat == NOW - 4
    started, progress = STARTED_ROUND, (set(prometheus_source.PROGRESS_QUERIES), {"2", "3"}, None)
    asked = fake_prometheus["asked"]
    raised = {int(labels["rank"]) for labels, _ in fake_prometheus["job"]["flare_rank_exception_info"]}
    if fault == "hang":
        # faults, and the hung group's numbers once the starts say it waited for the threshold; progress of
        # 2 and 3, rank 1's groups, detail
        gone = (set(prometheus_source.GONE_GROUP_QUERIES), {"1"}, None)
        world = (
            set(prometheus_source.NUMBER_QUERIES),
            None,
            {"world"},
        )  # rank 4, behind, waits in no other group
        assert asked.index(started) < asked.index(world)
        assert but(asked, [started, OTHER_FAULTS_ROUND, world]) == [
            progress,
            gone,
            ({records.ISSUED_AT}, {"4"}, {"world"}),  # could rank 4's number be from before the hang?
            (set(prometheus_source.NAMED_DETAIL_QUERIES), {"1"}, None),
        ]
        # rank 1 vanished, rank 2 raised after it; the world waits on them (rank 1 is in it: its past groups)
        assert [(v["kind"], v["ranks"], v["evidence"]["hung_groups"]) for v in verdicts] == [
            ("rank_down", [1], ["world"])
        ]
        assert verdicts[0]["evidence"]["followed_by"] == [2]
        assert snapshot.ranks[2].steps == 102  # the rank_down evidence of the rank that raised
        fields = (*FAULT_FIELDS, "world")
    else:  # faults, progress of 3, (nothing in flight: no groups), pace, (drifts,) detail of 5
        pace, detail = (
            (set(prometheus_source.PACE_QUERIES) | {"ild_candidates"}, None, None),
            (set(prometheus_source.NAMED_DETAIL_QUERIES), {"5"}, None),
        )
        # only where one could count: the screen of the candidates (rank 5), then every rank's drift
        screen = [({"ild_screen"}, {"5"}, None), (set(prometheus_source.ILD_QUERIES), None, None)]
        assert but(asked, [started, OTHER_FAULTS_ROUND]) == [
            (progress[0], {"3"}, None),
            pace,
            *(screen if ild_shifted else []),
            detail,
        ]
        ild = [("ild_regression", [5])] if ild_shifted else []
        assert [(v["kind"], v["ranks"]) for v in verdicts] == [("straggler", [5]), *ild]
        assert "SM clock" in verdicts[0]["summary"]  # the detail round's GPU health
        fields = (*FAULT_FIELDS, *PACE_FIELDS)
        if not ild_shifted:  # not read: the rules find no drift, and no shift in none
            fields = tuple(field for field in fields if not field.startswith("ild_"))
            assert all(record.ild_ks == {} for record in snapshot.ranks.values())
    windows, _ = straggler_verdicts.window_scores(everything, policies.StragglerPolicy())
    if fault == "straggler":  # the last three, of every rank alike: the rounds read no older one
        assert (
            straggler_verdicts.window_scores(snapshot, policies.StragglerPolicy())[0] == windows == [7, 8, 9]
        )
        assert all(set(record.step_windows) == {7, 8, 9} for record in snapshot.ranks.values())
    for rank, record in snapshot.ranks.items():
        full = everything.ranks[rank]
        assert [read(record, name, windows) for name in fields] == [
            read(full, name, windows) for name in fields
        ]
        detail = (record.steps, record.heartbeat, record.gpu, record.frames)
        if rank in named:
            assert detail == (full.steps, full.heartbeat, full.gpu, full.frames)
        elif rank in raised:  # their progress only
            assert detail == (full.steps, full.heartbeat, None, "")
        else:
            assert detail == (None, None, None, "")


PACE_FIELDS = (
    "collective_seconds",
    "step_seconds",
    "step_count",
    "step_windows",
    "best_step_seconds",
    "ild_ks",
    "ild_wasserstein",
)


def with_windows(job: dict[str, list], rank: int = 0, **changes: float | None) -> dict[str, list]:
    """`job` with `rank`'s straggler series changed: `last` its last window, `best` its best step time
    (None: not exported), `oldest_step` the step time of its oldest window (ago 3)."""
    changed = dict(job)

    def replaced(name: str, value: object, ago: str | None = None) -> None:
        rows = []
        for labels, old in changed[name]:
            if labels["rank"] == str(rank) and (ago is None or labels.get("ago") == ago):
                if value is None:
                    continue
                old = value
            rows.append((labels, old))
        changed[name] = rows

    if "last" in changes:
        replaced("flare_straggler_last_window", changes["last"])
    if "best" in changes:
        replaced("flare_straggler_best_step_seconds", changes["best"])
    if "oldest_step" in changes:
        replaced("flare_straggler_window_step_seconds", changes["oldest_step"], ago="3")
    return changed


@pytest.mark.parametrize(
    "changes, older_read",
    [
        ({}, False),
        # rank 0 closed one more window than the others: the rules weigh the three they share (7-9), one of
        # them rank 0's fourth last
        ({"rank": 0, "last": 10.0}, True),
        # the straggler exports no best step time: its oldest window (the fastest) stands in for it
        ({"rank": 5, "best": None, "oldest_step": 0.1}, True),
        ({"rank": 5, "oldest_step": 0.1}, False),  # ... which its best step time makes moot
    ],
)
def test_older_straggler_windows_are_read_only_where_the_rules_would_weigh_them(
    fake_prometheus, changes, older_read
):
    fake_prometheus["job"] = with_windows(job("straggler", ild_shifted=False), **changes)
    everything, snapshot, verdicts = rounds_and_all_at_once(fake_prometheus)
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("straggler", [5])]
    windows = set(pace_queries.recent_windows(policies.StragglerPolicy())[1])
    asked = [names for names, _, _ in fake_prometheus["asked"]]
    assert (windows in asked) == older_read
    if older_read:  # then every window, as all at once
        assert all(
            record.step_windows == everything.ranks[rank].step_windows
            for rank, record in snapshot.ranks.items()
        )
    if "best" in changes:  # the fastest window, the oldest, in the straggler's slowdown
        assert verdicts[0]["evidence"]["ranks"]["5"]["slowdown_ratio"] == [2.0, 2.0, 2.0]


def chained_job() -> dict[str, list]:
    """Four ranks; groups `world`, `pair-a` (ranks 2 and 3) and `pair-b` (0 and 1). Ranks 0-2 wait in
    collective 8 of the world; rank 3 never issued it: it waits in collective 5 of `pair-a`, which rank 2
    never issued (it waits in the world). A deadlock across two groups; `pair-b` has nothing to do with it."""
    rows: list[tuple[str, dict, float]] = []
    for rank in range(4):
        pair = "pair-a" if rank >= 2 else "pair-b"
        rows += [
            ("flare_rank_info", {"rank": rank, "host": f"h{rank}", "world_size": 4}, 1.0),
            ("up", {"rank": rank}, 1.0),
            ("flare_heartbeat_timestamp_seconds", {"rank": rank}, NOW - 400),
            ("flare_steps_total", {"rank": rank}, 100.0),
        ]
        issued = {"world": 7.0 if rank == 3 else 8.0, pair: 4.0 if rank == 2 else 5.0}
        waits_in = "world" if rank < 3 else "pair-a"
        for group, seq in issued.items():
            rows += [
                ("flare_process_group_info", {"rank": rank, "group": group}, 1.0),
                ("flare_collective_last_issued_seq", {"rank": rank, "group": group}, seq),
                ("flare_collective_last_completed_seq", {"rank": rank, "group": group}, seq - 1),
            ]
        flight = {"rank": rank, "group": waits_in}
        rows += [
            ("flare_collective_in_flight_info", {**flight, "op": "all_reduce", "state": "started"}, 1.0),
            ("flare_collective_in_flight_seq", flight, issued[waits_in]),
            ("flare_collective_in_flight_bytes", flight, 4096.0),
            ("flare_collective_in_flight_started_timestamp_seconds", flight, NOW - 400),
        ]
    return series_of(*rows)


def test_a_hang_reads_the_groups_its_chain_leads_to_and_no_other(fake_prometheus):
    fake_prometheus["job"] = chained_job()
    everything, snapshot, verdicts = rounds_and_all_at_once(fake_prometheus)
    # both groups are hung (in flight for 400 s); rank 3 is behind in the world and waits in pair-a, where
    # rank 2 is behind and waits in the world: a deadlock, both ranks suspects
    kinds = [(v["kind"], v["ranks"], v["group"], v["evidence"].get("deadlock")) for v in verdicts]
    assert kinds == [("hang", [2, 3], "world", True)]  # one verdict for the culprits, every group it holds up
    assert verdicts[0]["evidence"]["groups"] == ["pair-a", "world"]
    groups = [
        asked[2] for asked in fake_prometheus["asked"] if asked[0] == set(prometheus_source.NUMBER_QUERIES)
    ]
    assert groups == [{"pair-a", "world"}]  # both hung: one round; pair-b's numbers never asked
    assert all("pair-b" not in record.groups for record in snapshot.ranks.values())


def test_a_chain_to_a_group_that_is_not_hung_reads_it_in_a_round_of_its_own(fake_prometheus):
    job = chained_job()
    started = "flare_collective_in_flight_started_timestamp_seconds"
    # rank 3 waits in pair-a for a second only: that group is not hung, the world is
    job[started] = [(labels, NOW - 1 if labels["group"] == "pair-a" else at) for labels, at in job[started]]
    fake_prometheus["job"] = job
    everything, snapshot, verdicts = rounds_and_all_at_once(fake_prometheus)
    assert [(v["kind"], v["group"]) for v in verdicts] == [("hang", "world")]
    chain = verdicts[0]["evidence"]["chain"]
    assert [(hop["group"], hop["rank"], hop["waits_in"]) for hop in chain][:2] == [
        ("world", 3, ["pair-a"]),
        ("pair-a", 2, ["world"]),
    ]
    groups = [
        asked[2] for asked in fake_prometheus["asked"] if asked[0] == set(prometheus_source.NUMBER_QUERIES)
    ]
    assert groups == [{"world"}, {"pair-a"}]  # the hung group, then the group its chain leads to


def front_job(issued: dict[int, int], nbytes: dict[int, int], states: dict[int, str]) -> dict[str, list]:
    """Four ranks of group `world`, each waiting for 400 s in the last collective it issued (`issued`, 8
    where not given), of 4096 bytes (`nbytes`), started (`states`)."""
    rows: list[tuple[str, dict, float]] = []
    for rank in range(4):
        seq, flight = issued.get(rank, 8), {"rank": rank, "group": "world"}
        state = {"op": "all_reduce", "state": states.get(rank, "started")}
        rows += [
            ("flare_rank_info", {"rank": rank, "host": f"h{rank}", "world_size": 4}, 1.0),
            ("up", {"rank": rank}, 1.0),
            ("flare_collective_last_issued_seq", {"rank": rank, "group": "world"}, float(seq)),
            ("flare_collective_in_flight_info", {**flight, **state}, 1.0),
            ("flare_collective_in_flight_seq", flight, float(seq)),
            ("flare_collective_in_flight_bytes", flight, float(nbytes.get(rank, 4096))),
            ("flare_collective_in_flight_started_timestamp_seconds", flight, NOW - 400),
        ]
    return series_of(*rows)


@pytest.mark.parametrize(
    "issued, nbytes, states, verdict, weighed",
    [
        ({3: 7}, {}, {}, ("hang", [3]), False),  # rank 3 is behind: the issued numbers name it
        ({3: 7}, {0: 1}, {0: "issued"}, ("hang", [3]), False),  # ... whatever the others have in flight
        ({}, {2: 8192}, {}, ("mismatch", [2]), True),  # every rank at the front; rank 2's is larger
        ({}, {}, {1: "issued"}, ("hang", [1]), True),  # ... rank 1's has not started
        ({}, {}, {}, ("hang", []), True),  # ... all alike: the group's communication
        ({0: 9}, {}, {}, ("mismatch", [0]), True),  # rank 0 issued one the others never did
    ],
)
def test_which_collective_is_in_flight_is_read_only_where_the_hang_verdict_weighs_it(
    fake_prometheus, issued, nbytes, states, verdict, weighed
):
    """The faults round reads since when every rank has had a collective in flight; which collective (op,
    number, bytes, state) is read in a round of its own, of the hung groups whose verdict weighs it: where
    no rank is behind, or most are. At a hang of thousands of ranks, most of what the ranks hold."""
    fake_prometheus["job"] = front_job(issued, nbytes, states)
    everything, snapshot, verdicts = rounds_and_all_at_once(fake_prometheus)
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [verdict]
    asked = fake_prometheus["asked"]
    world = (
        set(prometheus_source.NUMBER_QUERIES),
        None,
        {"world"},
    )  # asked in the faults round: the starts say hung
    later = but(asked, [STARTED_ROUND, OTHER_FAULTS_ROUND, world])
    flights = [names for names, _, _ in asked if set(prometheus_source.FLIGHT_QUERIES) & names]
    assert flights == ([set(prometheus_source.FLIGHT_QUERIES)] if weighed else [])  # in a round of its own
    assert ((set(prometheus_source.FLIGHT_QUERIES), None, {"world"}) in later) == weighed
    in_flight = {rank: record.groups["world"].in_flight for rank, record in snapshot.ranks.items()}
    assert all(flight is not None and flight.started_at == NOW - 400 for flight in in_flight.values())
    if not weighed:
        assert {flight.op for flight in in_flight.values() if flight is not None} == {""}


def test_a_number_scraped_before_its_groups_newest_issue_is_late():
    """GroupState.seen_before_stall from the issued numbers' scrape times (records.ISSUED_AT) against the
    newest start of a collective in flight in the same group, on any rank: at it or before, late."""
    started = "flare_collective_in_flight_started_timestamp_seconds"
    job = series_of(
        *[("flare_collective_last_issued_seq", {"rank": r, "group": g}, 8.0) for r in range(3) for g in "ab"],
        (started, {"rank": 0, "group": "a"}, NOW - 50),
        (started, {"rank": 1, "group": "a"}, NOW - 40),  # group a's newest issue
        (records.ISSUED_AT, {"rank": 0, "group": "a"}, NOW - 45),  # before it
        (records.ISSUED_AT, {"rank": 1, "group": "a"}, NOW - 40),  # at it
        (records.ISSUED_AT, {"rank": 2, "group": "a"}, NOW - 39),  # after it
        *[
            (records.ISSUED_AT, {"rank": r, "group": "b"}, NOW - 100) for r in range(3)
        ],  # b: nothing in flight
    )
    groups = {rank: fields["groups"] for rank, fields in records.group_fields(job, NOW).items()}
    late = {
        (rank, name)
        for rank, found in groups.items()
        for name, state in found.items()
        if state.seen_before_stall
    }
    assert late == {(0, "a"), (1, "a")}


def test_a_rounds_fields_keep_the_group_indexes_built_unless_they_change_the_groups():
    """records.with_fields: a round that adds fields other than a record's groups, up and exception
    (detail, pace) keeps the snapshot's group indexes as built; one that changes them builds them anew."""
    started = records.FLIGHT_STARTED
    job = series_of(
        *[("flare_rank_info", {"rank": rank, "host": "h", "world_size": "3"}, 1.0) for rank in range(3)],
        *[("up", {"rank": rank}, 1.0) for rank in range(3)],
        *[(started, {"rank": rank, "group": "world"}, NOW - 100 + rank) for rank in range(3)],
    )
    faults = prometheus_source._snapshot(job, NOW, "r")
    indexes = [faults.members, faults.live_states, faults.oldest_in_flight]
    assert faults.oldest_in_flight == {"world": 100.0}
    detailed = records.with_fields(faults, {1: {"steps": 7.0, "activity": "compute"}})
    assert detailed.ranks[1].steps == 7.0
    assert [vars(detailed).get(name) for name in rule_types.GROUP_INDEXES] == indexes  # not built again
    for fields in ({"up": False}, {"exception": "RuntimeError"}, {"groups": {}}):
        changed = records.with_fields(detailed, {0: fields})
        assert not any(name in vars(changed) for name in rule_types.GROUP_INDEXES)
        assert changed.oldest_in_flight == ({"world": 100.0} if "exception" in fields else {"world": 99.0})
        assert changed.ranks[0].gone == ("groups" not in fields)


def test_the_faults_round_asks_the_numbers_of_the_groups_its_starts_say_are_hung(fake_prometheus):
    """prometheus_source._faults_round: told the hang threshold, the issued numbers of the groups in which a
    rank has had a collective in flight for it are asked before the round's records are built (ReadAhead);
    not where none has, nor without a threshold."""
    fake_prometheus["job"] = front_job({3: 7}, {}, {})  # every rank in flight in group world since NOW - 400

    def fetch(queries: dict[str, str], ranks: Sequence[int] = (), groups: Iterable[str] = ()) -> dict:
        assert not ranks
        named = f', group=~"{prometheus_source._any_of(sorted(groups))}"' if groups else ""
        return prometheus_source._fetch("http://x", queries, 'run="r"' + named, "5m", 10.0, NOW)

    series, ahead = prometheus_source._faults_round(fetch, NOW, HANG_SECONDS)
    assert {records.FLIGHT_STARTED, "up", "flare_rank_info"} <= set(series)
    assert ahead is not None and ahead.groups == {"world"}
    numbers = ahead.answers.result()["flare_collective_last_issued_seq"]
    assert {labels["rank"]: value for labels, value in numbers} == {"0": 8.0, "1": 8.0, "2": 8.0, "3": 7.0}
    assert prometheus_source._faults_round(fetch, NOW, 401.0)[1] is None  # in flight for 400 s: not hung yet
    assert prometheus_source._faults_round(fetch, NOW, None)[1] is None


def test_the_group_round_asks_the_scrape_times_of_only_the_numbers_that_could_be_late():
    """prometheus_source.late_scrape_queries: the scrape times of the issued numbers scraped at or before
    the newest start in the groups asked (a bound for each group's own, which _group_fields applies); none
    where nothing is in flight in them."""
    started = records.FLIGHT_STARTED
    series = series_of(
        (started, {"rank": 0, "group": "a"}, NOW - 50),
        (started, {"rank": 1, "group": "a"}, NOW - 40.25),
        (started, {"rank": 0, "group": "b"}, NOW - 10),
    )
    unfiltered = prometheus_source.GROUP_QUERIES[records.ISSUED_AT]
    assert prometheus_source.late_scrape_queries(series, {"a"}) == {
        records.ISSUED_AT: f"{unfiltered} <= {NOW - 40.25!r}"
    }
    assert prometheus_source.late_scrape_queries(series, {"a", "b"}) == {
        records.ISSUED_AT: f"{unfiltered} <= {NOW - 10!r}"
    }
    assert prometheus_source.late_scrape_queries(series, {"c"}) == {}
    # and those scraped before the group was hung: its oldest start + the hang threshold, when later
    assert prometheus_source.late_scrape_queries(series, {"a"}, hang_seconds=30) == {
        records.ISSUED_AT: f"{unfiltered} <= {NOW - 20.0!r}"
    }


def test_late_scrapes_are_asked_of_the_ranks_below_their_groups_top_alone():
    """prometheus_source._late_scrapes: a rank at its group's top issued the collective the group waits in,
    however late its scrape; only the ranks below it may be unjudged, and only they are asked, by name."""
    series = front_job({2: 7, 3: 6}, {}, {})  # ranks 2 and 3 below the top, 8
    snapshot = prometheus_source._snapshot(series, NOW, "r")
    # ranks 0 and 2 were last scraped before the hang; rank 0 is at the top all the same
    scraped = {0: NOW - 500, 1: NOW - 1, 2: NOW - 500, 3: NOW - 1}
    asked = []

    def fetch(queries: dict[str, str], ranks: Sequence[int] = (), groups: Iterable[str] = ()) -> dict:
        asked.append((set(queries), list(ranks), set(groups)))
        bound = float(queries[records.ISSUED_AT].rsplit(" <= ", 1)[1])
        rows = [({"rank": str(r), "group": "world"}, scraped[r]) for r in ranks if scraped[r] <= bound]
        return {records.ISSUED_AT: rows}

    assert prometheus_source._late_scrapes(snapshot, series, {"world"}, fetch, HANG_SECONDS)
    assert asked == [({records.ISSUED_AT}, [2, 3], {"world"})]
    late = records.with_fields(snapshot, records.group_fields(series, NOW))
    assert [r for r, record in late.ranks.items() if record.groups["world"].seen_before_stall] == [2]
    (verdict,) = diagnosis.diagnose(late, HANG_SECONDS)
    assert (verdict.kind, verdict.ranks, verdict.evidence["seen_before_stall"]) == ("hang", (3,), [2])
    scraped[2] = NOW - 1  # none late: nothing to build again
    assert not prometheus_source._late_scrapes(snapshot, series, {"world"}, fetch, HANG_SECONDS)


def test_groups_are_named_to_prometheus_exactly(clusters):
    """The group matcher of a round: a regular expression in a PromQL string that matches the names given,
    whatever they hold, and no other name."""
    run = clusters.large.run
    answer = clusters.prometheus.query(f'count by (group) (flare_collective_last_issued_seq{{run="{run}"}})')
    counts = {item["metric"]["group"]: int(float(item["value"][1])) for item in answer}
    picked = sorted(name for name in counts if "-" in name)[:2] + ["world", 'no.such|group"\\']
    assert len(picked) == 4 and "world" in counts
    selector = f'run="{run}", group=~"{prometheus_source._any_of(picked)}"'
    expr = f"count by (group) (flare_collective_last_issued_seq{{{selector}}})"
    found = {
        item["metric"]["group"]: int(float(item["value"][1])) for item in clusters.prometheus.query(expr)
    }
    assert found == {name: counts[name] for name in picked if name in counts}


SUMMARY_RANKS = straggler_verdicts.LEAVE_ONE_OUT_RANKS + 4
# The figures of the mixin's straggler_rules.straggler_summary_rules for a run whose every rank closed window
# 12 and has 10 to 12
FIGURES = {
    **{(f"{record_names.WINDOW_SHARE}:median", str(ago)): 0.4 for ago in range(3)},
    **{(f"{record_names.WINDOW_SHARE}:mad", str(ago)): 0.01 for ago in range(3)},
    **{(record_names.WINDOW_RANKS, str(ago)): SUMMARY_RANKS for ago in range(3)},
    (f"{record_names.POOLED_SHARE}:median", ""): 0.4,
    (f"{record_names.POOLED_SHARE}:mad", ""): 0.01,
    (record_names.BEST_STEP_RANKS, ""): SUMMARY_RANKS,
    (f"{record_names.LAST_WINDOW}:min", ""): 12,
    (f"{record_names.LAST_WINDOW}:max", ""): 12,
    (record_names.SUMMARY_AT, ""): 1.2,
}


def as_answer(figures: dict[tuple[str, str], float]) -> list[dict]:
    return [
        {"metric": {"__name__": name, **({"ago": ago} if ago else {})}, "value": [0, repr(value)]}
        for (name, ago), value in figures.items()
    ]


@pytest.mark.parametrize(
    "changed, stands",
    [
        ({}, True),
        ({(f"{record_names.LAST_WINDOW}:min", ""): 11}, False),  # a rank has not closed window 12
        ({(record_names.WINDOW_RANKS, "2"): SUMMARY_RANKS - 1}, False),  # one without 10
        ({(record_names.BEST_STEP_RANKS, ""): SUMMARY_RANKS - 1}, False),  # one without its best
        (
            {(record_names.SUMMARY_AT, ""): 1.5},
            False,
        ),  # every rank 1.5x its best: the job-wide verdict lists each
        ({(f"{record_names.POOLED_SHARE}:mad", ""): None}, False),  # not evaluated yet
    ],
)
def test_the_figures_stand_in_only_for_every_live_rank_with_the_same_windows(changed, stands):
    """prometheus_source._window_summary: the figures as of the rules' last evaluation, the windows of the
    ranks they name read at that time; None (every rank's windows read) where they do not stand for every
    live rank."""
    figures = {key: value for key, value in (FIGURES | changed).items() if value is not None}
    asked, fetched = [], []

    def answers(queries, at=NOW):
        asked.append((sorted(queries), at))
        if "summary_at" in queries:
            return [[{"metric": {}, "value": [NOW, repr(NOW - 20)]}]]
        return [as_answer(figures), [{"metric": {"rank": "5"}, "value": [NOW - 20, "0.02"]}]]

    def fetch(queries, ranks=(), groups=(), at=NOW):
        fetched.append((set(queries), list(ranks), at))
        return {"flare_straggler_last_window": [({"rank": "5"}, 12.0)]}

    faults = rule_types.Snapshot({r: rule_types.RankRecord(r) for r in range(SUMMARY_RANKS)}, NOW, "r")
    found = prometheus_source._window_summary(answers, fetch, faults, policies.StragglerPolicy())
    assert asked == [(["summary_at"], NOW), (["candidates", "figures"], NOW - 20)]
    if not stands:
        assert found is None and fetched == []
        return
    assert found is not None
    summary, windows = found
    assert summary == rule_types.WindowSummary(
        (10, 11, 12), SUMMARY_RANKS, ((0.4, 1.4826 * 0.01),) * 3, (0.4, 1.4826 * 0.01), NOW - 20
    )
    assert fetched == [
        (set(prometheus_source.PACE_QUERIES), [5], NOW - 20)
    ]  # the named rank's, at the figures' time
    assert windows == {"flare_straggler_last_window": [({"rank": "5"}, 12.0)]}
