"""The straggler rules: the rank that waits least in collectives per step, far below the median (median/MAD),
over the exported windows or the cumulative times; the job-wide slowdown; a straggler's GPU health. Pure
functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from ..label_values import GPU_SLOWDOWN_REASONS
from ..policies import StragglerPolicy
from .rule_types import GpuState, Snapshot, Verdict, rank_list


def straggler_scores(snapshot: Snapshot) -> dict[int, dict[str, float]]:
    """Per live rank with data: step time and collective wait per step, and the wait's robust z-score
    below the ranks' median (positive: waits less than the others, as a straggler does)."""
    rows = {
        record.rank: (record.step_seconds / record.step_count, record.collective_seconds / record.step_count)
        for record in snapshot.ranks.values()
        if record.up
        and record.step_count
        and record.step_seconds is not None
        and record.collective_seconds is not None
    }
    if not rows:
        return {}
    waits = [wait for _, wait in rows.values()]
    median_wait = statistics.median(waits)
    spread = 1.4826 * statistics.median(abs(wait - median_wait) for wait in waits) or 1e-9
    return {
        rank: {
            "step_seconds": step,
            "wait_seconds_per_step": wait,
            "score": (median_wait - wait) / spread,
        }
        for rank, (step, wait) in sorted(rows.items())
    }


def judged_by_windows(snapshot: Snapshot) -> bool:
    """Whether stragglers are judged from the exported windows (every live rank with data has them), not
    from the cumulative step and collective times (older exporters, or before the first window closed).
    A summary of every rank's windows says they do."""
    if snapshot.window_summary is not None:
        return True
    live = [record for record in snapshot.ranks.values() if record.up and record.step_count]
    return bool(live) and all(record.step_windows for record in live)


def decided_by_last_windows(snapshot: Snapshot, policy: StragglerPolicy) -> bool:
    """Whether the straggler rules weigh no window older than each live rank's last `hold_windows`, so that
    older ones would change no verdict: every live rank has the same last window and the `hold_windows - 1`
    before it, and exports its best step time (else its fastest window, however old, stands in for it). A
    source can leave the older windows unread then (prometheus_source.from_prometheus)."""
    live = [record for record in snapshot.ranks.values() if record.up]
    if policy.hold_windows < 1 or not live:
        return False
    if not all(record.step_windows and record.best_step_seconds for record in live):
        return False
    newest = max(live[0].step_windows)
    needed = range(newest - policy.hold_windows + 1, newest + 1)
    return all(
        max(record.step_windows) == newest and all(window in record.step_windows for window in needed)
        for record in live
    )


def straggler_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """Stragglers from the exported windows, else from the cumulative step and collective times (see
    judged_by_windows); a straggler's verdict carries its GPU's hardware reasons."""
    if judged_by_windows(snapshot):
        verdicts = window_verdicts(snapshot, policy)
    else:
        verdicts = cumulative_verdicts(snapshot, policy)
    return [with_hardware_reasons(snapshot, verdict, policy) for verdict in verdicts]


def _robust(values: list[float]) -> tuple[float, float]:
    """Median and MAD scaled to a standard deviation (never 0, so that scores stay finite)."""
    median = statistics.median(values)
    return median, 1.4826 * statistics.median(abs(value - median) for value in values) or 1e-9


LEAVE_ONE_OUT_RANKS = 64  # up to this many ranks, each is scored against the others only
MIN_SHARE_SPREAD = 0.005  # ranks that agree closer than 0.5 % of the step do not make a gap of 1 % a score


def _scores_below_median(shares: Mapping[int, float]) -> dict[int, tuple[float, float, float]]:
    """Per rank: (median of the others' shares, robust z of its share below it, the gap).

    In a small group one straggler moves the median and the MAD it is measured with, so each rank is
    compared with the others only; in a large one its own weight is negligible and one median serves all.
    """
    if len(shares) > LEAVE_ONE_OUT_RANKS:
        return _scores_against(shares, *_robust(list(shares.values())))
    out = {}
    for rank, share in shares.items():
        median, spread = _robust([other for key, other in shares.items() if key != rank])
        out[rank] = (median, (median - share) / max(spread, MIN_SHARE_SPREAD), median - share)
    return out


def _scores_against(
    shares: Mapping[int, float], median: float, spread: float
) -> dict[int, tuple[float, float, float]]:
    """Per rank: (median, robust z of its share below it, the gap), against one median and spread."""
    scale = max(spread, MIN_SHARE_SPREAD)
    return {rank: (median, (median - share) / scale, median - share) for rank, share in shares.items()}


def window_scores(snapshot: Snapshot, policy: StragglerPolicy) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """The last `hold_windows` windows that every live rank has closed, and each rank's scores over them.

    A rank's wait share of a window is its time in collectives over its step time. Per window, its score
    is how far its share lies below the other ranks' median, in robust sigmas (median/MAD); pooled, the
    same over the windows together, and `gap` that distance as a share of the step. `slowdown_ratio` is its
    step time in each window over its own best window's.
    """
    scored = WindowScores(snapshot, policy)
    return scored.windows, {rank: scored.row(rank) for rank in scored.ranks}


class WindowScores:
    """window_scores's numbers, each rank's row of them (rounded, as a verdict carries it) built only when
    asked: a verdict reads a few rows, and rounding every rank's took most of the rules' time at thousands
    of ranks (twice per `flare diagnose`)."""

    def __init__(self, snapshot: Snapshot, policy: StragglerPolicy) -> None:
        self.windows: list[int] = []
        self.ranks: list[int] = []  # the scored ones, in order; none when too few ranks or windows
        self.count = 0  # the ranks weighed: the scored ones, or with a summary every rank it stands for
        rows = {
            record.rank: record for record in snapshot.ranks.values() if record.up and record.step_windows
        }
        summary = snapshot.window_summary
        if summary is None:
            self.count = len(rows)
            if self.count < policy.min_ranks:  # a rank is scored against the others: too few to compare
                return
            common = set.intersection(*(set(record.step_windows) for record in rows.values()))
            self.windows = sorted(common)[-policy.hold_windows :]
        else:  # its windows, of the ranks that have them all
            self.count = summary.ranks
            self.windows = list(summary.windows)
            rows = {
                rank: record
                for rank, record in rows.items()
                if set(summary.windows) <= record.step_windows.keys()
            }
        if self.count < policy.min_ranks or len(self.windows) < policy.hold_windows:
            return
        self.records = rows
        # each rank's (step, wait) in each of the windows, in their order; the scores per window, then pooled
        self.weighed = {
            rank: [rows[rank].step_windows[window] for window in self.windows] for rank in sorted(rows)
        }
        self.ranks = list(self.weighed)
        shares = [
            {rank: _share(*found[index]) for rank, found in self.weighed.items()}
            for index in range(len(self.windows))
        ]
        self.pooled = {
            rank: _share(sum(step for step, _ in found), sum(wait for _, wait in found))
            for rank, found in self.weighed.items()
        }
        if summary is None:
            self.per_window = [_scores_below_median(found) for found in shares]
            self.pooled_scores = _scores_below_median(self.pooled)
        else:
            self.per_window = [
                _scores_against(found, *figures)
                for found, figures in zip(shares, summary.per_window, strict=True)
            ]
            self.pooled_scores = _scores_against(self.pooled, *summary.pooled)

    def stands_out(self, rank: int, policy: StragglerPolicy) -> bool:
        """Whether the rank's wait share over the windows together lies `pooled_z` robust sigmas and
        `min_wait_gap` of its step below the median (as its row rounds them)."""
        _, z, gap = self.pooled_scores[rank]
        return round(z, 3) >= policy.pooled_z and round(gap, 6) >= policy.min_wait_gap

    def slowdown_ratio(self, rank: int) -> list[float]:
        """The rank's step time in each window over its own best window's (as its row rounds it)."""
        best = self._best(rank)
        return [round(step / best, 4) if best > 0 else 1.0 for step, _ in self.weighed[rank]]

    def _best(self, rank: int) -> float:
        record = self.records[rank]
        return record.best_step_seconds or min(step for step, _ in record.step_windows.values())

    def row(self, rank: int) -> dict[str, Any]:
        """The rank's scores as window_scores gives them and a verdict's evidence carries them."""
        median, z, gap = self.pooled_scores[rank]
        return {
            "window_z": [round(scored[rank][1], 3) for scored in self.per_window],
            "window_gap": [round(scored[rank][2], 6) for scored in self.per_window],
            "wait_share": round(self.pooled[rank], 6),
            "median_wait_share": round(median, 6),
            "pooled_z": round(z, 3),
            "gap": round(gap, 6),
            "best_step_seconds": self._best(rank),
            "step_seconds": self.weighed[rank][-1][0],
            "slowdown_ratio": self.slowdown_ratio(rank),
        }


def _share(step_seconds: float, wait_seconds: float) -> float:
    return wait_seconds / step_seconds if step_seconds > 0 else 0.0


def window_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """A straggler is named when its score holds over the last `hold_windows` shared windows: in each, it
    waits `window_z` robust sigmas and `window_gap` of its step below the median wait share; over all of
    them, `pooled_z` sigmas and
    `min_wait_gap` of its step. Fewer than half the ranks may be named. With no straggler, every rank
    `job_slowdown` slower than its own best window in each of them is the job-wide case: kind straggler,
    domain job, no culprit rank (every rank slowed alike: software, data, the network, the cluster), as
    long as no rank's wait share stands out over the windows together (else it is a straggler that did
    not hold in every window yet, and no verdict is better than the wrong one)."""
    scored = WindowScores(snapshot, policy)
    windows = scored.windows
    if scored.count < policy.min_ranks or not scored.ranks:
        return []
    stands_out = [rank for rank in scored.ranks if scored.stands_out(rank, policy)]
    scores = {rank: scored.row(rank) for rank in stands_out}
    slow = [
        rank
        for rank in stands_out
        if min(scores[rank]["window_z"]) >= policy.window_z
        and min(scores[rank]["window_gap"]) >= policy.window_gap
    ]
    if slow and len(slow) * 2 < scored.count:
        first = scores[slow[0]]
        evidence = {"windows": windows, "ranks": {str(rank): scores[rank] for rank in slow}}
        return [
            Verdict(
                "straggler",
                tuple(slow),
                "rank",
                f"rank {rank_list(slow)} waits least in collectives over the last {len(windows)} windows "
                f"({first['wait_share']:.1%} of its step against a median of "
                f"{first['median_wait_share']:.1%}, "
                f"robust z {first['pooled_z']:.1f}): the others wait for it; its step time is "
                f"{first['slowdown_ratio'][-1]:.2f}x its own best",
                evidence,
            )
        ]
    if snapshot.window_summary is not None:  # given only where no rank is job_slowdown slower in every window
        return []
    threshold = 1 + policy.job_slowdown
    if not stands_out and all(min(scored.slowdown_ratio(rank)) >= threshold for rank in scored.ranks):
        scores = {rank: scored.row(rank) for rank in scored.ranks}
        ratios = [row["slowdown_ratio"][-1] for row in scores.values()]
        evidence = {
            "windows": windows,
            "slowdown_ratio": {str(rank): row["slowdown_ratio"] for rank, row in scores.items()},
            "step_seconds": {str(rank): row["step_seconds"] for rank, row in scores.items()},
            "best_step_seconds": {str(rank): row["best_step_seconds"] for rank, row in scores.items()},
            "wait_share": {str(rank): row["wait_share"] for rank, row in scores.items()},
        }
        return [
            Verdict(
                "straggler",
                (),
                "job",
                f"every rank is slower than its own best, {min(ratios):.2f}x to {max(ratios):.2f}x over the "
                f"last {len(windows)} windows, and none waits markedly less than the others: a job-wide "
                "slowdown, not one rank",
                evidence,
            )
        ]
    return []


def hardware_reasons(gpu: GpuState | None, policy: StragglerPolicy = StragglerPolicy()) -> list[str]:
    """What in a rank's GPU health explains it being slow: throttling, a low clock, a degraded link."""
    if gpu is None or not gpu.up:
        return []
    reasons = [reason for reason in GPU_SLOWDOWN_REASONS if reason in gpu.clock_events]
    clock, clock_max = gpu.sm_clock_hertz, gpu.sm_clock_max_hertz
    if clock is not None and clock_max and clock < policy.clock_below_max * clock_max:
        reasons.append(f"SM clock {clock / 1e6:.0f} MHz of {clock_max / 1e6:.0f} MHz max")
    generation, width = gpu.pcie_link_generation, gpu.pcie_link_width
    generation_max, width_max = gpu.pcie_link_generation_max, gpu.pcie_link_width_max
    if None not in (generation, width, generation_max, width_max) and (
        generation < generation_max or width < width_max  # type: ignore[operator]
    ):
        reasons.append(
            f"PCIe link Gen{generation:.0f} x{width:.0f} (max Gen{generation_max:.0f} x{width_max:.0f})"
        )
    if gpu.xid_events:
        reasons.append(f"{gpu.xid_events:.0f} XID events (last XID {gpu.last_xid or 0:.0f})")
    if gpu.row_remap_failed:
        reasons.append("row remapping failed")
    return reasons


def with_hardware_reasons(snapshot: Snapshot, verdict: Verdict, policy: StragglerPolicy) -> Verdict:
    """The verdict with each culprit's GPU health reasons in its evidence and summary (if any)."""
    found = {rank: hardware_reasons(snapshot.ranks[rank].gpu, policy) for rank in verdict.ranks}
    found = {rank: reasons for rank, reasons in found.items() if reasons}
    if not found:
        return verdict
    evidence = dict(verdict.evidence)
    evidence["hardware"] = {str(rank): reasons for rank, reasons in found.items()}
    said = "; ".join(f"rank {rank}'s GPU shows {', '.join(reasons)}" for rank, reasons in found.items())
    return dataclasses.replace(verdict, summary=f"{verdict.summary}; {said}", evidence=evidence)


def cumulative_verdicts(snapshot: Snapshot, policy: StragglerPolicy) -> list[Verdict]:
    """Stragglers from step and collective time summed over the source's window (older exporters)."""
    scores = straggler_scores(snapshot)
    if len(scores) < policy.min_ranks:
        return []
    if any((snapshot.ranks[rank].step_count or 0) < policy.min_steps for rank in scores):
        return []
    median_step = statistics.median(row["step_seconds"] for row in scores.values())
    median_wait = statistics.median(row["wait_seconds_per_step"] for row in scores.values())
    slow = [
        rank
        for rank, row in scores.items()
        if row["score"] >= policy.robust_z
        and median_wait - row["wait_seconds_per_step"] >= policy.min_share_of_step * median_step
    ]
    if not slow or len(slow) * 2 >= len(scores):
        return []
    evidence = {
        "median_step_seconds": median_step,
        "median_wait_seconds_per_step": median_wait,
        "ranks": {str(rank): scores[rank] for rank in slow},
    }
    return [
        Verdict(
            "straggler",
            tuple(slow),
            "rank",
            f"rank {rank_list(slow)} waits least in collectives "
            f"({scores[slow[0]]['wait_seconds_per_step']:.4f} s per step against a median of "
            f"{median_wait:.4f} s): the others wait for it",
            evidence,
        )
    ]
