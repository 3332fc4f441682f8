"""The hardware canary as the engine reads it: each rank's flare_canary_* series made into records, and the
faults they show, each naming a rank, a host or a link. Pure functions over series and records; no I/O.
Runs in the `flare` command (diagnosis.canary_verdicts, canary_view.py); the rank side is rank/canary.py.

A rank's readings are per (measurement, scope): its preflight value and its share of the job's median
(flare_canary_relative), its last in-flight value, its moving average over its preflight value, and the
checks it failed as the rank judged them (flare_canary_failed, flare_canary_drift). The engine does not judge
the numbers again: it names what the ranks flagged.

- A rank's checks in order: a failed preflight, a failed in-flight check, a drift; within one, the
  measurements in label_values.CANARY_MEASUREMENTS' order (a rank slow at compute reads slowly too:
  compute is its cause; a slow mount on a rank that computes at the median's pace is named as
  storage_read). Each rank is named for its first; the others are listed with it.
- Bus bandwidth within a host (scope intra_host) is the link of that host's ranks: domain `link`, one fault
  per host. Across hosts (inter_host) the members of a canary group share one measurement: domain `link`,
  the ranks of the groups that failed together.
- Other scopes: several ranks of one host failing the same check of the same measurement -> domain `host`;
  the others -> domain `rank`, one fault listing them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import label_values, spec
from .verdict_terms import Domain

CANARY_DRIFT = spec.series("flare_canary_drift")
CANARY_EWMA_RATIO = spec.series("flare_canary_ewma_ratio")
CANARY_FAILED = spec.series("flare_canary_failed")
CANARY_RELATIVE = spec.series("flare_canary_relative")
CANARY_VALUE = spec.series("flare_canary_value")

Key = tuple[str, str]  # (measurement, scope)
Rows = Sequence[tuple[Mapping[str, str], float]]  # (labels, value) of one metric (records.Series)

PREFLIGHT, IN_FLIGHT = label_values.CANARY_PHASES
DRIFT = "drift"
CHECKS = (PREFLIGHT, IN_FLIGHT, DRIFT)  # the order a rank's failures are named in
LINK_SCOPES = ("intra_host", "inter_host")
PREFLIGHT_PASSED = spec.series("flare_canary_preflight_passed")
# What the engine reads of a rank's canary: every flare_canary_* metric of the spec but the canary's own
# bookkeeping (how often it ran, for how long), which says nothing of the hardware.
BOOKKEEPING = (spec.series("flare_canary_runs_total"), spec.series("flare_canary_duration_seconds"))
METRICS = tuple(
    metric.name
    for metric in spec.METRICS
    if metric.name.startswith("flare_canary_") and metric.name not in BOOKKEEPING
)
THROUGHPUTS = ("gemm_flops", "allreduce_busbw", "allgather_busbw", "h2d_copy", "d2h_copy", "storage_read")
UNITS = {"gemm_flops": "FLOP/s", **{name: "B/s" for name in THROUGHPUTS if name != "gemm_flops"}}


class CanaryReading(NamedTuple):
    """One rank's canary figures of one measurement and scope (None: not exported)."""

    preflight: float | None = None
    in_flight: float | None = None
    relative: float | None = None  # preflight over the job's median
    failed: tuple[str, ...] = ()  # the phases whose check failed (preflight, in_flight)
    ewma_ratio: float | None = None  # in-flight moving average over the preflight value
    drift: bool = False

    @property
    def job_median(self) -> float | None:
        """The job's median of the measurement, as the rank saw it (its preflight over its relative)."""
        if self.preflight is None or not self.relative:
            return None
        return self.preflight / self.relative

    def checks(self) -> list[str]:
        """The checks it failed, in CHECKS order."""
        return [check for check in CHECKS if check in self.failed or (check == DRIFT and self.drift)]


@dataclass(frozen=True)
class CanaryState:
    """A rank's canary: its readings, and whether the job's preflight passed (None: not run or not read)."""

    readings: Mapping[Key, CanaryReading] = field(default_factory=dict)
    passed: bool | None = None


def canary_fields(series: Mapping[str, Rows]) -> dict[int, dict[str, Any]]:
    """Per rank that exports canary series, its RankRecord field `canary` (a CanaryState)."""
    found: dict[int, dict[Key, dict[str, Any]]] = defaultdict(dict)

    def reading(labels: Mapping[str, str]) -> dict[str, Any]:
        key = (labels.get("measurement", ""), labels.get("scope", ""))
        return found[int(labels["rank"])].setdefault(key, {"failed": ()})

    for labels, value in series.get(CANARY_VALUE, []):
        if labels.get("phase") in label_values.CANARY_PHASES:
            reading(labels)[labels["phase"]] = value
    for labels, value in series.get(CANARY_RELATIVE, []):
        reading(labels)["relative"] = value
    for labels, value in series.get(CANARY_EWMA_RATIO, []):
        reading(labels)["ewma_ratio"] = value
    for labels, value in series.get(CANARY_FAILED, []):
        if value == 1 and labels.get("phase") in label_values.CANARY_PHASES:
            entry = reading(labels)
            entry["failed"] = tuple(sorted({*entry["failed"], labels["phase"]}, key=CHECKS.index))
    for labels, value in series.get(CANARY_DRIFT, []):
        reading(labels)["drift"] = value == 1
    passed = {int(labels["rank"]): value == 1 for labels, value in series.get(PREFLIGHT_PASSED, [])}
    return {
        rank: {
            "canary": CanaryState(
                {key: CanaryReading(**fields) for key, fields in found.get(rank, {}).items()},
                passed.get(rank),
            )
        }
        for rank in found.keys() | passed.keys()
    }


class Finding(NamedTuple):
    """A check a rank failed: which, of which measurement and scope, and its figures."""

    rank: int
    host: str
    check: str  # preflight | in_flight | drift
    measurement: str
    scope: str
    reading: CanaryReading

    @property
    def value(self) -> float | None:
        """The figure that failed: the preflight or in-flight value, or the moving average (in base units)."""
        if self.check == PREFLIGHT:
            return self.reading.preflight
        if self.check == IN_FLIGHT:
            return self.reading.in_flight
        ratio, baseline = self.reading.ewma_ratio, self.reading.preflight
        return None if ratio is None or baseline is None else ratio * baseline

    @property
    def baseline(self) -> float | None:
        """What it fell short of: the job's median (preflight), else the rank's own preflight value."""
        return self.reading.job_median if self.check == PREFLIGHT else self.reading.preflight

    def described(self) -> str:
        return f"{self.measurement} [{self.scope}] {self.check}"


def _order(finding: Finding) -> tuple[int, int, int, str]:
    scopes = label_values.CANARY_SCOPES
    scope = scopes.index(finding.scope) if finding.scope in scopes else len(scopes)
    return CHECKS.index(finding.check), measurement_order(finding.measurement), scope, finding.scope


def measurement_order(measurement: str) -> int:
    """Where `measurement` comes in label_values.CANARY_MEASUREMENTS (an unknown one last)."""
    known = label_values.CANARY_MEASUREMENTS
    return known.index(measurement) if measurement in known else len(known)


def rank_findings(rank: int, host: str, state: CanaryState | None) -> list[Finding]:
    """Every check the rank failed, the one to name it for first."""
    if state is None:
        return []
    found = [
        Finding(rank, host, check, measurement, scope, reading)
        for (measurement, scope), reading in state.readings.items()
        for check in reading.checks()
    ]
    return sorted(found, key=_order)


@dataclass(frozen=True)
class CanaryFault:
    """Ranks named for the same check of the same measurement and scope, and the domain they make."""

    domain: Domain  # rank, host or link
    findings: tuple[Finding, ...]  # one per rank named, by rank
    host: str = ""  # the host of a host fault, or of an intra-host link
    also: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # a rank's other failed checks

    @property
    def first(self) -> Finding:
        return self.findings[0]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(finding.rank for finding in self.findings)


def canary_faults(ranks: Iterable[tuple[int, str, CanaryState | None]]) -> list[CanaryFault]:
    """The faults of the ranks given as (rank, host, canary state): each rank named once, for its first
    failed check (rank_findings); a fault per host or link where several share one (the module docstring),
    in CHECKS and measurement order."""
    named: dict[tuple[str, str, str], list[Finding]] = defaultdict(list)
    also: dict[int, tuple[str, ...]] = {}
    for rank, host, state in ranks:
        findings = rank_findings(rank, host, state)
        if findings:
            first = findings[0]
            named[first.check, first.measurement, first.scope].append(first)
            also[rank] = tuple(finding.described() for finding in findings[1:])
    faults = [fault for findings in named.values() for fault in _grouped(sorted(findings))]
    faults = [
        CanaryFault(fault.domain, fault.findings, fault.host, {r: also[r] for r in fault.ranks if also[r]})
        for fault in faults
    ]
    return sorted(faults, key=lambda fault: (_order(fault.first), fault.first.rank))


def _grouped(findings: list[Finding]) -> list[CanaryFault]:
    """Findings of one check, measurement and scope, by rank, as faults (the module docstring)."""
    scope = findings[0].scope
    if scope == "inter_host":
        return [CanaryFault("link", tuple(findings))]
    by_host: dict[str, list[Finding]] = defaultdict(list)
    for finding in findings:
        by_host[finding.host].append(finding)
    if scope in LINK_SCOPES:
        return [CanaryFault("link", tuple(found), host) for host, found in by_host.items()]
    shared = {host: found for host, found in by_host.items() if host and len(found) > 1}
    faults = [CanaryFault("host", tuple(found), host) for host, found in shared.items()]
    alone = [finding for finding in findings if finding.host not in shared]
    return faults + ([CanaryFault("rank", tuple(alone))] if alone else [])


def number(value: float | None, measurement: str = "") -> str:
    """A canary figure for people: 3 significant digits and its unit ('?' where unknown)."""
    if value is None:
        return "?"
    unit = UNITS.get(measurement, "")
    return f"{value:.3g}" + (f" {unit}" if unit else "")


def summary(fault: CanaryFault) -> str:
    """One sentence naming the fault's rank, host or link, the measurement and its baseline."""
    first = fault.first
    ranks = ", ".join(map(str, fault.ranks))
    who = f"rank {ranks}" if len(fault.ranks) == 1 else f"ranks {ranks}"
    if fault.domain == "host":
        who = f"host {fault.host} ({who})"
    elif fault.domain == "link":
        hosts = sorted({finding.host for finding in fault.findings if finding.host})
        which = "intra-host link of host" if first.scope == "intra_host" else "inter-host link of hosts"
        who = f"the {which} {', '.join(hosts) or '?'} ({who})"
    elif len(fault.ranks) == 1 and first.host:
        who = f"{who} (host {first.host})"
    return f"{who}: {_what_failed(first)}"


def _what_failed(finding: Finding) -> str:
    measured = f"{finding.measurement} [{finding.scope}]"
    value = number(finding.value, finding.measurement)
    baseline = number(finding.baseline, finding.measurement)
    if finding.check == PREFLIGHT:
        relative = finding.reading.relative
        against = f", {relative:.2f} of the job's median {baseline}" if relative is not None else ""
        return f"failed the canary's {measured} before the first step: {value}{against}"
    if finding.check == IN_FLIGHT:
        share = _share(finding.value, finding.baseline)
        return f"its in-flight {measured} measured {value}{share} its preflight {baseline}"
    ratio = finding.reading.ewma_ratio
    at = f" at {ratio:.2f} of its preflight {baseline}" if ratio is not None else ""
    return f"its {measured} drifts: its moving average{at} ({value}), below the canary's band"


def _share(value: float | None, baseline: float | None) -> str:
    return f", {value / baseline:.2f} of" if value is not None and baseline else ", against"


def evidence(fault: CanaryFault) -> dict[str, Any]:
    """The numbers of a canary verdict (docs/diagnosis.md, evidence by kind)."""
    first = fault.first
    return {
        "check": first.check,
        "measurement": first.measurement,
        "scope": first.scope,
        "host": fault.host or None,
        "ranks": {
            str(finding.rank): {
                "host": finding.host or None,
                "value": finding.value,
                "baseline": finding.baseline,
                "preflight_value": finding.reading.preflight,
                "in_flight_value": finding.reading.in_flight,
                "relative": finding.reading.relative,
                "job_median": finding.reading.job_median,
                "ewma_ratio": finding.reading.ewma_ratio,
                "also_failed": list(fault.also.get(finding.rank, ())),
            }
            for finding in fault.findings
        },
    }
