"""A dead run's last words from Prometheus's history: what each rank exported last before it vanished.

One round of queries (history_queries, 14, whatever the rank count), evaluated at `at` (now, or a past
incident's time) over `window` before it. Values look back (`last_over_time`); when a rank was last scraped
comes from the timestamps of its own samples (`timestamp()` in a subquery whose step is at most a second
per window/600, so no scrape falls between two steps at the scrape intervals flare's ranks are scraped at).
A collective counts as in flight at the end only if the rank's last scrape still held it: a series that
vanished earlier (it completed) has an older last timestamp than the rank's last scrape. So does an op or
state of a group's in-flight info that an earlier collective had (DDP's first broadcast, say).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from .. import causes, spec
from ..causes import Cause
from ..durations import duration_seconds
from . import prometheus_source, promql
from .post_mortem import DeadRun, ExceptionWord, LastWord, Termination
from .records import (
    COLLECTIVE_LAST_COMPLETED_SEQ,
    COLLECTIVE_LAST_ISSUED_SEQ,
    FLIGHT_INFO,
    FLIGHT_NUMBERS,
    FLIGHT_STARTED,
    HEARTBEAT_TIMESTAMP_SECONDS,
    RANK_EXCEPTION_INFO,
    RANK_EXCEPTION_TIMESTAMP_SECONDS,
    RANK_INFO,
    STEPS_TOTAL,
    Series,
    SourceError,
    group_fields,
    per_rank,
)

LAST_SEEN = "last_seen"  # when each rank was last scraped
FLIGHT_SEEN = "flight_seen"  # when each (rank, group)'s in-flight collective was last scraped
INFO_SEEN = "flight_info_seen"  # when each (rank, group, op, state) of one was last scraped
TERMINATED = spec.series("flare_rank_terminated_timestamp_seconds")


def history_queries(step: str) -> dict[str, str]:
    """The queries of one round; `step` is the subquery resolution of the last-scrape times."""
    last = "last_over_time({name}{{sel}}[{{window}}])"

    def looked_back(name: str, labels: str = "") -> str:
        return f"max by (rank{labels}) ({last.format(name=name)})"

    def last_scraped(name: str, labels: str) -> str:
        return f"max by (rank{labels}) (max_over_time(timestamp({name}{{sel}})[{{window}}:{step}]))"

    return {
        RANK_INFO: looked_back(RANK_INFO, ", host, world_size, switch, rack"),
        LAST_SEEN: last_scraped(RANK_INFO, ""),
        RANK_EXCEPTION_INFO: looked_back(RANK_EXCEPTION_INFO, ", type, cause"),
        RANK_EXCEPTION_TIMESTAMP_SECONDS: looked_back(RANK_EXCEPTION_TIMESTAMP_SECONDS),
        TERMINATED: looked_back(TERMINATED, ", signal, sender"),
        HEARTBEAT_TIMESTAMP_SECONDS: looked_back(HEARTBEAT_TIMESTAMP_SECONDS),
        STEPS_TOTAL: looked_back(STEPS_TOTAL),
        COLLECTIVE_LAST_ISSUED_SEQ: looked_back(COLLECTIVE_LAST_ISSUED_SEQ, ", group"),
        COLLECTIVE_LAST_COMPLETED_SEQ: looked_back(COLLECTIVE_LAST_COMPLETED_SEQ, ", group"),
        FLIGHT_STARTED: looked_back(FLIGHT_STARTED, ", group"),
        FLIGHT_SEEN: last_scraped(FLIGHT_STARTED, ", group"),
        FLIGHT_INFO: looked_back(FLIGHT_INFO, ", group, op, state"),
        INFO_SEEN: last_scraped(FLIGHT_INFO, ", group, op, state"),
        **{name: looked_back(name, ", group") for name in FLIGHT_NUMBERS},
    }


def subquery_step(window_seconds: float) -> str:
    """At least one step per second of the window up to 600 steps, then window/600 (whole seconds)."""
    return f"{max(1, round(window_seconds / 600))}s"


def dead_run_from_prometheus(
    server: promql.Prometheus,
    run: str = "",
    window: str = "10m",
    timeout: float = 10.0,
    at: float | None = None,
) -> DeadRun:
    """Every rank's last word of `run` (the one run seen within `window`, if not given) as of `at` (now),
    from the Prometheus at `server` (its base URL, or a promql.Connection where it is secured)."""
    now = time.time() if at is None else at
    seconds = duration_seconds(window, "flag --window")
    connection = promql.connection(server)
    run = run or prometheus_source.the_run(connection, window, timeout, now)
    prometheus = prometheus_source.PrometheusRun(
        connection, prometheus_source.matcher(run), window, timeout, now
    )
    series = prometheus.fetch(history_queries(subquery_step(seconds)))
    if not series.get(RANK_INFO):
        raise SourceError(
            f"Prometheus at {connection.url}: no rank of run {run!r} was scraped in the {window} before "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(now))} UTC (widen --window or set --at)"
        )
    return dead_run(series, run, f"prometheus {connection.url}", now)


def dead_run(series: Mapping[str, Series], run: str, source: str, now: float) -> DeadRun:
    """The DeadRun Prometheus's answers describe (pure: the answers in, the last words out)."""
    info = {int(labels["rank"]): labels for labels, _ in series.get(RANK_INFO, [])}
    last_seen = per_rank(series, LAST_SEEN)
    groups = group_fields(_at_the_end(series, last_seen), now)
    exceptions = _exceptions(series)
    terminations = {
        int(labels["rank"]): Termination(labels.get("signal", ""), labels.get("sender", "unknown"), value)
        for labels, value in series.get(TERMINATED, [])
    }
    heartbeat = per_rank(series, HEARTBEAT_TIMESTAMP_SECONDS)
    steps = per_rank(series, STEPS_TOTAL)
    words = {
        rank: LastWord(
            rank,
            host=labels.get("host", ""),
            topology={key: labels[key] for key in ("switch", "rack") if labels.get(key)},
            last_seen=last_seen.get(rank),
            heartbeat=heartbeat.get(rank),
            steps=steps.get(rank),
            groups=groups.get(rank, {}).get("groups", {}),
            exception=exceptions.get(rank),
            terminated=terminations.get(rank),
            sources=("prometheus",),
        )
        for rank, labels in info.items()
    }
    world_size = max((int(labels.get("world_size") or 0) for labels in info.values()), default=0)
    return DeadRun(run, world_size, words, source)


def _exceptions(series: Mapping[str, Series]) -> dict[int, ExceptionWord]:
    raised_at = per_rank(series, RANK_EXCEPTION_TIMESTAMP_SECONDS)
    return {
        int(labels["rank"]): ExceptionWord(
            labels.get("type", ""),
            _exception_cause(labels.get("cause", "")),
            raised_at.get(int(labels["rank"])),
        )
        for labels, _ in series.get(RANK_EXCEPTION_INFO, [])
    }


def _exception_cause(label: str) -> Cause:
    """The cause a rank's flare_rank_exception_info names; software_exception where it names none."""
    return label if causes.is_cause(label, causes.EXCEPTION_CAUSES) else "software_exception"


def _at_the_end(series: Mapping[str, Series], last_seen: Mapping[int, float]) -> dict[str, Series]:
    """`series` with only the in-flight collectives each rank's last scrape still held."""

    def held(name: str, key: Callable[[Mapping[str, str]], tuple]) -> set[tuple]:
        return {
            key(labels)
            for labels, value in series.get(name, [])
            if value >= last_seen.get(int(labels["rank"]), 0.0) - 1e-3
        }

    in_flight, current_info = held(FLIGHT_SEEN, _rank_group), held(INFO_SEEN, _info_key)
    kept: dict[str, Series] = defaultdict(list, series)
    for name in (FLIGHT_STARTED, FLIGHT_INFO, *FLIGHT_NUMBERS):
        kept[name] = [item for item in series.get(name, []) if _rank_group(item[0]) in in_flight]
    kept[FLIGHT_INFO] = [item for item in kept[FLIGHT_INFO] if _info_key(item[0]) in current_info]
    return kept


def _info_key(labels: Mapping[str, str]) -> tuple[int, str, str, str]:
    return int(labels["rank"]), labels["group"], labels.get("op", ""), labels.get("state", "")


def _rank_group(labels: Mapping[str, str]) -> tuple[int, str]:
    return int(labels["rank"]), labels["group"]
