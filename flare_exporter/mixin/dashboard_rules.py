"""Recording rules the dashboards read instead of counting ranks at query time: for each ranks heatmap (step
time, collective wait share, ILD drift), how many of a run's ranks have a value at most each bucket bound.
Runs where the mixin is generated (`flare rules`, the dashboards). Wired into the rules file as one group of
RULE_GROUPS (rules.py):

    RuleGroup("flare.dashboards", recordings=(dashboard_recording_rules,), slow=True)

Counted at query time, a heatmap evaluated every rank's values once per bound at each of its steps: at
1,024 ranks 1.6 s (step time) and 3.4 s (wait share) a refresh, paid again by every open dashboard
(docs/dashboards.md). Recorded on the slow schedule (the straggler and drift windows they count change
once in many steps), a refresh reads one series per bound and run. The price: a heatmap counts every rank
of the run (the view's $rank and $selector do not apply; `flare rules --selector` scopes the rules) and
moves once per slow_interval.

Each heatmap's per-rank values are recorded first, in the same group (its rules run in order), and its
buckets count that recording: computed inline, each of its 12 to 14 bounds would compute them again (at
6,144 ranks, the wait share's division alone cost Prometheus about a second a bound; benchmarks/rule_cost.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import spec
from .rule_model import Recording, Thresholds, selector

ILD_DRIFT_KS = spec.series("flare_ild_drift_ks")
STEP_DURATION_SECONDS = spec.histogram("flare_step_duration_seconds")
STRAGGLER_WINDOW_STEP_SECONDS = spec.series("flare_straggler_window_step_seconds")
STRAGGLER_WINDOW_WAIT_SECONDS = spec.series("flare_straggler_window_wait_seconds")

# Named as Prometheus names a histogram's bucket recordings: level `run`, `le` implied by `_bucket`.
STEP_TIME_RANKS = "run:flare_straggler_window_step_seconds_bucket:ranks"
WAIT_SHARE_RANKS = "run:flare_straggler_window_wait_share_bucket:ranks"
DRIFT_KS_RANKS = "run:flare_ild_drift_ks_bucket:ranks"
# Each rank's value the buckets count: its last straggler window's, its largest drift.
STEP_TIME_OF_RANK = "run_rank:flare_straggler_window_step_seconds:last"
WAIT_SHARE_OF_RANK = "run_rank:flare_straggler_window_wait_share:last"
DRIFT_KS_OF_RANK = "run_rank:flare_ild_drift_ks:max"

# The heatmaps' bucket bounds. Step time: the step-duration histogram's (1 ms to 1000 s); wait share: finer
# near 0, where a straggler is; KS drift: 5 % to 100 %.
STEP_TIME_BOUNDS = spec.BY_NAME[STEP_DURATION_SECONDS].buckets
WAIT_SHARE_BOUNDS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
KS_BOUNDS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def dashboard_recording_rules(t: Thresholds) -> list[Recording]:
    last_window = selector(t, 'ago="0"')
    step = f"max by (run, rank) ({STRAGGLER_WINDOW_STEP_SECONDS}{last_window})"
    wait = f"max by (run, rank) ({STRAGGLER_WINDOW_WAIT_SECONDS}{last_window})"
    drift = f"max by (run, rank) ({ILD_DRIFT_KS}{selector(t)})"
    return [
        Recording(STEP_TIME_OF_RANK, step),
        Recording(WAIT_SHARE_OF_RANK, f"{wait}\n/ {step}"),
        Recording(DRIFT_KS_OF_RANK, drift),
        Recording(STEP_TIME_RANKS, ranks_per_bucket(STEP_TIME_OF_RANK, STEP_TIME_BOUNDS, "run")),
        Recording(WAIT_SHARE_RANKS, ranks_per_bucket(WAIT_SHARE_OF_RANK, WAIT_SHARE_BOUNDS, "run")),
        Recording(DRIFT_KS_RANKS, ranks_per_bucket(DRIFT_KS_OF_RANK, KS_BOUNDS, "run")),
    ]


def ranks_per_bucket(values: str, bounds: Sequence[float], by: str = "") -> str:
    """How many ranks have a value of `values` (one series per rank) at most each bound, and in all (+Inf),
    per the labels `by` (none: over them all): cumulative buckets labelled `le`, as a Prometheus histogram's,
    which Grafana's heatmap draws per time bucket. len(bounds) + 1 series (per `by`) whatever the number of
    ranks (`bool`: a bucket no rank falls in counts 0 while any rank has a value)."""
    ranks = f"({' '.join(values.split())})"
    grouping = f" by ({by})" if by else ""
    parts = [
        f'label_replace(sum{grouping} ({ranks} <= bool {bound:g}), "le", "{bound:g}", "", "")'
        for bound in bounds
    ]
    parts.append(f'label_replace(count{grouping} ({ranks}), "le", "+Inf", "", "")')
    return "\n or ".join(parts)
