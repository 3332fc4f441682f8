"""Where a Snapshot comes from: the Prometheus HTTP API, or the ranks' endpoints scraped directly.

Both sources reduce to the same thing, series by metric name (labels, value), which `build_snapshot`
turns into RankRecords (records). Prometheus answers a fixed number of queries whatever the number of ranks,
in rounds that read only what the verdicts need (prometheus_source.from_prometheus); the direct scrape
reads every rank's exposition in parallel, each with a timeout (scrape_source.from_targets).

The names the CLI, the tests and the benchmarks use of either source, in one place.
"""

from __future__ import annotations

from .prometheus_source import (
    CANARY_FAILING_QUERY,
    CUMULATIVE_QUERIES,
    DETAIL_QUERIES,
    FAULT_QUERIES,
    FLIGHT_QUERIES,
    GONE_GROUP_QUERIES,
    GROUP_QUERIES,
    ILD_QUERIES,
    NAMED_DETAIL_QUERIES,
    NUMBER_QUERIES,
    PACE_QUERIES,
    PROGRESS_QUERIES,
    PROMETHEUS_QUERIES,
    WINDOW_METRICS,
    canary_reads_every_rank,
    from_prometheus,
    ild_candidates,
    ild_screen,
    late_scrape_queries,
    recent_windows,
    summary_candidates,
)
from .records import (
    FLIGHT_STARTED,
    ISSUED_AT,
    SNAPSHOT_METRICS,
    Liveness,
    Series,
    SourceError,
    build_snapshot,
    with_detail,
    with_pace,
)
from .scrape_source import from_targets

__all__ = [
    "CANARY_FAILING_QUERY",
    "CUMULATIVE_QUERIES",
    "DETAIL_QUERIES",
    "FAULT_QUERIES",
    "FLIGHT_QUERIES",
    "FLIGHT_STARTED",
    "GONE_GROUP_QUERIES",
    "GROUP_QUERIES",
    "ILD_QUERIES",
    "ISSUED_AT",
    "NAMED_DETAIL_QUERIES",
    "NUMBER_QUERIES",
    "PACE_QUERIES",
    "PROGRESS_QUERIES",
    "PROMETHEUS_QUERIES",
    "SNAPSHOT_METRICS",
    "WINDOW_METRICS",
    "Liveness",
    "Series",
    "SourceError",
    "build_snapshot",
    "canary_reads_every_rank",
    "from_prometheus",
    "from_targets",
    "ild_candidates",
    "ild_screen",
    "late_scrape_queries",
    "recent_windows",
    "summary_candidates",
    "with_detail",
    "with_pace",
]
