"""Grafana's JSON for the dashboards, through Grafana's own builders (grafana-foundation-sdk: the `dev`
extra, imported only here and only when a dashboard is built)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .catalog import dashboards
from .metrics import GROUP_INFO, RANK_INFO
from .model import (
    DATASOURCE,
    DEFAULT_K,
    FIRING_ALERTS,
    K_CHOICES,
    SELECTOR,
    Dashboard,
    Panel,
    with_selector,
)

TAG = "flare"


def all_json(selector: str = "") -> dict[str, dict[str, Any]]:
    """{file name: JSON model} of every dashboard, each linked to the others; `selector` (label matchers,
    as label_matchers.check_selector returns them) ANDed into every query of flare's own series."""
    every = dashboards()
    return {
        f"{dashboard.uid}.json": build(
            dashboard, [other for other in every if other is not dashboard], selector
        )
        for dashboard in every
    }


def render(model: Mapping[str, Any]) -> str:
    """The text of a dashboard's JSON file."""
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def build(dashboard: Dashboard, others: Iterable[Dashboard] = (), selector: str = "") -> dict[str, Any]:
    """The dashboard's JSON model, linked to `others`, `selector` ANDed into its queries (see all_json)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as models

    datasource = models.DataSourceRef(type_val="prometheus", uid=DATASOURCE)
    result = _dashboard_settings(dashboard)
    for variable in _variables(dashboard, datasource, selector):
        result = result.with_variable(variable)
    result = result.annotation(_alerts_annotation(datasource))
    for other in others:
        result = result.link(_link_to(other))
    for number, (panel, position) in enumerate(_layout(dashboard), start=1):
        result = result.with_panel(_panel(panel, number, position, datasource, selector))
    # written as Grafana's typed model reads it back, defaults filled in: a fixed point of the check
    return typed_round_trip(json.loads(json.dumps(result.build(), cls=JSONEncoder)))


def typed_round_trip(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model read by Grafana's typed dashboard model (the foundation SDK's) and written back."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import dashboard as models

    register_default_plugins()  # panels' options and Prometheus queries decode into their own types
    return dict(json.loads(json.dumps(models.Dashboard.from_json(dict(model)), cls=JSONEncoder)))


# ---------------------------------------------------------------------------------------------------------
# the dashboard: its settings, variables, alert annotations and links


def _dashboard_settings(dashboard: Dashboard) -> Any:
    """A dashboard builder with the title, uid, tag, time range and refresh every flare dashboard has."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import dashboard as models

    return (
        builders.Dashboard(dashboard.title)
        .uid(dashboard.uid)
        .description(dashboard.description)
        .tags([TAG])
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
    )


def _variables(dashboard: Dashboard, datasource: Any, selector: str) -> list[Any]:
    """$datasource, $selector (the view's extra label matchers), $run, $group and $rank (one rank on the
    rank dashboard, else any number), and $k where a panel shows the top or bottom k."""
    from grafana_foundation_sdk.builders import dashboard as builders

    scoped = with_selector(SELECTOR, selector)
    variables = [
        builders.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        builders.TextBoxVariable("selector")
        .label("Selector")
        .description(
            'Extra label matchers ANDed into every query of flare\'s own series, e.g. cluster="eu-1" '
            "(empty: none)"
        )
        .default_value(""),
        _query_variable(datasource, "run", f"label_values({RANK_INFO}{{{scoped}}}, run)"),
        _query_variable(
            datasource, "group", f'label_values({GROUP_INFO}{{run="$run", {scoped}}}, group)', multi=True
        ),
        _query_variable(
            datasource,
            "rank",
            f'label_values({RANK_INFO}{{run="$run", {scoped}}}, rank)',
            multi=not dashboard.single_rank,
        ),
    ]
    if "k" in dashboard.variables:
        variables.append(_k_variable())
    return variables


def _k_variable() -> Any:
    """$k: how many ranks (or groups) the top-k and bottom-k tables and series show."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import dashboard as models

    return (
        builders.CustomVariable("k")
        .label("Top / bottom k")
        .description("How many ranks (or groups) the top-k and bottom-k tables and series show")
        .values(",".join(str(k) for k in K_CHOICES))
        .current(models.VariableOption(selected=True, text=str(DEFAULT_K), value=str(DEFAULT_K)))
        .options(
            [models.VariableOption(selected=k == DEFAULT_K, text=str(k), value=str(k)) for k in K_CHOICES]
        )
    )


def _query_variable(datasource: Any, name: str, query: str, multi: bool = False) -> Any:
    """A variable whose values a query lists (`multi`: any number of them, All meaning `.*`)."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import dashboard as models

    variable = (
        builders.QueryVariable(name)
        .label(name.capitalize())
        .datasource(datasource)
        .query(query)
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.NUMERICAL_ASC if name == "rank" else models.VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def _alerts_annotation(datasource: Any) -> Any:
    """The run's firing alerts, marked on every time axis."""
    from grafana_foundation_sdk.builders import dashboard as builders

    return (
        builders.AnnotationQuery()
        .name("Flare alerts")
        .datasource(datasource)
        .enable(True)
        .icon_color("red")
        .expr(FIRING_ALERTS)
    )


def _link_to(other: Dashboard) -> Any:
    """A link to another flare dashboard, keeping the variables and the time range."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import dashboard as models

    return (
        builders.DashboardLink(other.title.removeprefix("Flare / "))
        .type(models.DashboardLinkType.LINK)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
        .url(other.path)
        .include_vars(True)
        .keep_time(True)
        .tooltip(other.description)
    )


def _layout(dashboard: Dashboard) -> list[tuple[Panel, dict[str, int]]]:
    """Each panel with its grid position: rows top to bottom, panels left to right."""
    placed, y = [], 0
    for row in dashboard.rows:
        x = 0
        for panel in row:
            placed.append((panel, {"x": x, "y": y, "w": panel.width, "h": panel.height}))
            x += panel.width
        if x > 24:
            raise ValueError(f"{dashboard.uid}: a row is {x} columns wide (at most 24)")
        y += max(panel.height for panel in row)
    return placed


# ---------------------------------------------------------------------------------------------------------
# a panel: its queries, its values' scale, links and hidden columns, and the options of its kind


def _panel(panel: Panel, number: int, position: dict[str, int], datasource: Any, selector: str) -> Any:
    """The panel's builder, numbered `number` and placed at `position`."""
    from grafana_foundation_sdk.builders import (
        bargauge,
        gauge,
        heatmap,
        stat,
        statetimeline,
        table,
        timeseries,
    )
    from grafana_foundation_sdk.models import dashboard as models

    kinds: dict[str, Any] = {
        "timeseries": timeseries.Panel,
        "heatmap": heatmap.Panel,
        "table": table.Panel,
        "stat": stat.Panel,
        "gauge": gauge.Panel,
        "bargauge": bargauge.Panel,
        "state-timeline": statetimeline.Panel,
    }
    built = (
        kinds[panel.kind]()
        .id(number)
        .title(panel.title)
        .description(panel.description)
        .datasource(datasource)
        .grid_pos(models.GridPos(x=position["x"], y=position["y"], w=position["w"], h=position["h"]))
    )
    for query in _queries(panel, datasource, selector):
        built = built.with_target(query)
    if panel.max_points:
        built = built.max_data_points(panel.max_points)
    built = _with_scale(built, panel)
    built = _with_links_and_columns(built, panel)
    return _with_options_of_kind(built, panel)


def _queries(panel: Panel, datasource: Any, selector: str) -> list[Any]:
    """The panel's Prometheus queries, refIds A, B, ... in order."""
    from grafana_foundation_sdk.builders import prometheus
    from grafana_foundation_sdk.models import prometheus as prometheus_models

    queries = []
    for index, target in enumerate(panel.targets):
        query = (
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + index))
            .datasource(datasource)
            .expr(with_selector(target.expr, selector))
            .format(prometheus_models.PromQueryFormat(target.format))
        )
        query = query.instant() if target.instant else query.range()
        if target.legend:
            query = query.legend_format(target.legend)
        queries.append(query)
    return queries


def _with_scale(built: Any, panel: Panel) -> Any:
    """The panel with its unit, bounds and threshold colors, where it has them."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import dashboard as models

    unit = "short" if panel.count and not panel.unit else panel.unit
    if unit:
        built = built.unit(unit)
    if panel.min is not None:
        built = built.min(panel.min)
    if panel.max is not None:
        built = built.max(panel.max)
    if panel.steps:
        built = built.thresholds(
            builders.ThresholdsConfig()
            .mode(models.ThresholdsMode.ABSOLUTE)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .steps([models.Threshold(value=value, color=color) for value, color in panel.steps])
        )
    return built


def _with_links_and_columns(built: Any, panel: Panel) -> Any:
    """The panel with data links on its rank field, and a table's hidden columns, value column name and
    order, where it has them."""
    from grafana_foundation_sdk.builders import common
    from grafana_foundation_sdk.models import dashboard as models

    if panel.links:
        links = [{"title": title, "url": url} for title, url in panel.links]
        built = built.override_by_name("rank", [models.DynamicConfigValue(id_val="links", value=links)])
    organize: dict[str, Any] = {}
    if panel.hide_columns:
        organize["excludeByName"] = {name: True for name in panel.hide_columns}
    if panel.value_name:
        organize["renameByName"] = {"Value": panel.value_name}
        built = built.sort_by(
            [common.TableSortByFieldState().display_name(panel.value_name).desc(not panel.ascending)]
        )
    if organize:
        built = built.with_transformation(models.DataTransformerConfig(id_val="organize", options=organize))
    return built


def _with_options_of_kind(built: Any, panel: Panel) -> Any:
    """The panel with the options its kind shows: stacking, legends, the last value, headers, orientation,
    cells."""
    from grafana_foundation_sdk.builders import common, heatmap
    from grafana_foundation_sdk.models import common as common_models

    if panel.stacked:
        stacking = common.StackingConfig().mode(common_models.StackingMode.NORMAL)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
        built = built.stacking(stacking).fill_opacity(60)
    if panel.kind in ("timeseries", "state-timeline"):
        built = built.legend(
            common.VizLegendOptions()
            .display_mode(common_models.LegendDisplayMode.LIST)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .placement(common_models.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    if panel.kind in ("stat", "gauge", "bargauge"):
        built = built.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    if panel.kind == "table":
        built = built.show_header(True)
    if panel.kind == "bargauge":
        built = built.orientation(common_models.VizOrientation.HORIZONTAL)
    if panel.kind == "heatmap":
        built = (
            built.calculate(False)
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common_models.HeatmapCellLayout.LE))  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .y_axis(heatmap.YAxisConfig().unit(panel.unit))
            .cell_values(heatmap.CellValues().unit(panel.cell_unit))
        )
    return built
