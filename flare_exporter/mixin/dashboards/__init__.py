"""Grafana dashboards, generated from the metric spec and the rules' thresholds (`dashboards/`).

    python -m flare_exporter.mixin.dashboards [--out dashboards/] [--check] [--selector MATCHERS]

Four dashboards, linked to each other and sharing the variables `$datasource`, `$selector` (extra label
matchers, typed in), `$run`, `$group` and `$rank`, and `$k`: the run at a glance, the collectives of the
process groups, issue latency (ILD), and one rank in depth, reached from the others' tables by a link. Made
for thousands of ranks: no panel is repeated per rank, and a signal that names ranks shows as the $k ranks
at either end (topk/bottomk tables), a heatmap counting ranks per bucket, or the spread across ranks.
--selector ANDs label matchers (as `flare rules --selector` takes them, e.g. 'cluster="eu-1"') into every
query of flare's own series (a recording rule's series and ALERTS carry only the labels the rule keeps and
are matched by run). They are built with Grafana's own Python builders (grafana-foundation-sdk, in the
`dev` extra) and committed as JSON ready for file provisioning; a test regenerates them and fails when they
differ, checks the units and that no panel repeats, runs every panel's query against a real Prometheus, and
checks that panels name only metrics the spec or a recording rule defines. Each panel names its metrics
through the constants of metrics.py, checked against the spec when it is imported: a renamed metric is a
one-line fix there.

One module per dashboard (overview, collectives, issue_latency, rank_detail), one per instrument whose rows
the overview and the rank detail show (perf: where the step time goes; canary), the records and query
helpers they share (model), their metrics (metrics), Grafana's JSON (build) and the checks (checks). The
ranks heatmaps read counts the flare.dashboards rules record (mixin/dashboard_rules.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ...config import ConfigError
from ..label_matchers import check_selector
from .build import all_json, build, render, typed_round_trip
from .catalog import dashboards
from .checks import (
    PanelQuery,
    expanded_panel_count,
    names_in,
    panel_queries,
    problems,
    queries,
    substitute,
    unit_problems,
    unknown_metrics,
    variable_query_as_promql,
)
from .metrics import _defined
from .model import (
    COLLECTIVES_UID,
    DATASOURCE,
    DEFAULT_K,
    FIRING_ALERTS,
    ILD_UID,
    NEEDS,
    OVERVIEW_UID,
    RANK_UID,
    VARIABLES,
    VIEW_DEFAULTS,
    Dashboard,
    Panel,
    Target,
    slug,
)

__all__ = [
    "COLLECTIVES_UID",
    "DATASOURCE",
    "DEFAULT_K",
    "DEFAULT_OUT",
    "FIRING_ALERTS",
    "ILD_UID",
    "NEEDS",
    "OVERVIEW_UID",
    "RANK_UID",
    "VARIABLES",
    "VIEW_DEFAULTS",
    "Dashboard",
    "Panel",
    "PanelQuery",
    "Target",
    "_defined",
    "all_json",
    "build",
    "dashboards",
    "expanded_panel_count",
    "main",
    "names_in",
    "panel_queries",
    "problems",
    "queries",
    "render",
    "slug",
    "substitute",
    "typed_round_trip",
    "unit_problems",
    "unknown_metrics",
    "variable_query_as_promql",
]

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "dashboards"  # the checkout's dashboards/


def main(argv: list[str] | None = None) -> int:
    """Write every dashboard's JSON file into --out, or with --check say (exit 1) which differ; exit 2 for a
    --selector Prometheus would not parse."""
    parser = argparse.ArgumentParser(prog="python -m flare_exporter.mixin.dashboards", description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory of the JSON files")
    parser.add_argument("--check", action="store_true", help="fail if the files differ from the output")
    parser.add_argument(
        "--selector", default="", help="extra label matchers for every query, e.g. 'cluster=\"eu-1\"'"
    )
    args = parser.parse_args(argv)
    try:
        selector = check_selector(args.selector)
    except ConfigError as error:
        print(f"flare: {error}", file=sys.stderr)
        return 2
    models = all_json(selector)
    wrong = unit_problems(dashboards()) + problems(models)
    if wrong:
        print("flare: the dashboards are wrong:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    return _write_or_check(models, Path(args.out), args.check)


def _write_or_check(models: dict[str, dict[str, Any]], out: Path, check: bool) -> int:
    """Write the models' JSON files into `out`, or (`check`) say (exit 1) which differ from them."""
    stale = []
    for name, model in models.items():
        path = out / name
        text = render(model)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            f"flare: stale dashboards (run python -m flare_exporter.mixin.dashboards): {', '.join(stale)}",
            file=sys.stderr,
        )
        return 1
    return 0
