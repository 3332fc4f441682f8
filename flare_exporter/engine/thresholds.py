"""The hang threshold `flare diagnose` judges a run by: the one it was told, else the run's own.

The engine is told a threshold by its flag --hang-seconds, else FLARE_HANG_SECONDS in its environment, else
hang_seconds in the config file FLARE_CONFIG names (config.load's order). Told none, it uses the threshold
the run's ranks were started with, which each exports (flare_hang_threshold_seconds; the largest of the
ranks'), and only where no rank exports one its own default (config.Config.hang_seconds). From
Prometheus that is one query, asked before the snapshot (its faults round reads ahead with the threshold);
from a direct scrape it is in the samples the scrape fetched (records.build_snapshot sets
Snapshot.hang_seconds).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .. import config as config_module
from . import prometheus_source, promql
from .records import HANG_THRESHOLD
from .rule_types import Snapshot

# Where the threshold came from: JSON key hang_seconds_from
FLAG, ENVIRONMENT, CONFIG = config_module.FLAG, config_module.ENVIRONMENT, config_module.CONFIG_FILE
RUN, DEFAULT = "run", "default"


@dataclass(frozen=True)
class Threshold:
    """The hang threshold in seconds, and where it came from (FLAG, ENVIRONMENT, CONFIG, RUN or DEFAULT)."""

    seconds: float
    source: str


def told(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """Where the engine was told its hang threshold: FLAG (--hang-seconds given), ENVIRONMENT
    (FLARE_HANG_SECONDS set, even to the default), CONFIG (the file FLARE_CONFIG names has hang_seconds);
    None where nothing told it."""
    return config_module.told_by(config_module.HANG_KEY, getattr(args, config_module.HANG_KEY, None), environ)


def configured(seconds: float, told_by: str | None) -> Threshold:
    """The threshold of the engine's config (`seconds`): told by `told_by`, else its default."""
    return Threshold(seconds, told_by or DEFAULT)


def of_run(found: float | None, fallback: Threshold) -> Threshold:
    """The run's own threshold (`found`, None where no rank exports one) where the engine was not told one;
    `fallback` otherwise."""
    if fallback.source != DEFAULT or found is None or not 0 < found < math.inf:
        return fallback
    return Threshold(found, RUN)


def of_snapshot(snapshot: Snapshot, fallback: Threshold) -> Threshold:
    """The threshold the snapshot's ranks export (a direct scrape's), where the engine was not told one."""
    return of_run(snapshot.hang_seconds, fallback)


def query(run: str, window: str) -> str:
    """The one query of the run's threshold: the largest its ranks exported within `window`."""
    return f"max(last_over_time({HANG_THRESHOLD}{{{prometheus_source.matcher(run)}}}[{window}]))"


def from_prometheus(
    server: promql.Prometheus, run: str, window: str, timeout: float, now: float
) -> float | None:
    """The run's threshold from Prometheus as of `now` (one query); None where no rank of it exported one."""
    answer = promql.query(server, query(run, window), timeout, now)
    return float(answer[0]["value"][1]) if answer else None


def resolve_prometheus(
    server: promql.Prometheus, run: str, window: str, timeout: float, fallback: Threshold, now: float
) -> tuple[str, Threshold]:
    """The run (`run`, else the one Prometheus saw within `window`: prometheus_source.the_run, as
    from_prometheus would resolve it) and the threshold to judge it by: `fallback` where the engine was told
    one, else the run's own (one query) or, where no rank of it exports one, `fallback`."""
    if fallback.source != DEFAULT:
        return run, fallback
    run = run or prometheus_source.the_run(promql.connection(server), window, timeout, now)
    return run, of_run(from_prometheus(server, run, window, timeout, now), fallback)
