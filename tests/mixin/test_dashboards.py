"""The Grafana dashboards (dashboards/): current, valid for Grafana's typed model, laid out without overlap,
naming only the spec's metrics, with a unit on every numeric panel, as many panels at 6,144 ranks as at 4
(none repeated per rank), and every panel's query answering from a real Prometheus scraping a real gloo
job, with the view's selector and as generated with --selector, and at most $k ranks per query and time on
the run-wide dashboards: the CPU job of conftest for the panels it can feed, a job with a fake GPU, fake
kernels, a straggler and a hang (flare_exporter.local.dashboard_preview) for all of them."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk")

from flare_exporter.engine import promql
from flare_exporter.local import dashboard_preview
from flare_exporter.local.prometheus import wait_for
from flare_exporter.mixin import dashboard_rules, dashboards, rules

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
needs_prometheus = pytest.mark.skipif(not shutil.which("prometheus"), reason="prometheus is not installed")
# The panels of each dashboard: fixed, whatever the number of ranks (none is repeated per rank).
PANELS = {
    "flare-overview.json": 27,
    "flare-collectives.json": 11,
    "flare-issue-latency.json": 9,
    "flare-rank.json": 27,
}
AT_SCALE = {"rank": 6144, "group": 1600, "k": 100}  # values a variable may have selected at 6,144 ranks
FLARE_SELECTOR = re.compile(r"(?<![\w:])(flare_[a-z0-9_]+)\{([^}]*)")  # a flare series' name and matchers


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


def test_panel_counts_are_bounded_and_nothing_repeats_per_rank():
    """Each dashboard draws the same panels at 6,144 ranks (All selected, $k at its most) as at 4: no panel
    repeats per a variable's values, the rank detail takes one rank, and the run-wide dashboards reach a
    rank through its row in a table."""
    models = committed()
    assert {name: len(model["panels"]) for name, model in models.items()} == PANELS
    for name, model in models.items():
        assert dashboards.expanded_panel_count(model, AT_SCALE) == PANELS[name] < 60, name
        assert not [panel["title"] for panel in model["panels"] if panel.get("repeat")], name
    rank = {variable["name"]: variable for variable in models["flare-rank.json"]["templating"]["list"]}[
        "rank"
    ]
    assert not rank["multi"] and not rank.get("includeAll")
    linked = [
        panel["title"]
        for model in models.values()
        for panel in model["panels"]
        if "var-rank=${__data.fields.rank}" in json.dumps(panel.get("fieldConfig", {}))
    ]
    assert len(linked) >= 8, linked
    broken = copy.deepcopy(models)
    broken["flare-issue-latency.json"]["panels"][0]["repeat"] = "rank"
    assert dashboards.expanded_panel_count(broken["flare-issue-latency.json"], AT_SCALE) == 9 + 6143
    rank_variable = broken["flare-rank.json"]["templating"]["list"][4]
    rank_variable.update(multi=True, includeAll=True)
    found = "\n".join(dashboards.problems(broken))
    assert "repeats per $rank" in found and "$rank takes several" in found


def test_every_numeric_panel_has_a_unit_and_a_panel_without_one_fails():
    assert dashboards.unit_problems(dashboards.dashboards()) == []
    series = (dashboards.Target('up{run="$run"}'),)
    bad = dashboards.Dashboard(
        "flare-bad",
        "Flare / Bad",
        "Panels with and without units.",
        (
            (
                dashboards.Panel("timeseries", "No unit", "d", series, width=6, height=4),
                dashboards.Panel("stat", "Unit none", "d", series, width=6, height=4, unit="none"),
                dashboards.Panel("timeseries", "Ranks", "d", series, width=6, height=4, count=True),
                dashboards.Panel("stat", "Seconds", "d", series, width=6, height=4, unit="s"),
            ),
            (
                dashboards.Panel(
                    "bargauge", "Counted seconds", "d", series, width=6, height=4, unit="s", count=True
                ),
            ),
        ),
    )
    records = "\n".join(dashboards.unit_problems([bad]))
    assert "'No unit': no unit" in records and "'Unit none': no unit" in records
    assert "'Counted seconds': a count with unit 's'" in records
    assert "Ranks" not in records and "'Seconds'" not in records
    model = dashboards.build(bad)
    units = {panel["title"]: panel["fieldConfig"]["defaults"].get("unit") for panel in model["panels"]}
    assert units["Ranks"] == "short"
    found = [problem for problem in dashboards.problems({"flare-bad.json": model}) if "unit" in problem]
    assert len(found) == 2 and "'No unit'" in found[0] and "'Unit none'" in found[1], found


def test_selector_is_anded_into_every_query_of_flare_series(tmp_path, capsys):
    """--selector (as `flare rules --selector` takes it) lands in every selector of flare's own series, in the
    panels and the variables, before the view's own $selector; one Prometheus would not parse exits 2."""
    selector = "cluster='eu-1'"  # as label_matchers.check_selector writes it
    assert dashboards.main(["--selector", "{cluster = 'eu-1'}", "--out", str(tmp_path)]) == 0
    scoped = 0
    for path in tmp_path.glob("*.json"):
        model = json.loads(path.read_text())
        exprs = dashboards.queries(model) + [
            variable.get("query", "") for variable in model["templating"]["list"]
        ]
        for expr in exprs:
            for metric, matchers in FLARE_SELECTOR.findall(expr):
                assert matchers.endswith(f"{selector}, ${{selector:raw"), (path.name, metric, expr)
                scoped += 1
    assert scoped > 120
    assert dashboards.main(["--selector", "cluster=eu-1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("flare: flag --selector: label values are quoted")


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
    """Panels that need no GPU, no fault and no rules return series from the shared 4-rank CPU job: as
    committed, and as generated with --selector and viewed with a $selector, both matching the job's series;
    a $selector matching none leaves every panel empty (or 0); with $k at 1 no query of a run-wide dashboard
    returns more than one rank at a time."""
    url = ddp_job.prometheus.url
    run = "test-ddp"
    queries = [query for query in dashboards.panel_queries() if not query.needs]
    assert len(queries) >= 40
    empty: list[str] = []

    def all_answer() -> bool:
        # Prometheus may first scrape the ranks after their 30 steps: a quantile of flat counters is then
        # NaN, but the query answers with series (the faulty job below, scraped throughout, needs values)
        window = dashboard_preview.Window(time.time() - 300, time.time())
        empty.clear()
        empty.extend(empty_panels(url, queries, window, run, finite=False))
        return not empty

    try:
        wait_for(all_answer, 60, "the CPU panels' queries to answer")
    except TimeoutError:
        pytest.fail("no series from:\n" + "\n".join(empty))
    window = dashboard_preview.Window(time.time() - 300, time.time())
    scoped = [query for query in dashboards.panel_queries('instance=~".+"') if not query.needs]
    assert empty_panels(url, scoped, window, run, finite=False, selector='job!=""') == []
    assert nonzero_panels(url, queries, window, run, selector='cluster="nowhere"') == []
    assert more_than_k_ranks(url, queries, window, run) == []
    for name in (dashboard_rules.STEP_TIME_RANKS, dashboard_rules.WAIT_SHARE_RANKS):  # KS needs a baseline
        counts = recorded_ranks_per_bucket(url, name, window, run)
        assert counts == sorted(counts) and counts[-1] == 4, (name, counts)
    for model in committed().values():
        for variable in model["templating"]["list"]:
            if variable["type"] == "query":
                values = {**dashboards.VIEW_DEFAULTS, "run": run}
                expr = dashboards.variable_query_as_promql(dashboards.substitute(variable["query"], values))
                assert promql.query(url, expr), (model["uid"], variable["name"])


def by_dashboard(queries):
    grouped: dict[str, list] = {}
    for query in queries:
        grouped.setdefault(query.dashboard, []).append(query)
    return grouped


def view(window, uid: str, run: str, **variables: str) -> dict[str, str]:
    """The variables as Grafana fills them in: every rank selected, but one on the rank dashboard."""
    return window.variables(run, str(RANK_OF_DETAIL) if uid == dashboards.RANK_UID else ".*", **variables)


RANK_OF_DETAIL = 1


def empty_panels(url, queries, window, run, finite=True, **variables) -> list[str]:
    """The queries that return no series (`finite`: no finite value)."""
    empty = []
    for uid, ours in by_dashboard(queries).items():
        values = view(window, uid, run, **variables)
        empty += dashboard_preview.empty_queries(url, ours, window, values, finite=finite)
    return empty


def nonzero_panels(url, queries, window, run, **variables) -> list[str]:
    """The queries that return a finite value other than 0."""
    found = []
    for query in queries:
        expr = dashboards.substitute(query.expr, view(window, query.dashboard, run, **variables))
        points = [
            v
            for series in dashboard_preview.evaluate(url, expr, query.instant, window)
            for _, v in series.points
        ]
        if any(math.isfinite(v) and v != 0 for v in points):
            found.append(f"{query.dashboard} / {query.panel} / {query.ref_id}")
    return found


def recorded_ranks_per_bucket(url, record: str, window, run) -> list[float]:
    """The run's counts of the flare.dashboards recording `record` at the window's end, evaluated from its
    rule's expression (the CPU job's Prometheus loads no rules), by bucket bound (+Inf last: every rank). The
    per-rank recordings it counts are inlined (their rules come first in the group)."""
    exprs = {rule.record: rule.expr for rule in dashboard_rules.dashboard_recording_rules(rules.Thresholds())}
    expr = exprs[record]
    for name, per_rank in exprs.items():
        expr = expr.replace(name, f"({per_rank})") if name != record else expr
    found = dashboard_preview.evaluate(url, expr, True, window)
    counts = sorted((float(s.labels["le"]), s.points[-1][1]) for s in found if s.labels["run"] == run)
    return [value for _, value in counts]


def test_rank_heatmaps_read_the_recorded_counts():
    """Each ranks heatmap reads the run's counts the flare.dashboards rules record (one series per bucket),
    not every rank's values: the rules count them once a minute instead of at every refresh."""
    recorded = {rule.record for rule in dashboard_rules.dashboard_recording_rules(rules.Thresholds())}
    heatmaps = [q for q in dashboards.panel_queries() if q.panel.startswith("Ranks by")]
    assert len(heatmaps) == 3
    for query in heatmaps:
        assert dashboards.names_in(query.expr) & recorded and "$rank" not in query.expr, query.expr
        assert "rules" in query.needs
    groups = {group.name: group for group in rules.RULE_GROUPS}
    assert groups["flare.dashboards"].slow
    assert {r.record for r in groups["flare.dashboards"].recording_rules(rules.Thresholds())} == recorded


def more_than_k_ranks(url, queries, window, run) -> list[str]:
    """With $k at 1, the queries of the run-wide dashboards that return more than one series with a rank label
    at one time (the verdict table lists the ranks the firing alerts name: as many as fire)."""
    found = []
    for query in queries:
        if query.dashboard == dashboards.RANK_UID or query.expr == dashboards.FIRING_ALERTS:
            continue
        expr = dashboards.substitute(query.expr, view(window, query.dashboard, run, k="1"))
        at_once = Counter(
            t
            for series in dashboard_preview.evaluate(url, expr, query.instant, window)
            if "rank" in series.labels
            for t, v in series.points
            if math.isfinite(v)
        )
        if max(at_once.values(), default=0) > 1:
            found.append(f"{query.dashboard} / {query.panel} / {query.ref_id}: {max(at_once.values())} ranks")
    return found


@needs_prometheus
@pytest.mark.multirank
def test_every_panel_answers_from_a_job_with_a_fake_gpu_a_straggler_and_a_hang(tmp_path):
    """Every query of every panel (and the alert annotation) returns data from a real gloo job with fake
    NVML and the fake device, a straggler and a hang, under a Prometheus evaluating the rules; the alerts in
    the verdict table name the stuck rank; with $k at 1 no query of a run-wide dashboard returns more than
    one rank at a time."""
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
        assert more_than_k_ranks(job.prometheus.url, dashboards.panel_queries(), window, job.run) == []
    assert named == {str(dashboard_preview.STUCK_RANK)}
    assert window.end > window.start
