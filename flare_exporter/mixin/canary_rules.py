"""Alert rules of the hardware canary (rank/canary.py): a failed preflight, a failed in-flight check, drift.

Not yet in RULE_GROUPS: `rules.py` wires them with
`RuleGroup("flare.canary", alerts=(canary_alerts,), slow=True)` (the canary measures once in many steps;
a minute's evaluation interval loses nothing), and its runbook sections are those of docs/canary.md.
"""

from __future__ import annotations

from .. import spec
from .rule_model import Alert, Thresholds, link, selector
from .rule_model import with_host as _with_host

CANARY_DRIFT = spec.series("flare_canary_drift")
CANARY_FAILED = spec.series("flare_canary_failed")
CANARY_RELATIVE = spec.series("flare_canary_relative")


def canary_alerts(t: Thresholds) -> list[Alert]:
    return [_preflight_failed(t), _in_flight_failed(t), _drift(t)]


def _failed(t: Thresholds, phase: str) -> str:
    """Per rank, measurement and scope: 1 where the rank failed the canary in `phase`."""
    matcher = f'phase="{phase}"'
    return f"max by (run, rank, measurement, scope) ({CANARY_FAILED}{selector(t, matcher)}) == 1"


def _preflight_failed(t: Thresholds) -> Alert:
    """A rank below the canary's policy at the preflight (under canary=warn: the job trains on, slowly)."""
    expr = _failed(t, "preflight")
    return Alert(
        "FlareCanaryPreflightFailed",
        _with_host(expr),
        "0s",  # measured once, before the first step: nothing to wait for
        "warning",
        "Rank {{ $labels.rank }} of run {{ $labels.run }} failed the canary's {{ $labels.measurement }}",
        "Rank {{ $labels.rank }} on host {{ $labels.host }} measured {{ $labels.measurement }} "
        "({{ $labels.scope }}) below the canary's floor before the first step: its hardware sets the job's "
        f"pace. `{CANARY_RELATIVE}` says how far below the job's median; reschedule without the host.",
        "flarecanarypreflightfailed",
        link("rank", "rank"),
    )


def _in_flight_failed(t: Thresholds) -> Alert:
    """A rank whose last in-flight check fell below the relaxed threshold (a fraction of its preflight)."""
    expr = _failed(t, "in_flight")
    return Alert(
        "FlareCanaryInFlightFailed",
        _with_host(expr),
        t.gpu_for,
        "warning",
        "Rank {{ $labels.rank }} of run {{ $labels.run }} lost {{ $labels.measurement }} in flight",
        "Rank {{ $labels.rank }} on host {{ $labels.host }} measured {{ $labels.measurement }} "
        "({{ $labels.scope }}) below canary_in_flight_fraction of its own preflight value.",
        "flarecanaryinflightfailed",
        link("rank", "rank"),
    )


def _drift(t: Thresholds) -> Alert:
    """A measurement whose moving average fell below the drift band: slow, sustained loss."""
    expr = f"max by (run, rank, measurement, scope) ({CANARY_DRIFT}{selector(t)}) == 1"
    return Alert(
        "FlareCanaryDrift",
        _with_host(expr),
        t.gpu_for,
        "warning",
        "Rank {{ $labels.rank }} of run {{ $labels.run }} is drifting on {{ $labels.measurement }}",
        "The moving average of rank {{ $labels.rank }}'s {{ $labels.measurement }} ({{ $labels.scope }}, "
        "host {{ $labels.host }}) is below the canary's drift band of its preflight value: a slow, "
        "sustained loss (a link or a GPU degrading) before any single check fails.",
        "flarecanarydrift",
        link("rank", "rank"),
    )
