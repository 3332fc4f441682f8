"""The issue-latency rules: a rank whose issue-latency distribution (kernel issue, host dispatch) shifted from
its own baseline while most ranks' did not, or the job's where most or all did. Pure functions, no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..policies import IldPolicy
from .rule_types import Snapshot, Verdict, rank_list


class IldDrift(NamedTuple):
    """One rank's drift of one distribution from its baseline."""

    ks: float
    wasserstein: float  # seconds
    op_shift: float | None  # seconds; host dispatch by the native timer only


class IldPeers(NamedTuple):
    """The ranks' medians of one distribution's drift, where 3 or more ranks export it (else None)."""

    wasserstein: float | None
    op_shift: float | None

    @classmethod
    def of(cls, drifts: Iterable[IldDrift]) -> IldPeers:
        drifts = list(drifts)
        shifts = [d.op_shift for d in drifts if d.op_shift is not None]
        return cls(
            statistics.median(d.wasserstein for d in drifts) if len(drifts) >= 3 else None,
            statistics.median(shifts) if len(shifts) >= 3 else None,
        )


def ild_shifted(drift: IldDrift, peers: IldPeers, policy: IldPolicy) -> bool:
    """Whether one rank's drift counts as a shift, given its peers' medians.

    The per-op shift counts beyond the peers' median (when that is positive), and only with one (3+ ranks,
    as the partial shift): a machine-wide slowdown that moves every rank alike is not one rank's, and a
    rank's own per-op shift also moves with the machine (a vCPU slower for a while), which only peers tell.
    """
    if drift.op_shift is not None and peers.op_shift is not None:
        if drift.op_shift - max(peers.op_shift, 0.0) >= policy.op_shift_seconds:
            return True
    if drift.wasserstein < policy.min_wasserstein_seconds:
        return False
    if drift.ks >= policy.ks:
        return True
    far = peers.wasserstein is not None and drift.wasserstein >= policy.far_factor * max(
        peers.wasserstein, policy.min_wasserstein_seconds
    )
    return drift.ks >= policy.partial_ks and far


def ild_drifts(snapshot: Snapshot) -> dict[str, dict[int, IldDrift]]:
    """Distribution -> live rank -> its drift, for the ranks that export one."""
    found: dict[str, dict[int, IldDrift]] = {}
    for record in sorted(snapshot.ranks.values(), key=lambda r: r.rank):
        if not record.up:
            continue
        for distribution, ks in sorted(record.ild_ks.items()):
            found.setdefault(distribution, {})[record.rank] = IldDrift(
                ks,
                record.ild_wasserstein.get(distribution, 0.0),
                record.ild_op_shift.get(distribution),
            )
    return found


def ild_verdicts(snapshot: Snapshot, policy: IldPolicy) -> list[Verdict]:
    """Shifted on a minority of ranks -> those ranks (their host); on most or all -> the job."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    job_wide: dict[str, tuple[tuple[int, ...], int]] = {}
    drifts = ild_drifts(snapshot)
    for distribution, per_rank in drifts.items():
        peers = IldPeers.of(per_rank.values())
        shifted = tuple(rank for rank, d in per_rank.items() if ild_shifted(d, peers, policy))
        if not shifted:
            continue
        if len(shifted) * 2 < len(per_rank):
            by_ranks.setdefault(shifted, []).append(distribution)
        else:
            job_wide[distribution] = (shifted, len(per_rank))
    verdicts = []
    for ranks, distributions in by_ranks.items():
        evidence = _ild_evidence(drifts, ranks, distributions, policy)
        first = drifts[distributions[0]][ranks[0]]
        verdicts.append(
            Verdict(
                "ild_regression",
                ranks,
                "rank",
                f"rank {rank_list(ranks)}: {' and '.join(_ild_name(d) for d in distributions)} shifted from "
                f"its baseline (KS {first.ks:.2f}, W1 {_seconds(first.wasserstein)}"
                + (f", every op +{_seconds(first.op_shift)}" if first.op_shift is not None else "")
                + f") while the other "
                f"{len(drifts[distributions[0]]) - len(ranks)} ranks' did not: a host-side slowdown there",
                evidence,
            )
        )
    for distribution, (ranks, count) in job_wide.items():
        evidence = _ild_evidence(drifts, ranks, [distribution], policy)
        evidence["ranks_with_data"] = count
        which = "every rank" if len(ranks) == count else f"{len(ranks)} of {count} ranks"
        verdicts.append(
            Verdict(
                "ild_regression",
                (),
                "job",
                f"{_ild_name(distribution)} shifted from the baseline on {which}: a job-wide change "
                "(software, driver, configuration, input)",
                evidence,
            )
        )
    return verdicts


def _ild_evidence(
    drifts: dict[str, dict[int, IldDrift]],
    ranks: tuple[int, ...],
    distributions: list[str],
    policy: IldPolicy,
) -> dict[str, Any]:
    return {
        "distributions": list(distributions),
        "ks_threshold": policy.ks,
        "op_shift_threshold_seconds": policy.op_shift_seconds,
        "shifted": {
            str(rank): {
                distribution: {
                    "ks": round(drifts[distribution][rank].ks, 4),
                    "wasserstein_seconds": drifts[distribution][rank].wasserstein,
                    "op_shift_seconds": drifts[distribution][rank].op_shift,
                }
                for distribution in distributions
            }
            for rank in ranks
        },
        "median_ks": {
            distribution: round(statistics.median(d.ks for d in drifts[distribution].values()), 4)
            for distribution in distributions
        },
        "median_wasserstein_seconds": {
            distribution: statistics.median(d.wasserstein for d in drifts[distribution].values())
            for distribution in distributions
        },
        "median_op_shift_seconds": {
            distribution: IldPeers.of(drifts[distribution].values()).op_shift
            for distribution in distributions
        },
    }


def _ild_name(distribution: str) -> str:
    if distribution == "host_gap":
        return "the training thread's time between ops (host gaps)"
    return distribution.replace("_", " ") + " latency"


def _seconds(value: float) -> str:
    return f"{value * 1e6:.1f} µs" if value < 1e-3 else f"{value * 1e3:.2f} ms"
