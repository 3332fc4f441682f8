"""The queries of prometheus_source's pace rounds that take a policy, or that stand for every rank's
straggler windows: the windows split by age (recent_windows), what the recording rules say of them
(SUMMARY_AT_QUERY, SUMMARY_FIGURES, summary_candidates), the screens of the ranks whose ILD drift could
count as shifted (ild_screen, ild_candidates), and the cumulative step and collective times
(CUMULATIVE_QUERIES). Placeholders as in prometheus_source: `{sel}` the run's selector, `{window}` the
lookback. Every rank's current values of the pace (PACE_QUERIES, ILD_QUERIES) are asked as the other
rounds' are, in prometheus_source.
"""

from __future__ import annotations

from .. import record_names
from ..policies import IldPolicy, StragglerPolicy
from . import straggler_verdicts
from .records import (
    COLLECTIVE_DURATION_SECONDS_SUM,
    ILD_DRIFT_KS,
    ILD_DRIFT_WASSERSTEIN_SECONDS,
    ILD_OP_SHIFT_SECONDS,
    STEP_DURATION_SECONDS_SUM,
    STRAGGLER_WINDOW_STEP_SECONDS,
    STRAGGLER_WINDOW_WAIT_SECONDS,
)

WINDOW_METRICS = (STRAGGLER_WINDOW_STEP_SECONDS, STRAGGLER_WINDOW_WAIT_SECONDS)


def recent_windows(policy: StragglerPolicy) -> tuple[dict[str, str], dict[str, str]]:
    """The straggler windows' queries in two parts: each rank's last `hold_windows` (label ago below it),
    which the rules read when every rank closed the same last window
    (straggler_verdicts.decided_by_last_windows), and the older ones, read only when they do not: a quarter of
    the pace round's series at 6,144 ranks."""
    recent = "|".join(str(ago) for ago in range(policy.hold_windows))

    def windows(match: str) -> dict[str, str]:
        return {name: f'max by (rank, ago) ({name}{{sel, ago{match}"{recent}"}})' for name in WINDOW_METRICS}

    return windows("=~"), windows("!~")


# At thousands of ranks, what Prometheus's recording rules say of every rank's straggler windows
# (record_names.py; WindowSummary), read in place of them where it stands for them: the time of the
# rules' last evaluation, then the figures at that time and the ranks that could be named.
SUMMARY_AT_QUERY = {"summary_at": f"max(timestamp({record_names.SUMMARY_AT}{{sel}}))"}
SUMMARY_FIGURES = 'max by (__name__, ago) ({sel, __name__=~"run(_ago)?:flare_straggler_.+"})'
SUMMARY_SLACK = 0.999  # the screen's distance below the median, against rounding: it may name more ranks


def summary_candidates(policy: StragglerPolicy) -> str:
    """The ranks whose wait share over the windows lies far enough below the median (pooled_z robust sigmas
    and min_wait_gap of the step; straggler_verdicts.WindowScores.stands_out) that the rules could name
    them."""
    pooled, figure = record_names.SUMMARY_POOLED, record_names.POOLED_SHARE
    spread = f"clamp_min(1.4826 * {figure}:mad{{sel}}, {straggler_verdicts.MIN_SHARE_SPREAD!r})"
    distance = (
        f"clamp_min({policy.pooled_z * SUMMARY_SLACK!r} * {spread}, {policy.min_wait_gap * SUMMARY_SLACK!r})"
    )
    return f"max by (rank) ({pooled}{{sel}} <= on (run) group_left () ({figure}:median{{sel}} - {distance}))"


def ild_screen(policy: IldPolicy) -> dict[str, str]:
    """The query for the ranks whose drift could count as shifted under `policy` (IldPolicy.floors), one
    series each, without the drift itself (key `ild_screen`, which no record reads)."""
    op_shift, ks, wasserstein = (repr(float(bound)) for bound in policy.floors())
    return {
        "ild_screen": (
            f"max by (rank) ({ILD_OP_SHIFT_SECONDS}{{sel}} >= {op_shift}"
            f" or ({ILD_DRIFT_KS}{{sel}} >= {ks} unless on (rank, distribution)"
            f" {ILD_DRIFT_WASSERSTEIN_SECONDS}{{sel}} < {wasserstein}))"
        )
    }


def ild_candidates(policy: IldPolicy) -> dict[str, str]:
    """The ranks ild_screen may name and more (key `ild_candidates`): its floors without the W1 one, so
    that the pace round need not read every rank's W1 (a third of the screen's series); ild_screen is
    asked of them only when there are any."""
    op_shift, ks, _ = (repr(float(bound)) for bound in policy.floors())
    return {
        "ild_candidates": (
            f"max by (rank) ({ILD_OP_SHIFT_SECONDS}{{sel}} >= {op_shift} or {ILD_DRIFT_KS}{{sel}} >= {ks})"
        )
    }


# The same from the cumulative step and collective times: every rank (asked when not every rank exports
# straggler windows; see straggler_verdicts.judged_by_windows).
CUMULATIVE_QUERIES = {
    STEP_DURATION_SECONDS_SUM: (f"sum by (rank) (increase({STEP_DURATION_SECONDS_SUM}{{sel}}[{{window}}]))"),
    COLLECTIVE_DURATION_SECONDS_SUM: (
        f"sum by (rank) (increase({COLLECTIVE_DURATION_SECONDS_SUM}{{sel}}[{{window}}]))"
    ),
}
