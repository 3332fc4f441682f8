"""Where a Snapshot comes from: the Prometheus HTTP API, or the ranks' endpoints scraped directly.

Both sources reduce to the same thing, series by metric name (labels, value), which `build_snapshot`
turns into RankRecords. Prometheus answers a fixed number of queries whatever the number of ranks, in
rounds that read only what the verdicts need (see from_prometheus); the direct scrape reads every rank's
exposition in parallel, each with a timeout.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from .. import spec
from ..mixin import rules
from . import diagnosis, promql, scrape
from .diagnosis import GpuState, GroupState, InFlight, RankRecord, Snapshot
from .targets import Target

Series = list[tuple[dict[str, str], float]]  # (labels, value) of one metric
ISSUED_AT = "issued_at"  # the series key of the time each rank's last issued number was scraped


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
    group_fields = _group_fields(series, now)
    exceptions = {
        int(labels["rank"]): labels["type"] for labels, _ in series.get("flare_rank_exception_info", [])
    }
    exception_at = _per_rank(series, "flare_rank_exception_timestamp_seconds")
    heartbeat = _progress(series)["heartbeat"]
    pace_fields = _pace_fields(series)
    detail_fields = _detail_fields(series)

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
            exception=exception,
            exception_at=died_at,
            **group_fields.get(rank, {}),
            **pace_fields.get(rank, {}),
            **detail_fields.get(rank, {}),
        )
    return Snapshot(records, now, run, world_size)


def _group_fields(series: Mapping[str, Series], now: float) -> dict[int, dict[str, Any]]:
    """Per rank, its process groups: sequence numbers issued and completed, the collective in flight.

    At a hang of thousands of ranks this runs on the way to the verdict, once per round that reads groups,
    over a series per member: each (rank, group) is looked up only in the series a round read."""

    def per_group(name: str) -> dict[tuple[int, str], float]:
        return {(int(labels["rank"]), labels["group"]): value for labels, value in series.get(name, [])}

    issued = per_group("flare_collective_last_issued_seq")
    completed = per_group("flare_collective_last_completed_seq")
    flight_started = per_group(FLIGHT_STARTED)
    # in flight since when, always; which collective (op and state, number and bytes) where read
    flights = {key: InFlight("", 0, 0, "issued", started) for key, started in flight_started.items()}
    if FLIGHT_INFO in series or any(name in series for name in FLIGHT_NUMBERS):
        flight_seq, flight_bytes = (per_group(name) for name in FLIGHT_NUMBERS)
        flight_info = {
            (int(labels["rank"]), labels["group"]): labels for labels, _ in series.get(FLIGHT_INFO, [])
        }
        flights = {
            key: InFlight(
                (info := flight_info.get(key, {})).get("op", ""),
                int(flight_seq.get(key, 0)),
                int(flight_bytes.get(key, 0)),
                info.get("state", "issued"),
                flight_started.get(key, now),
            )
            for key in flight_started.keys() | flight_info.keys()
        }
    group_keys = issued.keys() | completed.keys() | flights.keys()
    group_keys |= {
        (int(labels["rank"]), labels["group"]) for labels, _ in series.get("flare_process_group_info", [])
    }
    newest_issue: dict[str, float] = {}  # group -> the latest start of a collective in flight in it
    for (_, group), started in flight_started.items():
        newest_issue[group] = max(started, newest_issue.get(group, started))
    seen_before_stall = {
        key
        for key, at in per_group(ISSUED_AT).items()
        if key[1] in newest_issue and at <= newest_issue[key[1]]
    }
    groups: dict[int, dict[str, GroupState]] = defaultdict(dict)
    for key in group_keys:
        groups[key[0]][key[1]] = GroupState(
            int(issued.get(key, 0)), int(completed.get(key, 0)), flights.get(key), key in seen_before_stall
        )
    return {rank: {"groups": found} for rank, found in groups.items()}


def _progress(series: Mapping[str, Series]) -> dict[str, dict[int, float]]:
    """RankRecord attribute (steps, heartbeat) -> rank -> its value (one series per rank; two rounds may
    both have read it)."""
    return {
        attribute: {int(labels["rank"]): value for labels, value in series.get(name, [])}
        for attribute, name in (
            ("steps", "flare_steps_total"),
            ("heartbeat", "flare_heartbeat_timestamp_seconds"),
        )
    }


def _per_rank(series: Mapping[str, Series], name: str) -> dict[int, float]:
    """Rank -> the sum of its series named `name` (but the native shim's, which repeat the others)."""
    values: dict[int, float] = defaultdict(float)
    for labels, value in series.get(name, []):
        if labels.get("group") != spec.NATIVE_GROUP:  # the shim's view of collectives counted already
            values[int(labels["rank"])] += value
    return values


# RankRecord field -> the metric it is read from, per distribution (label `distribution`)
ILD_FIELDS = {
    "ild_ks": "flare_ild_drift_ks",
    "ild_wasserstein": "flare_ild_drift_wasserstein_seconds",
    "ild_op_shift": "flare_ild_op_shift_seconds",
}


def _pace_fields(series: Mapping[str, Series]) -> dict[int, dict[str, Any]]:
    """Per rank, the RankRecord fields that say how fast it goes (what the straggler and ILD rules weigh):
    step and collective times over the window, straggler windows, ILD drift. A rank none of these series
    name keeps the fields' defaults."""
    fields: dict[int, dict[str, Any]] = defaultdict(dict)
    collective_seconds = _per_rank(series, "flare_collective_duration_seconds_sum")
    step_seconds = _per_rank(series, "flare_step_duration_seconds_sum")
    step_count = _per_rank(series, "flare_step_duration_seconds_count")
    for rank in collective_seconds.keys() | step_seconds.keys() | step_count.keys():
        fields[rank].update(
            collective_seconds=collective_seconds.get(rank, 0.0 if rank in step_count else None),
            step_seconds=step_seconds.get(rank),
            step_count=step_count.get(rank),
        )
    for field, name in ILD_FIELDS.items():
        for labels, value in series.get(name, []):
            fields[int(labels["rank"])].setdefault(field, {})[labels.get("distribution", "")] = value
    for rank, found in _straggler_fields(series).items():
        fields[rank].update(found)
    return fields


def _straggler_fields(series: Mapping[str, Series]) -> dict[int, dict[str, Any]]:
    """Per rank, the RankRecord fields of its straggler windows (numbered) and its best window."""
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
    return fields


# GpuState attribute -> the metric it is read from (besides flare_gpu_health_up and the clock events)
GPU_METRICS = {
    "sm_clock_hertz": "flare_gpu_sm_clock_hertz",
    "sm_clock_max_hertz": "flare_gpu_sm_clock_max_hertz",
    "pcie_link_generation": "flare_gpu_pcie_link_generation",
    "pcie_link_generation_max": "flare_gpu_pcie_link_generation_max",
    "pcie_link_width": "flare_gpu_pcie_link_width",
    "pcie_link_width_max": "flare_gpu_pcie_link_width_max",
    "temperature_celsius": "flare_gpu_temperature_celsius",
    "xid_events": "flare_gpu_xid_events_total",
    "last_xid": "flare_gpu_last_xid",
    "row_remap_failed": "flare_gpu_row_remap_failed",
}


def _detail_fields(series: Mapping[str, Series]) -> dict[int, dict[str, Any]]:
    """Per rank, the RankRecord fields that explain a verdict: its progress (steps, heartbeat), what it is
    doing (its stack sample) and its GPU's health. Of these, only the heartbeat of a rank with an exception
    decides anything (whether it restarted, which rank went first): PROGRESS_QUERIES reads those first."""
    fields: dict[int, dict[str, Any]] = defaultdict(dict)
    for attribute, values in _progress(series).items():
        for rank, value in values.items():
            fields[rank][attribute] = value
    for labels, _ in series.get("flare_rank_stack_info", []):
        fields[int(labels["rank"])].update(
            activity=labels.get("activity", ""), frames=labels.get("frames", "")
        )

    def gpu_values(name: str) -> dict[int, float]:
        return {int(labels["rank"]): value for labels, value in series.get(name, [])}

    events: dict[int, list[str]] = defaultdict(list)
    for labels, value in series.get("flare_gpu_clock_event_active", []):
        if value == 1:
            events[int(labels["rank"])].append(labels.get("reason", ""))
    scalars = {attribute: gpu_values(name) for attribute, name in GPU_METRICS.items()}
    for rank, value in gpu_values("flare_gpu_health_up").items():
        fields[rank]["gpu"] = GpuState(
            up=value == 1,
            clock_events=tuple(sorted(events.get(rank, []))),
            **{attribute: values.get(rank) for attribute, values in scalars.items()},
        )
    return fields


def with_detail(snapshot: Snapshot, series: Mapping[str, Series]) -> Snapshot:
    """The snapshot with the detail fields (see _detail_fields) that `series` holds of its ranks."""
    return _with_fields(snapshot, _detail_fields(series))


def with_pace(snapshot: Snapshot, series: Mapping[str, Series]) -> Snapshot:
    """The snapshot with the pace fields (see _pace_fields) that `series` holds of its ranks: the same
    records as build_snapshot makes from all the series at once, without building them again."""
    return _with_fields(snapshot, _pace_fields(series))


def _with_fields(snapshot: Snapshot, found: Mapping[int, Mapping[str, Any]]) -> Snapshot:
    ranks = {
        rank: _replaced(record, found[rank]) if rank in found else record
        for rank, record in snapshot.ranks.items()
    }
    groups_kept = not any(diagnosis.GROUP_INDEX_FIELDS.intersection(fields) for fields in found.values())
    return snapshot.replaced(groups_kept, ranks=ranks)


def _replaced(record: RankRecord, fields: Mapping[str, Any]) -> RankRecord:
    """A copy of `record` with `fields` replaced, made as copy.copy makes one (its attributes set before
    anyone sees it): 5 ms a round at 6,144 ranks, against 20 ms for RankRecord(**...) and more for
    dataclasses.replace, which looks at every field anew."""
    copied = object.__new__(RankRecord)
    copied.__dict__.update(vars(record))
    copied.__dict__.update(fields)
    return copied


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
        [target.address for target in targets], timeout=timeout, via=via, wanted=SNAPSHOT_METRICS
    )
    _leave_out(results, _bad_identity)
    try:  # every target's records at once; only where that fails, each target's alone, to leave out the bad
        return _targets_snapshot(targets, results, run, now)
    except BUILD_ERRORS:
        _leave_out(results, lambda samples: _unusable(samples, now))
        return _targets_snapshot(targets, results, run, now)


def _leave_out(
    results: dict[str, list[scrape.Sample] | scrape.ScrapeError],
    problem_of: Callable[[list[scrape.Sample]], str],
) -> None:
    """Each target whose samples `problem_of` finds a problem with ('' for none) counts as one that answered
    with a malformed exposition."""
    for address, result in list(results.items()):
        if isinstance(result, list) and (problem := problem_of(result)):
            results[address] = scrape.ScrapeError(f"{address}: malformed exposition ({problem})")


def _targets_snapshot(
    targets: list[Target],
    results: Mapping[str, list[scrape.Sample] | scrape.ScrapeError],
    run: str,
    now: float,
) -> Snapshot:
    """build_snapshot over the direct scrape's results: a rank is up if its target answered."""
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


BUILD_ERRORS = (ValueError, KeyError, TypeError, OverflowError)  # what build_snapshot raises on bad samples


def _bad_identity(samples: list[scrape.Sample]) -> str:
    """Why one target's flare_rank_info cannot name its rank and job ('' if it can): build_snapshot makes a
    record for every rank below world_size."""
    for sample in samples:
        if sample.name == "flare_rank_info":
            for name in ("rank", "world_size"):
                text = sample.labels.get(name, "0") or "0"
                if not (text.isascii() and text.isdigit() and int(text) <= MAX_RANKS):
                    return f"flare_rank_info {name}={text[:40]!r} is not a rank count up to {MAX_RANKS}"
    return ""


def _unusable(samples: list[scrape.Sample], now: float) -> str:
    """Why one target's samples cannot become rank records ('' if they can): the records are built alone."""
    series: dict[str, Series] = defaultdict(list)
    for sample in samples:
        series[sample.name].append((sample.labels, sample.value))
    # Only this target's own records: with its world_size (_bad_identity checked it), build_snapshot would
    # also make one for every other rank of the job, for every target: O(ranks²) over a direct scrape.
    series["flare_rank_info"] = [
        ({**labels, "world_size": "0"}, value) for labels, value in series.get("flare_rank_info", [])
    ]
    try:
        build_snapshot(series, {}, now, "")
    except BUILD_ERRORS as error:
        return f"{type(error).__name__}: {str(error)[:200]}"
    return ""


# ---------------------------------------------------------------------------------------------------------
# Prometheus

# The queries. Each keeps only the labels build_snapshot reads (`max by` them): the other labels of every
# series (instance, job, run, ...) would be most of the answer, for Prometheus to write and for us to parse.
# A query's answer is named by its key (or by `__name__` where it keeps one). Placeholders: `{sel}` the
# selector of the run (or of its named ranks), `{sel, more="matchers"}` it with more matchers,
# `{sel_not_native}` it without the native shim's collectives, `{window}` the lookback.
# Identity, groups and exceptions look back (a dead rank's last word); the rest is the current state.


def _current(names: Iterable[str], labels: str) -> dict[str, str]:
    """A query per metric in `names` for its current value, one series per (rank, `labels`). Each alone:
    one query over several metrics (`{__name__=~"a|b"}` grouped by `__name__`) took Prometheus twice as
    long as the queries of its metrics together (6,144 ranks: 0.94 s against 0.46 s for the windows)."""
    return {name: f"max by (rank{labels}) ({name}{{sel}})" for name in names}


# Since when each rank has had a collective in flight in each group: is a group hung? (every rank, faults)
FLIGHT_STARTED = "flare_collective_in_flight_started_timestamp_seconds"
# Which collective (op and state; its number and bytes): what a hang's verdict weighs only where no member
# of the group is behind, or most are (diagnosis.what_hang_rules_read).
FLIGHT_INFO = "flare_collective_in_flight_info"
FLIGHT_NUMBERS = ("flare_collective_in_flight_seq", "flare_collective_in_flight_bytes")
STRAGGLER_METRICS = (
    "flare_straggler_last_window",
    "flare_straggler_best_step_seconds",
    "flare_straggler_window_step_seconds",
    "flare_straggler_window_wait_seconds",
)
PROGRESS_METRICS = ("flare_heartbeat_timestamp_seconds", "flare_steps_total")
ILD_METRICS = ("flare_ild_drift_ks", "flare_ild_drift_wasserstein_seconds", "flare_ild_op_shift_seconds")
GPU_HEALTH_METRICS = ("flare_gpu_health_up", *GPU_METRICS.values())

# Is a rank gone, is a group hung, and who is behind in it: every rank.
FAULT_QUERIES = {
    "flare_rank_info": "max by (rank, host, world_size) (last_over_time(flare_rank_info{sel}[{window}]))",
    "flare_rank_exception_info": (
        "max by (rank, type) (last_over_time(flare_rank_exception_info{sel}[{window}]))"
    ),
    "flare_rank_exception_timestamp_seconds": (
        "max by (rank) (last_over_time(flare_rank_exception_timestamp_seconds{sel}[{window}]))"
    ),
    "up": "max by (rank) (up{sel})",
    **_current([FLIGHT_STARTED], ", group"),
}
# The progress of the ranks that raised (asked of them when there are any): whether they restarted since, and
# the rank_down evidence. A target that is down has no current series; the other ranks' progress is detail.
PROGRESS_QUERIES = _current(PROGRESS_METRICS, "")
# Who is in each group and who is behind in it: every rank (asked when a collective has been in flight for
# the hang threshold, or when from_prometheus is not told the threshold; the rules need them only then), of
# the groups the hang rules read (diagnosis.what_hang_rules_read) when told the threshold.
GROUP_QUERIES = {
    "flare_collective_last_issued_seq": "max by (rank, group) (flare_collective_last_issued_seq{sel})",
    # when each number was scraped: one scraped at or before its group's newest issue (the latest start the
    # faults round read) is late (diagnosis.GroupState.seen_before_stall). Compared here, not in
    # Prometheus, which read every rank's start again for it (at 6,144 ranks, twice as long).
    ISSUED_AT: "max by (rank, group) (timestamp(flare_collective_last_issued_seq{sel}))",
}
# The issued numbers alone: a hang's rounds ask the scrape times after them, of the few ranks they could
# leave unjudged (_late_scrapes).
NUMBER_QUERIES = {name: query for name, query in GROUP_QUERIES.items() if name != ISSUED_AT}
# Which collective each rank of the hung groups whose verdicts weigh it has in flight, and how large. At a
# hang of thousands of ranks, half of what the faults round would read.
FLIGHT_QUERIES = {
    FLIGHT_INFO: f"max by (rank, group, op, state) ({FLIGHT_INFO}{{sel}})",
    **_current(FLIGHT_NUMBERS, ", group"),
}
# The groups a rank was in that it reports no issued number of now (issued 0, as when the series is absent):
# a rank that is down has no current series. Asked with the groups, of the ranks that are down; five minutes
# of every rank's group info would be the slowest query of the round.
GONE_GROUP_QUERIES = {
    "flare_process_group_info": (
        "max by (rank, group) (last_over_time(flare_process_group_info{sel}[{window}]))"
        " unless on (rank, group) flare_collective_last_issued_seq{sel}"
    ),
}
# Is a rank slower than the others: every rank (asked when no rank is gone or hung; the rules weigh
# stragglers and ILD only then). The straggler windows are most of the series of the round: the rounds
# read the last few of each rank first (see recent_windows).
PACE_QUERIES = {
    **_current(STRAGGLER_METRICS, ", ago"),
    "flare_step_duration_seconds_count": (
        "sum by (rank) (increase(flare_step_duration_seconds_count{sel}[{window}]))"
    ),
}
WINDOW_METRICS = ("flare_straggler_window_step_seconds", "flare_straggler_window_wait_seconds")


def recent_windows(policy: diagnosis.StragglerPolicy) -> tuple[dict[str, str], dict[str, str]]:
    """The straggler windows' queries in two parts: each rank's last `hold_windows` (label ago below it),
    which the rules read when every rank closed the same last window (diagnosis.decided_by_last_windows),
    and the older ones, read only when they do not: a quarter of the pace round's series at 6,144 ranks."""
    recent = "|".join(str(ago) for ago in range(policy.hold_windows))

    def windows(match: str) -> dict[str, str]:
        return {name: f'max by (rank, ago) ({name}{{sel, ago{match}"{recent}"}})' for name in WINDOW_METRICS}

    return windows("=~"), windows("!~")


# At thousands of ranks, what Prometheus's recording rules say of every rank's straggler windows
# (rules.straggler_summary_rules; diagnosis.WindowSummary), read in place of them where it stands for them:
# the time of the rules' last evaluation, then the figures at that time and the ranks that could be named.
SUMMARY_AT_QUERY = {"summary_at": f"max(timestamp({rules.SUMMARY_AT}{{sel}}))"}
SUMMARY_FIGURES = 'max by (__name__, ago) ({sel, __name__=~"run(_ago)?:flare_straggler_.+"})'
SUMMARY_SLACK = 0.999  # the screen's distance below the median, against rounding: it may name more ranks


def summary_candidates(policy: diagnosis.StragglerPolicy) -> str:
    """The ranks whose wait share over the windows lies far enough below the median (pooled_z robust sigmas
    and min_wait_gap of the step; diagnosis.WindowScores.stands_out) that the rules could name them."""
    pooled, figure = rules.SUMMARY_POOLED, rules.POOLED_SHARE
    spread = f"clamp_min(1.4826 * {figure}:mad{{sel}}, {diagnosis.MIN_SHARE_SPREAD!r})"
    distance = (
        f"clamp_min({policy.pooled_z * SUMMARY_SLACK!r} * {spread}, {policy.min_wait_gap * SUMMARY_SLACK!r})"
    )
    return f"max by (rank) ({pooled}{{sel}} <= on (run) group_left () ({figure}:median{{sel}} - {distance}))"


# Has a rank's issue latency shifted: every rank's drift (its peers' medians decide), asked with the pace
# only when ild_screen finds a rank whose drift could count as shifted; most of the time none does.
ILD_QUERIES = _current(ILD_METRICS, ", distribution")


def ild_screen(policy: diagnosis.IldPolicy) -> dict[str, str]:
    """The query for the ranks whose drift could count as shifted under `policy` (IldPolicy.floors), one
    series each, without the drift itself (key `ild_screen`, which no record reads)."""
    op_shift, ks, wasserstein = (repr(float(bound)) for bound in policy.floors())
    return {
        "ild_screen": (
            f"max by (rank) (flare_ild_op_shift_seconds{{sel}} >= {op_shift}"
            f" or (flare_ild_drift_ks{{sel}} >= {ks} unless on (rank, distribution)"
            f" flare_ild_drift_wasserstein_seconds{{sel}} < {wasserstein}))"
        )
    }


def ild_candidates(policy: diagnosis.IldPolicy) -> dict[str, str]:
    """The ranks ild_screen may name and more (key `ild_candidates`): its floors without the W1 one, so
    that the pace round need not read every rank's W1 (a third of the screen's series); ild_screen is
    asked of them only when there are any."""
    op_shift, ks, _ = (repr(float(bound)) for bound in policy.floors())
    return {
        "ild_candidates": (
            f"max by (rank) (flare_ild_op_shift_seconds{{sel}} >= {op_shift}"
            f" or flare_ild_drift_ks{{sel}} >= {ks})"
        )
    }


# The same from the cumulative step and collective times: every rank (asked when not every rank exports
# straggler windows; see diagnosis.judged_by_windows).
CUMULATIVE_QUERIES = {
    "flare_step_duration_seconds_sum": (
        "sum by (rank) (increase(flare_step_duration_seconds_sum{sel}[{window}]))"
    ),
    "flare_collective_duration_seconds_sum": (
        "sum by (rank) (increase(flare_collective_duration_seconds_sum{sel_not_native}[{window}]))"
    ),
}
# What explains a verdict without deciding it, of every rank (the views).
DETAIL_QUERIES = {
    **PROGRESS_QUERIES,
    "flare_rank_stack_info": "max by (rank, activity, frames) (flare_rank_stack_info{sel})",
    **_current(GPU_HEALTH_METRICS, ""),
    # only the clock events that are active: the others would be most of the answer
    "flare_gpu_clock_event_active": "max by (rank, reason) (flare_gpu_clock_event_active{sel} == 1)",
}
# The same of the few ranks a verdict names, in three queries instead of fifteen: the one-value metrics in
# one query (each row named by its __name__). Of a few ranks Prometheus finds them at once; the per-metric
# queries of every rank are faster apart (_current).
DETAIL_VALUES = (*PROGRESS_METRICS, *GPU_HEALTH_METRICS)
NAMED_DETAIL_QUERIES = {
    "detail_values": f'max by (__name__, rank) ({{sel, __name__=~"{"|".join(DETAIL_VALUES)}"}})',
    **{name: query for name, query in DETAIL_QUERIES.items() if name not in DETAIL_VALUES},
}
# What only a view shows (`flare hang`): every rank.
VIEW_QUERIES = {
    "flare_collective_last_completed_seq": "max by (rank, group) (flare_collective_last_completed_seq{sel})",
}
PROMETHEUS_QUERIES = {
    **FAULT_QUERIES,
    **GROUP_QUERIES,
    **FLIGHT_QUERIES,
    **GONE_GROUP_QUERIES,
    **PACE_QUERIES,
    **ILD_QUERIES,
    **CUMULATIVE_QUERIES,
    **DETAIL_QUERIES,
    **VIEW_QUERIES,
}

# Every metric build_snapshot reads (a direct scrape asks the ranks for these alone, and parses only these);
# the queries above ask for each.
SNAPSHOT_METRICS = frozenset(
    [
        "flare_rank_info",
        "flare_process_group_info",
        "flare_rank_exception_info",
        "flare_rank_exception_timestamp_seconds",
        "flare_heartbeat_timestamp_seconds",
        "flare_collective_last_issued_seq",
        "flare_collective_last_completed_seq",
        FLIGHT_STARTED,
        FLIGHT_INFO,
        *FLIGHT_NUMBERS,
        *STRAGGLER_METRICS,
        *ILD_METRICS,
        "flare_step_duration_seconds_count",
        "flare_step_duration_seconds_sum",
        "flare_collective_duration_seconds_sum",
        "flare_rank_stack_info",
        "flare_steps_total",
        *GPU_HEALTH_METRICS,
        "flare_gpu_clock_event_active",
    ]
)
MAX_NAMED_RANKS = 256  # named in a selector up to this many (a URL that any proxy takes); beyond, every rank
MAX_CHAIN_ROUNDS = 8  # rounds of groups a hang's chain names; beyond, every group at once


def _matcher(run: str) -> str:
    escaped = run.replace("\\", "\\\\").replace('"', '\\"')
    return f'run="{escaped}"'


def from_prometheus(
    base_url: str,
    run: str = "",
    window: str = "5m",
    timeout: float = 10.0,
    detail_for: Callable[[Snapshot], Iterable[int]] | None = None,
    hang_seconds: float | None = None,
    ild: diagnosis.IldPolicy | None = None,
    stragglers: diagnosis.StragglerPolicy | None = None,
) -> Snapshot:
    """A Snapshot of one run from Prometheus, at the current time, in a fixed number of queries.

    Without `detail_for`, everything of every rank, at once. With it (the rules: the ranks their verdicts
    name), in rounds, each only where the rules need it: every rank's faults (and the progress of the
    ranks that raised; and every rank's groups, with the past groups of the ranks that are down, when a
    collective has been in flight for `hang_seconds`, always when it is None: the hung groups' numbers are
    asked during the faults round, as soon as the starts say so, see _faults_round; and which collective
    the members of a hung group have in flight, where the hang's verdict weighs it); when they name no rank,
    every rank's pace (its last straggler windows under `stragglers`, the rules' StragglerPolicy, and the
    older ones where the rules would read them; its cumulative times where the rules need them; its ILD
    drift where a rank's could count as shifted under `ild`, the rules' IldPolicy); then the detail of the
    ranks named. At thousands of ranks, most of a snapshot is what no verdict needs. Each round adds fields
    to the records of the rounds before (the same records as build_snapshot makes of all the answers at
    once), without building them again.
    """
    now = time.time()
    run = run or _the_run(base_url, window, timeout, now)
    matchers = _matcher(run)

    def fetch(
        queries: Mapping[str, str], ranks: Sequence[int] = (), groups: Iterable[str] = (), at: float = now
    ) -> dict[str, Series]:
        """The answers to `queries`, of the ranks named (of every rank if none), in the groups named (all),
        at `at` (now)."""
        named = f', rank=~"{"|".join(map(str, ranks))}"' if ranks else ""
        if groups:
            named += f', group=~"{_any_of(sorted(groups))}"'
        return _fetch(base_url, queries, matchers + named, window, timeout, at)

    def answers(queries: Mapping[str, str], at: float = now) -> list[list[dict[str, Any]]]:
        return _answers(base_url, queries, matchers, window, timeout, at)

    if detail_for is None:
        return _snapshot(fetch(PROMETHEUS_QUERIES), now, run)
    series, ahead = _faults_round(fetch, now, hang_seconds)
    raised = sorted({int(labels["rank"]) for labels, _ in series.get("flare_rank_exception_info", [])})
    if raised:  # did they restart since? (before the records are built: it decides which ranks are gone)
        series |= fetch(PROGRESS_QUERIES, raised if len(raised) <= MAX_NAMED_RANKS else [])
    faults = _snapshot(series, now, run)
    oldest = faults.oldest_in_flight
    hung = {name for name, age in oldest.items() if hang_seconds is not None and age >= hang_seconds}
    if hang_seconds is None or hung:  # a group may be hung
        down = [rank for rank, record in faults.ranks.items() if not record.up]
        if down:
            series |= fetch(GONE_GROUP_QUERIES, down if len(down) <= MAX_NAMED_RANKS else [])
        if hang_seconds is None:
            series |= fetch(GROUP_QUERIES | FLIGHT_QUERIES)
            faults = _with_fields(faults, _group_fields(series, now))
        else:
            faults, weighed = _with_hang_groups(faults, series, hung, hang_seconds, fetch, now, ahead)
            if weighed:
                series |= fetch(FLIGHT_QUERIES, groups=weighed)
                faults = _with_fields(faults, _group_fields(series, now))
    snapshot = faults
    named = sorted(set(detail_for(snapshot)))
    if not named:  # nothing gone or hung: the rules weigh every rank's pace
        ild = ild or diagnosis.IldPolicy()
        stragglers = stragglers or diagnosis.StragglerPolicy()
        recent, older = recent_windows(stragglers)
        summary: diagnosis.WindowSummary | None = None
        if faults.ranks_seen <= diagnosis.LEAVE_ONE_OUT_RANKS:
            pace = fetch(PACE_QUERIES | recent | ild_candidates(ild))
        else:  # the rules' figures may stand in for every rank's windows; the ILD candidates meanwhile
            with ThreadPoolExecutor(max_workers=1) as pool:
                screened = pool.submit(fetch, ild_candidates(ild))
                summarised = _window_summary(answers, fetch, faults, stragglers)
                if summarised is None:
                    pace = fetch(PACE_QUERIES | recent)
                else:
                    summary, pace = summarised
                pace |= screened.result()
        candidates = sorted({int(labels["rank"]) for labels, _ in pace.pop("ild_candidates", [])})
        if candidates:
            some = candidates if len(candidates) <= MAX_NAMED_RANKS else []
            if fetch(ild_screen(ild), some).get("ild_screen"):
                pace |= fetch(ILD_QUERIES)  # every rank's drift: its peers' medians decide
        snapshot = with_pace(faults, pace)
        if summary is not None:
            snapshot = snapshot.replaced(True, window_summary=summary)
        elif not diagnosis.decided_by_last_windows(snapshot, stragglers):
            _extend(pace, fetch(older))
            snapshot = with_pace(faults, pace)
        if not diagnosis.judged_by_windows(snapshot):
            pace |= fetch(CUMULATIVE_QUERIES)
            snapshot = with_pace(faults, pace)
        named = sorted(set(detail_for(snapshot)))
    if not named:
        return snapshot
    if len(named) > MAX_NAMED_RANKS:
        return with_detail(snapshot, fetch(DETAIL_QUERIES))
    return with_detail(snapshot, fetch(NAMED_DETAIL_QUERIES, named))


def _the_run(base_url: str, window: str, timeout: float, now: float) -> str:
    """The one run whose ranks Prometheus scraped within `window` before `now`. Its index answers first (no
    sample read: the query reads every rank's `window` of flare_rank_info, 0.1 to 0.3 s at 6,144 ranks);
    where it names other than one run (it may name runs scraped before the window), the query decides."""
    where = f"Prometheus at {base_url}"
    start = now - rules.duration_seconds(window, "flag --window")
    named = promql.label_values(base_url, "run", "flare_rank_info", start, now, timeout)
    if len(named) == 1 and named[0]:
        return named[0]
    runs = promql.query(base_url, f"count by (run) (last_over_time(flare_rank_info[{window}]))", timeout, now)
    return _one_run([item["metric"].get("run", "") for item in runs], "", where)


def _window_summary(
    answers: Callable[..., list[list[dict[str, Any]]]],
    fetch: Callable[..., dict[str, Series]],
    faults: Snapshot,
    policy: diagnosis.StragglerPolicy,
) -> tuple[diagnosis.WindowSummary, dict[str, Series]] | None:
    """What Prometheus's recording rules say of every rank's straggler windows, and the windows of the ranks
    they could name, all as of the rules' last evaluation; None where the figures do not stand for every
    live rank's windows (diagnosis.WindowSummary): no rules, not every live rank with each of the windows
    and a best step time, windows not closed alike, a job-wide slowdown, more ranks to name than a
    selector names."""
    (at_answer,) = answers(SUMMARY_AT_QUERY)
    if not at_answer:
        return None
    at = float(at_answer[0]["value"][1])
    queries = {"figures": SUMMARY_FIGURES, "candidates": summary_candidates(policy)}
    found, named = answers(queries, at)
    figures = {
        (item["metric"].get("__name__", ""), item["metric"].get("ago", "")): float(item["value"][1])
        for item in found
    }
    agos = [str(ago) for ago in reversed(range(policy.hold_windows))]  # the oldest window first
    counts = [figures.get((rules.WINDOW_RANKS, ago)) for ago in agos]
    counts.append(figures.get((rules.BEST_STEP_RANKS, "")))
    first = figures.get((f"{rules.LAST_WINDOW}:min", ""))
    last = figures.get((f"{rules.LAST_WINDOW}:max", ""))
    slowest = figures.get((rules.SUMMARY_AT, ""))
    candidates = sorted({int(item["metric"]["rank"]) for item in named if "rank" in item["metric"]})
    if (
        any(count != faults.ranks_seen for count in counts)
        or first is None
        or first != last
        or slowest is None
        or round(slowest, 4) >= 1 + policy.job_slowdown
        or len(candidates) > MAX_NAMED_RANKS
    ):
        return None

    def robust(prefix: str, ago: str = "") -> tuple[float, float]:
        median, mad = (figures.get((f"{prefix}:{stat}", ago), math.nan) for stat in ("median", "mad"))
        return median, 1.4826 * mad

    per_window = tuple(robust(rules.WINDOW_SHARE, ago) for ago in agos)
    pooled = robust(rules.POOLED_SHARE)
    if any(math.isnan(value) for figure in (*per_window, pooled) for value in figure):
        return None
    newest = int(last)
    summary = diagnosis.WindowSummary(
        tuple(range(newest - policy.hold_windows + 1, newest + 1)), faults.ranks_seen, per_window, pooled, at
    )
    return summary, (fetch(PACE_QUERIES, candidates, at=at) if candidates else {})


class ReadAhead(NamedTuple):
    """The issued numbers of `groups`, asked before the faults round's records were built (_faults_round)."""

    groups: set[str]
    answers: Future[dict[str, Series]]


def _faults_round(
    fetch: Callable[..., dict[str, Series]], now: float, hang_seconds: float | None
) -> tuple[dict[str, Series], ReadAhead | None]:
    """Every rank's faults (FAULT_QUERIES); and, told the hang threshold, the issued numbers of the groups
    in which some rank has had a collective in flight for it (the hung groups, or more where that rank is
    not up), asked as soon as the starts are in: while the round's other answers come and its records are
    built. At a hang of thousands of ranks, both rounds' answers take Prometheus hundreds of ms; the records,
    about 100 ms."""
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        rest = pool.submit(
            fetch, {name: query for name, query in FAULT_QUERIES.items() if name != FLIGHT_STARTED}
        )
        series = fetch({FLIGHT_STARTED: FAULT_QUERIES[FLIGHT_STARTED]})
        ahead = None
        if hang_seconds is not None:
            groups = {
                labels["group"]
                for labels, started in series.get(FLIGHT_STARTED, [])
                if now - started >= hang_seconds
            }
            if groups:
                ahead = ReadAhead(groups, pool.submit(fetch, NUMBER_QUERIES, groups=groups))
        series |= rest.result()
    finally:
        pool.shutdown(wait=False)  # a read-ahead no hung group needs after all goes on alone
    return series, ahead


def late_scrape_queries(series: Mapping[str, Series], groups: Iterable[str]) -> dict[str, str]:
    """The query of the scrape times of the issued numbers in `groups` that could be late: those scraped at
    or before the newest start in `groups` that `series` hold; none where nothing is in flight in them.
    Each group's own newest start decides (_group_fields); the late scrapes are few, a row each."""
    groups = set(groups)
    newest = max(
        (started for labels, started in series.get(FLIGHT_STARTED, []) if labels["group"] in groups),
        default=None,
    )
    if newest is None:
        return {}
    query = GROUP_QUERIES[ISSUED_AT]
    return {ISSUED_AT: f"{query} <= {newest!r}" if math.isfinite(newest) else query}


def _with_hang_groups(
    faults: Snapshot,
    series: dict[str, Series],
    hung: set[str],
    hang_seconds: float,
    fetch: Callable[..., dict[str, Series]],
    now: float,
    ahead: ReadAhead | None,
) -> tuple[Snapshot, set[str]]:
    """`faults` with the groups the hang rules read: the hung groups' issued numbers first (those `ahead`
    asked, and any other), then those of the groups their chains lead to, as the rules name them, until
    they name none unread (at thousands of ranks in tensor-, pipeline- and data-parallel groups, most
    groups have nothing to do with a hang), each group's late scrapes asked once its numbers are in
    (_late_scrapes); and the groups of which the rules weigh what each member has in flight
    (diagnosis.what_hang_rules_read)."""
    read: set[str] = set()
    if ahead is not None:
        _extend(series, ahead.answers.result())
        read = set(ahead.groups)
    timed: set[str] = set()  # the groups whose late scrapes were asked
    needed = hung
    for _ in range(MAX_CHAIN_ROUNDS):
        unread = needed - read
        if unread:
            _extend(series, fetch(NUMBER_QUERIES, groups=unread))
        read |= needed
        snapshot = _with_fields(faults, _group_fields(series, now))
        if _late_scrapes(snapshot, series, read - timed, fetch):
            snapshot = _with_fields(faults, _group_fields(series, now))
        timed = set(read)
        reads = diagnosis.what_hang_rules_read(snapshot, hang_seconds)
        if reads.numbers <= read:
            return snapshot, reads.flights
        needed = reads.numbers
    series |= fetch(GROUP_QUERIES)  # a chain longer than any job's: every group
    snapshot = _with_fields(faults, _group_fields(series, now))
    return snapshot, diagnosis.what_hang_rules_read(snapshot, hang_seconds).flights


def _late_scrapes(
    snapshot: Snapshot, series: dict[str, Series], groups: set[str], fetch: Callable[..., dict[str, Series]]
) -> bool:
    """Asks the scrape times that could be late (late_scrape_queries) in `groups` of their members below
    the group's top, the only ranks a late scrape leaves unjudged (diagnosis.below_top): at a hang, the few
    behind instead of every member (at thousands of ranks a query Prometheus spends as long on as on the
    numbers). True where some were late: `series` holds them."""
    below = sorted({rank for group in groups for rank in diagnosis.below_top(snapshot, group)})
    queries = late_scrape_queries(series, groups)
    if not below or not queries:
        return False
    found = fetch(queries, below if len(below) <= MAX_NAMED_RANKS else [], groups=groups)
    _extend(series, found)
    return bool(found.get(ISSUED_AT))


def _extend(series: dict[str, Series], more: Mapping[str, Series]) -> None:
    """`more` added to `series`, which may hold other series of the same metrics (other groups, windows)."""
    for name, found in more.items():
        series.setdefault(name, []).extend(found)


REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$-")


def _any_of(names: Sequence[str]) -> str:
    """A PromQL regular expression (in a double-quoted string) that matches exactly the names given."""
    escaped = ("".join("\\" + char if char in REGEX_SPECIAL else char for char in name) for name in names)
    return "|".join(escaped).replace("\\", "\\\\").replace('"', '\\"')


def _snapshot(series: Mapping[str, Series], now: float, run: str) -> Snapshot:
    """build_snapshot over Prometheus's answers: a rank is up if Prometheus scrapes it and `up` is 1."""
    liveness = {
        int(labels["rank"]): Liveness(value == 1.0, "" if value == 1.0 else "target down (up == 0)")
        for labels, value in series.get("up", [])
    }
    for labels, _ in series.get("flare_rank_info", []):
        liveness.setdefault(int(labels["rank"]), Liveness(False, "no longer scraped by Prometheus"))
    return build_snapshot(series, liveness, now, run)


PLACEHOLDERS = re.compile(r"\{sel_not_native\}|\{sel|\{window\}")


def _fetch(
    base_url: str, queries: Mapping[str, str], matchers: str, window: str, timeout: float, now: float
) -> dict[str, Series]:
    """The answers to `queries` over the series that `matchers` select, at `now`, as series by metric name."""
    series: dict[str, Series] = defaultdict(list)
    for name, answer in zip(
        queries, _answers(base_url, queries, matchers, window, timeout, now), strict=True
    ):
        for item in answer:
            labels = item["metric"]
            if "rank" in labels:
                series[labels.pop("__name__", name)].append((labels, float(item["value"][1])))
    return series


def _answers(
    base_url: str, queries: Mapping[str, str], matchers: str, window: str, timeout: float, now: float
) -> list[list[dict[str, Any]]]:
    """Prometheus's answers to `queries` (at once) over the series that `matchers` select, at `now`."""
    values = {
        "{sel_not_native}": f'{{{matchers}, group!="{spec.NATIVE_GROUP}"}}',
        "{sel": f"{{{matchers}",  # `{sel}`, or `{sel, more="matchers"}`
        "{window}": window,
    }
    # in one pass: a run's name may hold a placeholder's text
    exprs = [PLACEHOLDERS.sub(lambda found: values[found.group()], template) for template in queries.values()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda expr: promql.query(base_url, expr, timeout, now), exprs))
