"""Grafana dashboards, generated from the metric spec and the rules' thresholds (`dashboards/`).

    python -m flare_exporter.mixin.dashboards [--out dashboards/] [--check]

Four dashboards, linked to each other and sharing the variables `$datasource`, `$run`, `$group` and
`$rank`: the run at a glance, the collectives of the process groups, issue latency (ILD), and one rank in
depth. They are built with Grafana's own Python builders (grafana-foundation-sdk, in the `dev` extra) and
committed as JSON ready for file provisioning; a test regenerates them and fails when they differ, runs
every panel's query against a real Prometheus, and checks that panels name only metrics the spec or a
recording rule defines. Each panel names its metrics through the constants of metrics.py, checked against
the spec when it is imported: a renamed metric is a one-line fix there.

One module per dashboard (overview, collectives, issue_latency, rank_detail), the records and query
helpers they share (model), their metrics (metrics), Grafana's JSON (build) and the checks (checks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .build import all_json, build, render, typed_round_trip
from .catalog import dashboards
from .checks import (
    VARIABLES,
    PanelQuery,
    names_in,
    panel_queries,
    problems,
    queries,
    substitute,
    unknown_metrics,
    variable_query_as_promql,
)
from .metrics import _defined
from .model import (
    COLLECTIVES_UID,
    DATASOURCE,
    FIRING_ALERTS,
    ILD_UID,
    NEEDS,
    OVERVIEW_UID,
    RANK_UID,
    Dashboard,
    Panel,
    Target,
    slug,
)

__all__ = [
    "COLLECTIVES_UID",
    "DATASOURCE",
    "DEFAULT_OUT",
    "FIRING_ALERTS",
    "ILD_UID",
    "NEEDS",
    "OVERVIEW_UID",
    "RANK_UID",
    "VARIABLES",
    "Dashboard",
    "Panel",
    "PanelQuery",
    "Target",
    "_defined",
    "all_json",
    "build",
    "dashboards",
    "main",
    "names_in",
    "panel_queries",
    "problems",
    "queries",
    "render",
    "slug",
    "substitute",
    "typed_round_trip",
    "unknown_metrics",
    "variable_query_as_promql",
]

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "dashboards"  # the checkout's dashboards/


def main(argv: list[str] | None = None) -> int:
    """Write every dashboard's JSON file into --out, or with --check say (exit 1) which differ."""
    parser = argparse.ArgumentParser(prog="python -m flare_exporter.mixin.dashboards", description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory of the JSON files")
    parser.add_argument("--check", action="store_true", help="fail if the files differ from the output")
    args = parser.parse_args(argv)
    out = Path(args.out)
    stale = []
    for name, model in all_json().items():
        path = out / name
        text = render(model)
        if args.check:
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
