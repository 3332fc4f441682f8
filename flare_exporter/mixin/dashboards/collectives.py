"""The process groups' collectives: durations, waits (the straggler waits least), bandwidth, lag."""

from __future__ import annotations

from .metrics import (
    COLLECTIVE_DURATION,
    LAST_COMPLETED,
    LAST_ISSUED,
    WINDOW_STEP,
    WINDOW_WAIT,
)
from .model import (
    COLLECTIVES_UID,
    LAST_WINDOW,
    RANK_LINK,
    RANKS_IN_GROUPS,
    RATE,
    STALLED,
    Dashboard,
    Panel,
    Row,
    Target,
    bus_bandwidth,
    heatmap,
    in_flight_age,
    quantile,
    table,
    timeseries,
)


def collectives() -> Dashboard:
    """The collectives dashboard."""
    return Dashboard(
        COLLECTIVES_UID,
        "Flare / Collectives",
        "The process groups' collectives: how long they take, how much they move, which rank waits least "
        "(the straggler the others wait for) and how far each rank is behind its group.",
        (_durations(), _straggler_waits(), _bandwidth_and_lag(), _in_flight_and_rate()),
    )


def _durations() -> Row:
    """How long the selected groups' collectives take: their distribution and quantiles."""
    by_group_op = "group, op"
    return (
        heatmap(
            "Collective duration",
            "Issue-to-completion time of the selected groups' collectives on the selected ranks.",
            COLLECTIVE_DURATION,
            RANKS_IN_GROUPS,
            width=12,
            height=9,
        ),
        timeseries(
            "Collective duration p50 / p99 by group and op",
            "Quantiles of the collective duration histogram over the selected ranks.",
            Target(quantile(0.5, COLLECTIVE_DURATION, RANKS_IN_GROUPS, by_group_op), "{{group}} {{op}} p50"),
            Target(quantile(0.99, COLLECTIVE_DURATION, RANKS_IN_GROUPS, by_group_op), "{{group}} {{op}} p99"),
            width=12,
            height=9,
            unit="s",
        ),
    )


def _straggler_waits() -> Row:
    """Each rank's wait in collectives over the last straggler window: the straggler waits least."""
    return (
        Panel(
            "bargauge",
            "Ranks ordered by collective wait (the straggler waits least)",
            "Mean time per step each rank spent in collectives over the last straggler window, "
            "least first: in a synchronous job every rank waits for the slowest, so the straggler "
            "is at the top.",
            (Target(f"sort(max by (rank) ({WINDOW_WAIT}{LAST_WINDOW}))", "rank {{rank}}", instant=True),),
            width=12,
            height=8,
            unit="s",
            min=0,
        ),
        timeseries(
            "Collective wait and step time per window by rank",
            "Solid: mean step time of the last window; the wait series: time per step in "
            "collectives. A straggler steps longest and waits least.",
            Target(f"max by (rank) ({WINDOW_STEP}{LAST_WINDOW})", "step, rank {{rank}}"),
            Target(f"max by (rank) ({WINDOW_WAIT}{LAST_WINDOW})", "wait, rank {{rank}}"),
            width=12,
            height=8,
            unit="s",
        ),
    )


def _bandwidth_and_lag() -> Row:
    """The bus bandwidth the collectives reach, and how far each rank is behind its group."""
    return (
        timeseries(
            "Bus bandwidth by group and op",
            "Bytes per second of collective time on each rank, times the op's bus factor as "
            "nccl-tests defines it (all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all "
            "(n-1)/n, others 1; n the group's size): comparable with the link's bandwidth.",
            Target(bus_bandwidth(RANKS_IN_GROUPS), "{{group}} {{op}}"),
            width=12,
            height=8,
            unit="Bps",
        ),
        timeseries(
            "Sequence-number lag per group",
            "How many collectives each rank is behind the furthest rank of its group (issued), and "
            "how many it issued that have not completed. A rank behind while the group waits is "
            "the hang's culprit.",
            Target(
                f"max by (group) ({LAST_ISSUED}{RANKS_IN_GROUPS})\n"
                f"- on (group) group_right max by (group, rank) ({LAST_ISSUED}{RANKS_IN_GROUPS})",
                "behind, {{group}} rank {{rank}}",
            ),
            Target(
                f"max by (group, rank) ({LAST_ISSUED}{RANKS_IN_GROUPS})\n"
                f"- max by (group, rank) ({LAST_COMPLETED}{RANKS_IN_GROUPS})",
                "unfinished, {{group}} rank {{rank}}",
            ),
            width=12,
            height=8,
            unit="none",
        ),
    )


def _in_flight_and_rate() -> Row:
    """What each rank waits in now, and how many collectives complete per second."""
    return (
        table(
            "In flight now",
            "Each rank's oldest unfinished collective per group: op, state (issued: handed to the "
            "backend; started: running on the device) and its age in seconds.",
            in_flight_age("group, rank, op, state", RANKS_IN_GROUPS),
            width=12,
            height=8,
            unit="s",
            needs=frozenset({STALLED}),
            links=(("Rank detail", RANK_LINK),),
            hide_columns=("Time",),
        ),
        timeseries(
            "Collectives per second by group and op",
            "Completed collectives per second, summed over the selected ranks.",
            Target(
                f"sum by (group, op) (rate({COLLECTIVE_DURATION}_count{RANKS_IN_GROUPS}[{RATE}]))",
                "{{group}} {{op}}",
            ),
            width=12,
            height=8,
            unit="none",
        ),
    )
