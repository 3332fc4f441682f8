"""Snapshots from the Prometheus HTTP API, in rounds of PromQL queries.

Each round asks a fixed set of queries, whatever the number of ranks: a query names ranks only where it
names few (MAX_NAMED_RANKS), and the rounds that follow a hang's chain from group to group stop after
MAX_CHAIN_ROUNDS. Rounds are asked only where the rules need what they read (see from_prometheus).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import record_names
from ..config import DEFAULT, HangThreshold, hang_of_run
from ..durations import duration_seconds
from ..policies import IldPolicy, StragglerPolicy
from . import canary, diagnosis, hang_verdicts, promql, straggler_verdicts
from .host_load import HOST_LOAD_METRICS
from .pace_queries import (
    CUMULATIVE_QUERIES,
    SUMMARY_AT_QUERY,
    SUMMARY_FIGURES,
    ild_candidates,
    ild_screen,
    recent_windows,
    summary_candidates,
)
from .promql import Prometheus
from .records import (
    COLLECTIVE_LAST_COMPLETED_SEQ,
    COLLECTIVE_LAST_ISSUED_SEQ,
    FLIGHT_INFO,
    FLIGHT_NUMBERS,
    FLIGHT_STARTED,
    GPU_CLOCK_EVENT_ACTIVE,
    GPU_HEALTH_METRICS,
    HANG_THRESHOLD,
    ILD_METRICS,
    ISSUED_AT,
    P2P_COUNTS,
    P2P_STARTED,
    PROCESS_GROUP_INFO,
    PROGRESS_METRICS,
    RANK_EXCEPTION_INFO,
    RANK_EXCEPTION_TIMESTAMP_SECONDS,
    RANK_INFO,
    RANK_STACK_INFO,
    STEP_DURATION_SECONDS_COUNT,
    STRAGGLER_METRICS,
    Liveness,
    Series,
    build_snapshot,
    group_fields,
    one_run,
    with_canary,
    with_detail,
    with_fields,
    with_pace,
)
from .rule_types import Snapshot, WindowSummary

# The queries. Each keeps only the labels build_snapshot reads (`max by` them): the other labels of every
# series (instance, job, run, ...) would be most of the answer, for Prometheus to write and for us to parse.
# A query's answer is named by its key (or by `__name__` where it keeps one). Placeholders: `{sel}` the
# selector of the run (or of its named ranks), `{sel, more="matchers"}` it with more matchers, `{window}`
# the lookback.
# Identity, groups and exceptions look back (a dead rank's last word); the rest is the current state.


def _current(names: Iterable[str], labels: str) -> dict[str, str]:
    """A query per metric in `names` for its current value, one series per (rank, `labels`). Each alone:
    one query over several metrics (`{__name__=~"a|b"}` grouped by `__name__`) took Prometheus twice as
    long as the queries of its metrics together (6,144 ranks: 0.94 s against 0.46 s for the windows)."""
    return {name: f"max by (rank{labels}) ({name}{{sel}})" for name in names}


RANK_INFO_NOW = "flare_rank_info_now"  # the key of the ranks present now (not a metric: never in a spec)


def _canary_series(ranks: str = "") -> str:
    """Every canary series (each named by its __name__) of the ranks `ranks` selects (`and on (rank) ...`;
    '': every rank)."""
    selected = f'{{sel, __name__=~"{"|".join(canary.METRICS)}"}}'
    kept = f"{selected} and on (rank) ({ranks})" if ranks else selected
    return f"max by (__name__, rank, measurement, scope, phase) ({kept})"


# The hardware canary's series of the ranks that failed one of its checks (one query, with the faults: a row
# per series of those ranks, none when every rank passed); records.with_canary makes them fields once the
# pace is read, so that they mask neither a straggler nor a hang (from_prometheus).
CANARY_FAILING = "canary_failing"
CANARY_FAILING_QUERY = _canary_series(
    f"{canary.CANARY_FAILED}{{sel}} == 1 or {canary.CANARY_DRIFT}{{sel}} == 1"
)
# `flare canary`'s view: every rank's up to CANARY_EVERY_RANK ranks, beyond them the bottom CANARY_BOTTOM
# ranks of each measurement and scope, by their share of the job's median and by their moving average.
CANARY_EVERY_RANK = 64
CANARY_BOTTOM = 3
CANARY_VIEW_QUERIES = {"canary_every_rank": _canary_series()}
CANARY_BOTTOM_QUERIES = {
    "canary_bottom": _canary_series(
        f"bottomk by (measurement, scope) ({CANARY_BOTTOM}, {canary.CANARY_RELATIVE}{{sel}})"
        f" or bottomk by (measurement, scope) ({CANARY_BOTTOM}, {canary.CANARY_EWMA_RATIO}{{sel}})"
    )
}

# Is a rank gone, is a group hung, and who is behind in it: every rank (and the canary's failing ranks).
FAULT_QUERIES = {
    RANK_INFO: f"max by (rank, host, world_size) (last_over_time({RANK_INFO}{{sel}}[{{window}}]))",
    RANK_EXCEPTION_INFO: (
        f"max by (rank, type, cause) (last_over_time({RANK_EXCEPTION_INFO}{{sel}}[{{window}}]))"
    ),
    RANK_EXCEPTION_TIMESTAMP_SECONDS: (
        f"max by (rank) (last_over_time({RANK_EXCEPTION_TIMESTAMP_SECONDS}{{sel}}[{{window}}]))"
    ),
    "up": "max by (rank) (up{sel})",
    # the ranks whose own series Prometheus has now: where a target's labels carry no rank (pods that service
    # discovery finds and drops as they die), `up` cannot say which rank is gone; this can
    RANK_INFO_NOW: f"max by (rank) ({RANK_INFO}{{sel}})",
    **_current([FLIGHT_STARTED], ", group"),
    **_current([P2P_STARTED], ", group, peer, direction"),
    CANARY_FAILING: CANARY_FAILING_QUERY,
}
# The progress of the ranks that raised (asked of them when there are any): whether they restarted since, and
# the rank_down evidence. A target that is down has no current series; the other ranks' progress is detail.
PROGRESS_QUERIES = _current(PROGRESS_METRICS, "")
# Who is in each group and who is behind in it: every rank (asked when a collective has been in flight for
# the hang threshold, or when from_prometheus is not told the threshold; the rules need them only then), of
# the groups the hang rules read (diagnosis.what_hang_rules_read) when told the threshold.
GROUP_QUERIES = {
    **_current([COLLECTIVE_LAST_ISSUED_SEQ], ", group"),
    # when each number was scraped: one scraped at or before its group's newest issue (the latest start the
    # faults round read) is late (rule_types.GroupState.seen_before_stall). Compared here, not in
    # Prometheus, which read every rank's start again for it (at 6,144 ranks, twice as long).
    ISSUED_AT: f"max by (rank, group) (timestamp({COLLECTIVE_LAST_ISSUED_SEQ}{{sel}}))",
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
# Every rank's sends and receives counted per peer: the wait-for graph's point-to-point edges (asked with
# every group's numbers where a send or receive has been in flight for the hang threshold).
P2P_QUERIES = _current(P2P_COUNTS, ", group, peer, direction")
# The groups a rank was in that it reports no issued number of now (issued 0, as when the series is absent):
# a rank that is down has no current series. Asked with the groups, of the ranks that are down; five minutes
# of every rank's group info would be the slowest query of the round.
GONE_GROUP_QUERIES = {
    PROCESS_GROUP_INFO: (
        f"max by (rank, group) (last_over_time({PROCESS_GROUP_INFO}{{sel}}[{{window}}]))"
        f" unless on (rank, group) {COLLECTIVE_LAST_ISSUED_SEQ}{{sel}}"
    ),
}
# Is a rank slower than the others: every rank (asked when no rank is gone or hung; the rules weigh
# stragglers and ILD only then). The straggler windows are most of the series of the round: the rounds
# read the last few of each rank first (see pace_queries.recent_windows).
PACE_QUERIES = {
    **_current(STRAGGLER_METRICS, ", ago"),
    **_current(HOST_LOAD_METRICS.values(), ""),
    STEP_DURATION_SECONDS_COUNT: (
        f"sum by (rank) (increase({STEP_DURATION_SECONDS_COUNT}{{sel}}[{{window}}]))"
    ),
}
# Has a rank's issue latency shifted: every rank's drift (its peers' medians decide), asked with the pace
# only when ild_screen finds a rank whose drift could count as shifted; most of the time none does.
ILD_QUERIES = _current(ILD_METRICS, ", distribution")
# What explains a verdict without deciding it, of every rank (the views).
DETAIL_QUERIES = {
    **PROGRESS_QUERIES,
    RANK_STACK_INFO: f"max by (rank, activity, frames) ({RANK_STACK_INFO}{{sel}})",
    **_current(GPU_HEALTH_METRICS, ""),
    # only the clock events that are active: the others would be most of the answer
    GPU_CLOCK_EVENT_ACTIVE: f"max by (rank, reason) ({GPU_CLOCK_EVENT_ACTIVE}{{sel}} == 1)",
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
    **_current([COLLECTIVE_LAST_COMPLETED_SEQ], ", group"),
}
PROMETHEUS_QUERIES = {
    **FAULT_QUERIES,
    **GROUP_QUERIES,
    **FLIGHT_QUERIES,
    **P2P_QUERIES,
    **GONE_GROUP_QUERIES,
    **PACE_QUERIES,
    **ILD_QUERIES,
    **CUMULATIVE_QUERIES,
    **DETAIL_QUERIES,
    **VIEW_QUERIES,
}

MAX_NAMED_RANKS = 256  # named in a selector up to this many (a URL that any proxy takes); beyond, every rank
MAX_CHAIN_ROUNDS = 8  # rounds of groups a hang's chain names; beyond, every group at once


Fetch = Callable[..., dict[str, Series]]  # PrometheusRun.fetch, or what stands for it
Answers = Callable[..., list[list[dict[str, Any]]]]  # PrometheusRun.answers


def from_prometheus(
    server: Prometheus,
    run: str = "",
    window: str = "5m",
    timeout: float = 10.0,
    detail_for: Callable[[Snapshot], Iterable[int]] | None = None,
    hang_seconds: float | None = None,
    ild: IldPolicy | None = None,
    stragglers: StragglerPolicy | None = None,
    canary_view: bool = False,
) -> Snapshot:
    """A Snapshot of one run from the Prometheus at `server` (its base URL, or a promql.Connection where it
    is secured), at the current time, in a fixed number of queries.

    Without `detail_for`, everything of every rank at once (PROMETHEUS_QUERIES). With it (the rules: the
    ranks their verdicts name), in rounds, each only where the rules need what it reads: every rank's
    faults; the progress of the ranks that raised; the groups the hang rules read, where a collective has
    been in flight for `hang_seconds` (every group where it is None); where the verdicts then name no rank,
    every rank's pace, as the rules' `stragglers` and `ild` policies weigh it; last, the detail of the ranks
    named. At thousands of ranks, most of a snapshot is what no verdict needs. Each round adds fields to the
    records of the rounds before (the same records as build_snapshot makes of all the answers at once),
    without building them again. The canary's series of the ranks that failed a check come with the faults
    and are added after the pace; `canary_view` (`flare canary`) reads more of them (_canary_round).
    """
    now = time.time()
    connection = promql.connection(server)
    run = run or the_run(connection, window, timeout, now)
    prometheus = PrometheusRun(connection, matcher(run), window, timeout, now)
    fetch = prometheus.fetch
    if detail_for is None:
        series = fetch(PROMETHEUS_QUERIES)
        failing = _canary_taken(series)
        return _canary_round(fetch, _snapshot(series, now, run), failing, canary_view)
    series, ahead = _faults_round(fetch, now, hang_seconds)
    failing = _canary_taken(series)
    _restarts_round(fetch, series)
    faults = _snapshot(series, now, run)
    if faults.ranks_seen == 0:  # the run is gone: its last words are judged instead (history_source)
        return faults
    if hang_seconds is None or _point_to_point_hung(series, now, hang_seconds):
        snapshot = _every_group_round(fetch, faults, series)
    else:
        snapshot = _hang_groups_round(fetch, faults, series, hang_seconds, ahead)
    named = sorted(set(detail_for(snapshot)))
    if not named:  # nothing gone or hung: the rules weigh every rank's pace
        stragglers = stragglers or StragglerPolicy()
        snapshot = _pace_rounds(prometheus, snapshot, ild or IldPolicy(), stragglers)
    read = _canary_round(fetch, snapshot, failing, canary_view)
    if read is not snapshot or not named:  # the verdicts of the pace or of the canary read since
        snapshot = read
        named = sorted(set(detail_for(snapshot)))
    return _detail_round(fetch, snapshot, named)


@dataclass(frozen=True)
class PrometheusRun:
    """Where the rounds ask their queries: one run's series at one Prometheus, as of `now`."""

    server: promql.Connection
    matchers: str  # the run's matchers in a selector (matcher)
    window: str
    timeout: float
    now: float

    def fetch(
        self,
        queries: Mapping[str, str],
        ranks: Sequence[int] = (),
        groups: Iterable[str] = (),
        at: float | None = None,
    ) -> dict[str, Series]:
        """The answers to `queries`, of the ranks named (of every rank if none), in the groups named (all),
        at `at` (now)."""
        named = f', rank=~"{"|".join(map(str, ranks))}"' if ranks else ""
        if groups:
            named += f', group=~"{_any_of(sorted(groups))}"'
        return _fetch(self.server, queries, self.matchers + named, self.window, self.timeout, self._at(at))

    def answers(self, queries: Mapping[str, str], at: float | None = None) -> list[list[dict[str, Any]]]:
        """Prometheus's answers to `queries` of every rank, at `at` (now), as it gives them."""
        return _answers(self.server, queries, self.matchers, self.window, self.timeout, self._at(at))

    def _at(self, at: float | None) -> float:
        return self.now if at is None else at


# ---------------------------------------------------------------------------------------------------------
# the rounds, in the order from_prometheus asks them


class ReadAhead(NamedTuple):
    """The issued numbers of `groups`, asked before the faults round's records were built (_faults_round)."""

    groups: set[str]
    answers: Future[dict[str, Series]]


def _faults_round(
    fetch: Fetch, now: float, hang_seconds: float | None
) -> tuple[dict[str, Series], ReadAhead | None]:
    """Every rank's faults (FAULT_QUERIES, 7 queries: is a rank gone, is a group hung, who is behind, which
    ranks failed a canary check); and, told the hang threshold, the issued numbers of the groups in which
    some rank has had a collective in flight for it (NUMBER_QUERIES, 1 query of those groups: the hung
    groups, or more where that rank is not up), asked as soon as the starts are in: while the round's
    other answers come and its records are built. At a hang of thousands of ranks, both rounds' answers
    take Prometheus hundreds of ms; the records, about 100 ms."""
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


def _restarts_round(fetch: Fetch, series: dict[str, Series]) -> None:
    """The progress of the ranks that raised (PROGRESS_QUERIES, 2 queries), added to `series`: whether each
    restarted since decides whether it is gone, so it is asked before the records are built. Nothing is
    asked where no rank raised."""
    raised = sorted({int(labels["rank"]) for labels, _ in series.get(RANK_EXCEPTION_INFO, [])})
    if raised:
        series.update(fetch(PROGRESS_QUERIES, _selectable(raised)))


def _gone_groups_round(fetch: Fetch, faults: Snapshot, series: dict[str, Series]) -> None:
    """The groups the ranks that are down were in (GONE_GROUP_QUERIES, 1 query of those ranks), added to
    `series`: a rank that is down has no current series to say so. Nothing is asked where every rank is up."""
    down = [rank for rank, record in faults.ranks.items() if not record.up]
    if down:
        series.update(fetch(GONE_GROUP_QUERIES, _selectable(down)))


def _point_to_point_hung(series: Mapping[str, Series], now: float, hang_seconds: float) -> bool:
    """Whether some rank's send or receive has been in flight for `hang_seconds` (the faults round's)."""
    return any(now - started >= hang_seconds for _, started in series.get(P2P_STARTED, []))


def _every_group_round(fetch: Fetch, faults: Snapshot, series: dict[str, Series]) -> Snapshot:
    """`faults` with every rank's groups, where from_prometheus is not told the hang threshold or a send or
    receive is hung (its wait-for graph may lead through any group): every rank's numbers, flights and
    sends and receives per peer (GROUP_QUERIES, FLIGHT_QUERIES and P2P_QUERIES, 7 queries), added to
    `series`, after the groups of the ranks that are down (_gone_groups_round)."""
    _gone_groups_round(fetch, faults, series)
    series.update(fetch(GROUP_QUERIES | FLIGHT_QUERIES | P2P_QUERIES))
    return with_fields(faults, group_fields(series, faults.now))


def _hang_groups_round(
    fetch: Fetch, faults: Snapshot, series: dict[str, Series], hang_seconds: float, ahead: ReadAhead | None
) -> Snapshot:
    """`faults` with the groups the hang rules read, where some group is hung (a live rank has had a
    collective in flight in it for `hang_seconds`): the groups of the ranks that are down
    (_gone_groups_round), the numbers of the hung groups and of those their chains lead to
    (_with_hang_groups), then which collective each member has in flight in the groups whose verdicts
    weigh it (FLIGHT_QUERIES, 3 queries of those groups), all added to `series`. Nothing is asked where no
    group is hung."""
    hung = {name for name, age in faults.oldest_in_flight.items() if age >= hang_seconds}
    if not hung:
        return faults
    _gone_groups_round(fetch, faults, series)
    snapshot, weighed = _with_hang_groups(faults, series, hung, hang_seconds, fetch, faults.now, ahead)
    if weighed:
        series.update(fetch(FLIGHT_QUERIES, groups=weighed))
        snapshot = with_fields(snapshot, group_fields(series, faults.now))
    return snapshot


def _with_hang_groups(
    faults: Snapshot,
    series: dict[str, Series],
    hung: set[str],
    hang_seconds: float,
    fetch: Fetch,
    now: float,
    ahead: ReadAhead | None,
) -> tuple[Snapshot, set[str]]:
    """`faults` with the groups the hang rules read: the hung groups' issued numbers first (those `ahead`
    asked, and any other), then those of the groups their chains lead to, as the rules name them, until
    they name none unread (at thousands of ranks in tensor-, pipeline- and data-parallel groups, most
    groups have nothing to do with a hang), each group's late scrapes asked once its numbers are in
    (_late_scrapes); and the groups of which the rules weigh what each member has in flight
    (diagnosis.what_hang_rules_read). Each round of the chain costs 2 queries at most (the numbers of the
    groups unread, NUMBER_QUERIES; their late scrapes), for at most MAX_CHAIN_ROUNDS rounds; a longer chain
    than that, GROUP_QUERIES (2 queries) of every group."""
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
        snapshot = with_fields(faults, group_fields(series, now))
        if _late_scrapes(snapshot, series, read - timed, fetch, hang_seconds):
            snapshot = with_fields(faults, group_fields(series, now))
        timed = set(read)
        reads = diagnosis.what_hang_rules_read(snapshot, hang_seconds)
        if reads.numbers <= read:
            return snapshot, reads.flights
        needed = reads.numbers
    series |= fetch(GROUP_QUERIES)  # a chain longer than any job's: every group
    snapshot = with_fields(faults, group_fields(series, now))
    return snapshot, diagnosis.what_hang_rules_read(snapshot, hang_seconds).flights


def _late_scrapes(
    snapshot: Snapshot, series: dict[str, Series], groups: set[str], fetch: Fetch, hang_seconds: float
) -> bool:
    """Asks the scrape times that could be late (late_scrape_queries) in `groups` of their members below
    the group's top, the only ranks a late scrape leaves unjudged (hang_verdicts.below_top): at a hang, the
    few behind instead of every member (at thousands of ranks a query Prometheus spends as long on as on the
    numbers). 1 query; none where no member is below the top or nothing is in flight. True where some were
    late: `series` holds them."""
    below = sorted({rank for group in groups for rank in hang_verdicts.below_top(snapshot, group)})
    queries = late_scrape_queries(series, groups, hang_seconds)
    if not below or not queries:
        return False
    found = fetch(queries, _selectable(below), groups=groups)
    _extend(series, found)
    return bool(found.get(ISSUED_AT))


def late_scrape_queries(
    series: Mapping[str, Series], groups: Iterable[str], hang_seconds: float = 0.0
) -> dict[str, str]:
    """The query of the scrape times of the issued numbers in `groups` that could be late: those scraped at
    or before the newest start in `groups` that `series` hold, or before the oldest start + `hang_seconds`
    (when its group became hung: hang_verdicts.GroupHang.judges); none where nothing is in flight in them.
    Each number's group decides (records.group_fields, hang_verdicts); the late scrapes are few, a row
    each."""
    groups = set(groups)
    starts = [started for labels, started in series.get(FLIGHT_STARTED, []) if labels["group"] in groups]
    if not starts:
        return {}
    bar = max(max(starts), min(starts) + hang_seconds)
    query = GROUP_QUERIES[ISSUED_AT]
    return {ISSUED_AT: f"{query} <= {bar!r}" if math.isfinite(bar) else query}


def _pace_rounds(
    prometheus: PrometheusRun,
    faults: Snapshot,
    ild: IldPolicy,
    stragglers: StragglerPolicy,
) -> Snapshot:
    """`faults` with every rank's pace, where no rank is gone or hung (the rules weigh stragglers and ILD
    only then), in the rounds the rules need: the last straggler windows (_recent_pace_round), the ILD drift
    where a rank's could count as shifted (_ild_round), the older windows where the last ones do not decide
    (_older_windows_round), the cumulative times where not every rank exports windows
    (_cumulative_round)."""
    summary, pace = _recent_pace_round(prometheus, faults, ild, stragglers)
    _ild_round(prometheus.fetch, pace, ild)
    snapshot = with_pace(faults, pace)
    if summary is not None:
        snapshot = snapshot.replaced(True, window_summary=summary)
    elif not straggler_verdicts.decided_by_last_windows(snapshot, stragglers):
        snapshot = _older_windows_round(prometheus.fetch, faults, pace, stragglers)
    if not straggler_verdicts.judged_by_windows(snapshot):
        snapshot = _cumulative_round(prometheus.fetch, faults, pace)
    return snapshot


def _recent_pace_round(
    prometheus: PrometheusRun,
    faults: Snapshot,
    ild: IldPolicy,
    stragglers: StragglerPolicy,
) -> tuple[WindowSummary | None, dict[str, Series]]:
    """Every rank's pace as the rules weigh it first, and the summary of its windows that stands for them
    (None where none is read): the last straggler windows (PACE_QUERIES and the recent part of
    recent_windows, 7 queries) and the ranks whose ILD drift could count as shifted (ild_candidates,
    1 query), at once. Beyond LEAVE_ONE_OUT_RANKS, what the recording rules say of every rank's windows
    (_window_summary) in their place where it stands for them, the candidates asked meanwhile."""
    recent, _ = recent_windows(stragglers)
    if faults.ranks_seen <= straggler_verdicts.LEAVE_ONE_OUT_RANKS:
        return None, prometheus.fetch(PACE_QUERIES | recent | ild_candidates(ild))
    summary: WindowSummary | None = None
    with ThreadPoolExecutor(max_workers=1) as pool:
        screened = pool.submit(prometheus.fetch, ild_candidates(ild))
        summarised = _window_summary(prometheus.answers, prometheus.fetch, faults, stragglers)
        if summarised is None:
            pace = prometheus.fetch(PACE_QUERIES | recent)
        else:
            summary, pace = summarised
        pace |= screened.result()
    return summary, pace


def _window_summary(
    answers: Answers,
    fetch: Fetch,
    faults: Snapshot,
    policy: StragglerPolicy,
) -> tuple[WindowSummary, dict[str, Series]] | None:
    """What Prometheus's recording rules say of every rank's straggler windows, and the windows of the ranks
    they could name, all as of the rules' last evaluation; None where the figures do not stand for every
    live rank's windows (WindowSummary): no rules, not every live rank with each of the windows
    and a best step time, windows not closed alike, a job-wide slowdown, more ranks to name than a
    selector names. 3 queries (the evaluation time, then the figures and the ranks they could name), and
    PACE_QUERIES (5 queries) of those ranks where there are any."""
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
    counts = [figures.get((record_names.WINDOW_RANKS, ago)) for ago in agos]
    counts.append(figures.get((record_names.BEST_STEP_RANKS, "")))
    first = figures.get((f"{record_names.LAST_WINDOW}:min", ""))
    last = figures.get((f"{record_names.LAST_WINDOW}:max", ""))
    slowest = figures.get((record_names.SUMMARY_AT, ""))
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

    per_window = tuple(robust(record_names.WINDOW_SHARE, ago) for ago in agos)
    pooled = robust(record_names.POOLED_SHARE)
    if any(math.isnan(value) for figure in (*per_window, pooled) for value in figure):
        return None
    newest = int(last)
    summary = WindowSummary(
        tuple(range(newest - policy.hold_windows + 1, newest + 1)), faults.ranks_seen, per_window, pooled, at
    )
    return summary, (fetch(PACE_QUERIES, candidates, at=at) if candidates else {})


def _ild_round(fetch: Fetch, pace: dict[str, Series], ild: IldPolicy) -> None:
    """Every rank's ILD drift (ILD_QUERIES, 3 queries), added to `pace`, where a candidate of the recent pace
    round (its `ild_candidates`, taken out) could count as shifted under `ild` (ild_screen, 1 query of the
    candidates): its peers' medians decide. Most of the time no rank is a candidate and nothing is asked."""
    candidates = sorted({int(labels["rank"]) for labels, _ in pace.pop("ild_candidates", [])})
    if candidates and fetch(ild_screen(ild), _selectable(candidates)).get("ild_screen"):
        pace.update(fetch(ILD_QUERIES))


def _older_windows_round(
    fetch: Fetch, faults: Snapshot, pace: dict[str, Series], stragglers: StragglerPolicy
) -> Snapshot:
    """`faults` with the pace read and every rank's older straggler windows (the older part of
    recent_windows, 2 queries), added to `pace`: asked where the last windows do not decide
    (straggler_verdicts.decided_by_last_windows)."""
    _, older = recent_windows(stragglers)
    _extend(pace, fetch(older))
    return with_pace(faults, pace)


def _cumulative_round(fetch: Fetch, faults: Snapshot, pace: dict[str, Series]) -> Snapshot:
    """`faults` with the pace read and every rank's cumulative step and collective times
    (CUMULATIVE_QUERIES, 2 queries), added to `pace`: asked where not every rank exports straggler windows
    (straggler_verdicts.judged_by_windows)."""
    pace.update(fetch(CUMULATIVE_QUERIES))
    return with_pace(faults, pace)


def _canary_taken(series: dict[str, Series]) -> dict[str, Series]:
    """The canary's series (those of CANARY_FAILING_QUERY), taken out of `series`: they become fields after
    the pace is read (_canary_round)."""
    return {name: series.pop(name) for name in canary.METRICS if name in series}


def _canary_round(fetch: Fetch, snapshot: Snapshot, failing: Mapping[str, Series], view: bool) -> Snapshot:
    """`snapshot` with the canary's series of the ranks that failed a check (`failing`, read with the faults)
    and, for `flare canary` (`view`), of every rank up to CANARY_EVERY_RANK ranks, else of the bottom
    CANARY_BOTTOM ranks of each measurement (1 query); `snapshot` itself where there are none."""
    found = {name: list(rows) for name, rows in failing.items()}
    if view:
        every = canary_reads_every_rank(snapshot.ranks_seen)
        _extend(found, fetch(CANARY_VIEW_QUERIES if every else CANARY_BOTTOM_QUERIES))
    return with_canary(snapshot, found) if found else snapshot


def canary_reads_every_rank(ranks_seen: int) -> bool:
    """Whether `flare canary` from Prometheus shows every rank (else the failing and the bottom few)."""
    return ranks_seen <= CANARY_EVERY_RANK


def _detail_round(fetch: Fetch, snapshot: Snapshot, named: Sequence[int]) -> Snapshot:
    """`snapshot` with what explains the verdicts of the ranks `named` (progress, stack, GPU health):
    NAMED_DETAIL_QUERIES of them, 3 queries; DETAIL_QUERIES of every rank, 15 queries, where more are named
    than a selector names. Nothing is asked where no rank is named."""
    if not named:
        return snapshot
    if len(named) > MAX_NAMED_RANKS:
        return with_detail(snapshot, fetch(DETAIL_QUERIES))
    return with_detail(snapshot, fetch(NAMED_DETAIL_QUERIES, named))


# ---------------------------------------------------------------------------------------------------------
# asking Prometheus


def the_run(server: Prometheus, window: str, timeout: float, now: float) -> str:
    """The one run whose ranks Prometheus scraped within `window` before `now`. Its index answers first (no
    sample read: the query reads every rank's `window` of flare_rank_info, 0.1 to 0.3 s at 6,144 ranks);
    where it names other than one run (it may name runs scraped before the window), the query decides: 1
    request, or 2."""
    where = f"Prometheus at {promql.connection(server).url}"
    start = now - duration_seconds(window, "flag --window")
    named = promql.label_values(server, "run", RANK_INFO, start, now, timeout)
    if len(named) == 1 and named[0]:
        return named[0]
    runs = promql.query(server, f"count by (run) (last_over_time({RANK_INFO}[{window}]))", timeout, now)
    return one_run([item["metric"].get("run", "") for item in runs], "", where)


def matcher(run: str) -> str:
    """The matcher of `run` in a selector."""
    escaped = run.replace("\\", "\\\\").replace('"', '\\"')
    return f'run="{escaped}"'


def hang_threshold_query(run: str, window: str) -> str:
    """The one query of the run's hang threshold: the largest its ranks exported within `window`."""
    return f"max(last_over_time({HANG_THRESHOLD}{{{matcher(run)}}}[{window}]))"


def run_hang_threshold(server: Prometheus, run: str, window: str, timeout: float, now: float) -> float | None:
    """The run's hang threshold from Prometheus as of `now` (one query); None where no rank of it exported
    one."""
    answer = promql.query(server, hang_threshold_query(run, window), timeout, now)
    return float(answer[0]["value"][1]) if answer else None


def resolve_hang_threshold(
    server: Prometheus, run: str, window: str, timeout: float, fallback: HangThreshold, now: float
) -> tuple[str, HangThreshold]:
    """The run (`run`, else the one Prometheus saw within `window`: the_run, as run_hang_threshold would
    resolve it) and the hang threshold to judge it by, asked before the snapshot (the faults round reads
    ahead with it): `fallback` where the engine was told one, else the run's own (one query) or, where no
    rank of it exports one, `fallback`."""
    if fallback.source != DEFAULT:
        return run, fallback
    run = run or the_run(promql.connection(server), window, timeout, now)
    return run, hang_of_run(run_hang_threshold(server, run, window, timeout, now), fallback)


def _selectable(ranks: Sequence[int]) -> Sequence[int]:
    """`ranks` to name in a selector; none (every rank) where they are more than MAX_NAMED_RANKS."""
    return ranks if len(ranks) <= MAX_NAMED_RANKS else []


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
    """build_snapshot over Prometheus's answers: a rank is up if its own series are there now (its
    flare_rank_info) or its target's `up` is 1, unless `up` says its target is down. A rank seen within the
    window but neither is no longer scraped: its target is gone (a file_sd entry removed, a dead pod that
    service discovery dropped, whose `up` never carried a rank)."""
    present = {int(labels["rank"]) for labels, _ in series.get(RANK_INFO_NOW, [])}
    up = {int(labels["rank"]): value for labels, value in series.get("up", [])}
    liveness = {rank: Liveness(True, "") for rank in present}
    liveness |= {
        rank: Liveness(value == 1.0, "" if value == 1.0 else "target down (up == 0)")
        for rank, value in up.items()
    }
    for labels, _ in series.get(RANK_INFO, []):
        liveness.setdefault(int(labels["rank"]), Liveness(False, "no longer scraped by Prometheus"))
    return build_snapshot(series, liveness, now, run)


PLACEHOLDERS = re.compile(r"\{sel|\{window\}")


def _fetch(
    server: Prometheus, queries: Mapping[str, str], matchers: str, window: str, timeout: float, now: float
) -> dict[str, Series]:
    """The answers to `queries` over the series that `matchers` select, at `now`, as series by metric name."""
    series: dict[str, Series] = defaultdict(list)
    for name, answer in zip(queries, _answers(server, queries, matchers, window, timeout, now), strict=True):
        for item in answer:
            labels = item["metric"]
            if "rank" in labels:
                series[labels.pop("__name__", name)].append((labels, float(item["value"][1])))
    return series


def _answers(
    server: Prometheus, queries: Mapping[str, str], matchers: str, window: str, timeout: float, now: float
) -> list[list[dict[str, Any]]]:
    """Prometheus's answers to `queries` (at once) over the series that `matchers` select, at `now`."""
    values = {
        "{sel": f"{{{matchers}",  # `{sel}`, or `{sel, more="matchers"}`
        "{window}": window,
    }
    # in one pass: a run's name may hold a placeholder's text
    exprs = [PLACEHOLDERS.sub(lambda found: values[found.group()], template) for template in queries.values()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda expr: promql.query(server, expr, timeout, now), exprs))
