"""Issue latency (ILD): kernel issue and host dispatch latency per rank, and their drift from its baseline."""

from __future__ import annotations

from ...policies import IldPolicy
from .metrics import DISPATCH_ILD, DRIFT_KS, DRIFT_W1, KERNEL_ILD, OP_SHIFT
from .model import DRIFT, ILD_UID, KERNEL, RANKS, Dashboard, Panel, Row, Target, heatmap, quantile, timeseries

KERNEL_TITLE = "Kernel issue latency"
DISPATCH_TITLE = "Host dispatch latency"


def issue_latency() -> Dashboard:
    """The issue latency dashboard."""
    return Dashboard(
        ILD_UID,
        "Flare / Issue latency",
        "Issue-latency distributions (ILD): kernel issue latency (device start minus host launch; a "
        "stalling host collapses it toward zero) and host dispatch latency (grows under CPU contention), "
        "each rank against its own baseline.",
        (
            (_per_rank_heatmap(KERNEL_ILD, KERNEL_TITLE, frozenset({KERNEL})),),
            (_per_rank_heatmap(DISPATCH_ILD, DISPATCH_TITLE, frozenset()),),
            _now_and_before_row(),
            _drift_row(),
            _op_shift_row(),
        ),
    )


def _per_rank_heatmap(histogram: str, what: str, needs: frozenset[str]) -> Panel:
    """The distribution of `histogram`, one copy of the panel per selected rank."""
    return heatmap(
        f"{what}, rank $rank",
        f"Distribution of the {what.lower()} on this rank (one panel per selected rank).",
        histogram,
        RANKS,
        width=24,  # Grafana sizes the copies: 24 / ranks wide, at least 6
        height=8,
        needs=needs,
        repeat="rank",
    )


def _now_and_before_row() -> Row:
    """The median of both distributions now and since each rank started."""
    return (
        _now_and_before(KERNEL_ILD, KERNEL_TITLE, frozenset({KERNEL})),
        _now_and_before(DISPATCH_ILD, DISPATCH_TITLE, frozenset()),
    )


def _now_and_before(histogram: str, what: str, needs: frozenset[str]) -> Panel:
    """The median of `histogram` per rank over the last interval and over every sample since the start."""
    return timeseries(
        f"{what}: current vs since start",
        "p50 per rank over the last interval (current) and over every sample since the rank started "
        "(dominated by the baseline steps early in a run). The drift panels compare the current window "
        "with each rank's own calibrated baseline.",
        Target(quantile(0.5, histogram, RANKS, "rank"), "current p50, rank {{rank}}"),
        Target(
            f"histogram_quantile(0.5, sum by (rank, le) ({histogram}_bucket{RANKS}))",
            "since start p50, rank {{rank}}",
        ),
        width=12,
        height=8,
        unit="s",
        needs=needs,
    )


def _drift_row() -> Row:
    """Each rank's drift from its own baseline: KS and Wasserstein over time, and KS now."""
    by_distribution = "{{distribution}}, rank {{rank}}"
    return (
        timeseries(
            "KS drift from baseline",
            "Kolmogorov-Smirnov statistic between the current window and the rank's baseline "
            "(0: same distribution, 1: disjoint).",
            Target(f"max by (rank, distribution) ({DRIFT_KS}{RANKS})", by_distribution),
            width=8,
            height=8,
            unit="none",
            needs=frozenset({DRIFT}),
            min=0,
            max=1,
        ),
        timeseries(
            "Wasserstein drift from baseline",
            "Wasserstein-1 distance between the current window and the rank's baseline, in seconds.",
            Target(f"max by (rank, distribution) ({DRIFT_W1}{RANKS})", by_distribution),
            width=8,
            height=8,
            unit="s",
            needs=frozenset({DRIFT}),
        ),
        Panel(
            "gauge",
            "KS drift now",
            "The largest KS drift of each rank over both distributions; a shift on one rank points "
            "at its host, on every rank at a job-wide change.",
            (Target(f"max by (rank) ({DRIFT_KS}{RANKS})", "rank {{rank}}", instant=True),),
            width=8,
            height=8,
            unit="none",
            needs=frozenset({DRIFT}),
            min=0,
            max=1,
            steps=((None, "green"), (0.3, "orange"), (0.6, "red")),
        ),
    )


def _op_shift_row() -> Row:
    """The delay the current window adds to every op of the host dispatch."""
    return (
        timeseries(
            "Per-op shift of host dispatch",
            "The delay the current window adds to every op, from each op's fastest time per sampled "
            "step against its baseline (stable ops weigh most). A uniform host slowdown too small "
            "to move KS or W1 shows here; the engine names a rank from "
            f"{IldPolicy().op_shift_seconds * 1e9:g} ns.",
            Target(f"max by (rank) ({OP_SHIFT}{RANKS})", "rank {{rank}}"),
            width=24,
            height=8,
            unit="s",
            needs=frozenset({DRIFT}),
        ),
    )
