"""The canary's arithmetic, in the training process: bus bandwidth, the groups it measures, the preflight
verdict across ranks and the in-flight moving average. Pure functions over numbers; no torch, no I/O."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import label_values

# Measurements whose value is a throughput, compared with the job's median; the others (NVML's PCIe width
# and clock state, ratios of their own maximum) meet only their absolute floor.
THROUGHPUTS = ("gemm_flops", "allreduce_busbw", "allgather_busbw", "h2d_copy", "d2h_copy", "storage_read")
# Ratios of the device's own best: anything below it (a narrower PCIe link, a slowdown reason) fails.
HEALTH_FLOOR = 0.999


def bus_bandwidth(op: str, payload_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of one collective taking `seconds`: algorithm bandwidth (bytes over time)
    times 2(n-1)/n for an all-reduce of `payload_bytes`, (n-1)/n for an all-gather whose output holds
    `payload_bytes` (ranks times each rank's input); comparable with the link's speed whatever n."""
    if seconds <= 0 or ranks < 2:
        return 0.0
    algorithm_bandwidth = payload_bytes / seconds
    factor = {"allreduce": 2 * (ranks - 1) / ranks, "allgather": (ranks - 1) / ranks}[op]
    return algorithm_bandwidth * factor


@dataclass(frozen=True)
class GroupPlan:
    """The canary's process groups, as lists of global ranks, in the order every rank creates them."""

    intra_host: tuple[tuple[int, ...], ...]  # ranks sharing a host, one group per host with 2 ranks or more
    inter_host: tuple[tuple[int, ...], ...]  # the i-th rank of every host, one group per i (several hosts)


def plan_groups(hosts: Sequence[str]) -> GroupPlan:
    """The groups for ranks whose hosts are `hosts` (indexed by global rank): every rank computes the same
    plan from the same gathered list, hosts in order of their lowest rank."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    members = list(by_host.values())
    intra = tuple(tuple(ranks) for ranks in members if len(ranks) > 1)
    inter: list[tuple[int, ...]] = []
    if len(members) > 1:
        for index in range(max(len(ranks) for ranks in members)):
            column = tuple(ranks[index] for ranks in members if index < len(ranks))
            if len(column) > 1:
                inter.append(column)
    return GroupPlan(intra, tuple(inter))


Key = tuple[str, str]  # (measurement, scope)


@dataclass(frozen=True)
class RankResults:
    """One rank's preflight: who it is and its measurements by (measurement, scope)."""

    rank: int
    host: str
    values: Mapping[Key, float]


@dataclass(frozen=True)
class Policy:
    """When a preflight measurement fails: below `relative_floor` of the job's median (0: never), or below
    its absolute floor (by measurement; 0 or absent: none)."""

    relative_floor: float
    absolute_floors: Mapping[str, float]


@dataclass(frozen=True)
class Failure:
    """A rank's measurement that failed the policy, with what decided it."""

    rank: int
    host: str
    measurement: str
    scope: str
    value: float
    median: float
    floor: float  # the value it had to reach
    reason: str  # "relative" (against the job's median) or "absolute"

    @property
    def ratio(self) -> float:
        return self.value / self.median if self.median > 0 else 0.0


def medians(results: Sequence[RankResults]) -> dict[Key, float]:
    """The job's median of each (measurement, scope) over the ranks that measured it."""
    collected: dict[Key, list[float]] = {}
    for result in results:
        for key, value in result.values.items():
            collected.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in collected.items()}


def rank_failures(result: RankResults, job_medians: Mapping[Key, float], policy: Policy) -> list[Failure]:
    """The measurements of one rank that fail `policy`."""
    failures = []
    for (measurement, scope), value in result.values.items():
        median = job_medians.get((measurement, scope), 0.0)
        absolute = policy.absolute_floors.get(measurement, 0.0)
        if measurement not in THROUGHPUTS:
            absolute = max(absolute, HEALTH_FLOOR)
        relative = policy.relative_floor * median if measurement in THROUGHPUTS else 0.0
        if absolute and value < absolute:
            failures.append(
                Failure(result.rank, result.host, measurement, scope, value, median, absolute, "absolute")
            )
        elif relative and value < relative:
            failures.append(
                Failure(result.rank, result.host, measurement, scope, value, median, relative, "relative")
            )
    return failures


def judge(results: Sequence[RankResults], policy: Policy) -> list[Failure]:
    """Every failure of every rank, the one to name first: in the order of label_values.CANARY_MEASUREMENTS
    (a rank slow at compute is slow at reading storage too: compute is its cause), then the lowest against
    its floor, then the lowest rank."""
    job_medians = medians(results)
    failures = [failure for result in results for failure in rank_failures(result, job_medians, policy)]
    order = {measurement: index for index, measurement in enumerate(label_values.CANARY_MEASUREMENTS)}
    return sorted(
        failures,
        key=lambda f: (order.get(f.measurement, len(order)), f.value / f.floor if f.floor else 0.0, f.rank),
    )


def best_of(first: Mapping[Key, float], again: Mapping[Key, float]) -> dict[Key, float]:
    """Each measurement's best of two runs (every one is better higher: a throughput, a health ratio)."""
    return {key: max(value, again.get(key, value)) for key, value in first.items()}


def confirmed(failures: Sequence[Failure], runs: int) -> str:
    """What a verdict says of how it was confirmed: the runs whose best values still failed."""
    measurements = sorted({f"{failure.measurement} [{failure.scope}]" for failure in failures})
    return f"confirmed by {runs} runs (best of each): {', '.join(measurements)}"


UNITS = {"gemm_flops": "FLOP/s"}


def describe(failure: Failure) -> str:
    """One line naming the rank, its host, the measurement and its baseline."""
    unit = UNITS.get(failure.measurement, "B/s" if failure.measurement in THROUGHPUTS else "")
    measured = f"{failure.value:.3g}{(' ' + unit) if unit else ''}"
    if failure.reason == "relative":
        against = f"{failure.ratio:.2f} of the job's median {failure.median:.3g}, floor {failure.floor:.3g}"
    else:
        against = f"below the floor {failure.floor:.3g}"
    return (
        f"rank {failure.rank} (host {failure.host}) failed {failure.measurement} [{failure.scope}]: "
        f"{measured}, {against}"
    )


@dataclass
class DriftTracker:
    """One measurement in flight: its moving average against the preflight `baseline`.

    `update()` folds a new value in and answers whether it is below the relaxed hard threshold
    (`hard_fraction` of the baseline) and whether the average has drifted below the band (1 - `band` of the
    baseline). The average starts at the baseline, so that one noisy reading moves it by `alpha` of its
    dip and only a sustained fall crosses the band.
    """

    baseline: float
    alpha: float
    band: float
    hard_fraction: float
    ewma: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        self.ewma = self.baseline

    def update(self, value: float) -> tuple[bool, bool]:
        """(below the hard threshold, drifted) after folding `value` in."""
        self.ewma = self.alpha * value + (1 - self.alpha) * self.ewma
        self.samples += 1
        return value < self.hard_fraction * self.baseline, self.drifted

    @property
    def ratio(self) -> float:
        return self.ewma / self.baseline if self.baseline > 0 else 0.0

    @property
    def drifted(self) -> bool:
        return self.baseline > 0 and self.ewma < (1 - self.band) * self.baseline
