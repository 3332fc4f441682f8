"""Checks of the dashboards' JSON: the names their queries use and the invariants Grafana's types do not
state; and every panel's query with the dashboard's variables filled in (what Grafana sends), for the tests
and the previews."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import spec
from .. import rules_render
from .catalog import dashboards
from .metrics import PROMETHEUS_SERIES, RECORDED
from .model import DATASOURCE, FIRING, FIRING_ALERTS, VARIABLES, Dashboard, K, slug, with_selector

METRIC_BEFORE_SELECTOR = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*\{")
GRID_COLUMNS = 24
NO_UNIT = ("", "none")
DATASOURCE_REF = {"type": "prometheus", "uid": DATASOURCE}


def queries(model: Mapping[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard JSON model: panels' targets and annotations."""
    found = [target["expr"] for panel in model.get("panels", []) for target in panel.get("targets", [])]
    found += [item["expr"] for item in model.get("annotations", {}).get("list", []) if "expr" in item]
    return found


def names_in(expr: str) -> set[str]:
    """The series an expression names: flare_ series, recording rules and anything before a `{`."""
    return rules_render.names_in(expr) | set(METRIC_BEFORE_SELECTOR.findall(expr))


def unknown_metrics(models: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names in the dashboards' queries that neither the spec, a recording rule, nor Prometheus defines."""
    named: set[str] = set()
    for model in models:
        for expr in queries(model):
            named |= names_in(expr)
        for variable in model.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                named |= names_in(variable["query"])
    return named - spec.all_series_names() - RECORDED - PROMETHEUS_SERIES


# ---------------------------------------------------------------------------------------------------------
# the JSON's invariants


def problems(models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What is wrong with the dashboards' JSON models (empty: nothing), beyond what Grafana's types say."""
    found: list[str] = []
    uids = {model["uid"] for model in models.values()}
    paths = {f"/d/{model['uid']}/{slug(model['title'])}" for model in models.values()}
    for name, model in models.items():
        found += _dashboard_problems(name, model, paths)
        found += _panels_problems(name, model.get("panels", []), uids)
    return found


def _dashboard_problems(where: str, model: Mapping[str, Any], paths: set[str]) -> list[str]:
    """The dashboard's schema version, uid, variables and links to the other dashboards (`paths`)."""
    found = []
    if model.get("schemaVersion", 0) < 36:
        found.append(f"{where}: schemaVersion {model.get('schemaVersion')} is older than 36")
    if not re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", model.get("uid", "")):
        found.append(f"{where}: uid {model.get('uid')!r} is not a valid Grafana uid")
    found += _variable_problems(where, model)
    for link in model.get("links", []):
        to_itself = link.get("url", "").startswith(f"/d/{model['uid']}/")
        if link.get("url", "").split("?")[0] not in paths or to_itself:
            found.append(f"{where}: link {link.get('url')!r} is not another flare dashboard")
    return found


def _variable_problems(where: str, model: Mapping[str, Any]) -> list[str]:
    """Variables other than every flare dashboard's (and $k where a panel shows the top or bottom k), and a
    rank variable that takes several ranks (or All) on a dashboard whose queries want one."""
    found = []
    variables = {variable["name"]: variable for variable in model.get("templating", {}).get("list", [])}
    texts = queries(model) + [panel.get("title", "") for panel in model.get("panels", [])]
    expected = [*VARIABLES, *(["k"] if any(K in text for text in texts) else [])]
    if list(variables) != expected:
        found.append(f"{where}: variables are {list(variables)}, not {expected}")
    rank = variables.get("rank", {})
    if any('rank="$rank"' in expr for expr in queries(model)) and (
        rank.get("multi") or rank.get("includeAll")
    ):
        found.append(f"{where}: its queries take one rank, but $rank takes several (or All)")
    return found


def _panels_problems(where: str, panels: Sequence[Mapping[str, Any]], uids: set[str]) -> list[str]:
    """The panels' ids, places on the grid, queries and data links."""
    found = []
    ids = [panel.get("id") for panel in panels]
    if len(set(ids)) != len(ids) or None in ids:
        found.append(f"{where}: panel ids are not unique: {ids}")
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        title = f"{where}: panel {panel.get('title')!r}"
        found += _grid_problems(title, panel, cells)
        found += _query_problems(title, panel)
        found += _data_link_problems(title, panel, uids)
        found += _repeat_and_unit_problems(title, panel)
    return found


def _repeat_and_unit_problems(title: str, panel: Mapping[str, Any]) -> list[str]:
    """A panel repeated per value of a variable (at thousands of ranks, thousands of panels), and a numeric
    panel without a unit (a pure count says so: "short")."""
    found = []
    if panel.get("repeat"):
        found.append(f"{title}: repeats per ${panel['repeat']} (one copy per value)")
    if _numeric(panel) and panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "") in NO_UNIT:
        found.append(f"{title}: no unit (a pure count has unit short)")
    return found


def _numeric(panel: Mapping[str, Any]) -> bool:
    """Whether the panel shows numbers: any but a table whose Value column is hidden."""
    hidden: set[str] = set()
    for transformation in panel.get("transformations", []):
        hidden |= set(transformation.get("options", {}).get("excludeByName", {}))
    return panel.get("type") != "table" or "Value" not in hidden


def unit_problems(every: Iterable[Dashboard]) -> list[str]:
    """Panels whose unit is missing or says nothing ("none"), unless they declare their values pure counts
    (count=True, shown as "short"), and counts with another unit."""
    found = []
    for dashboard in every:
        for panel in dashboard.panels:
            where = f"{dashboard.uid}: panel {panel.title!r}"
            if panel.count and panel.unit not in ("", "short"):
                found.append(f"{where}: a count with unit {panel.unit!r}")
            if panel.numeric and not panel.count and panel.unit in NO_UNIT:
                found.append(f"{where}: no unit (declare count=True for a pure count)")
    return found


def expanded_panel_count(model: Mapping[str, Any], values: Mapping[str, int]) -> int:
    """How many panels Grafana draws of the dashboard when each variable has values[name] values selected
    (a panel repeated per a variable is drawn once per value)."""
    return sum(
        values.get(panel["repeat"], 1) if panel.get("repeat") else 1 for panel in model.get("panels", [])
    )


def _grid_problems(title: str, panel: Mapping[str, Any], cells: dict[tuple[int, int], str]) -> list[str]:
    """The panel outside the grid, or on a cell of `cells` (the panels before it), which it then claims."""
    found = []
    grid = panel.get("gridPos", {})
    x, y, w, h = (grid.get(key, -1) for key in ("x", "y", "w", "h"))
    if x < 0 or y < 0 or w < 1 or h < 1 or x + w > GRID_COLUMNS:
        found.append(f"{title}: gridPos {grid} is outside the 24-column grid")
    overlapped = _claim_cells(
        cells, str(panel.get("title")), range(max(x, 0), min(x + w, GRID_COLUMNS)), y, h
    )
    if overlapped is not None:
        found.append(f"{title} overlaps {overlapped!r}")
    return found


def _claim_cells(cells: dict[tuple[int, int], str], owner: str, columns: range, y: int, h: int) -> str | None:
    """Mark the cells of `columns` and h lines from y as `owner`'s, up to the first one another panel
    holds: that panel's title (None: no overlap)."""
    for column in columns:
        for line in range(max(y, 0), max(y, 0) + max(h, 0)):
            if (column, line) in cells:
                return cells[column, line]
            cells[column, line] = owner
    return None


def _query_problems(title: str, panel: Mapping[str, Any]) -> list[str]:
    """The panel's and its queries' data source, and its queries' refIds and expressions."""
    found = []
    if panel.get("datasource") != DATASOURCE_REF:
        found.append(f"{title}: datasource is not ${{datasource}}")
    targets = panel.get("targets", [])
    if not targets:
        found.append(f"{title}: no query")
    ref_ids = [target.get("refId") for target in targets]
    if None in ref_ids or len(set(ref_ids)) != len(ref_ids):
        found.append(f"{title}: refIds {ref_ids} are missing or repeated")
    for target in targets:
        if target.get("datasource") != DATASOURCE_REF:
            found.append(f"{title}: query {target.get('refId')} has no ${{datasource}}")
        if not target.get("expr"):
            found.append(f"{title}: query {target.get('refId')} has no expression")
    return found


def _data_link_problems(title: str, panel: Mapping[str, Any], uids: set[str]) -> list[str]:
    """The panel's data links that open no flare dashboard."""
    found = []
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        for prop in override.get("properties", []):
            for link in prop.get("value", []) if prop.get("id") == "links" else []:
                uid = link["url"].split("/")[2] if link["url"].startswith("/d/") else ""
                if uid not in uids:
                    found.append(f"{title}: data link {link['url']!r} is not a flare dashboard")
    return found


# ---------------------------------------------------------------------------------------------------------
# queries with the dashboard's variables filled in (what Grafana sends), for the tests and the previews


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with $name, ${name} and ${name:raw} replaced by values[name], longest names first."""
    for name in sorted(values, key=len, reverse=True):
        for form in ("${" + name + ":raw}", "${" + name + "}", "$" + name):
            expr = expr.replace(form, values[name])
    return expr


def variable_query_as_promql(query: str) -> str:
    """A `label_values(selector, label)` variable query as the PromQL that lists the same values."""
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip(), re.S)
    if not match:
        raise ValueError(f"not a label_values query: {query!r}")
    return f"group by ({match.group(2)}) ({match.group(1)})"


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool
    needs: frozenset[str] = field(default_factory=frozenset)


def panel_queries(selector: str = "") -> list[PanelQuery]:
    """Every query of every panel, with what its signal needs (`selector`: as generated with it)."""
    found = []
    for dashboard in dashboards():
        for panel in dashboard.panels:
            for index, target in enumerate(panel.targets):
                ref_id = chr(ord("A") + index)
                expr = with_selector(target.expr, selector)
                found.append(
                    PanelQuery(dashboard.uid, panel.title, ref_id, expr, target.instant, panel.needs)
                )
        found.append(
            PanelQuery(
                dashboard.uid, "annotation: Flare alerts", "", FIRING_ALERTS, True, frozenset({FIRING})
            )
        )
    return found
