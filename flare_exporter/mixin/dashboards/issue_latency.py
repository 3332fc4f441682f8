"""Issue latency (ILD): kernel issue and host dispatch latency over the selected ranks, and each rank's drift
from its own baseline as a heatmap of ranks and the $k ranks that drifted most: as many panels and series
at 6,144 ranks as at 4 (each rank's own distributions are on the rank detail)."""

from __future__ import annotations

from ...policies import IldPolicy
from .metrics import DISPATCH_ILD, DRIFT_KS, DRIFT_KS_RANKS, DRIFT_W1, KERNEL_ILD, OP_SHIFT
from .model import (
    DRIFT,
    ILD_UID,
    KERNEL,
    RANKS,
    Dashboard,
    Panel,
    Row,
    Target,
    heatmap,
    quantile,
    rank_heatmap,
    rank_table,
    timeseries,
    top,
)

KERNEL_TITLE = "Kernel issue latency"
DISPATCH_TITLE = "Host dispatch latency"
KS_STEPS: tuple[tuple[float | None, str], ...] = ((None, "green"), (0.3, "orange"), (0.6, "red"))


def issue_latency() -> Dashboard:
    """The issue latency dashboard."""
    return Dashboard(
        ILD_UID,
        "Flare / Issue latency",
        "Issue-latency distributions (ILD): kernel issue latency (device start minus host launch; a "
        "stalling host collapses it toward zero) and host dispatch latency (grows under CPU contention) "
        "over the selected ranks, and each rank's drift from its own baseline: a shift on a few ranks "
        "points at their hosts, on every rank at a job-wide change. Click a rank for its own.",
        (
            _distributions_row(),
            _drift_now_row(),
            _drift_over_time_row(),
            _now_and_before_row(),
        ),
    )


def _distributions_row() -> Row:
    """Both distributions over the selected ranks."""
    return (
        _distribution(KERNEL_ILD, KERNEL_TITLE, frozenset({KERNEL})),
        _distribution(DISPATCH_ILD, DISPATCH_TITLE, frozenset()),
    )


def _distribution(histogram: str, what: str, needs: frozenset[str]) -> Panel:
    """The distribution of `histogram` over the selected ranks."""
    return heatmap(
        what,
        f"Distribution of the {what.lower()} over the selected ranks (each rank's own is on the rank "
        "detail; the drift panels compare each rank with its baseline).",
        histogram,
        RANKS,
        width=12,
        height=8,
        needs=needs,
    )


def _drift_now_row() -> Row:
    """Every rank's KS drift counted per bucket over time, and the $k ranks that drifted most."""
    return (
        rank_heatmap(
            "Ranks by KS drift",
            "How many of the run's ranks had each Kolmogorov-Smirnov drift from their own baseline (the "
            "larger of both distributions'), over time: a few ranks apart from the pack point at their "
            "hosts, the whole band moving at a job-wide change (counted by the flare.dashboards rules once "
            "a minute; every rank of the run, whatever $rank and $selector).",
            DRIFT_KS_RANKS,
            unit="percentunit",
            width=12,
            height=8,
            needs=frozenset({DRIFT}),
        ),
        rank_table(
            "Most drifted ranks (top $k by KS)",
            "The ranks and distributions whose current window is furthest from the rank's own baseline "
            "(Kolmogorov-Smirnov: 0 same distribution, 100% disjoint), with their host. Click a rank for "
            "its detail.",
            top(f"max by (rank, distribution) ({DRIFT_KS}{RANKS})"),
            value="KS drift",
            unit="percentunit",
            width=12,
            height=8,
            needs=frozenset({DRIFT}),
            steps=KS_STEPS,
        ),
    )


def _drift_over_time_row() -> Row:
    """The $k ranks that drifted most over time: KS, Wasserstein and the per-op shift."""
    by_distribution = "{{distribution}}, rank {{rank}}"
    return (
        timeseries(
            "KS drift from baseline (top $k)",
            "Kolmogorov-Smirnov statistic between the current window and the rank's baseline (0: same "
            "distribution, 100%: disjoint), for the $k ranks and distributions furthest at each time.",
            Target(top(f"max by (rank, distribution) ({DRIFT_KS}{RANKS})"), by_distribution),
            width=8,
            height=8,
            unit="percentunit",
            needs=frozenset({DRIFT}),
            min=0,
            max=1,
        ),
        timeseries(
            "Wasserstein drift from baseline (top $k)",
            "Wasserstein-1 distance between the current window and the rank's baseline, for the $k ranks "
            "and distributions furthest at each time.",
            Target(top(f"max by (rank, distribution) ({DRIFT_W1}{RANKS})"), by_distribution),
            width=8,
            height=8,
            unit="s",
            needs=frozenset({DRIFT}),
        ),
        timeseries(
            "Per-op shift of host dispatch (top $k)",
            "The delay the current window adds to every op, from each op's fastest time per sampled "
            "step against its baseline (stable ops weigh most), for the $k ranks shifted most. A uniform "
            "host slowdown too small to move KS or W1 shows here; the engine names a rank from "
            f"{IldPolicy().op_shift_seconds * 1e9:g} ns.",
            Target(top(f"max by (rank) ({OP_SHIFT}{RANKS})"), "rank {{rank}}"),
            width=8,
            height=8,
            unit="s",
            needs=frozenset({DRIFT}),
        ),
    )


def _now_and_before_row() -> Row:
    """The median and p99 of both distributions over the selected ranks, now and since they started."""
    return (
        _now_and_before(KERNEL_ILD, KERNEL_TITLE, frozenset({KERNEL})),
        _now_and_before(DISPATCH_ILD, DISPATCH_TITLE, frozenset()),
    )


def _now_and_before(histogram: str, what: str, needs: frozenset[str]) -> Panel:
    """The median of `histogram` over the selected ranks over the last interval and since they started."""
    return timeseries(
        f"{what}: current vs since start",
        "p50 and p99 over the selected ranks over the last interval (current), and p50 over every sample "
        "since the ranks started (dominated by the baseline steps early in a run).",
        Target(quantile(0.5, histogram, RANKS), "current p50"),
        Target(quantile(0.99, histogram, RANKS), "current p99"),
        Target(
            f"histogram_quantile(0.5, sum by (le) ({histogram}_bucket{RANKS}))",
            "since start p50",
        ),
        width=12,
        height=8,
        unit="s",
        needs=needs,
    )
