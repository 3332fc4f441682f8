"""The run at a glance: ranks up, step rates and times across ranks, the slowest ranks, the firing alerts (the
verdicts), the groups' hang state, where the step time goes and what it costs (perf.py), the hardware
canary (canary.py) and the exporters' own health: as many panels and series at 6,144 ranks as at 4."""

from __future__ import annotations

from . import canary, perf
from .metrics import (
    COLLECTOR_DURATION,
    COLLECTOR_SUCCESS,
    EXPORTER_DROPPED,
    EXPORTER_ERRORS,
    GROUP_MAX_AGE,
    LAST_COMPLETED,
    SLOWDOWN,
    STEP_TIME_RANKS,
    STEPS,
)
from .model import (
    FIRING,
    FIRING_ALERTS,
    GROUPS,
    HANG,
    HANG_STEPS,
    LIVENESS_WINDOW,
    OVERVIEW_UID,
    RANK_LINK,
    RANKS,
    RATE,
    RECORDED_GROUPS,
    RULES,
    Dashboard,
    Panel,
    Row,
    Target,
    mean_step,
    rank_heatmap,
    rank_table,
    ranks_gone,
    ranks_up,
    sel,
    spread,
    stat,
    table,
    timeseries,
    top,
    window_step,
)

STEP_RATE = f"sum by (rank) (rate({STEPS}{RANKS}[{RATE}]))"


def overview() -> Dashboard:
    """The run overview dashboard."""
    return Dashboard(
        OVERVIEW_UID,
        "Flare / Run overview",
        "The run at a glance: how many ranks are up, how fast they step and how far apart, the slowest "
        "ranks, what the alerts (the rules engine's verdicts in PromQL) name, whether a process group is "
        "hung, where the step time goes (phases, bottleneck classes, MFU, the GPU-hours each rank and "
        "host cost), what the hardware canary measured, and the exporters' own health. Ranks show as "
        "counts, spreads, heatmaps and top-k tables: the same panels at any number of ranks.",
        (
            _headline_counts(),
            _ranks_and_step_rates(),
            _step_times(),
            _slowest_ranks(),
            _verdicts_and_hangs(),
            *perf.overview_rows(),
            *canary.overview_rows(),
            _exporter_health(),
        ),
    )


def _headline_counts() -> Row:
    """Four numbers: ranks up, ranks down, the slowest step rate, alerts firing."""
    red_from_one = ((None, "green"), (1, "red"))
    return (
        stat(
            "Ranks up",
            "Ranks that report: their flare_rank_info is scraped, whatever labels discovery gave them.",
            ranks_up(RANKS),
            width=6,
            height=4,
            count=True,
        ),
        stat(
            "Ranks down",
            f"Ranks that reported within the last {LIVENESS_WINDOW} and no longer do (FlareRankDown names "
            "them; FlareRanksMissing counts ranks of the world size never seen).",
            ranks_gone(RANKS),
            width=6,
            height=4,
            count=True,
            steps=red_from_one,
        ),
        stat(
            "Slowest rank's step rate",
            "Optimizer steps per second of the slowest rank.",
            f"min({STEP_RATE})",
            width=6,
            height=4,
            unit="ops",
        ),
        stat(
            "Firing alerts",
            "Flare alerts firing for this run (the verdict table below lists them).",
            f"count({FIRING_ALERTS})",
            width=6,
            height=4,
            count=True,
            needs=frozenset({FIRING}),
            steps=red_from_one,
        ),
    )


def _ranks_and_step_rates() -> Row:
    """How many ranks are up and down over time, and the spread of their step rates."""
    return (
        timeseries(
            "Ranks up and down",
            f"Up: ranks that report (their flare_rank_info is scraped); down: ranks that reported within "
            f"the last {LIVENESS_WINDOW} and no longer do. The verdict table names them.",
            Target(ranks_up(RANKS), "up"),
            Target(ranks_gone(RANKS), "down"),
            width=12,
            height=8,
            count=True,
        ),
        timeseries(
            "Step rate across ranks",
            "Optimizer steps per second: the slowest, the median and the fastest rank.",
            *spread(STEP_RATE, "rank"),
            width=12,
            height=8,
            unit="ops",
        ),
    )


def _step_times() -> Row:
    """How far apart the ranks' step times are, and every rank's step time counted per bucket over time."""
    return (
        timeseries(
            "Step time spread across ranks",
            "Each rank's mean step time over the interval: the fastest, the median and the slowest "
            "rank. A wide gap is a straggler (the tables below and the Collectives dashboard say which).",
            *spread(mean_step(RANKS), "rank"),
            width=12,
            height=8,
            unit="s",
        ),
        rank_heatmap(
            "Ranks by step time",
            "How many of the run's ranks had each mean step time over their last straggler window, over "
            "time: the pack is a band, a straggler a lone cell above it (the ranks are counted by the "
            "flare.dashboards rules once a minute: one series per bucket whatever the number of ranks; "
            "every rank of the run, whatever $rank and $selector).",
            STEP_TIME_RANKS,
            unit="s",
            width=12,
            height=8,
        ),
    )


def _slowest_ranks() -> Row:
    """The $k ranks with the longest step time, and those most slowed down against their own best."""
    return (
        rank_table(
            "Slowest ranks (top $k by step time)",
            "The ranks with the longest mean step time over their last straggler window, with their host. "
            "Click a rank for its detail.",
            top(window_step()),
            value="step time",
            unit="s",
            width=12,
            height=8,
        ),
        timeseries(
            "Most slowed down against their own best (top $k)",
            "The last straggler window's mean step time over the rank's own best window (1: as fast "
            "as it has ever been), for the $k ranks most slowed down at each time.",
            Target(top(f"max by (rank) ({SLOWDOWN}{RANKS})"), "rank {{rank}}"),
            width=12,
            height=8,
            unit="suffix:×",
            steps=((None, "green"), (1.5, "orange"), (3, "red")),
        ),
    )


def _verdicts_and_hangs() -> Row:
    """The firing alerts as a table of verdicts, and the $k groups with the oldest collective in flight."""
    return (
        table(
            "Current verdicts (firing alerts)",
            "The alerts mirror the rules engine's verdicts (`flare diagnose`), so in Prometheus the "
            "current verdicts are the run's firing ALERTS: alertname is the kind, rank the culprit, "
            "host or group the fault domain. Click a rank for its detail; `flare diagnose "
            "--prometheus URL --run RUN` adds the evidence.",
            FIRING_ALERTS,
            width=14,
            height=9,
            needs=frozenset({FIRING}),
            links=(("Rank detail", RANK_LINK),),
            hide_columns=("Time", "Value", "__name__", "alertstate", "run"),
        ),
        Panel(
            "bargauge",
            "Hang state: oldest collective in flight (top $k groups)",
            "Age of the oldest unfinished collective of the $k groups where it is oldest (0: nothing in "
            f"flight). At the run's hang threshold (its ranks' hang_seconds; colours at {HANG:g} s, the "
            "default) the group is hung and FlareCollectiveHang fires.",
            (
                Target(
                    top(
                        f"max by (group) ({GROUP_MAX_AGE}{RECORDED_GROUPS})\n"
                        f"or max by (group) (0 * {LAST_COMPLETED}{GROUPS})"
                    ),
                    "{{group}}",
                    instant=True,
                ),
            ),
            width=10,
            height=9,
            unit="s",
            needs=frozenset({RULES}),
            min=0,
            max=HANG * 1.2,
            steps=HANG_STEPS,
        ),
    )


def _exporter_health() -> Row:
    """The $k ranks whose exporter has the most problems, and the $k slowest to collect."""
    not_failed = sel('queue!="failed_collectives"')  # a failed collective is not the exporter's problem
    return (
        rank_table(
            "Exporter problems (top $k ranks)",
            "Collectors failing on the last scrape, plus the errors the exporter caught and the events it "
            "dropped over the dashboard's time range (a failed collective's own drops are not counted). "
            "0: healthy.",
            top(
                f"sum by (rank) (\n  (1 - {COLLECTOR_SUCCESS}{RANKS})\n"
                f"  or increase({EXPORTER_ERRORS}{RANKS}[$__range])\n"
                f"  or increase({EXPORTER_DROPPED}{not_failed}[$__range])\n)"
            ),
            value="problems",
            width=12,
            height=8,
            count=True,
            steps=((None, "green"), (1, "red")),
        ),
        rank_table(
            "Slowest exporters (top $k by collection time)",
            "Time the rank's collectors took on its last scrape, all together: a scrape that nears the "
            "scrape timeout loses the rank's series.",
            top(f"sum by (rank) ({COLLECTOR_DURATION}{RANKS})"),
            value="collection time",
            unit="s",
            width=12,
            height=8,
        ),
    )
