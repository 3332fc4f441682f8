"""Snapshots from the ranks' own endpoints, scraped directly: every rank's exposition read in parallel, each
within a timeout, and the series of one run made into RankRecords (records.build_snapshot)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from . import scrape
from .records import RANK_INFO, SNAPSHOT_METRICS, Liveness, Series, build_snapshot, one_run
from .rule_types import Snapshot
from .targets import Target


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
    runs = [scrape.labels_of(samples, RANK_INFO).get("run", "") for samples in answered.values()]
    run = one_run([r for r in runs if r], run, f"{len(targets)} targets")
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
        if scrape.labels_of(result, RANK_INFO).get("run") != run:
            continue
        for sample in result:
            series[sample.name].append((sample.labels, sample.value))
        rank = scrape.labels_of(result, RANK_INFO).get("rank")
        if rank is not None:
            liveness[int(rank)] = Liveness(True)
    return build_snapshot(series, liveness, now, run)


MAX_RANKS = 1 << 22  # beyond any job's world size; a larger one in an exposition is garbage


BUILD_ERRORS = (ValueError, KeyError, TypeError, OverflowError)  # what build_snapshot raises on bad samples


def _bad_identity(samples: list[scrape.Sample]) -> str:
    """Why one target's flare_rank_info cannot name its rank and job ('' if it can): build_snapshot makes a
    record for every rank below world_size."""
    for sample in samples:
        if sample.name == RANK_INFO:
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
    series[RANK_INFO] = [
        ({**labels, "world_size": "0"}, value) for labels, value in series.get(RANK_INFO, [])
    ]
    try:
        build_snapshot(series, {}, now, "")
    except BUILD_ERRORS as error:
        return f"{type(error).__name__}: {str(error)[:200]}"
    return ""
