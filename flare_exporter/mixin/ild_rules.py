"""Recording and alert rules of issue latency (ILD, rank/ild.py): a rank whose distribution shifted from its
own baseline, as ild_verdicts.ild_shifted judges it (policies.IldPolicy), and a shift on most ranks of a run.
Wired into the rules file as part of the group flare.slow_signals of RULE_GROUPS (rules.py).
"""

from __future__ import annotations

from .. import spec
from .rule_model import Alert, Recording, Thresholds, link, selector
from .rule_model import with_host as _with_host

ILD_DRIFT_KS = spec.series("flare_ild_drift_ks")
ILD_DRIFT_WASSERSTEIN_SECONDS = spec.series("flare_ild_drift_wasserstein_seconds")
ILD_OP_SHIFT_SECONDS = spec.series("flare_ild_op_shift_seconds")


def ild_recording_rules(t: Thresholds) -> list[Recording]:
    s = selector(t)
    return [
        # A rank's distribution shifted from its own baseline (ild_verdicts.ild_shifted), and how many
        # ranks of the run shifted.
        Recording("run_rank_distribution:flare_ild_drift:shifted_ks", _ild_shifted(t)),
        Recording(
            "run_distribution:flare_ild_drift:shifted_ranks",
            "count by (run, distribution) (run_rank_distribution:flare_ild_drift:shifted_ks)",
        ),
        Recording(
            "run_distribution:flare_ild_drift:ranks",
            f"count by (run, distribution) ({ILD_DRIFT_KS}{s})",
        ),
    ]


def _op_shift_beyond_peers(s: str, threshold: float) -> str:
    """Ranks whose per-op shift exceeds the ranks' median (if positive; 3+ ranks) by `threshold`."""
    shift, peers = f"{ILD_OP_SHIFT_SECONDS}{s}", "on (run, distribution)"
    ranks = f"count by (run, distribution) ({shift})"
    return (
        "(\n"
        "      (\n"
        f"        {shift}\n"
        f"        - {peers} group_left clamp_min(quantile by (run, distribution) (0.5, {shift}), 0)\n"
        f"      ) >= {threshold:g}\n"
        f"      and {peers} ({ranks} >= 3)\n"
        "    )\n"
    )


def _ild_shifted(t: Thresholds) -> str:
    """The KS of each rank whose distribution shifted: KS over the threshold, or a partial shift that moved
    far (W1 a factor above the ranks' median, with 3+ ranks), and W1 above the floor either way; or a per-op
    shift over its threshold beyond the ranks' median (3+ ranks)."""
    s, policy, floor = selector(t), t.ild, f"{t.ild.min_wasserstein_seconds:g}"
    per_rank = "on (run, rank, distribution)"
    return (
        "max by (run, rank, distribution) (\n"
        f"  {ILD_DRIFT_KS}{s}\n"
        f"  and {per_rank} (\n"
        f"    ({ILD_DRIFT_WASSERSTEIN_SECONDS}{s} >= {floor})\n"
        f"    and {per_rank} (\n"
        f"      {ILD_DRIFT_KS}{s} >= {policy.ks:g}\n"
        f"      or {per_rank} (\n"
        f"        {ILD_DRIFT_KS}{s} >= {policy.partial_ks:g}\n"
        f"        and {per_rank} (\n"
        f"          {ILD_DRIFT_WASSERSTEIN_SECONDS}{s}\n"
        f"          >= on (run, distribution) group_left {policy.far_factor:g} * clamp_min(\n"
        "            quantile by (run, distribution)\n"
        f"              (0.5, {ILD_DRIFT_WASSERSTEIN_SECONDS}{s}), {floor})\n"
        "        )\n"
        f"        and on (run, distribution) (count by (run, distribution) ({ILD_DRIFT_KS}{s}) >= 3)\n"
        "      )\n"
        "    )\n"
        f"    or {per_rank} {_op_shift_beyond_peers(s, policy.op_shift_seconds)}"
        "  )\n"
        ")"
    )


def issue_latency_alerts(t: Thresholds) -> list[Alert]:
    def shifted(comparison: str) -> str:  # how the shifted ranks compare with half the ranks
        ranks = "run_distribution:flare_ild_drift"
        return f"{ranks}:shifted_ranks * 2 {comparison} {ranks}:ranks"

    minority = shifted("<")
    return [
        Alert(
            "FlareIssueLatencyShifted",
            _with_host(
                f"run_rank_distribution:flare_ild_drift:shifted_ks\n  and on (run, distribution) ({minority})"
            ),
            t.ild_for,
            "warning",
            "The {{ $labels.distribution }} latency of rank {{ $labels.rank }} shifted from its baseline",
            "The {{ $labels.distribution }} latency distribution of rank {{ $labels.rank }} (host "
            "{{ $labels.host }}) in run {{ $labels.run }} moved away from the rank's own baseline (KS "
            '{{ $value | printf "%.2f" }}) while most ranks\' did not: something on that host slows the '
            "issue path (CPU contention, a noisy neighbour, throttling, a GC storm).",
            "flareissuelatencyshifted",
            link("issue_latency", "rank"),
        ),
        Alert(
            "FlareIssueLatencyShiftedJobWide",
            f"run_distribution:flare_ild_drift:shifted_ranks\n  and on (run, distribution) ({shifted('>=')})",
            t.ild_for,
            "warning",
            "The {{ $labels.distribution }} latency of run {{ $labels.run }} shifted on most ranks",
            "The {{ $labels.distribution }} latency distribution shifted from the baseline on "
            "{{ $value }} ranks of run {{ $labels.run }}, half or more: a job-wide change (software, driver, "
            "configuration, input), not one host.",
            "flareissuelatencyshiftedjobwide",
            link("issue_latency"),
        ),
    ]
