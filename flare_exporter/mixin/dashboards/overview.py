"""The run at a glance: ranks up, step rates, the firing alerts (the verdicts) and the groups' hang state."""

from __future__ import annotations

from .metrics import GROUP_MAX_AGE, LAST_COMPLETED, SLOWDOWN, STEPS
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
    RULES,
    Dashboard,
    Panel,
    Row,
    Target,
    liveness,
    mean_step,
    ranks_gone,
    ranks_up,
    stat,
    table,
    timeseries,
)


def overview() -> Dashboard:
    """The run overview dashboard."""
    return Dashboard(
        OVERVIEW_UID,
        "Flare / Run overview",
        "The run at a glance: which ranks are up, how fast they step, what the alerts (the rules engine's "
        "verdicts in PromQL) name, and whether a process group is hung.",
        (_headline_counts(), _ranks_over_time(), _step_times(), _verdicts_and_hangs()),
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
        ),
        stat(
            "Ranks down",
            f"Ranks that reported within the last {LIVENESS_WINDOW} and no longer do (FlareRankDown names "
            "them; FlareRanksMissing counts ranks of the world size never seen).",
            ranks_gone(RANKS),
            width=6,
            height=4,
            steps=red_from_one,
        ),
        stat(
            "Slowest rank's step rate",
            "Optimizer steps per second of the slowest rank.",
            f"min(rate({STEPS}{RANKS}[{RATE}]))",
            width=6,
            height=4,
        ),
        stat(
            "Firing alerts",
            "Flare alerts firing for this run (the verdict table below lists them).",
            f"count({FIRING_ALERTS})",
            width=6,
            height=4,
            needs=frozenset({FIRING}),
            steps=red_from_one,
        ),
    )


def _ranks_over_time() -> Row:
    """Each rank's liveness and step rate over time."""
    return (
        Panel(
            "state-timeline",
            "Ranks up / down",
            f"1: the rank reports (its flare_rank_info is scraped); 0: it reported within the last "
            f"{LIVENESS_WINDOW} and no longer does.",
            (Target(liveness(RANKS, "rank"), "rank {{rank}}"),),
            width=12,
            height=8,
            steps=((None, "red"), (1, "green")),
        ),
        timeseries(
            "Step rate by rank",
            "Optimizer steps per second of each rank.",
            Target(f"sum by (rank) (rate({STEPS}{RANKS}[{RATE}]))", "rank {{rank}}"),
            width=12,
            height=8,
            unit="none",
        ),
    )


def _step_times() -> Row:
    """How far apart the ranks' step times are, and how far each is from its own best."""
    return (
        timeseries(
            "Step time spread across ranks",
            "Each rank's mean step time over the interval: the fastest, the median and the slowest "
            "rank. A wide gap is a straggler (the Collectives dashboard says which rank).",
            Target(f"min(\n{mean_step(RANKS)}\n)", "fastest rank"),
            Target(f"quantile(0.5,\n{mean_step(RANKS)}\n)", "median rank"),
            Target(f"max(\n{mean_step(RANKS)}\n)", "slowest rank"),
            width=12,
            height=8,
            unit="s",
        ),
        timeseries(
            "Slowdown against each rank's own best",
            "The last straggler window's mean step time over the rank's own best window (1: as fast "
            "as it has ever been).",
            Target(f"max by (rank) ({SLOWDOWN}{RANKS})", "rank {{rank}}"),
            width=12,
            height=8,
            unit="none",
            steps=((None, "green"), (1.5, "orange"), (3, "red")),
        ),
    )


def _verdicts_and_hangs() -> Row:
    """The firing alerts as a table of verdicts, and each group's oldest collective in flight."""
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
            "Hang state per process group",
            "Age of each group's oldest unfinished collective (0: nothing in flight). At the run's hang "
            f"threshold (its ranks' hang_seconds; colours at {HANG:g} s, the default) the group is hung and "
            "FlareCollectiveHang fires.",
            (
                Target(
                    f"max by (group) ({GROUP_MAX_AGE}{GROUPS})\n"
                    f"or max by (group) (0 * {LAST_COMPLETED}{GROUPS})",
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
