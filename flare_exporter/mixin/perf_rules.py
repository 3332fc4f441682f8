"""Recording rules of the step breakdown: seconds per phase per step, each rank's bottleneck class, the
badput ledger (seconds lost per second, by rank and host), and each run's collective time by group role.
The same policy as `flare perf` (engine/perf.py): policies.BottleneckPolicy. Wired into the rules file as
one group of RULE_GROUPS (rules.py):

    RuleGroup("flare.perf", recordings=(perf_rules.perf_recording_rules,), slow=True)
"""

from __future__ import annotations

from .. import spec
from ..policies import BottleneckPolicy
from .rule_model import Recording, Thresholds, selector

RANK_INFO = spec.series("flare_rank_info")
STEP_COLLECTIVE_SECONDS_TOTAL = spec.series("flare_step_collective_seconds_total")
STEP_PHASE_SECONDS_TOTAL = spec.series("flare_step_phase_seconds_total")
STEP_PHASE_STEPS_TOTAL = spec.series("flare_step_phase_steps_total")

PERF_WINDOW = "5m"  # the span each rule's rates cover
PER_STEP = "run_rank_phase:flare_step_phase_seconds:per_step"
SHARE = "run_rank_phase:flare_step_phase_seconds:share"
BOTTLENECK = "run_rank:flare_step_bottleneck:info"
OWN_BOTTLENECK = "run_rank:flare_step_bottleneck:own"  # judged on the rank's own step alone
PACER_WAIT = "run_rank:flare_step_pacer_wait:share"  # of its step, the wait for the last arriver
EXPOSED = "run_rank:flare_step_collective_seconds:per_step"
LOST_BY_RANK = "run_rank:flare_badput_seconds:rate5m"
LOST_BY_HOST = "run_host:flare_badput_seconds:rate5m"
ROLE_SHARE = "run_role:flare_step_collective_seconds:share"  # of the run's step time, by group role


def perf_recording_rules(t: Thresholds, policy: BottleneckPolicy = BottleneckPolicy()) -> list[Recording]:  # noqa: B008
    s = selector(t)
    steps = f"sum by (run, rank) (increase({STEP_PHASE_STEPS_TOTAL}{s}[{PERF_WINDOW}]))"
    return [
        Recording(
            PER_STEP,
            f"sum by (run, rank, phase) (increase({STEP_PHASE_SECONDS_TOTAL}{s}[{PERF_WINDOW}]))\n"
            f"/ on (run, rank) group_left {steps}",
        ),
        Recording(SHARE, f"{JUDGED}\n/ on (run, rank) group_left sum by (run, rank) ({JUDGED})"),
        Recording(OWN_BOTTLENECK, bottleneck_expr(policy)),
        Recording(PACER_WAIT, _PACER_WAIT),
        Recording(BOTTLENECK, pacer_expr(policy)),
        *ledger_recordings(t),
        Recording(ROLE_SHARE, role_share_expr(t)),
    ]


def role_share_expr(t: Thresholds) -> str:
    """Per run and group role (dp, tp, pp, ...), the collective phase spent waiting on that role's groups,
    as a share of the run's step time (both summed over its ranks): as `flare perf` shows it."""
    s = selector(t)
    return (
        f"sum by (run, role) (increase({STEP_COLLECTIVE_SECONDS_TOTAL}{s}[{PERF_WINDOW}]))\n"
        f"/ on (run) group_left sum by (run) (increase({STEP_PHASE_SECONDS_TOTAL}{s}[{PERF_WINDOW}]))"
    )


# Each rank's step as it is judged (engine/perf.py's `judged`): its collective time per step lowered to the
# run's least, the last arriver's; the rest of its wait is the last arriver's, and its class theirs.
# A rank that spends most of its step waiting for the last arriver takes that rank's class (engine/perf.py
# waits_for_pacer): pacer_expr.
_COLLECTIVE = f'{PER_STEP}{{phase="collective"}}'
JUDGED = (
    f'({PER_STEP}{{phase!="collective"}}\n or 0 * {_COLLECTIVE}\n'
    f" + on (run) group_left () min by (run) ({_COLLECTIVE}))"
)


_LEAST = f"on (run) group_left () min by (run) ({_COLLECTIVE})"
_PACER_WAIT = (
    f"max by (run, rank) ({_COLLECTIVE} - {_LEAST})\n/ on (run, rank) sum by (run, rank) ({PER_STEP})"
)


def pacer_expr(policy: BottleneckPolicy) -> str:
    """Each rank's class: its own (OWN_BOTTLENECK), or, where the wait for the last arriver takes
    communication_share of its step or more, the last arriver's (the rank of the run's least collective
    time per step; one of them where several tie)."""
    waiting = f"{PACER_WAIT} >= {policy.communication_share:g}"
    pacer = (
        f"topk by (run) (1, {OWN_BOTTLENECK}\n"
        f"  and on (run, rank) max by (run, rank) ({_COLLECTIVE} == {_LEAST}))"
    )
    return (
        f"({OWN_BOTTLENECK} unless on (run, rank) ({waiting}))\n"
        f"or (\n  (0 * max by (run, rank) ({waiting}) + 1)\n"
        f"  * on (run) group_left (bottleneck) max by (run, bottleneck) ({pacer})\n)"
    )


def bottleneck_expr(policy: BottleneckPolicy) -> str:
    """1 per rank, labelled with its class: the first class whose phase share reaches its threshold, in the
    policy's order; compute_bound where none does."""
    earlier: list[str] = []
    parts = []
    for bottleneck, phase, share in policy.thresholds():
        reached = f'max by (run, rank) ({SHARE}{{phase="{phase}"}} >= {share:g})'
        parts.append(_labelled(reached, bottleneck, earlier))
        earlier.append(reached)
    parts.append(_labelled(f"max by (run, rank) ({SHARE})", "compute_bound", earlier))
    return "\nor ".join(parts)


def _labelled(condition: str, bottleneck: str, earlier: list[str]) -> str:
    labelled = f'label_replace(0 * {condition} + 1, "bottleneck", "{bottleneck}", "", "")'
    return f"({labelled} unless on (run, rank) ({' or '.join(earlier)}))" if earlier else f"({labelled})"


def ledger_recordings(t: Thresholds) -> list[Recording]:
    """Per run, the rank with the least collective time per step is charged the others' excess per step,
    times its steps per second: seconds lost per second (the other ranks: no series, nothing lost)."""
    s = selector(t)
    excess = f"sum by (run) ({EXPOSED}) - count by (run) ({EXPOSED}) * min by (run) ({EXPOSED})"
    last = f"0 * ({EXPOSED} == on (run) group_left min by (run) ({EXPOSED}))"
    step_rate = f"sum by (run, rank) (rate({STEP_PHASE_STEPS_TOTAL}{s}[{PERF_WINDOW}]))"
    host = f"max by (run, rank, host) ({RANK_INFO}{s})"
    return [
        Recording(EXPOSED, f'sum without (phase) ({PER_STEP}{{phase="collective"}})'),
        Recording(
            LOST_BY_RANK,
            f"({last}\n + on (run) group_left () ({excess}))\n* on (run, rank) {step_rate}",
        ),
        Recording(
            LOST_BY_HOST, f"sum by (run, host) ({LOST_BY_RANK}\n* on (run, rank) group_left (host) {host})"
        ),
    ]
