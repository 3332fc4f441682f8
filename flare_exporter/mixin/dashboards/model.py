"""What the dashboards are made of: panels and their queries as plain records, the selectors and query
helpers the panels share, and the dashboards' addresses (build.py turns the records into Grafana's JSON)."""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .metrics import (
    ALERTS,
    COLLECTIVE_BYTES,
    COLLECTIVE_DURATION,
    DEFAULT_HANG_SECONDS,
    GROUP_INFO,
    IN_FLIGHT_INFO,
    IN_FLIGHT_STARTED,
    RANK_INFO,
    STEP_DURATION,
    THRESHOLDS,
)

DATASOURCE = "${datasource}"

# What a panel needs beyond an ordinary CPU job (the tests feed those panels from a job that has it).
GPU = "gpu"  # GPU health from NVML (the fake NVML on CPU)
KERNEL = "kernel"  # kernel launches (the fake device on CPU)
DRIFT = "ild_drift"  # an ILD baseline and a window after it
RULES = "rules"  # Prometheus evaluating alerts/flare.rules.yml
FIRING = "firing"  # an alert firing
STALLED = "stalled"  # a collective in flight and a rank stalled (a hang)
NEEDS = frozenset({GPU, KERNEL, DRIFT, RULES, FIRING, STALLED})


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
    unit: str = ""
    needs: frozenset[str] = frozenset()
    min: float | None = None
    max: float | None = None
    steps: tuple[tuple[float | None, str], ...] = ()  # thresholds: (from value, color); None is the base
    repeat: str = ""  # a variable: one copy of the panel per value
    links: tuple[tuple[str, str], ...] = ()  # data links: (title, url)
    hide_columns: tuple[str, ...] = ()  # tables: columns not shown


Row = tuple[Panel, ...]


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
    f"/d/{RANK_UID}/{slug(RANK_TITLE)}?var-datasource=${{datasource}}&var-run=${{run}}"
    "&var-rank=${__data.fields.rank}&${__url_time_range}"
)


# ---------------------------------------------------------------------------------------------------------
# selectors: the dashboard's run, ranks and groups, with the rules' extra matchers


def sel(*matchers: str, rank: str = 'rank=~"$rank"') -> str:
    """A selector for the dashboard's run (and ranks), with the rules' extra matchers."""
    parts = ['run="$run"', *([rank] if rank else []), *matchers]
    if THRESHOLDS.selector:
        parts.append(THRESHOLDS.selector)
    return "{" + ", ".join(parts) + "}"


RATE = "$__rate_interval"
ONE_RANK = 'rank="$rank"'
GROUP_MATCH = 'group=~"$group"'
RANKS = sel()  # the run's selected ranks
RANKS_IN_GROUPS = sel(GROUP_MATCH)  # ... in the selected groups
GROUPS = sel(GROUP_MATCH, rank="")  # the selected groups, whatever the ranks
THE_RANK = sel(rank=ONE_RANK)  # the rank of the rank dashboard
THE_RANK_IN_GROUPS = sel(GROUP_MATCH, rank=ONE_RANK)
LAST_WINDOW = sel('ago="0"')  # the last closed straggler window
THE_RANK_LAST_WINDOW = sel('ago="0"', rank=ONE_RANK)
FIRING_ALERTS = ALERTS + sel('alertstate="firing"', rank="")

HANG = DEFAULT_HANG_SECONDS
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


def quantile(q: float, histogram: str, selector: str, by: str) -> str:
    """The q-quantile of `histogram` over the rate interval, per the labels `by`."""
    return f"histogram_quantile({q:g}, sum by ({by}, le) (rate({histogram}_bucket{selector}[{RATE}])))"


def bus_bandwidth(selector: str) -> str:
    """Bytes per second of collective time per rank, times nccl-tests' bus factor for the op's algorithm."""
    members = f"count by (group) ({GROUP_INFO}{GROUPS})"
    factors = (
        ("allreduce.*", f"2 * ({members} - 1) / {members}"),
        ("allgather.*|reduce_scatter.*|alltoall.*", f"({members} - 1) / {members}"),
        ("broadcast|reduce|gather|scatter|send|recv.*", f"0 * {members} + 1"),
    )
    parts = []
    for ops, factor in factors:
        of_ops = selector[:-1] + f', op=~"{ops}"}}'
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
# panels of the kinds most panels are; `options` are Panel's (needs, steps, links, ...)


def timeseries(
    title: str, description: str, *targets: Target, width: int, height: int, **options: Any
) -> Panel:
    """Each target's series over time."""
    return Panel("timeseries", title, description, targets, width=width, height=height, **options)


def stat(
    title: str, description: str, expr: str, *, width: int, height: int, unit: str = "none", **options: Any
) -> Panel:
    """One number: the instant value of `expr`."""
    query = (Target(expr, instant=True),)
    return Panel("stat", title, description, query, width=width, height=height, unit=unit, **options)


def table(title: str, description: str, expr: str, *, width: int, height: int, **options: Any) -> Panel:
    """The instant series of `expr`, one a row, their labels and value as columns (but `hide_columns`)."""
    query = (Target(expr, instant=True, format="table"),)
    return Panel("table", title, description, query, width=width, height=height, **options)


def heatmap(
    title: str, description: str, histogram: str, selector: str, *, width: int, height: int, **options: Any
) -> Panel:
    """The distribution of `histogram`'s observations (seconds) over the rate interval, bucket by bucket."""
    query = (Target(f"sum by (le) (rate({histogram}_bucket{selector}[{RATE}]))", "{{le}}", format="heatmap"),)
    return Panel("heatmap", title, description, query, width=width, height=height, unit="s", **options)
