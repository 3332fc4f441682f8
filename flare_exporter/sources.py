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
from typing import Any, NamedTuple

from . import promql, scrape, spec
from .diagnosis import GpuState, GroupState, InFlight, RankRecord, Snapshot
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
            if labels.get("group") != spec.NATIVE_GROUP:  # the shim's view of collectives counted already
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
    straggler_fields = _straggler_fields(series)
    ild_ks: dict[int, dict[str, float]] = defaultdict(dict)
    ild_wasserstein: dict[int, dict[str, float]] = defaultdict(dict)
    for name, into in (
        ("flare_ild_drift_ks", ild_ks),
        ("flare_ild_drift_wasserstein_seconds", ild_wasserstein),
    ):
        for labels, value in series.get(name, []):
            into[int(labels["rank"])][labels.get("distribution", "")] = value

    records = {}
    for rank in sorted(ranks):
        alive = liveness.get(rank)
        if alive is None:
            alive = Liveness(rank in info, "" if rank in info else "no endpoint answered for this rank")
        exception, died_at = exceptions.get(rank, ""), exception_at.get(rank)
        if (
            exception
            and alive.up
            and died_at is not None
            and died_at + 1.0 < heartbeat.get(rank, 0.0) <= now + 60
        ):
            # a restarted rank (same rank id): Prometheus's lookback still holds the exception its previous
            # process died of, but the process answering now has made progress since (by more than clock
            # jitter; a heartbeat from the future is no evidence); it is not gone
            exception, died_at = "", None
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
            exception=exception,
            exception_at=died_at,
            collective_seconds=collective_seconds.get(rank, 0.0 if rank in step_count else None),
            step_seconds=step_seconds.get(rank),
            step_count=step_count.get(rank),
            ild_ks=dict(ild_ks.get(rank, {})),
            ild_wasserstein=dict(ild_wasserstein.get(rank, {})),
            **straggler_fields.get(rank, {}),
        )
    return Snapshot(records, now, run, world_size)


def _straggler_fields(series: Mapping[str, Series]) -> dict[int, dict[str, Any]]:
    """Per rank, the RankRecord fields of its straggler windows (numbered) and its GPU health."""
    fields: dict[int, dict[str, Any]] = defaultdict(dict)
    last = {
        int(labels["rank"]): int(value) for labels, value in series.get("flare_straggler_last_window", [])
    }
    waits = {
        (int(labels["rank"]), labels.get("ago", "")): value
        for labels, value in series.get("flare_straggler_window_wait_seconds", [])
    }
    for labels, step in series.get("flare_straggler_window_step_seconds", []):
        rank, ago = int(labels["rank"]), labels.get("ago", "")
        if rank in last and ago.isdigit() and (rank, ago) in waits:
            fields[rank].setdefault("step_windows", {})[last[rank] - int(ago)] = (step, waits[rank, ago])
    for labels, value in series.get("flare_straggler_best_step_seconds", []):
        fields[int(labels["rank"])]["best_step_seconds"] = value

    def gpu_values(name: str) -> dict[int, float]:
        return {int(labels["rank"]): value for labels, value in series.get(name, [])}

    up = gpu_values("flare_gpu_health_up")
    events: dict[int, list[str]] = defaultdict(list)
    for labels, value in series.get("flare_gpu_clock_event_active", []):
        if value == 1:
            events[int(labels["rank"])].append(labels.get("reason", ""))
    scalars = {
        attribute: gpu_values(name)
        for attribute, name in (
            ("sm_clock_hertz", "flare_gpu_sm_clock_hertz"),
            ("sm_clock_max_hertz", "flare_gpu_sm_clock_max_hertz"),
            ("pcie_link_generation", "flare_gpu_pcie_link_generation"),
            ("pcie_link_generation_max", "flare_gpu_pcie_link_generation_max"),
            ("pcie_link_width", "flare_gpu_pcie_link_width"),
            ("pcie_link_width_max", "flare_gpu_pcie_link_width_max"),
            ("temperature_celsius", "flare_gpu_temperature_celsius"),
            ("xid_events", "flare_gpu_xid_events_total"),
            ("last_xid", "flare_gpu_last_xid"),
            ("row_remap_failed", "flare_gpu_row_remap_failed"),
        )
    }
    for rank, value in up.items():
        fields[rank]["gpu"] = GpuState(
            up=value == 1,
            clock_events=tuple(sorted(events.get(rank, []))),
            **{attribute: values.get(rank) for attribute, values in scalars.items()},
        )
    return fields


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


def from_targets(
    targets: list[Target], run: str = "", timeout: float = 5.0, via: scrape.Client | None = None
) -> Snapshot:
    """Scrape every target in parallel (each within `timeout`) into a Snapshot of one run.

    A target whose exposition cannot be read into rank records (malformed, truncated, a rank label that
    is not a number) counts as a target that did not answer, with the reason; the others are diagnosed.
    """
    now = time.time()
    results = scrape.scrape_all(
        [target.address for target in targets], timeout=timeout, via=via, wanted=read_by_snapshot
    )
    for address, result in list(results.items()):
        if isinstance(result, list):
            problem = _unusable(result, now)
            if problem:
                results[address] = scrape.ScrapeError(f"{address}: malformed exposition ({problem})")
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


MAX_RANKS = 1 << 22  # beyond any job's world size; a larger one in an exposition is garbage


def read_by_snapshot(name: str) -> bool:
    """Whether build_snapshot reads samples named `name` (a direct scrape parses only those: no buckets)."""
    return name in PROMETHEUS_QUERIES or name.startswith(("flare_straggler_", "flare_gpu_"))


def _unusable(samples: list[scrape.Sample], now: float) -> str:
    """Why one target's samples cannot become rank records ('' if they can): the records are built alone."""
    series: dict[str, Series] = defaultdict(list)
    for sample in samples:
        series[sample.name].append((sample.labels, sample.value))
    for labels, _ in series.get("flare_rank_info", []):
        for name in ("rank", "world_size"):
            text = labels.get(name, "0") or "0"
            # build_snapshot makes a record for every rank below world_size
            if not (text.isascii() and text.isdigit() and int(text) <= MAX_RANKS):
                return f"flare_rank_info {name}={text[:40]!r} is not a rank count up to {MAX_RANKS}"
    # Only this target's own records: with its world_size (checked above), build_snapshot would also make one
    # for every other rank of the job, for every target: O(ranks²) over a direct scrape of the job.
    series["flare_rank_info"] = [
        ({**labels, "world_size": "0"}, value) for labels, value in series.get("flare_rank_info", [])
    ]
    try:
        build_snapshot(series, {}, now, "")
    except (ValueError, KeyError, TypeError, OverflowError) as error:
        return f"{type(error).__name__}: {str(error)[:200]}"
    return ""


# ---------------------------------------------------------------------------------------------------------
# Prometheus

# Queries, one per metric whatever the number of ranks. `{sel}` is the run selector (`{sel_not_native}`
# the same without the native shim's collectives), `{window}` the lookback. Identity and exceptions look
# back (a dead rank's last word); the rest is the current state.
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
        "sum by (rank, run) (increase(flare_collective_duration_seconds_sum{sel_not_native}[{window}]))"
    ),
    "flare_step_duration_seconds_sum": "increase(flare_step_duration_seconds_sum{sel}[{window}])",
    "flare_step_duration_seconds_count": "increase(flare_step_duration_seconds_count{sel}[{window}])",
    "flare_ild_drift_ks": "flare_ild_drift_ks{sel}",
    "flare_ild_drift_wasserstein_seconds": "flare_ild_drift_wasserstein_seconds{sel}",
    # the straggler-window and GPU-health series the snapshot reads, in one query (split by __name__ below):
    # only those, and only the clock events that are active; the others would be most of the answer
    "straggler_and_gpu": (
        '{__name__=~"flare_straggler_(last_window|window_step_seconds|window_wait_seconds|best_step_seconds)'
        "|flare_gpu_(health_up|sm_clock_hertz|sm_clock_max_hertz|pcie_link_generation"
        "|pcie_link_generation_max|pcie_link_width|pcie_link_width_max|temperature_celsius|xid_events_total"
        '|last_xid|row_remap_failed)"} '
        "and on (rank, run) last_over_time(flare_rank_info{sel}[{window}])"
    ),
    "flare_gpu_clock_event_active": "flare_gpu_clock_event_active{sel} == 1",
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
    not_native = f'{selector[:-1]},group!="{spec.NATIVE_GROUP}"}}'
    exprs = {
        name: template.replace("{sel}", selector)
        .replace("{sel_not_native}", not_native)
        .replace("{window}", window)
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
    for labels, value in series.pop("straggler_and_gpu", []):
        series.setdefault(labels.get("__name__", ""), []).append((labels, value))
    liveness = {
        int(labels["rank"]): Liveness(value == 1.0, "" if value == 1.0 else "target down (up == 0)")
        for labels, value in series.pop("up")
    }
    for labels, _ in series.get("flare_rank_info", []):
        liveness.setdefault(int(labels["rank"]), Liveness(False, "no longer scraped by Prometheus"))
    return build_snapshot(series, liveness, now, run)
