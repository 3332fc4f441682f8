"""Where the job's step time goes, and what each rank cost it: `flare perf` and the badput ledger.

Pure functions over per-rank records (PerfRank), read from every rank's series: seconds per phase over the
accounted steps (rank/perf.py), the collective phase by the role of the group waited on (dp, tp, pp, ...),
model FLOPs per step, achieved FLOP/s and MFU. Two sources give the series:
a direct scrape (the counters since each rank started) and Prometheus (their increase over --window).

- Bottleneck class per rank (and for the job, over the sum of the ranks' phases): policies.BottleneckPolicy,
  on each rank's step without the time it waited for the last arriver (classify): the job's ranks share
  the bottleneck of the rank they wait for.
- The badput ledger: a synchronous collective ends for every rank when the last one arrives, so the rank
  that arrived last waited least, and every other rank waited for it the difference. Over the steps of the
  source's span, the rank with the least collective time per step (not overlapped by compute) is charged
  sum over the other ranks of (their time per step - its own) x steps; every other rank is charged nothing.
  Seconds lost per host: the sum over its ranks. Over a span in which one rank is the straggler throughout,
  that is the time the others spent waiting for it; noise that moves from rank to rank averages out of it.
- A slower device: compute FLOP/s (model FLOPs over the compute seconds of a step) below
  `slow_device_share` of the ranks' median.
- Pipeline stages differ by design (the last computes the loss, the first embeds): a rank that sends or
  receives in a group is a stage, at its position in that group, and is weighed (ledger, least wait,
  slower device) only against the same stage of other pipelines, never against other stages or the
  ranks of no pipeline; with one pipeline, each stage only against itself over time (the straggler
  windows' own best). Its waits in sends and receives are its `bubble` phase, apart from the collectives.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import label_values, spec
from ..policies import BottleneckPolicy
from . import promql, scrape
from .prometheus_source import matcher, the_run
from .records import RANK_INFO, Series, SourceError, one_run
from .targets import Target

PHASES = spec.series("flare_step_phase_seconds_total")
STEPS = spec.series("flare_step_phase_steps_total")
ROLES = spec.series("flare_step_collective_seconds_total")
GAUGES = (
    spec.series("flare_model_flops_per_step"),
    spec.series("flare_achieved_flops"),
    spec.series("flare_mfu_ratio"),
)
GROUP_INFO, P2P_DONE = spec.series("flare_process_group_info"), spec.series("flare_p2p_completed_total")
PERF_METRICS = frozenset([PHASES, STEPS, ROLES, *GAUGES, RANK_INFO, GROUP_INFO, P2P_DONE])


@dataclass(frozen=True)
class PerfRank:
    """One rank's step breakdown: seconds per phase over `steps` steps, FLOPs, achieved FLOP/s, MFU, and
    its collective phase's seconds by group role."""

    rank: int
    host: str = ""
    steps: float = 0.0
    phases: Mapping[str, float] = field(default_factory=dict)
    flops_per_step: float | None = None
    achieved_flops: float | None = None
    mfu: float | None = None
    collective_by_role: Mapping[str, float] = field(default_factory=dict)
    stage: str = ""  # its pipeline stage (`mesh_pp stage 1`); "" where it sends and receives nothing

    @property
    def step_seconds(self) -> float:
        return sum(self.phases.values())

    def per_step(self, phase: str) -> float | None:
        return self.phases.get(phase, 0.0) / self.steps if self.steps > 0 else None

    def shares(self) -> dict[str, float]:
        total = self.step_seconds
        return {phase: seconds / total for phase, seconds in self.phases.items()} if total > 0 else {}

    @property
    def compute_flops(self) -> float | None:
        """Model FLOPs over the compute seconds of a step: how fast its device runs, waits left out."""
        compute = self.per_step("compute")
        return self.flops_per_step / compute if self.flops_per_step and compute else None


def records_from_series(series: Mapping[str, Series]) -> dict[int, PerfRank]:
    """Per rank, its PerfRank from series by metric name ((labels, value) lists), of one run."""
    hosts = {int(labels["rank"]): labels.get("host", "") for labels, _ in series.get(RANK_INFO, [])}
    phases = _per_rank_and(series.get(PHASES, []), "phase", label_values.STEP_PHASES)
    roles = _per_rank_and(series.get(ROLES, []), "role", label_values.GROUP_ROLES)
    values = {name: _per_rank(series.get(name, [])) for name in (STEPS, *GAUGES)}
    stages = stages_from_series(series)
    ranks = set(phases) | set(values[STEPS])
    return {
        rank: PerfRank(
            rank,
            hosts.get(rank, ""),
            values[STEPS].get(rank, 0.0),
            phases.get(rank, {}),
            flops_per_step=values[GAUGES[0]].get(rank),
            achieved_flops=values[GAUGES[1]].get(rank),
            mfu=values[GAUGES[2]].get(rank),
            collective_by_role=roles.get(rank, {}),
            stage=stages.get(rank, ""),
        )
        for rank in sorted(ranks)
    }


def stages_from_series(series: Mapping[str, Series]) -> dict[int, str]:
    """Rank -> its pipeline stage: a rank that sent or received in group G is the stage at its position in G
    (flare_process_group_info's group_rank); the same position in another group of G's kind (its name
    without the members' hash: another pipeline) is the same stage. Of several such groups, the first."""
    positions = {
        (int(labels["rank"]), labels["group"]): labels.get("group_rank", "")
        for labels, _ in series.get(GROUP_INFO, [])
    }
    stages: dict[int, str] = {}
    for labels, value in sorted(series.get(P2P_DONE, []), key=lambda item: item[0].get("group", "")):
        rank, group = int(labels["rank"]), labels.get("group", "")
        if value > 0 and rank not in stages:
            kind = group.rsplit("-", 1)[0] if "-" in group else group
            stages[rank] = f"{kind} stage {positions.get((rank, group)) or rank}"
    return stages


def peer_classes(records: Mapping[int, PerfRank]) -> dict[str, dict[int, PerfRank]]:
    """The ranks weighed against each other: those of each pipeline stage, and those of no pipeline."""
    classes: dict[str, dict[int, PerfRank]] = {}
    for rank, record in records.items():
        classes.setdefault(record.stage, {})[rank] = record
    return classes


def _per_rank(series: Series) -> dict[int, float]:
    return {int(labels["rank"]): value for labels, value in series if math.isfinite(value)}


def _per_rank_and(series: Series, label: str, known: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """Per rank, the values of `series` by its `label` (counters: negative ones as 0), the `known` only."""
    found: dict[int, dict[str, float]] = {}
    for labels, value in series:
        if labels.get(label, "") in known and math.isfinite(value):
            found.setdefault(int(labels["rank"]), {})[labels[label]] = max(0.0, value)
    return found


def classify(record: PerfRank, policy: BottleneckPolicy, least_wait: float | None = None) -> str:
    """The rank's bottleneck class ("" before it has accounted a step), judged on its step without the time
    it waited for the last arriver: with `least_wait` (the ranks' least collective time per step), its own
    collective time counts as that much. A synchronous job's ranks all wait for the slowest one, whose
    bottleneck (its data, its compute) is theirs; the ledger charges that wait to it."""
    shares = judged(record, least_wait).shares()
    return policy.classify(shares) if shares else ""


def judged(record: PerfRank, least_wait: float | None) -> PerfRank:
    """`record` with its collective time per step lowered to `least_wait` (if given and lower)."""
    own = record.per_step("collective")
    if least_wait is None or own is None or own <= least_wait:
        return record
    return PerfRank(
        record.rank, record.host, record.steps, {**record.phases, "collective": least_wait * record.steps}
    )


def least_wait(records: Mapping[int, PerfRank]) -> float | None:
    """The ranks' least collective time per step: the last arriver's, the collectives' own cost."""
    waits = [wait for record in records.values() if (wait := record.per_step("collective")) is not None]
    return min(waits) if len(waits) >= 2 else None


def job_record(records: Iterable[PerfRank]) -> PerfRank:
    """The job as one rank: phases and steps summed over the ranks."""
    phases: dict[str, float] = {}
    steps = 0.0
    for record in records:
        steps += record.steps
        for phase, seconds in record.phases.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return PerfRank(-1, steps=steps, phases=phases)


def seconds_lost(records: Mapping[int, PerfRank]) -> dict[int, float]:
    """The badput ledger (module docstring): seconds the other ranks waited for each rank."""
    waits = {rank: r.per_step("collective") for rank, r in records.items()}
    known = {rank: wait for rank, wait in waits.items() if wait is not None}
    lost = dict.fromkeys(records, 0.0)
    if len(known) < 2:
        return lost
    last = min(known, key=lambda rank: (known[rank], rank))
    excess_per_step = sum(wait - known[last] for rank, wait in known.items() if rank != last)
    lost[last] = excess_per_step * records[last].steps
    return lost


def seconds_lost_by_host(records: Mapping[int, PerfRank], lost: Mapping[int, float]) -> dict[str, float]:
    by_host: dict[str, float] = {}
    for rank, seconds in lost.items():
        host = records[rank].host or "?"
        by_host[host] = by_host.get(host, 0.0) + seconds
    return by_host


def slow_ranks(records: Mapping[int, PerfRank], policy: BottleneckPolicy) -> list[dict[str, Any]]:
    """Ranks (of 3 or more) whose compute FLOP/s is below `slow_device_share` of the ranks' median."""
    speeds = {rank: r.compute_flops for rank, r in records.items() if r.compute_flops}
    if len(speeds) < 3:
        return []
    median = statistics.median(speeds.values())
    return [
        {"rank": rank, "compute_flops": speed, "median_compute_flops": median, "ratio": speed / median}
        for rank, speed in sorted(speeds.items())
        if speed < policy.slow_device_share * median
    ]


POLICY = BottleneckPolicy()


def perf_view(
    records: Mapping[int, PerfRank], policy: BottleneckPolicy = POLICY
) -> tuple[dict[str, Any], list[str]]:
    """`flare perf`'s JSON fields and text lines. Each class of peers (peer_classes) is weighed alone."""
    lost: dict[int, float] = {}
    rows: dict[int, dict[str, Any]] = {}
    judged_records: list[PerfRank] = []
    slow: list[dict[str, Any]] = []
    for peers in peer_classes(records).values():
        lost.update(seconds_lost(peers))
        least = least_wait(peers)
        pacer = pacer_class(peers, policy, least)
        for rank, record in peers.items():
            rows[rank] = _rank_json(record, policy, lost[rank], least, pacer)
            judged_records.append(judged(record, least))
        slow += slow_ranks(peers, policy)
    ranks = [rows[rank] for rank in records]
    job = job_record(judged_records)
    slow.sort(key=lambda found: found["rank"])
    result = {
        "policy_version": policy.version,
        "bottleneck": classify(job, policy),
        "phases_share": _rounded(job.shares()),
        "collective_share_by_role": _rounded(role_shares(records.values())),
        "ranks": ranks,
        "seconds_lost_by_host": _rounded(seconds_lost_by_host(records, lost)),
        "slow_ranks": slow,
    }
    return result, _perf_lines(result)


def role_shares(records: Iterable[PerfRank]) -> dict[str, float]:
    """The job's collective phase by group role, as shares of its step time (summed over the ranks), the
    largest first: as the flare.perf rules record it per run and role."""
    step_seconds, by_role = 0.0, dict.fromkeys(label_values.GROUP_ROLES, 0.0)
    for record in records:
        step_seconds += record.step_seconds
        for role, seconds in record.collective_by_role.items():
            by_role[role] += seconds
    if step_seconds <= 0:
        return {}
    seen = sorted((role for role in by_role if by_role[role] > 0), key=lambda role: -by_role[role])
    return {role: by_role[role] / step_seconds for role in seen}


def pacer_class(records: Mapping[int, PerfRank], policy: BottleneckPolicy, least: float | None) -> str:
    """The class of the rank that sets the job's pace: the last arriver, the one that waits least."""
    waits = {rank: wait for rank, r in records.items() if (wait := r.per_step("collective")) is not None}
    if least is None or not waits:
        return ""
    return classify(records[min(waits, key=lambda rank: (waits[rank], rank))], policy)


def waits_for_pacer(record: PerfRank, policy: BottleneckPolicy, least: float | None) -> bool:
    """Whether most of the rank's step is the wait for the last arriver (its collective time beyond the
    least): its step is the pacer's, and so is its bottleneck."""
    own = record.per_step("collective")
    step = record.step_seconds / record.steps if record.steps > 0 else 0.0
    if least is None or own is None or not step:
        return False
    return (own - least) / step >= policy.communication_share


def _rank_json(
    record: PerfRank, policy: BottleneckPolicy, lost: float, least: float | None, pacer: str = ""
) -> dict[str, Any]:
    waiting = bool(pacer) and waits_for_pacer(record, policy, least)
    return {
        "rank": record.rank,
        "host": record.host,
        "bottleneck": pacer if waiting else classify(record, policy, least),
        "waits_for_last_arriver": waiting,
        "steps": record.steps,
        "phases": {phase: _per_step_rounded(record, phase) for phase in record.phases},
        "collective_by_role": {
            role: round(seconds / record.steps, 6) if record.steps else None
            for role, seconds in sorted(record.collective_by_role.items(), key=lambda item: -item[1])
        },
        "phases_share": _rounded(record.shares()),
        "step_seconds": round(record.step_seconds / record.steps, 6) if record.steps else None,
        "flops_per_step": record.flops_per_step,
        "achieved_flops": record.achieved_flops,
        "mfu": record.mfu,
        "seconds_lost": round(lost, 6),
        "stage": record.stage or None,
    }


def _per_step_rounded(record: PerfRank, phase: str) -> float | None:
    seconds = record.per_step(phase)
    return round(seconds, 6) if seconds is not None else None


def _rounded(values: Mapping[Any, float]) -> dict[Any, float]:
    return {key: round(value, 6) for key, value in values.items()}


def _perf_lines(result: Mapping[str, Any]) -> list[str]:
    shown = [phase for phase in label_values.STEP_PHASES if phase != "transfer"]  # host: 0 where not measured
    lines = [
        f"job: {result['bottleneck'] or 'no steps accounted yet'} (policy v{result['policy_version']})",
        f"{'rank':>5} {'bottleneck':<20} {'step':>9} "
        + " ".join(f"{phase:>10}" for phase in shown)
        + f" {'TFLOP/s':>8} {'MFU':>6} {'lost':>9}  collective/step by group role",
    ]
    for row in result["ranks"]:
        step = row["step_seconds"]
        shares = row["phases_share"]
        cells = " ".join(f"{shares.get(phase, 0.0) * 100:>9.1f}%" for phase in shown)
        achieved = (
            f"{row['achieved_flops'] / 1e12:>8.3f}" if row["achieved_flops"] is not None else f"{'-':>8}"
        )
        mfu = f"{row['mfu'] * 100:>5.1f}%" if row["mfu"] is not None else f"{'-':>6}"
        step_text = f"{step * 1000:>7.2f}ms" if step is not None else f"{'-':>9}"
        lines.append(
            f"{row['rank']:>5} {row['bottleneck'] or '-':<20} {step_text} {cells} {achieved} {mfu} "
            f"{row['seconds_lost']:>8.2f}s  {_by_role_text(row['collective_by_role'])}"
        )
    if result["collective_share_by_role"]:
        shares = ", ".join(
            f"{role} {share * 100:.1f}%" for role, share in result["collective_share_by_role"].items()
        )
        lines.append(f"collective by group role, of the job's step time: {shares}")
    for slow in result["slow_ranks"]:
        lines.append(
            f"rank {slow['rank']} computes at {slow['ratio'] * 100:.0f}% of the ranks' median FLOP/s: "
            "a slower device than its peers'"
        )
    return lines


def _by_role_text(by_role: Mapping[str, float | None]) -> str:
    """`world 3.20ms tp 0.41ms`: a rank's collective seconds per step by group role."""
    return " ".join(
        f"{role} {seconds * 1000:.2f}ms" for role, seconds in by_role.items() if seconds is not None
    )


# ---------------------------------------------------------------------------------------------------------
# sources


def from_targets(
    targets: list[Target], run: str = "", timeout: float = 5.0, via: scrape.Client | None = None
) -> tuple[str, dict[int, PerfRank]]:
    """The run and its ranks' records from their endpoints (counters since each rank started)."""
    results = scrape.scrape_all(
        [target.address for target in targets], timeout=timeout, via=via, wanted=PERF_METRICS
    )
    answered = [samples for samples in results.values() if isinstance(samples, list)]
    runs = [scrape.labels_of(samples, RANK_INFO).get("run", "") for samples in answered]
    run = one_run([r for r in runs if r], run, f"{len(targets)} targets")
    series: dict[str, Series] = {}
    for samples in answered:
        if scrape.labels_of(samples, RANK_INFO).get("run") != run:
            continue
        for sample in samples:
            series.setdefault(sample.name, []).append((sample.labels, sample.value))
    return run, records_from_series(series)


def from_prometheus(
    server: Any, run: str, window: str, timeout: float, now: float
) -> tuple[str, dict[int, PerfRank]]:
    """The run and its ranks' records from Prometheus: counters' increase over `window`, gauges' last value.
    Seven queries, whatever the rank count."""
    run = run or the_run(server, window, timeout, now)
    selected = matcher(run)
    gauges = "|".join(GAUGES)
    queries = {
        PHASES: f"increase({PHASES}{{{selected}}}[{window}])",
        STEPS: f"increase({STEPS}{{{selected}}}[{window}])",
        ROLES: f"increase({ROLES}{{{selected}}}[{window}])",
        "gauges": f'{{__name__=~"{gauges}",{selected}}}',  # their current values (instant: names kept)
        RANK_INFO: f"last_over_time({RANK_INFO}{{{selected}}}[{window}])",
        GROUP_INFO: (
            f"max by (rank, group, group_rank) (last_over_time({GROUP_INFO}{{{selected}}}[{window}]))"
        ),
        P2P_DONE: f"max by (rank, group) (increase({P2P_DONE}{{{selected}}}[{window}]))",
    }
    series: dict[str, Series] = {}
    for name, expr in queries.items():
        for item in promql.query(server, expr, timeout, now):
            labels = item["metric"]
            metric = labels.get("__name__", name) if name == "gauges" else name
            series.setdefault(metric, []).append((labels, float(item["value"][1])))
    if not series.get(RANK_INFO):
        raise SourceError(f"Prometheus has no rank of run {run!r} within {window}")
    return run, records_from_series(series)
