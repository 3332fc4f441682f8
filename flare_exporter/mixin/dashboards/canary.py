"""The hardware canary (rank/canary.py, docs/canary.md): the rows of the run overview (the ranks lowest
against the job's median, the ranks failing, in-flight drift, how long it ran) and of the rank detail (the
rank's measurements against the job's median and its own preflight, its failures): as many panels and
series at 6,144 ranks as at 4."""

from __future__ import annotations

from ...config import Config
from .metrics import CANARY_DURATION, CANARY_EWMA, CANARY_FAILED, CANARY_RELATIVE
from .model import (
    CANARY,
    RANK_LINK,
    RANKS,
    THE_RANK,
    Row,
    Target,
    bargauge,
    bottom,
    labels_table,
    rank_table,
    timeseries,
    top,
    with_host,
)

NEEDS_CANARY = frozenset({CANARY})
DEFAULTS = Config()
# Against the job's median: red below the pass line (canary_relative_floor).
RELATIVE_STEPS: tuple[tuple[float | None, str], ...] = (
    (None, "red"),
    (DEFAULTS.canary_relative_floor, "green"),
)
# In flight, against the rank's own preflight: red below the relaxed hard threshold, orange in the drift band.
IN_FLIGHT_STEPS: tuple[tuple[float | None, str], ...] = (
    (None, "red"),
    (DEFAULTS.canary_in_flight_fraction, "orange"),
    (1 - DEFAULTS.canary_drift_band, "green"),
)
MEASURED = "{{measurement}} {{scope}}"


def overview_rows() -> tuple[Row, ...]:
    """The run overview's canary rows."""
    return (_lowest_and_failing(), _drift_and_duration())


def _lowest_and_failing() -> Row:
    """The $k lowest measurements against the job's median, and the ranks that failed the canary."""
    return (
        rank_table(
            "Canary: lowest against the job's median (bottom $k)",
            "The preflight measurements furthest below the job's median for the same measurement and scope "
            "(1: as fast as the median rank), with the rank and its host: compute (gemm_flops), bus "
            "bandwidth within and across hosts, copies, storage, PCIe width. Below "
            f"{DEFAULTS.canary_relative_floor:.0%} (canary_relative_floor, its default) the rank fails. "
            "Click a rank for its detail.",
            bottom(f"min by (rank, measurement, scope) ({CANARY_RELATIVE}{RANKS})"),
            value="of the median",
            ascending=True,
            unit="percentunit",
            steps=RELATIVE_STEPS,
            width=12,
            height=8,
            needs=NEEDS_CANARY,
        ),
        labels_table(
            "Ranks failing the canary (first $k)",
            "Ranks and measurements below the canary's policy, with their host: in the preflight, below an "
            "absolute floor or canary_relative_floor of the job's median; in flight, below "
            "canary_in_flight_fraction of the rank's own preflight. Under canary=enforce a failed preflight "
            "ends the job (exit 75); under warn it trains on, at the failing rank's pace. FlareCanary* "
            "alerts page them. Click a rank for its detail.",
            with_host(top(f"max by (rank, measurement, scope, phase) ({CANARY_FAILED}{RANKS}) == 1")),
            width=12,
            height=8,
            links=(("Rank detail", RANK_LINK),),
            needs=NEEDS_CANARY,
        ),
    )


def _drift_and_duration() -> Row:
    """The $k in-flight moving averages furthest below their preflight, and how long the canary ran."""
    return (
        timeseries(
            "Canary in flight: moving average against preflight (bottom $k)",
            "Each in-flight measurement's exponentially weighted moving average over the rank's own "
            "preflight value, for the $k lowest at each time: a link or a GPU losing speed slowly crosses "
            f"the drift band ({1 - DEFAULTS.canary_drift_band:.0%}, canary_drift_band) long before a single "
            f"check falls below {DEFAULTS.canary_in_flight_fraction:.0%} (canary_in_flight_fraction).",
            Target(
                bottom(f"min by (rank, measurement, scope) ({CANARY_EWMA}{RANKS})"),
                f"rank {{{{rank}}}} {MEASURED}",
            ),
            width=16,
            height=8,
            unit="percentunit",
            steps=IN_FLIGHT_STEPS,
            needs=NEEDS_CANARY,
        ),
        bargauge(
            "Canary run time (slowest rank)",
            "Wall time of the canary's last run on the slowest rank, by phase: the preflight (before the "
            "first step: the job starts this much later) and the in-flight set (training pauses this long "
            "every canary_interval_steps steps).",
            f"max by (phase) ({CANARY_DURATION}{RANKS})",
            "{{phase}}",
            width=8,
            height=8,
            unit="s",
            min=0,
            needs=NEEDS_CANARY,
        ),
    )


def rank_row() -> Row:
    """The rank detail's canary row: its measurements against the job's median and its own preflight, and
    what it failed."""
    return (
        bargauge(
            "Canary against the job's median (preflight)",
            "Each preflight measurement of this rank over the job's median for the same measurement and "
            f"scope (1: as fast as the median rank); below {DEFAULTS.canary_relative_floor:.0%} "
            "(canary_relative_floor, its default) it fails.",
            f"max by (measurement, scope) ({CANARY_RELATIVE}{THE_RANK})",
            MEASURED,
            width=8,
            height=8,
            unit="percentunit",
            min=0,
            steps=RELATIVE_STEPS,
            needs=NEEDS_CANARY,
        ),
        timeseries(
            "Canary in flight against its preflight",
            "The moving average of each in-flight measurement over this rank's own preflight value: "
            f"below {1 - DEFAULTS.canary_drift_band:.0%} it drifts (FlareCanaryDrift), a single check "
            f"below {DEFAULTS.canary_in_flight_fraction:.0%} fails.",
            Target(f"max by (measurement, scope) ({CANARY_EWMA}{THE_RANK})", MEASURED),
            width=8,
            height=8,
            unit="percentunit",
            steps=IN_FLIGHT_STEPS,
            needs=NEEDS_CANARY,
        ),
        labels_table(
            "Canary failures",
            "The measurements this rank failed, by phase (preflight: against the floors and the job's "
            "median; in_flight: against its own preflight). Empty: it passed.",
            f"max by (measurement, scope, phase) ({CANARY_FAILED}{THE_RANK}) == 1",
            width=8,
            height=8,
            needs=NEEDS_CANARY,
        ),
    )
