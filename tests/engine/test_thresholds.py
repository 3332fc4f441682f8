"""The job's hang threshold travels with it: each rank exports the one it was started with
(flare_hang_threshold_seconds), and `flare diagnose` and the rules `flare rules` prints, told none
themselves, judge the run by it.

A virtual cluster (flare_exporter.local.testing.virtual_cluster) whose ranks were started with hang_seconds 4
and have had a collective in flight for 10 s: a hang by their threshold, none by the engine's default.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import time
from collections.abc import Iterator

import pytest
import yaml
from conftest import flare_json, queries_sent

from flare_exporter import cli, config
from flare_exporter.config import Config
from flare_exporter.engine import prometheus_source, records, scrape
from flare_exporter.engine.rule_types import Snapshot
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.mixin import collective_rules

RUN_THRESHOLD = 4.0
WORLD, HUNG = 4, 2
IN_FLIGHT_SECONDS = 10.0


@pytest.fixture(autouse=True)
def untold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's environment tells it no threshold (whatever the shell running the tests sets)."""
    monkeypatch.delenv("FLARE_HANG_SECONDS", raising=False)
    monkeypatch.delenv("FLARE_CONFIG", raising=False)


def flags(hang_seconds: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(hang_seconds=hang_seconds)


# ---------------------------------------------------------------------------------------------------------
# was the engine told a threshold?


def test_told_by_the_flag_first_then_the_environment_then_the_config_file(tmp_path):
    path = tmp_path / "flare.yml"
    path.write_text("hang_seconds: 60\n")
    everything = {"FLARE_HANG_SECONDS": "30", "FLARE_CONFIG": str(path)}
    assert config.hang_told_by(flags("10"), everything) == config.FLAG
    assert config.hang_told_by(flags(), everything) == config.ENVIRONMENT
    # set, even to the default: told
    assert config.hang_told_by(flags(), {"FLARE_HANG_SECONDS": "300"}) == config.ENVIRONMENT
    assert config.hang_told_by(flags(), {"FLARE_CONFIG": str(path)}) == config.CONFIG_FILE


def test_not_told_by_a_config_file_without_hang_seconds_nor_by_other_keys(tmp_path):
    path = tmp_path / "flare.yml"
    path.write_text("stall_seconds: 60\n")
    assert config.hang_told_by(flags(), {"FLARE_CONFIG": str(path), "FLARE_STALL_SECONDS": "5"}) is None
    assert config.hang_told_by(flags(), {}) is None
    assert config.hang_told_by(argparse.Namespace(), {}) is None  # a command without the flag


def test_the_runs_threshold_counts_only_where_the_engine_was_not_told_one():
    default = config.configured_hang(300.0, None)
    assert default == config.HangThreshold(300.0, config.DEFAULT)
    assert config.hang_of_run(4.0, default) == config.HangThreshold(4.0, config.RUN)
    assert config.hang_of_run(None, default) == default  # no rank exports one: the default
    assert config.hang_of_run(float("nan"), default) == default
    assert config.hang_of_run(0.0, default) == default
    flag = config.configured_hang(300.0, config.FLAG)
    assert config.hang_of_run(4.0, flag) == flag
    assert (
        config.hang_of_run(4.0, config.configured_hang(30.0, config.CONFIG_FILE)).source == config.CONFIG_FILE
    )


def test_the_prometheus_query_is_of_the_one_run():
    expr = prometheus_source.hang_threshold_query('a"b', "5m")
    assert expr == 'max(last_over_time(flare_hang_threshold_seconds{run="a\\"b"}[5m]))'


# ---------------------------------------------------------------------------------------------------------
# the snapshot carries the run's threshold


def info(rank: int) -> tuple[dict[str, str], float]:
    return {"rank": str(rank), "run": "r", "world_size": "2"}, 1.0


def test_build_snapshot_takes_the_largest_threshold_the_ranks_export():
    series: dict[str, records.Series] = {
        "flare_rank_info": [info(0), info(1)],
        records.HANG_THRESHOLD: [({"rank": "0", "run": "r"}, 4.0), ({"rank": "1", "run": "r"}, 6.0)],
    }
    snapshot = records.build_snapshot(series, {}, 100.0, "r")
    assert snapshot.hang_seconds == 6.0
    assert config.hang_of_run(snapshot.hang_seconds, config.configured_hang(300.0, None)).seconds == 6.0


def test_build_snapshot_without_thresholds_has_none():
    snapshot = records.build_snapshot({"flare_rank_info": [info(0)]}, {}, 100.0, "r")
    assert snapshot.hang_seconds is None
    assert Snapshot({}, 0.0).hang_seconds is None
    assert records.HANG_THRESHOLD in records.SNAPSHOT_METRICS  # a direct scrape asks the ranks for it


def test_a_rank_exports_the_threshold_it_was_started_with():
    state = vc.rank_state(3, 8, "t", time.perf_counter(), config=Config(hang_seconds=RUN_THRESHOLD))
    samples = [s for s in scrape.parse(vc.render(state).decode()) if s.name == records.HANG_THRESHOLD]
    assert [(s.labels, s.value) for s in samples] == [({"rank": "3", "run": "t"}, RUN_THRESHOLD)]


# ---------------------------------------------------------------------------------------------------------
# a hung virtual cluster started with hang_seconds 4


@contextlib.contextmanager
def hung_cluster(run: str) -> Iterator[vc.ClusterServer]:
    """WORLD virtual ranks started with hang_seconds 4; rank HUNG stuck in compute and the others in the world
    all-reduce, issued IN_FLIGHT_SECONDS ago."""
    _, _, hung_pages = vc.render_phases(WORLD, run, None, HUNG, config=Config(hang_seconds=RUN_THRESHOLD))
    with vc.ClusterServer(vc.hung_at(hung_pages, time.time() - IN_FLIGHT_SECONDS)) as server:
        yield server


def hang_verdicts(report: dict) -> list[dict]:
    return [verdict for verdict in report["verdicts"] if verdict["kind"] == "hang"]


def test_diagnose_judges_the_run_by_its_own_threshold_unless_told_one(tmp_path, monkeypatch):
    with hung_cluster("own-threshold") as server:
        targets = tmp_path / "targets.txt"
        targets.write_text("\n".join(server.targets()) + "\n")
        command = ("diagnose", "--targets", str(targets))

        code, report = flare_json(*command)
        assert code == 1, report
        assert (report["hang_seconds"], report["hang_seconds_from"]) == (RUN_THRESHOLD, "run")
        (hang,) = hang_verdicts(report)
        assert hang["ranks"] == [HUNG] and hang["group"] == "world", hang

        code, report = flare_json(*command, "--hang-seconds", "300")
        assert (report["hang_seconds"], report["hang_seconds_from"]) == (300.0, "flag")
        assert hang_verdicts(report) == [], report

        monkeypatch.setenv("FLARE_HANG_SECONDS", "300")
        code, report = flare_json(*command)
        assert (report["hang_seconds"], report["hang_seconds_from"]) == (300.0, "environment")
        assert hang_verdicts(report) == [], report


def test_a_run_whose_ranks_export_no_threshold_is_judged_by_the_default(tmp_path):
    page = vc.render(vc.rank_state(0, 1, "old", time.perf_counter()))
    old = b"\n".join(line for line in page.split(b"\n") if records.HANG_THRESHOLD.encode() not in line)
    with vc.ClusterServer([old]) as server:
        targets = tmp_path / "targets.txt"
        targets.write_text(server.targets()[0] + "\n")
        _, report = flare_json("diagnose", "--targets", str(targets))
    assert (report["hang_seconds"], report["hang_seconds_from"]) == (300.0, "default")


@pytest.mark.prometheus
def test_diagnose_reads_the_runs_threshold_from_prometheus_in_one_query(tmp_path, monkeypatch):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    run = "own-threshold-prom"
    file_sd = str(tmp_path / "targets")
    with hung_cluster(run) as server:
        vc.write_file_sd(file_sd, run, server.targets(), WORLD)
        rule_file = tmp_path / "flare.rules.yml"
        rule_file.write_text(flare_rules("--for", "0s", "--scrape-interval", "1s", "--slow-interval", "0s"))
        with PrometheusProcess(
            str(tmp_path / "prometheus"), file_sd, rule_files=[str(rule_file)]
        ) as prometheus:

            def count(expr: str) -> int:
                answer = prometheus.query(f"count({expr})")
                return int(float(answer[0]["value"][1])) if answer else 0

            def scraped() -> bool:  # every rank scraped (else an unscraped one reads as gone), and in flight
                ranks = count(f'flare_rank_info{{run="{run}"}}')
                return (
                    ranks == WORLD and count(f'flare_collective_in_flight_info{{run="{run}"}}') == WORLD - 1
                )

            wait_for(scraped, 60, "every waiting rank's collective in flight")
            with queries_sent(monkeypatch) as sent:
                code, report = flare_json("diagnose", "--prometheus", prometheus.url)
            assert code == 1, report
            assert (report["run"], report["hang_seconds"], report["hang_seconds_from"]) == (
                run,
                RUN_THRESHOLD,
                "run",
            )
            assert [verdict["ranks"] for verdict in hang_verdicts(report)] == [[HUNG]], report
            assert sent.count(prometheus_source.hang_threshold_query(run, "5m")) == 1

            with queries_sent(monkeypatch) as sent:
                _, report = flare_json("diagnose", "--prometheus", prometheus.url, "--hang-seconds", "300")
            assert (report["hang_seconds"], report["hang_seconds_from"]) == (300.0, "flag")
            assert hang_verdicts(report) == [], report
            assert not any(records.HANG_THRESHOLD in expr for expr in sent)  # told: not asked

            # the rules, told no threshold, page the culprit by the run's own 4 s (not the default 300 s)
            wait_for(lambda: paged(prometheus, run), 60, "FlareCollectiveHangCulprit")
            assert paged(prometheus, run) == {str(HUNG)}


def paged(prometheus: PrometheusProcess, run: str) -> set[str]:
    firing = f'ALERTS{{alertname="FlareCollectiveHangCulprit", alertstate="firing", run="{run}"}}'
    return {item["metric"]["rank"] for item in prometheus.query(firing)}


# ---------------------------------------------------------------------------------------------------------
# `flare rules`


def flare_rules(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["rules", *args]) == 0
    return out.getvalue()


def hang_expr(text: str) -> str:
    document = yaml.safe_load(text)
    alerts = [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]
    return next(rule["expr"] for rule in alerts if rule["alert"] == "FlareCollectiveHang")


def test_rules_told_no_threshold_judge_each_run_by_its_own():
    text = flare_rules()
    assert collective_rules.RUN_HANG_THRESHOLD in hang_expr(text)
    assert f"record: {collective_rules.RUN_HANG_THRESHOLD}" in text


@pytest.mark.parametrize("how", ["flag", "environment", "config"])
def test_rules_told_a_threshold_use_it_for_every_run(how, tmp_path, monkeypatch):
    args: tuple[str, ...] = ()
    if how == "flag":
        args = ("--hang-seconds", "60")
    elif how == "environment":
        monkeypatch.setenv("FLARE_HANG_SECONDS", "60")
    else:
        (tmp_path / "flare.yml").write_text("hang_seconds: 60\n")
        monkeypatch.setenv("FLARE_CONFIG", str(tmp_path / "flare.yml"))
    text = flare_rules(*args)
    assert hang_expr(text) == "run_group:flare_collective_in_flight:max_age_seconds >= 60"
    assert collective_rules.RUN_HANG_THRESHOLD not in text
