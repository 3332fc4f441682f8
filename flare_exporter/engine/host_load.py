"""Slowdowns read together with what the ranks' hosts were doing (CLI engine; pure, no I/O).

Each rank exports its host's CPU pressure now and its floor (the lowest read while the job ran), the host's
run queue and usable CPUs, and its training thread's share of a CPU (rank/host_load.py). A host is busy where
HostLoadPolicy says so. Then, among the straggler verdicts (straggler_verdicts.straggler_verdicts):

- a slowdown every rank of the busy hosts shares (the job-wide verdict, or stragglers that are all the
  ranks of their hosts) is the hosts' load: a warning, domain host (one host) or job, cause
  host_contention, naming no rank's fault;
- a straggler alone on a busy host stays a straggler, with its host's load in its evidence;
- a rank whose issue latency shifted host side (an ild_regression of its own) stays that verdict even where
  it also ends up the slowest: the straggler verdict's evidence joins it (it waits least *because* of it),
  unless its GPU's health explains the slowness (the straggler verdict's hardware reasons).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import spec
from ..policies import HostLoadPolicy

WARNING = "warning"  # a verdict's severity where no rank is at fault (the others: "page")


@dataclass(frozen=True)
class HostLoadState:
    """What a rank last exported of its host's load (flare_host_*, flare_training_thread_cpu_ratio)."""

    cpu_pressure: float | None = None
    cpu_pressure_floor: float | None = None
    runnable_tasks: float | None = None
    cpus: float | None = None
    thread_cpu_ratio: float | None = None


# HostLoadState attribute -> the metric it is read from
HOST_LOAD_METRICS = {
    "cpu_pressure": spec.series("flare_host_cpu_pressure_ratio"),
    "cpu_pressure_floor": spec.series("flare_host_cpu_pressure_floor_ratio"),
    "runnable_tasks": spec.series("flare_host_runnable_tasks"),
    "cpus": spec.series("flare_host_cpus"),
    "thread_cpu_ratio": spec.series("flare_training_thread_cpu_ratio"),
}


def busy_hosts(records: Iterable[Any], policy: HostLoadPolicy) -> dict[str, dict[str, Any]]:
    """The busy hosts among the live ranks' (RankRecords with .host, .host_load), each with its evidence."""
    by_host: dict[str, list[Any]] = {}
    for record in records:
        if not record.gone and record.host_load is not None:
            by_host.setdefault(record.host, []).append(record)
    found = {}
    for host, on_host in by_host.items():
        evidence = _host_evidence(on_host, policy)
        if evidence["busy"]:
            found[host] = evidence
    return found


def _median(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _host_evidence(on_host: list[Any], policy: HostLoadPolicy) -> dict[str, Any]:
    loads = [record.host_load for record in on_host]
    pressure = _median(load.cpu_pressure for load in loads)
    floor = _median(load.cpu_pressure_floor for load in loads)
    runnable = _median(load.runnable_tasks for load in loads)
    cpus = _median(load.cpus for load in loads)
    if pressure is not None:
        rose = floor is not None and pressure - floor >= policy.pressure_rise  # no floor: no rise to tell
        busy = pressure >= policy.cpu_pressure and rose
    else:
        busy = runnable is not None and bool(cpus) and runnable / cpus >= policy.runnable_per_cpu  # type: ignore[operator]
    return {
        "busy": busy,
        "ranks": sorted(record.rank for record in on_host),
        "cpu_pressure": pressure,
        "cpu_pressure_floor": floor,
        "runnable_tasks": runnable,
        "cpus": cpus,
        "thread_cpu_ratio": {
            str(record.rank): record.host_load.thread_cpu_ratio
            for record in on_host
            if record.host_load.thread_cpu_ratio is not None
        },
        "policy_version": policy.version,
    }


def said(hosts: Mapping[str, Mapping[str, Any]]) -> str:
    """What the busy hosts' evidence says, in one clause."""
    parts = []
    for host, evidence in sorted(hosts.items()):
        pressure, floor = evidence["cpu_pressure"], evidence["cpu_pressure_floor"]
        if pressure is not None:
            load = f"a task waited for a CPU {pressure:.0%} of the last 10 s"
            load += f" (at least {floor:.0%} all along)" if floor is not None else ""
        else:
            load = f"{evidence['runnable_tasks']:.0f} runnable tasks on {evidence['cpus']:.0f} CPUs"
        shares = list(evidence["thread_cpu_ratio"].values())
        if shares:
            load += f", its training threads ran {min(shares):.0%}-{max(shares):.0%} of a CPU"
        parts.append(f"host {host or '(unnamed)'} busy: {load}")
    return "; ".join(parts)


def judged_with_host_load(snapshot: Any, verdicts: list[Any], policy: HostLoadPolicy) -> list[Any]:
    """The pace verdicts (stragglers, ILD) judged with the hosts' load and the host-side shifts (above)."""
    verdicts = host_side_before_straggler(verdicts)
    hosts = busy_hosts(snapshot.ranks.values(), policy)
    if not hosts:
        return verdicts
    return [_with_host_load(snapshot, verdict, hosts) for verdict in verdicts]


def _with_host_load(snapshot: Any, verdict: Any, hosts: Mapping[str, dict[str, Any]]) -> Any:
    if verdict.kind != "straggler":
        return verdict
    slowed = [int(rank) for rank in verdict.evidence.get("slowdown_ratio", {})] if not verdict.ranks else []
    ranks = list(verdict.ranks) or slowed
    on = {snapshot.ranks[rank].host for rank in ranks if rank in snapshot.ranks}
    busy = {host: hosts[host] for host in on if host in hosts}
    if not busy:
        return verdict
    evidence = {**verdict.evidence, "host_load": busy}
    # every live rank of those hosts, read or not (a source may read the host's load of a few ranks only)
    on_busy = {record.rank for record in snapshot.ranks.values() if record.host in busy and not record.gone}
    every_rank_of_them = set(ranks) == on_busy
    if len(busy) < len(on) or not every_rank_of_them:  # a rank slower than its busy host's others: its own
        return dataclasses.replace(verdict, summary=f"{verdict.summary}; {said(busy)}", evidence=evidence)
    what = "every rank" if not verdict.ranks else f"ranks {', '.join(map(str, ranks))}, all of theirs,"
    return dataclasses.replace(
        verdict,
        ranks=(),
        domain="host" if len(busy) == 1 else "job",
        summary=f"{said(busy)}: {what} slowed alike, the host's load and no rank's fault ({verdict.summary})",
        evidence={**evidence, "slowed_ranks": ranks},
        cause="host_contention",
        severity=WARNING,
    )


def host_side_before_straggler(verdicts: list[Any]) -> list[Any]:
    """A rank named both a straggler (without its GPU's reasons) and by an issue-latency regression of its
    own (domain rank: host side) is that regression's: it waits least because its host side slowed. The
    straggler verdict drops it (and goes where it named no one else); the regression's evidence keeps what
    the straggler verdict said."""
    shifted = {
        rank
        for verdict in verdicts
        if verdict.kind == "ild_regression" and verdict.domain == "rank"
        for rank in verdict.ranks
    }
    slowest: dict[int, Any] = {}
    kept = []
    for verdict in verdicts:
        hardware = verdict.evidence.get("hardware", {})  # its GPU's reasons: the device side, not the host
        both = [rank for rank in verdict.ranks if rank in shifted and str(rank) not in hardware]
        both = both if verdict.kind == "straggler" else []
        for rank in both:
            slowest[rank] = verdict.evidence.get("ranks", {}).get(str(rank), {})
        rest = tuple(rank for rank in verdict.ranks if rank not in both)
        if both and not rest:
            continue
        kept.append(dataclasses.replace(verdict, ranks=rest) if both else verdict)
    if not slowest:
        return verdicts
    return [_also_slowest(verdict, slowest) for verdict in kept]


def _also_slowest(verdict: Any, slowest: Mapping[int, Any]) -> Any:
    ranks = [rank for rank in verdict.ranks if rank in slowest]
    if verdict.kind != "ild_regression" or not ranks:
        return verdict
    evidence = {**verdict.evidence, "also_slowest": {str(rank): slowest[rank] for rank in ranks}}
    summary = f"{verdict.summary}; it is also the slowest rank: the others wait for it"
    return dataclasses.replace(verdict, summary=summary, evidence=evidence)
