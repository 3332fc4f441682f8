"""Where the step time goes (the performance monitor, rank/perf.py, and the flare.perf rules): the rows of
the run overview (the phases of the median rank, the bottleneck classes, the run's collective time by group
role, MFU, the slowest devices, the GPU-hours lost by rank and host) and of the rank detail (the rank's
phases, its bottleneck, its FLOP/s): as many panels and series at 6,144 ranks as at 4."""

from __future__ import annotations

from typing import Any

from ...policies import BottleneckPolicy
from .metrics import (
    ACHIEVED_FLOPS,
    BOTTLENECK,
    COLLECTIVE_ROLE_SHARE,
    LOST_BY_HOST,
    LOST_BY_RANK,
    MFU,
    MODEL_FLOPS,
    PHASE_PER_STEP,
    PHASE_SECONDS,
    PHASE_SHARE,
    PHASE_STEPS,
)
from .model import (
    PEAK,
    RANKS,
    RATE,
    RECORDED_RANKS,
    RECORDED_RUN,
    RECORDED_THE_RANK,
    RULES,
    THE_RANK,
    Panel,
    Row,
    Target,
    bargauge,
    bottom,
    labels_table,
    rank_table,
    sel,
    spread,
    table,
    timeseries,
    top,
)

NEEDS_RULES = frozenset({RULES})
COMPUTE_PER_STEP = sel('phase="compute"', scoped=False)  # the selected ranks' compute phase, recorded
# The ledger's seconds lost per second, integrated over the dashboard's range: sampled at this step (a
# quarter of the slow rules' minute, so that a range of less than a minute still has a sample), each sample
# standing for LEDGER_SAMPLE_SECONDS. Unlike an average over the range, a rank charged for part of it (its
# series absent the rest of the time) is charged for that part alone.
LEDGER_SAMPLE_SECONDS = 15
GPU_HOURS = "suffix: GPU-h"


def gpu_hours_lost(recorded: str, by: str, selector: str) -> str:
    """GPU-hours the ledger's `recorded` (seconds lost per second) charged over the dashboard's range, by
    `by`, the $k most first."""
    integral = (
        f"sum_over_time({recorded}{selector}[$__range:{LEDGER_SAMPLE_SECONDS}s]) * {LEDGER_SAMPLE_SECONDS}"
    )
    return top(f"sum by ({by}) (\n  {integral}\n) / 3600")


def deciding_share() -> str:
    """Each rank's bottleneck class, valued by the share of its step in the phase that decided it (compute
    for compute_bound)."""
    classes = [(bottleneck, phase) for bottleneck, phase, _ in BottleneckPolicy().thresholds()]
    parts = []
    for bottleneck, phase in [*classes, ("compute_bound", "compute")]:
        of_class = sel(f'bottleneck="{bottleneck}"', scoped=False)
        of_phase = sel(f'phase="{phase}"', scoped=False)
        parts.append(f"{BOTTLENECK}{of_class}\n  * on (run, rank) group_left () {PHASE_SHARE}{of_phase}")
    return "max by (rank, bottleneck) (\n  " + "\n  or ".join(parts) + "\n)"


def overview_rows() -> tuple[Row, ...]:
    """The run overview's rows: where the step time goes, and what it yields and costs."""
    return (_phases_and_bottlenecks(), _collective_by_role(), _flops(), _lost())


def _phases_and_bottlenecks() -> Row:
    """The median rank's step by phase, the ranks per bottleneck class, and the $k ranks most bound."""
    return (
        timeseries(
            "Where the step time goes (median rank, by phase)",
            "The median over the selected ranks of each phase's share of a rank's step (5-minute windows, "
            "the flare.perf rules): data (the data loader's next), optimizer, collective (waiting for "
            "collectives, not overlapped by compute) and compute (the rest). Each rank's step is judged "
            "as `flare perf` judges it: its wait for the last rank to arrive is the last arriver's, so "
            "the stack shows what the ranks themselves spend their steps on.",
            Target(f"quantile by (phase) (0.5, {PHASE_SHARE}{RECORDED_RANKS})", "{{phase}}"),
            width=12,
            height=8,
            unit="percentunit",
            min=0,
            stacked=True,
            needs=NEEDS_RULES,
        ),
        bargauge(
            "Ranks per bottleneck class",
            "How many of the selected ranks are in each bottleneck class (the flare.perf rules, the "
            "thresholds of `flare perf`): input_bound, communication_bound, bubble_bound, transfer_bound, "
            "launch_bound where that phase takes its share of the step, else compute_bound.",
            f"count by (bottleneck) ({BOTTLENECK}{RECORDED_RANKS})",
            "{{bottleneck}}",
            width=4,
            height=8,
            count=True,
            needs=NEEDS_RULES,
        ),
        rank_table(
            "Bottleneck by rank (top $k by the deciding share)",
            "Each rank's bottleneck class and the share of its step in the phase that decided it (compute "
            "for compute_bound), the $k highest first. Click a rank for its detail.",
            top(deciding_share()),
            value="deciding share",
            unit="percentunit",
            width=8,
            height=8,
            needs=NEEDS_RULES,
        ),
    )


def _collective_by_role() -> Row:
    """The run's collective phase by the role of the process group waited on."""
    return (
        timeseries(
            "Collective time by group role (share of the run's step time)",
            "The run's collective phase (waiting for collectives, not overlapped by compute) by the role of "
            "the process group waited on: dp, tp, pp, ep, cp, world (the default group) or other, as shares "
            "of the run's step time summed over its ranks (5-minute windows, the flare.perf rules; `flare "
            "perf` shows it per rank). The role that grows is the parallelism whose communication the steps "
            "wait on; the Collectives dashboard shows its groups. The run's: $rank does not apply.",
            Target(f"max by (role) ({COLLECTIVE_ROLE_SHARE}{RECORDED_RUN})", "{{role}}"),
            width=24,
            height=8,
            unit="percentunit",
            min=0,
            stacked=True,
            needs=NEEDS_RULES,
        ),
    )


def _flops() -> Row:
    """MFU and achieved FLOP/s across ranks, and the $k ranks whose devices compute slowest."""
    return (
        _across_ranks(
            "MFU across ranks",
            "Model FLOPs utilization: achieved FLOP/s over the device's peak (a GPU's by its NVML name, or "
            "peak_flops): the lowest, median and highest rank.",
            MFU,
            unit="percentunit",
            needs=frozenset({PEAK}),
        ),
        _across_ranks(
            "Achieved FLOP/s across ranks",
            "Model FLOPs per step over the mean step time of the last steps: the lowest, median and highest "
            "rank. In a synchronous job every rank steps at the pace of the slowest, so this is the run's "
            "pace; the table beside it finds the slow device.",
            ACHIEVED_FLOPS,
            unit="flops",
        ),
        rank_table(
            "Slowest devices (bottom $k by compute FLOP/s)",
            "Model FLOPs per step over the rank's compute seconds per step (5-minute windows, the "
            "flare.perf rules): what its device does with its own share of the step. `flare perf` names "
            f"a rank below {BottleneckPolicy().slow_device_share:.0%} of the ranks' median as on a slower "
            "device. Click a rank for its detail.",
            bottom(
                f"max by (rank) ({MODEL_FLOPS}{RANKS})\n/ max by (rank) ({PHASE_PER_STEP}{COMPUTE_PER_STEP})"
            ),
            value="compute FLOP/s",
            ascending=True,
            unit="flops",
            width=8,
            height=8,
            needs=NEEDS_RULES,
        ),
    )


def _lost() -> Row:
    """The GPU-hours the badput ledger charged over the dashboard's range, by rank and by host."""
    return (
        rank_table(
            "GPU-hours lost by rank (top $k)",
            "The badput ledger over the dashboard's time range: the GPU time the other ranks spent waiting "
            "for the rank (the flare.perf rules charge the rank with the least collective time per step "
            "the others' excess, each 5-minute window; `flare stragglers` and `flare perf` charge alike). "
            "Click a rank for its detail.",
            gpu_hours_lost(LOST_BY_RANK, "rank", RECORDED_RANKS),
            value="GPU-hours lost",
            unit=GPU_HOURS,
            width=12,
            height=8,
            needs=NEEDS_RULES,
        ),
        table(
            "GPU-hours lost by host (top $k)",
            "The badput ledger over the dashboard's time range, summed over each host's ranks: a host whose "
            "ranks cost the job most (its hardware, or its share of the input pipeline) is the one to look "
            "at or drain.",
            gpu_hours_lost(LOST_BY_HOST, "host", RECORDED_RUN),
            width=12,
            height=8,
            unit=GPU_HOURS,
            hide_columns=("Time",),
            value_name="GPU-hours lost",
            needs=NEEDS_RULES,
        ),
    )


def rank_row() -> Row:
    """The rank detail's row: the rank's phases over time, its bottleneck class, its MFU and FLOP/s."""
    per_step = f"sum (rate({PHASE_STEPS}{THE_RANK}[{RATE}]))"
    return (
        timeseries(
            "Step time by phase",
            "Seconds per step in each phase over the interval: data (the data loader's next), optimizer, "
            "collective (waiting for collectives, not overlapped by compute: here with its wait for the "
            "last rank to arrive) and compute (the rest).",
            Target(
                f"sum by (phase) (rate({PHASE_SECONDS}{THE_RANK}[{RATE}]))\n/ on () group_left () {per_step}",
                "{{phase}}",
            ),
            width=10,
            height=8,
            unit="s",
            min=0,
            stacked=True,
        ),
        labels_table(
            "Bottleneck",
            "The rank's bottleneck class (the flare.perf rules, over 5 minutes, as `flare perf` classifies "
            "it).",
            f"max by (bottleneck) ({BOTTLENECK}{RECORDED_THE_RANK})",
            width=4,
            height=8,
            needs=NEEDS_RULES,
        ),
        _of_the_rank(
            "MFU",
            "Model FLOPs utilization: achieved FLOP/s over the device's peak.",
            MFU,
            "MFU",
            unit="percentunit",
            needs=frozenset({PEAK}),
        ),
        _of_the_rank(
            "Achieved FLOP/s",
            "Model FLOPs per step (counted on one sampled step) over the mean step time of the last steps.",
            ACHIEVED_FLOPS,
            "achieved",
            unit="flops",
        ),
    )


def _across_ranks(title: str, description: str, gauge: str, **options: Any) -> Panel:
    """The lowest, median and highest of the selected ranks' `gauge` over time (a third of a row)."""
    values = f"max by (rank) ({gauge}{RANKS})"
    return timeseries(title, description, *spread(values, "rank"), width=8, height=8, min=0, **options)


def _of_the_rank(title: str, description: str, gauge: str, legend: str, **options: Any) -> Panel:
    """The rank's `gauge` over time, in a narrow panel of the rank detail's perf row."""
    return timeseries(
        title, description, Target(f"max({gauge}{THE_RANK})", legend), width=5, height=8, min=0, **options
    )
