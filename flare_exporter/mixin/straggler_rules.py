"""Recording and alert rules of stragglers (rank/straggler_windows.py): per window, each rank's share of the
step spent waiting in collectives against the run's median (a straggler waits least), as
diagnosis.py's straggler rules weigh it (policies.StragglerPolicy); the summary `flare diagnose` reads in
place of every rank's windows at thousands of ranks (record_names.py); and a job-wide slowdown. Wired into
the rules file as part of the group flare.slow_signals of RULE_GROUPS (rules.py).
"""

from __future__ import annotations

from .. import spec
from ..record_names import (
    BEST_STEP_RANKS,
    LAST_WINDOW,
    POOLED_SHARE,
    SUMMARY_AT,
    SUMMARY_POOLED,
    WINDOW_RANKS,
    WINDOW_SHARE,
)
from .gpu_rules import GPU_SLOWDOWN
from .host_load_rules import BUSY_EVERYWHERE
from .rule_model import Alert, Recording, Thresholds, link, selector
from .rule_model import with_host as _with_host

GPU_CLOCK_EVENT_ACTIVE = spec.series("flare_gpu_clock_event_active")
STRAGGLER_BEST_STEP_SECONDS = spec.series("flare_straggler_best_step_seconds")
STRAGGLER_LAST_WINDOW = spec.series("flare_straggler_last_window")
STRAGGLER_SLOWDOWN_RATIO = spec.series("flare_straggler_slowdown_ratio")
STRAGGLER_WINDOW_STEP_SECONDS = spec.series("flare_straggler_window_step_seconds")
STRAGGLER_WINDOW_WAIT_SECONDS = spec.series("flare_straggler_window_wait_seconds")


def straggler_recording_rules(t: Thresholds) -> list[Recording]:
    held = selector(t, f'ago=~"{_held_windows(t)}"')
    return [
        # Per window of the last hold_windows (ago=0 the last closed one; the older windows a rank
        # exports are for dashboards): each rank's share of the step spent waiting in collectives, the run's
        # median and MAD of it, and the rank's robust z below the median (a straggler waits least); then over
        # those windows, its lowest z and mean gap.
        Recording(
            "run_rank_ago:flare_straggler_wait_share:ratio",
            f"max by (run, rank, ago) ({STRAGGLER_WINDOW_WAIT_SECONDS}{held} / "
            f"{STRAGGLER_WINDOW_STEP_SECONDS}{held})",
        ),
        Recording(
            f"{WINDOW_SHARE}:median",
            "quantile by (run, ago) (0.5, run_rank_ago:flare_straggler_wait_share:ratio)",
        ),
        Recording(
            f"{WINDOW_SHARE}:mad",
            "quantile by (run, ago) (0.5, abs(\n"
            "  run_rank_ago:flare_straggler_wait_share:ratio\n"
            "  - on (run, ago) group_left run_ago:flare_straggler_wait_share:median\n))",
        ),
        Recording(
            "run_rank_ago:flare_straggler_wait_share:gap",
            "run_ago:flare_straggler_wait_share:median\n"
            "- on (run, ago) group_right run_rank_ago:flare_straggler_wait_share:ratio",
        ),
        Recording(
            "run_rank_ago:flare_straggler_score:robust_z",
            "run_rank_ago:flare_straggler_wait_share:gap\n"
            "/ on (run, ago) group_left clamp_min(1.4826 * run_ago:flare_straggler_wait_share:mad, 0.005)",
        ),
        Recording(
            "run_rank:flare_straggler_score:held",
            "min by (run, rank) (run_rank_ago:flare_straggler_score:robust_z)",
        ),
        Recording(
            "run_rank:flare_straggler_wait_share:min_gap",
            "min by (run, rank) (run_rank_ago:flare_straggler_wait_share:gap)",
        ),
        Recording(
            "run_rank:flare_straggler_wait_share:gap",
            "avg by (run, rank) (run_rank_ago:flare_straggler_wait_share:gap)",
        ),
    ]


def straggler_summary_rules(t: Thresholds) -> list[Recording]:
    """What `flare diagnose` reads of a run's straggler windows at thousands of ranks in place of every
    rank's (rule_types.WindowSummary): each rank's wait share over the last hold_windows together, their
    median and MAD; how many ranks have each window, and a best step time; the lowest and the highest last
    window of a rank; and the lowest of the ranks' step times over their own best. All at one evaluation:
    the last rule's timestamp is theirs."""
    held = selector(t, f'ago=~"{_held_windows(t)}"')
    s = selector(t)

    def per_window(name: str) -> str:
        return f"max by (run, rank, ago) ({name}{held})"

    pooled_median = f"{POOLED_SHARE}:median"
    return [
        Recording(
            SUMMARY_POOLED,
            f"sum by (run, rank) ({per_window(STRAGGLER_WINDOW_WAIT_SECONDS)})\n"
            f"/ sum by (run, rank) ({per_window(STRAGGLER_WINDOW_STEP_SECONDS)})",
        ),
        Recording(pooled_median, f"quantile by (run) (0.5, {SUMMARY_POOLED})"),
        Recording(
            f"{POOLED_SHARE}:mad",
            f"quantile by (run) (0.5, abs({SUMMARY_POOLED} - on (run) group_left {pooled_median}))",
        ),
        Recording(
            WINDOW_RANKS,
            "count by (run, ago) (run_rank_ago:flare_straggler_wait_share:ratio)",
        ),
        Recording(
            BEST_STEP_RANKS,
            f"count by (run) (max by (run, rank) ({STRAGGLER_BEST_STEP_SECONDS}{s}) > 0)",
        ),
        Recording(f"{LAST_WINDOW}:min", f"min by (run) ({STRAGGLER_LAST_WINDOW}{s})"),
        Recording(f"{LAST_WINDOW}:max", f"max by (run) ({STRAGGLER_LAST_WINDOW}{s})"),
        Recording(
            SUMMARY_AT,
            "min by (run) (\n"
            f"  min by (run, rank) ({per_window(STRAGGLER_WINDOW_STEP_SECONDS)})\n"
            f"  / on (run, rank) max by (run, rank) ({STRAGGLER_BEST_STEP_SECONDS}{s})\n)",
        ),
    ]


def _one_line(expr: str) -> str:
    return " ".join(expr.split())


def _held_windows(t: Thresholds) -> str:
    return "|".join(str(ago) for ago in range(t.stragglers.hold_windows))


_GPU_REASONS = (
    f'{{{{ with printf "{GPU_CLOCK_EVENT_ACTIVE}{{run=%q, rank=%q, reason=~\\"'
    + GPU_SLOWDOWN
    + '\\"} == 1" $labels.run $labels.rank | query }} Its GPU reports:{{ range . }} {{ .Labels.reason }}'
    "{{ end }}.{{ end }}"
)


def straggler_alerts(t: Thresholds) -> list[Alert]:
    policy = t.stragglers
    named = (
        f"run_rank:flare_straggler_score:held >= {policy.window_z:g}\n"
        f"  and on (run, rank) run_rank:flare_straggler_wait_share:min_gap >= {policy.window_gap:g}\n"
        f"  and on (run, rank) run_rank:flare_straggler_wait_share:gap >= {policy.min_wait_gap:g}"
    )
    few = (
        f"count by (run) ({_one_line(named)}) * 2\n    < count by (run) (run_rank:flare_straggler_score:held)"
    )
    enough_ranks = f"count by (run) (run_rank:flare_straggler_score:held) >= {policy.min_ranks}"
    return [
        Alert(
            "FlareRankStraggler",
            _with_host(f"{named}\n  and on (run) ({few})\n  and on (run) ({enough_ranks})"),
            t.straggler_for,
            "warning",
            "Rank {{ $labels.rank }} of run {{ $labels.run }} is a straggler",
            "Rank {{ $labels.rank }} (host {{ $labels.host }}) of run {{ $labels.run }} waits least in "
            f'collectives, {{{{ $value | printf "%.1f" }}}} robust sigmas below the run\'s median in each of '
            f"its last {policy.hold_windows} windows: the other ranks wait for it." + _GPU_REASONS,
            "flarerankstraggler",
            link("collectives", "rank"),
        ),
        Alert(
            "FlareJobSlowdown",
            f"min by (run) ({STRAGGLER_SLOWDOWN_RATIO}{selector(t)}) >= {1 + policy.job_slowdown:g}\n"
            f"unless on (run) ({named})\n"
            f"unless on (run) ({BUSY_EVERYWHERE})",  # the busy hosts' then: FlareHostBusy
            t.straggler_for,
            "warning",
            "Every rank of run {{ $labels.run }} is slower than its own best",
            'Every rank of run {{ $labels.run }} takes at least {{ $value | printf "%.2f" }} times its own '
            "best step time, and no rank stands out: a job-wide slowdown (input pipeline, storage, network, "
            "a configuration change), not one straggler; where every host of the run is busy, FlareHostBusy "
            "says so instead.",
            "flarejobslowdown",
            link("overview"),
        ),
    ]
