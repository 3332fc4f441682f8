"""The Grafana dashboards (dashboards/): current, valid for Grafana's typed model, laid out without overlap,
naming only the spec's metrics, and every panel's query answering from a real Prometheus scraping a real
gloo job: the CPU job of conftest for the panels it can feed, a job with a fake GPU, fake kernels, a
straggler and a hang (flare_exporter.local.dashboard_preview) for all of them."""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk")

from flare_exporter.engine import promql
from flare_exporter.local import dashboard_preview
from flare_exporter.local.prometheus import wait_for
from flare_exporter.mixin import dashboards

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
needs_prometheus = pytest.mark.skipif(not shutil.which("prometheus"), reason="prometheus is not installed")


def committed() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def test_committed_dashboards_are_the_generator_output(tmp_path):
    assert dashboards.main(["--check", "--out", str(DASHBOARDS)]) == 0, (
        "dashboards/ is stale: run python -m flare_exporter.mixin.dashboards"
    )
    (tmp_path / "flare-overview.json").write_text("{}\n")
    assert dashboards.main(["--check", "--out", str(tmp_path)]) == 1


def test_four_dashboards_with_stable_uids():
    assert set(committed()) == {
        "flare-overview.json",
        "flare-collectives.json",
        "flare-issue-latency.json",
        "flare-rank.json",
    }
    assert {model["uid"] for model in committed().values()} == {
        dashboards.OVERVIEW_UID,
        dashboards.COLLECTIVES_UID,
        dashboards.ILD_UID,
        dashboards.RANK_UID,
    }


def test_grafanas_typed_model_reads_back_exactly_what_is_committed():
    """The foundation SDK's dashboard, panel-options and Prometheus-query types read each file and write
    it back unchanged: no unknown field, no value outside an enum."""
    for name, model in committed().items():
        assert dashboards.typed_round_trip(model) == model, name
    model = committed()["flare-overview.json"]
    for tamper in (
        lambda m: m["panels"][0].update(gridPosition={}),
        lambda m: m["panels"][0]["options"].update(colour="red"),
        lambda m: m["panels"][0]["targets"][0].update(query="up"),
    ):
        broken = copy.deepcopy(model)
        tamper(broken)
        assert dashboards.typed_round_trip(broken) != broken


def test_structure_ids_grid_datasources_variables_and_links():
    models = committed()
    assert dashboards.problems(models) == []
    for model in models.values():
        assert model["schemaVersion"] >= 36
        linked = sorted(link["url"].split("/")[2] for link in model["links"])
        assert linked == sorted(other["uid"] for other in models.values() if other is not model)
    broken = copy.deepcopy(models)
    overview = broken["flare-overview.json"]
    overview["panels"][1]["gridPos"]["x"] = 3  # onto the first panel
    overview["panels"][2]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "prom-1"}
    overview["panels"][3]["id"] = overview["panels"][4]["id"]
    overview["templating"]["list"].pop()
    overview["links"][0]["url"] = "/d/no-such-dashboard/x"
    found = "\n".join(dashboards.problems(broken))
    for expected in ("overlaps", "has no ${datasource}", "panel ids are not unique", "variables are", "link"):
        assert expected in found


def test_panels_name_only_metrics_the_spec_or_a_recording_rule_defines():
    models = list(committed().values())
    assert dashboards.unknown_metrics(models) == set()
    broken = copy.deepcopy(models)
    broken[0]["panels"][0]["targets"][0]["expr"] += " or flare_no_such_total{run='x'} or node_load1{}"
    assert dashboards.unknown_metrics(broken) == {"flare_no_such_total", "node_load1"}
    with pytest.raises(ValueError, match="flare_renamed_total"):
        dashboards._defined("flare_renamed_total")


def test_every_panel_has_queries_and_known_needs():
    for dashboard in dashboards.dashboards():
        for panel in dashboard.panels:
            assert panel.targets and panel.description, panel.title
            assert panel.needs <= dashboards.NEEDS, panel.title


def test_substitution_fills_every_variable():
    window = dashboard_preview.Window(1000.0, 1300.0)
    values = window.variables("r", ".*")
    for query in dashboards.panel_queries():
        assert "$" not in dashboards.substitute(query.expr, values), query.expr
    assert (
        dashboards.variable_query_as_promql('label_values(up{run="r"}, rank)')
        == 'group by (rank) (up{run="r"})'
    )


@needs_prometheus
@pytest.mark.multirank
def test_cpu_panels_answer_from_the_ddp_job(ddp_job):
    """Panels that need no GPU, no fault and no rules return series from the shared 4-rank CPU job."""
    url = ddp_job.prometheus.url
    run = "test-ddp"
    queries = [query for query in dashboards.panel_queries() if not query.needs]
    assert len(queries) >= 30
    empty: list[str] = []

    def all_answer() -> bool:
        # Prometheus may first scrape the ranks after their 30 steps: a quantile of flat counters is then
        # NaN, but the query answers with series (the faulty job below, scraped throughout, needs values)
        window = dashboard_preview.Window(time.time() - 300, time.time())
        empty.clear()
        for uid in {query.dashboard for query in queries}:
            values = window.variables(run, "1" if uid == dashboards.RANK_UID else ".*")
            ours = [query for query in queries if query.dashboard == uid]
            empty.extend(dashboard_preview.empty_queries(url, ours, window, values, finite=False))
        return not empty

    try:
        wait_for(all_answer, 60, "the CPU panels' queries to answer")
    except TimeoutError:
        pytest.fail("no series from:\n" + "\n".join(empty))
    for model in committed().values():
        for variable in model["templating"]["list"][1:]:
            expr = dashboards.variable_query_as_promql(dashboards.substitute(variable["query"], {"run": run}))
            assert promql.query(url, expr), (model["uid"], variable["name"])


@needs_prometheus
@pytest.mark.multirank
def test_every_panel_answers_from_a_job_with_a_fake_gpu_a_straggler_and_a_hang(tmp_path):
    """Every query of every panel (and the alert annotation) returns data from a real gloo job with fake
    NVML and the fake device, a straggler and a hang, under a Prometheus evaluating the rules; the alerts in
    the verdict table name the stuck rank."""
    with dashboard_preview.faulty_job(str(tmp_path)) as job:
        window = dashboard_preview.await_every_panel(job, timeout=240)

        def culprits() -> set[str]:  # the verdict table's hang rows, once the hang has lasted long enough
            expr = dashboards.substitute(dashboards.FIRING_ALERTS, {"run": job.run})
            alerts = promql.query(job.prometheus.url, expr)
            return {
                a["metric"]["rank"]
                for a in alerts
                if a["metric"]["alertname"] == "FlareCollectiveHangCulprit"
            }

        named = wait_for(culprits, 120, "the hang's culprit alert")
    assert named == {str(dashboard_preview.STUCK_RANK)}
    assert window.end > window.start
