"""Where a Snapshot comes from: the Prometheus HTTP API, or the ranks' endpoints scraped directly.

Both sources reduce to the same thing, series by metric name (labels, value), which `build_snapshot`
turns into RankRecords. Prometheus answers a fixed list of queries, one per metric, whatever the number
of ranks; the direct scrape reads every rank's exposition in parallel, each with a timeout.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from . import promql, scrape
from .diagnosis import GroupState, InFlight, RankRecord, Snapshot
from .targets import Target

Series = list[tuple[dict[str, str], float]]  # (labels, value) of one metric


class SourceError(RuntimeError):
    """The source answered, but not with one run we can diagnose (no ranks, or several runs)."""


class Liveness(NamedTuple):
    up: bool
    reason: str = ""
    host: str = ""


def build_snapshot(
    series: Mapping[str, Series], liveness: Mapping[int, Liveness], now: float, run: str
) -> Snapshot:
    """RankRecords from series of one run; `liveness` says which ranks answered (others: only from series)."""
    info = {int(labels["rank"]): labels for labels, _ in series.get("flare_rank_info", [])}
    world_size = max((int(labels.get("world_size", 0) or 0) for labels in info.values()), default=0)
    ranks = set(info) | set(liveness) | set(range(world_size))

    def per_rank(name: str) -> dict[int, float]:
        values: dict[int, float] = defaultdict(float)
        for labels, value in series.get(name, []):
            values[int(labels["rank"])] += value
        return values

    def per_group(name: str) -> dict[tuple[int, str], float]:
        return {(int(labels["rank"]), labels["group"]): value for labels, value in series.get(name, [])}

    issued = per_group("flare_collective_last_issued_seq")
    completed = per_group("flare_collective_last_completed_seq")
    flight_seq = per_group("flare_collective_in_flight_seq")
    flight_bytes = per_group("flare_collective_in_flight_bytes")
    flight_started = per_group("flare_collective_in_flight_started_timestamp_seconds")
    flights = {
        (int(labels["rank"]), labels["group"]): InFlight(
            labels.get("op", ""),
            int(flight_seq.get((int(labels["rank"]), labels["group"]), 0)),
            int(flight_bytes.get((int(labels["rank"]), labels["group"]), 0)),
            labels.get("state", "issued"),
            flight_started.get((int(labels["rank"]), labels["group"]), now),
        )
        for labels, _ in series.get("flare_collective_in_flight_info", [])
    }
    group_keys = set(issued) | set(completed) | set(flights)
    group_keys |= {
        (int(labels["rank"]), labels["group"]) for labels, _ in series.get("flare_process_group_info", [])
    }
    groups: dict[int, dict[str, GroupState]] = defaultdict(dict)
    for rank, group in group_keys:
        groups[rank][group] = GroupState(
            int(issued.get((rank, group), 0)),
            int(completed.get((rank, group), 0)),
            flights.get((rank, group)),
        )
    stacks = {int(labels["rank"]): labels for labels, _ in series.get("flare_rank_stack_info", [])}
    exceptions = {
        int(labels["rank"]): labels["type"] for labels, _ in series.get("flare_rank_exception_info", [])
    }
    exception_at = per_rank("flare_rank_exception_timestamp_seconds")
    steps = per_rank("flare_steps_total")
    heartbeat = per_rank("flare_heartbeat_timestamp_seconds")
    collective_seconds = per_rank("flare_collective_duration_seconds_sum")
    step_seconds = per_rank("flare_step_duration_seconds_sum")
    step_count = per_rank("flare_step_duration_seconds_count")

    records = {}
    for rank in sorted(ranks):
        alive = liveness.get(rank)
        if alive is None:
            alive = Liveness(rank in info, "" if rank in info else "no endpoint answered for this rank")
        records[rank] = RankRecord(
            rank=rank,
            up=alive.up,
            down_reason=alive.reason,
            host=info.get(rank, {}).get("host", "") or alive.host,
            steps=steps.get(rank),
            heartbeat=heartbeat.get(rank),
            groups=dict(groups.get(rank, {})),
            activity=stacks.get(rank, {}).get("activity", ""),
            frames=stacks.get(rank, {}).get("frames", ""),
            exception=exceptions.get(rank, ""),
            exception_at=exception_at.get(rank),
            collective_seconds=collective_seconds.get(rank, 0.0 if rank in step_count else None),
            step_seconds=step_seconds.get(rank),
            step_count=step_count.get(rank),
        )
    return Snapshot(records, now, run, world_size)


def _one_run(runs: Iterable[str], run: str, where: str) -> str:
    found = sorted(set(runs))
    if run:
        return run
    if not found:
        raise SourceError(f"{where}: no flare-exporter rank answered")
    if len(found) > 1:
        raise SourceError(f"{where}: several runs ({', '.join(found)}); choose one with --run")
    return found[0]


# ---------------------------------------------------------------------------------------------------------
# direct scrape


def from_targets(targets: list[Target], run: str = "", timeout: float = 5.0) -> Snapshot:
    """Scrape every target in parallel (each within `timeout`) into a Snapshot of one run."""
    now = time.time()
    results = scrape.scrape_all([target.address for target in targets], timeout=timeout)
    answered = {address: samples for address, samples in results.items() if isinstance(samples, list)}
    runs = [scrape.labels_of(samples, "flare_rank_info").get("run", "") for samples in answered.values()]
    run = _one_run([r for r in runs if r], run, f"{len(targets)} targets")
    series: dict[str, Series] = defaultdict(list)
    liveness: dict[int, Liveness] = {}
    for target in targets:
        result = results[target.address]
        if isinstance(result, scrape.ScrapeError):
            if "rank" in target.labels and target.labels.get("run", run) == run:
                reason = str(result).split(": ", 1)[-1]
                liveness[int(target.labels["rank"])] = Liveness(
                    False, reason, target.labels.get("__meta_flare_host", "")
                )
            continue
        if scrape.labels_of(result, "flare_rank_info").get("run") != run:
            continue
        for sample in result:
            series[sample.name].append((sample.labels, sample.value))
        rank = scrape.labels_of(result, "flare_rank_info").get("rank")
        if rank is not None:
            liveness[int(rank)] = Liveness(True)
    return build_snapshot(series, liveness, now, run)


# ---------------------------------------------------------------------------------------------------------
# Prometheus

# Queries, one per metric whatever the number of ranks. `{sel}` is the run selector, `{window}` the
# lookback. Identity and exceptions look back (a dead rank's last word); the rest is the current state.
PROMETHEUS_QUERIES = {
    "flare_rank_info": "last_over_time(flare_rank_info{sel}[{window}])",
    "flare_process_group_info": "last_over_time(flare_process_group_info{sel}[{window}])",
    "flare_rank_exception_info": "last_over_time(flare_rank_exception_info{sel}[{window}])",
    "flare_rank_exception_timestamp_seconds": (
        "last_over_time(flare_rank_exception_timestamp_seconds{sel}[{window}])"
    ),
    "flare_collective_last_issued_seq": "flare_collective_last_issued_seq{sel}",
    "flare_collective_last_completed_seq": "flare_collective_last_completed_seq{sel}",
    "flare_collective_in_flight_info": "flare_collective_in_flight_info{sel}",
    "flare_collective_in_flight_seq": "flare_collective_in_flight_seq{sel}",
    "flare_collective_in_flight_bytes": "flare_collective_in_flight_bytes{sel}",
    "flare_collective_in_flight_started_timestamp_seconds": (
        "flare_collective_in_flight_started_timestamp_seconds{sel}"
    ),
    "flare_rank_stack_info": "flare_rank_stack_info{sel}",
    "flare_steps_total": "flare_steps_total{sel}",
    "flare_heartbeat_timestamp_seconds": "flare_heartbeat_timestamp_seconds{sel}",
    "flare_collective_duration_seconds_sum": (
        "sum by (rank, run) (increase(flare_collective_duration_seconds_sum{sel}[{window}]))"
    ),
    "flare_step_duration_seconds_sum": "increase(flare_step_duration_seconds_sum{sel}[{window}])",
    "flare_step_duration_seconds_count": "increase(flare_step_duration_seconds_count{sel}[{window}])",
    "up": "up{sel}",
}


def _selector(run: str) -> str:
    escaped = run.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{run="{escaped}"}}'


def from_prometheus(base_url: str, run: str = "", window: str = "5m", timeout: float = 10.0) -> Snapshot:
    """A Snapshot of one run from Prometheus, at the current time, in a fixed number of queries."""
    now = time.time()
    if not run:
        runs = promql.query(
            base_url, f"count by (run) (last_over_time(flare_rank_info[{window}]))", timeout, now
        )
        run = _one_run([item["metric"].get("run", "") for item in runs], run, f"Prometheus at {base_url}")
    selector = _selector(run)
    exprs = {
        name: template.replace("{sel}", selector).replace("{window}", window)
        for name, template in PROMETHEUS_QUERIES.items()
    }
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = dict(
            zip(
                exprs,
                pool.map(lambda expr: promql.query(base_url, expr, timeout, now), exprs.values()),
                strict=True,
            )
        )
    series: dict[str, Series] = {
        name: [(item["metric"], float(item["value"][1])) for item in answer if "rank" in item["metric"]]
        for name, answer in answers.items()
    }
    liveness = {
        int(labels["rank"]): Liveness(value == 1.0, "" if value == 1.0 else "target down (up == 0)")
        for labels, value in series.pop("up")
    }
    for labels, _ in series.get("flare_rank_info", []):
        liveness.setdefault(int(labels["rank"]), Liveness(False, "no longer scraped by Prometheus"))
    return build_snapshot(series, liveness, now, run)
