"""The process groups' collectives: durations, waits (the straggler waits least), the seconds a rank costs the
others, bandwidth, lag and what is in flight, as the $k ranks or groups at either end, heatmaps and
distributions: as many panels and series at 6,144 ranks as at 4."""

from __future__ import annotations

from .metrics import (
    COLLECTIVE_DURATION,
    GROUP_RANK_BEHIND,
    LAST_COMPLETED,
    LAST_ISSUED,
    LOST_BY_RANK,
    STRAGGLER_SCORE,
    THRESHOLDS,
    WAIT_SHARE_RANKS,
)
from .model import (
    COLLECTIVES_UID,
    GROUP_MATCH,
    RANK_LINK,
    RANKS_IN_GROUPS,
    RATE,
    RECORDED_RANKS,
    RECORDED_RANKS_IN_GROUPS,
    RULES,
    STALLED,
    Dashboard,
    Row,
    Target,
    bottom,
    bus_bandwidth,
    heatmap,
    in_flight_age,
    quantile,
    rank_heatmap,
    rank_table,
    table,
    timeseries,
    top,
    wait_share,
)


def collectives() -> Dashboard:
    """The collectives dashboard."""
    return Dashboard(
        COLLECTIVES_UID,
        "Flare / Collectives",
        "The process groups' collectives: how long they take, how much they move, which ranks wait least "
        "(the straggler the others wait for) and what they cost the others, how far ranks are behind "
        "their group and what is in flight. Ranks and groups show as heatmaps, distributions and top-k "
        "tables: the same panels at any number of ranks.",
        (_durations(), _waits(), _straggler_tables(), _bandwidth_and_lag(), _in_flight_and_rate()),
    )


def _durations() -> Row:
    """How long the selected groups' collectives take: their distribution, and the slowest groups."""
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
            "Collective duration p99 (top $k groups and ops)",
            "The 99th percentile of the collective duration over the selected ranks, for the $k groups "
            "and ops where it is longest at each time.",
            Target(
                top(quantile(0.99, COLLECTIVE_DURATION, RANKS_IN_GROUPS, "group, op")), "{{group}} {{op}}"
            ),
            width=12,
            height=9,
            unit="s",
        ),
    )


def _waits() -> Row:
    """Every rank's wait share counted per bucket over time, and its spread."""
    return (
        rank_heatmap(
            "Ranks by collective wait share",
            "How many of the run's ranks spent each share of their step waiting in collectives over "
            "their last straggler window, over time. In a synchronous job every rank waits for the "
            "slowest: the pack is a band and a straggler a lone cell below it (counted by the "
            "flare.dashboards rules once a minute: one series per bucket whatever the number of ranks; "
            "every rank of the run, whatever $rank and $selector).",
            WAIT_SHARE_RANKS,
            unit="percentunit",
            width=12,
            height=8,
        ),
        timeseries(
            "Collective wait share across ranks",
            "Share of the step spent waiting in collectives over the last straggler window: the least "
            "(the straggler candidate), the median and the most of the selected ranks.",
            Target(f"min(\n{wait_share()}\n)", "least (straggler candidate)"),
            Target(f"quantile(0.5,\n{wait_share()}\n)", "median rank"),
            Target(f"max(\n{wait_share()}\n)", "most"),
            width=12,
            height=8,
            unit="percentunit",
            min=0,
        ),
    )


def _straggler_tables() -> Row:
    """The $k ranks that wait least, cost the others most, and score highest as stragglers."""
    return (
        rank_table(
            "Straggler candidates (bottom $k by wait share)",
            "The ranks that spent the least share of their step waiting in collectives over the last "
            "straggler window: the others wait for them. Click a rank for its detail.",
            bottom(wait_share()),
            value="wait share",
            ascending=True,
            unit="percentunit",
            width=8,
            height=8,
        ),
        rank_table(
            "Seconds lost to the rank per second (top $k, badput ledger)",
            "The badput ledger (recorded by the flare.perf rules over 5 minutes, as `flare stragglers` "
            "charges it): a synchronous collective ends when the last rank arrives, so the rank with the "
            "least collective time per step is charged the others' excess wait, times its steps per "
            "second: GPU-seconds the job loses to it each second (3: three GPUs' worth of time idle). One "
            "rank of a run is charged at a time; the overview adds it up over the time range by rank and "
            "host.",
            top(f"max by (rank) ({LOST_BY_RANK}{RECORDED_RANKS})"),
            value="lost per second",
            unit="suffix: GPU-s/s",
            needs=frozenset({RULES}),
            width=8,
            height=8,
        ),
        rank_table(
            "Straggler score (top $k ranks)",
            "The straggler alert's score: the rank's robust z below the median wait share (median/MAD "
            f"over the ranks, in units of the standard deviation), its lowest over the last "
            f"{THRESHOLDS.stragglers.hold_windows} windows (recorded by the slow signals' rules). "
            f"FlareStraggler names a rank from {THRESHOLDS.stragglers.window_z:g} when its wait gap holds "
            "too.",
            top(f"max by (rank) ({STRAGGLER_SCORE}{RECORDED_RANKS})"),
            value="robust z",
            unit="suffix:σ",
            needs=frozenset({RULES}),
            width=8,
            height=8,
        ),
    )


def _bandwidth_and_lag() -> Row:
    """The groups' slowest bus bandwidth, and the ranks furthest behind their group."""
    return (
        timeseries(
            "Bus bandwidth (bottom $k groups and ops)",
            "Bytes per second of collective time, times the op's bus factor as nccl-tests defines it "
            "(all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, others 1; n the "
            "group's size): comparable with the link's bandwidth. The $k groups and ops slowest at each "
            "time.",
            Target(bottom(bus_bandwidth(GROUP_MATCH)), "{{group}} {{op}}"),
            width=12,
            height=8,
            unit="Bps",
        ),
        timeseries(
            "Sequence-number lag (top $k ranks)",
            "How many collectives a rank is behind the furthest rank of its group (issued; recorded by the "
            "rules), and how many it issued that have not completed, for the $k ranks furthest behind; "
            "none while no rank is. A rank behind while the group waits is the hang's culprit.",
            Target(
                top(f"max by (group, rank) ({GROUP_RANK_BEHIND}{RECORDED_RANKS_IN_GROUPS}) > 0"),
                "behind, {{group}} rank {{rank}}",
            ),
            Target(
                top(
                    f"max by (group, rank) ({LAST_ISSUED}{RANKS_IN_GROUPS})\n"
                    f"- max by (group, rank) ({LAST_COMPLETED}{RANKS_IN_GROUPS}) > 0"
                ),
                "unfinished, {{group}} rank {{rank}}",
            ),
            width=12,
            height=8,
            count=True,
            needs=frozenset({RULES, STALLED}),
        ),
    )


def _in_flight_and_rate() -> Row:
    """The oldest collectives in flight now, and how many collectives complete per second."""
    return (
        table(
            "In flight now (oldest $k)",
            "The oldest unfinished collectives, one per rank and group: op, state (issued: handed to the "
            "backend; started: running on the device) and age. Click a rank for its detail.",
            top(in_flight_age("group, rank, op, state", RANKS_IN_GROUPS)),
            width=12,
            height=8,
            unit="s",
            needs=frozenset({STALLED}),
            links=(("Rank detail", RANK_LINK),),
            hide_columns=("Time",),
            value_name="age",
        ),
        timeseries(
            "Collectives per second (top $k groups and ops)",
            "Completed collectives per second, summed over the selected ranks, for the $k groups and ops "
            "that complete most.",
            Target(
                top(f"sum by (group, op) (rate({COLLECTIVE_DURATION}_count{RANKS_IN_GROUPS}[{RATE}]))"),
                "{{group}} {{op}}",
            ),
            width=12,
            height=8,
            unit="ops",
        ),
    )
