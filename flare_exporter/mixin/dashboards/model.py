"""What the dashboards are made of: panels and their queries as plain records, the selectors and query
helpers the panels share, and the dashboards' addresses (build.py turns the records into Grafana's JSON).

Built for thousands of ranks: no panel is repeated per rank and no panel of the run-wide dashboards draws a
series per rank. A signal that names ranks shows as a table of the $k ranks at either end (topk/bottomk,
each row linking to the rank detail), as a heatmap counting the ranks per value bucket (recorded by the
flare.dashboards rules: dashboard_rules.py), or as the spread across ranks (fastest, median, slowest)."""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ... import config
from .metrics import (
    ALERTS,
    COLLECTIVE_BYTES,
    COLLECTIVE_DURATION,
    GROUP_INFO,
    IN_FLIGHT_INFO,
    IN_FLIGHT_STARTED,
    RANK_INFO,
    STEP_DURATION,
    THRESHOLDS,
    WINDOW_STEP,
    WINDOW_WAIT,
)

DATASOURCE = "${datasource}"
# The view's extra label matchers (a text box; empty: none), written raw after the other matchers of every
# selector of flare's own series: `{run="$run", rank=~"$rank", ${selector:raw}}` (PromQL takes the comma
# left before `}` when the box is empty). A selector given when the dashboards are generated (--selector)
# is written before it, in every query (with_selector).
SELECTOR = "${selector:raw}"
K = "$k"  # how many ranks (or groups) the top-k and bottom-k tables and series show
K_CHOICES = (5, 10, 20, 50, 100)
DEFAULT_K = 10
# The values Grafana starts the view-time variables with (the tests and previews fill them in likewise).
VIEW_DEFAULTS = {"selector": "", "k": str(DEFAULT_K)}

# What a panel needs beyond an ordinary CPU job (the tests feed those panels from a job that has it).
GPU = "gpu"  # GPU health from NVML (the fake NVML on CPU)
KERNEL = "kernel"  # kernel launches (the fake device on CPU)
DRIFT = "ild_drift"  # an ILD baseline and a window after it
RULES = "rules"  # Prometheus evaluating alerts/flare.rules.yml
FIRING = "firing"  # an alert firing
STALLED = "stalled"  # a collective in flight and a rank stalled (a hang)
PEAK = "mfu"  # a peak FLOP/s for the MFU: a GPU's by its NVML name, or peak_flops (none on CPU by default)
CANARY = "canary"  # the hardware canary on (canary=warn), in flight too, and a rank failing it
NEEDS = frozenset({GPU, KERNEL, DRIFT, RULES, FIRING, STALLED, PEAK, CANARY})


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    format: str = "time_series"  # or "table", "heatmap"


@dataclass(frozen=True)
class Panel:
    kind: str  # timeseries, heatmap, table, stat, gauge, bargauge, state-timeline
    title: str
    description: str
    targets: tuple[Target, ...]
    _: KW_ONLY
    width: int  # grid columns, of 24
    height: int  # grid rows
    unit: str = ""  # Grafana's unit of the values (checks.unit_problems: none left unset but counts)
    count: bool = False  # the values are pure counts (ranks, collectives, errors): shown as "short"
    needs: frozenset[str] = frozenset()
    min: float | None = None
    max: float | None = None
    steps: tuple[tuple[float | None, str], ...] = ()  # thresholds: (from value, color); None is the base
    links: tuple[tuple[str, str], ...] = ()  # data links: (title, url)
    hide_columns: tuple[str, ...] = ()  # tables: columns not shown
    value_name: str = ""  # tables: the name of the Value column, by which the rows are ordered
    ascending: bool = False  # tables: least first (else greatest first)
    cell_unit: str = ""  # heatmaps: the unit of a cell's count (`unit` is the unit of the buckets)
    max_points: int = 0  # at most this many steps over the time range (0: Grafana's, one per pixel)
    stacked: bool = False  # time series: stacked (parts of a whole)

    @property
    def numeric(self) -> bool:
        """Whether the panel shows numbers (a table whose Value column is hidden shows only labels)."""
        return self.kind != "table" or "Value" not in self.hide_columns


Row = tuple[Panel, ...]
VARIABLES = ("datasource", "selector", "run", "group", "rank")  # every dashboard's, in this order; then k


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    single_rank: bool = False  # $rank is one rank (the rank dashboard), else any number of them

    @property
    def panels(self) -> tuple[Panel, ...]:
        return tuple(panel for row in self.rows for panel in row)

    @property
    def variables(self) -> tuple[str, ...]:
        """Its variables: those of every flare dashboard, and $k where a panel shows the top or bottom k."""
        texts = [panel.title for panel in self.panels]
        texts += [target.expr for panel in self.panels for target in panel.targets]
        return VARIABLES + (("k",) if any(K in text for text in texts) else ())

    @property
    def path(self) -> str:
        return f"/d/{self.uid}/{slug(self.title)}"


def slug(title: str) -> str:
    """Grafana's URL slug of a dashboard title."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


# ---------------------------------------------------------------------------------------------------------
# the dashboards' addresses

OVERVIEW_UID = "flare-overview"
COLLECTIVES_UID = "flare-collectives"
ILD_UID = "flare-issue-latency"
RANK_UID = "flare-rank"
RANK_TITLE = "Flare / Rank detail"
RANK_LINK = (
    f"/d/{RANK_UID}/{slug(RANK_TITLE)}?var-datasource=${{datasource}}&${{selector:queryparam}}"
    "&var-run=${run}&var-rank=${__data.fields.rank}&${__url_time_range}"
)


# ---------------------------------------------------------------------------------------------------------
# selectors: the dashboard's run, ranks and groups, with the view's extra matchers


def sel(*matchers: str, rank: str = 'rank=~"$rank"', scoped: bool = True) -> str:
    """A selector for the dashboard's run (and ranks), with the view's extra matchers (`scoped`: flare's own
    series; a recording rule's or ALERTS carry only the labels the rule keeps, run, rank, group, and are
    scoped by the run alone)."""
    parts = ['run="$run"', *([rank] if rank else []), *matchers, *([SELECTOR] if scoped else [])]
    return "{" + ", ".join(parts) + "}"


def with_selector(expr: str, selector: str) -> str:
    """`expr` with the label matchers `selector` (checked, as label_matchers.check_selector returns them)
    ANDed into every selector of flare's own series: written before the view's own extra matchers."""
    return expr.replace(SELECTOR, f"{selector}, {SELECTOR}") if selector else expr


RATE = "$__rate_interval"
ONE_RANK = 'rank="$rank"'
GROUP_MATCH = 'group=~"$group"'
RANKS = sel()  # the run's selected ranks
RANKS_IN_GROUPS = sel(GROUP_MATCH)  # ... in the selected groups
GROUPS = sel(GROUP_MATCH, rank="")  # the selected groups, whatever the ranks
RECORDED_GROUPS = sel(GROUP_MATCH, rank="", scoped=False)  # ... in a recording rule's series
RECORDED_RUN = sel(rank="", scoped=False)  # a recording rule's series of the run, whatever the ranks
RECORDED_RANKS = sel(scoped=False)  # the selected ranks in a recording rule's series
RECORDED_RANKS_IN_GROUPS = sel(GROUP_MATCH, scoped=False)  # ... in the selected groups
THE_RANK = sel(rank=ONE_RANK)  # the rank of the rank dashboard
THE_RANK_IN_GROUPS = sel(GROUP_MATCH, rank=ONE_RANK)
RECORDED_THE_RANK = sel(rank=ONE_RANK, scoped=False)  # the rank of the rank dashboard in a recording's series
LAST_WINDOW = sel('ago="0"')  # the last closed straggler window
THE_RANK_LAST_WINDOW = sel('ago="0"', rank=ONE_RANK)
FIRING_ALERTS = ALERTS + sel('alertstate="firing"', rank="", scoped=False)

HANG = config.Config.hang_seconds  # the hang colours' scale: a run's threshold where its ranks export none
LIVENESS_WINDOW = THRESHOLDS.lookback  # how long a rank that stopped reporting shows as down, as in the rules


def liveness(selector: str, by: str) -> str:
    """Per `by`: 1 while the ranks of `selector` report (flare_rank_info, whatever labels discovery gave their
    targets), 0 once they stopped within LIVENESS_WINDOW."""
    seen = f"last_over_time({RANK_INFO}{selector}[{LIVENESS_WINDOW}])"
    return f"max by ({by}) ({RANK_INFO}{selector})\nor max by ({by}) (0 * {seen})"


def ranks_up(selector: str) -> str:
    """How many ranks of `selector` report."""
    return f"count({RANK_INFO}{selector}) or vector(0)"


def ranks_gone(selector: str) -> str:
    """How many ranks of `selector` reported within LIVENESS_WINDOW and no longer do."""
    seen = f"max by (rank) (last_over_time({RANK_INFO}{selector}[{LIVENESS_WINDOW}]))"
    return f"count({seen} unless on (rank) {RANK_INFO}{selector}) or vector(0)"


HANG_STEPS: tuple[tuple[float | None, str], ...] = ((None, "green"), (HANG / 2, "orange"), (HANG, "red"))


# ---------------------------------------------------------------------------------------------------------
# queries more than one panel asks


def mean_step(selector: str) -> str:
    """Each rank's mean step time over the rate interval."""
    return (
        f"sum by (rank) (rate({STEP_DURATION}_sum{selector}[{RATE}]))\n"
        f"/ sum by (rank) (rate({STEP_DURATION}_count{selector}[{RATE}]))"
    )


def quantile(q: float, histogram: str, selector: str, by: str = "") -> str:
    """The q-quantile of `histogram` over the rate interval, per the labels `by` (none: over them all)."""
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile({q:g}, sum by ({labels}) (rate({histogram}_bucket{selector}[{RATE}])))"


def bus_bandwidth(*matchers: str) -> str:
    """Bytes per second of collective time per group and op over the selected ranks (and `matchers`), times
    nccl-tests' bus factor for the op's algorithm."""
    members = f"count by (group) ({GROUP_INFO}{GROUPS})"
    factors = (
        ("allreduce.*", f"2 * ({members} - 1) / {members}"),
        ("allgather.*|reduce_scatter.*|alltoall.*", f"({members} - 1) / {members}"),
        ("broadcast|reduce|gather|scatter|send|recv.*", f"0 * {members} + 1"),
    )
    parts = []
    for ops, factor in factors:
        of_ops = sel(*matchers, f'op=~"{ops}"')
        parts.append(
            f"(sum by (group, op) (rate({COLLECTIVE_BYTES}{of_ops}[{RATE}]))\n"
            f" / sum by (group, op) (rate({COLLECTIVE_DURATION}_sum{of_ops}[{RATE}])))\n"
            f"* on (group) group_left () ({factor})"
        )
    return "\n or ".join(parts)


def in_flight_age(by: str, selector: str) -> str:
    """The age of each rank's oldest unfinished collective per group, with its op and state, by `by`."""
    return (
        f"max by ({by}) (\n"
        f"  (time() - {IN_FLIGHT_STARTED}{selector})\n"
        f"  * on (run, group, rank) group_left (op, state) {IN_FLIGHT_INFO}{selector}\n)"
    )


# ---------------------------------------------------------------------------------------------------------
# one value per rank, and what a panel shows of them whatever the number of ranks: the $k at either end, the
# ranks counted per value bucket (recorded: dashboard_rules.py), the spread


def window_step(selector: str = LAST_WINDOW) -> str:
    """Each rank's mean step time over the last closed straggler window."""
    return f"max by (rank) ({WINDOW_STEP}{selector})"


def wait_share(selector: str = LAST_WINDOW) -> str:
    """Each rank's share of the step spent in collectives over the last closed straggler window (the
    straggler waits least: the others wait for it)."""
    return f"max by (rank) ({WINDOW_WAIT}{selector})\n/ {window_step(selector)}"


def top(expr: str) -> str:
    """The $k series of `expr` with the greatest values (at each step of a range)."""
    return f"topk({K},\n{expr}\n)"


def bottom(expr: str) -> str:
    """The $k series of `expr` with the least values (at each step of a range)."""
    return f"bottomk({K},\n{expr}\n)"


def with_host(expr: str) -> str:
    """`expr` (series with a rank label) with each rank's host, from its flare_rank_info."""
    return f"{expr}\n* on (rank) group_left (host) max by (rank, host) ({RANK_INFO}{RANKS})"


def spread(values: str, what: str) -> tuple[Target, ...]:
    """The lowest, median and highest of `values` (one series per rank) over time: three series."""
    return (
        Target(f"min(\n{values}\n)", f"lowest {what}"),
        Target(f"quantile(0.5,\n{values}\n)", f"median {what}"),
        Target(f"max(\n{values}\n)", f"highest {what}"),
    )


# ---------------------------------------------------------------------------------------------------------
# panels of the kinds most panels are; `options` are Panel's (needs, steps, links, ...)


def timeseries(
    title: str, description: str, *targets: Target, width: int, height: int, **options: Any
) -> Panel:
    """Each target's series over time."""
    return Panel("timeseries", title, description, targets, width=width, height=height, **options)


def stat(title: str, description: str, expr: str, *, width: int, height: int, **options: Any) -> Panel:
    """One number: the instant value of `expr`."""
    query = (Target(expr, instant=True),)
    return Panel("stat", title, description, query, width=width, height=height, **options)


def table(title: str, description: str, expr: str, *, width: int, height: int, **options: Any) -> Panel:
    """The instant series of `expr`, one a row, their labels and value as columns (but `hide_columns`)."""
    query = (Target(expr, instant=True, format="table"),)
    return Panel("table", title, description, query, width=width, height=height, **options)


def labels_table(
    title: str, description: str, expr: str, *, width: int, height: int, **options: Any
) -> Panel:
    """The instant series of `expr`, one a row, their labels only: what they are, not a value."""
    return table(
        title, description, expr, width=width, height=height, hide_columns=("Time", "Value"), **options
    )


def bargauge(
    title: str, description: str, expr: str, legend: str, *, width: int, height: int, **options: Any
) -> Panel:
    """One bar per instant series of `expr`, named by `legend`."""
    query = (Target(expr, legend, instant=True),)
    return Panel("bargauge", title, description, query, width=width, height=height, **options)


def rank_table(
    title: str, description: str, ranks: str, *, value: str, width: int, height: int, **options: Any
) -> Panel:
    """The ranks of `ranks` (a topk or bottomk: $k rows whatever the number of ranks) with their host, the
    value column named `value` and ordered by it, each rank linking to its detail."""
    return table(
        title,
        description,
        with_host(ranks),
        width=width,
        height=height,
        links=(("Rank detail", RANK_LINK),),
        hide_columns=("Time",),
        value_name=value,
        **options,
    )


def heatmap(
    title: str, description: str, histogram: str, selector: str, *, width: int, height: int, **options: Any
) -> Panel:
    """The distribution of `histogram`'s observations (seconds) over the rate interval, bucket by bucket:
    each cell the observations per second in the bucket, summed over the selected ranks."""
    query = (Target(f"sum by (le) (rate({histogram}_bucket{selector}[{RATE}]))", "{{le}}", format="heatmap"),)
    return Panel(
        "heatmap", title, description, query, width=width, height=height, unit="s", cell_unit="ops", **options
    )


# Columns of a ranks heatmap over any time range: its recording changes once per slow_interval (1m), and more
# columns than that only repeat it.
HEATMAP_COLUMNS = 100


def rank_heatmap(
    title: str,
    description: str,
    recorded: str,
    *,
    unit: str,
    width: int,
    height: int,
    **options: Any,
) -> Panel:
    """Ranks over time: each cell how many of the run's ranks had a value in the bucket at that time, from
    `recorded` (dashboard_rules.py: the run's ranks counted per bucket bound `le`, cumulative, on the slow
    schedule). Grafana receives one series per bucket: at 6,144 ranks a heatmap of every rank's series would
    fetch 6,144 series and draw each in less than a pixel; counted, the pack is a band and a straggler a lone
    cell away from it. The count is the run's: $rank and $selector do not apply (the rules are scoped by
    `flare rules --selector`)."""
    query = (Target(f"sum by (le) ({recorded}{RECORDED_RUN})", "{{le}}", format="heatmap"),)
    return Panel(
        "heatmap",
        title,
        description,
        query,
        width=width,
        height=height,
        unit=unit,
        cell_unit="short",
        needs=frozenset({RULES}) | options.pop("needs", frozenset()),
        max_points=HEATMAP_COLUMNS,
        **options,
    )
