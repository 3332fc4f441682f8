"""The view of `flare canary`: each rank's hardware canary, one row per rank, measurement and scope: its
preflight value, its share of the job's median, its last in-flight value, its moving average over its
preflight value, the checks it failed and whether it drifts. Runs in the `flare` command, over a snapshot
(from Prometheus beyond prometheus_source.CANARY_EVERY_RANK ranks, only the ranks that failed a check and
the bottom few of each measurement are read).
"""

from __future__ import annotations

from typing import Any

from .canary import DRIFT, CanaryReading, measurement_order
from .rule_types import RankRecord, Snapshot

NO_READINGS = "(no canary readings: the canary is off (canary: warn or enforce turns it on), or has not run)"


def canary_view(snapshot: Snapshot) -> tuple[dict[str, Any], list[str]]:
    """The view's JSON fields (`preflight_passed`, `canary`: the rows, the failing ones first, then by their
    share of the job's median) and its lines."""
    rows = [
        _row(record, measurement, scope, reading)
        for record in snapshot.ranks.values()
        if record.up and record.canary is not None
        for (measurement, scope), reading in record.canary.readings.items()
    ]
    rows.sort(key=_order)
    passed = preflight_passed(snapshot)
    said = {None: "not run (or not read)", True: "passed", False: "failed"}[passed]
    lines = [f"preflight: {said}"]
    lines.append(
        f"{'rank':>5} {'host':<14} {'measurement':<16} {'scope':<11} {'preflight':>10} {'relative':>8} "
        f"{'in flight':>10} {'ewma':>6}  failed"
    )
    lines += [_line(row) for row in rows] or [NO_READINGS]
    return {"preflight_passed": passed, "canary": rows}, lines


def preflight_passed(snapshot: Snapshot) -> bool | None:
    """Whether the job's preflight passed (each rank exports the same answer): False where a live rank says
    it failed, None where none says."""
    said = {
        record.canary.passed
        for record in snapshot.ranks.values()
        if record.up and record.canary is not None and record.canary.passed is not None
    }
    return None if not said else all(said)


def _row(record: RankRecord, measurement: str, scope: str, reading: CanaryReading) -> dict[str, Any]:
    return {
        "rank": record.rank,
        "host": record.host or None,
        "measurement": measurement,
        "scope": scope,
        "preflight_value": reading.preflight,
        "relative": reading.relative,
        "in_flight_value": reading.in_flight,
        "ewma_ratio": reading.ewma_ratio,
        "failed": [check for check in reading.checks() if check != DRIFT],
        "drift": reading.drift,
    }


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    flagged = bool(row["failed"]) or row["drift"]
    relative = row["relative"] if row["relative"] is not None else 1.0
    return (not flagged, relative, row["rank"], measurement_order(row["measurement"]), row["scope"])


def _line(row: dict[str, Any]) -> str:
    failed = ", ".join([*row["failed"], *([DRIFT] if row["drift"] else [])]) or "-"
    return (
        f"{row['rank']:>5} {(row['host'] or '?')[:14]:<14} {row['measurement']:<16} {row['scope']:<11} "
        f"{_figure(row['preflight_value']):>10} {_figure(row['relative'], '.2f'):>8} "
        f"{_figure(row['in_flight_value']):>10} {_figure(row['ewma_ratio'], '.2f'):>6}  {failed}"
    )


def _figure(value: float | None, form: str = ".3g") -> str:
    return "-" if value is None else format(value, form)
