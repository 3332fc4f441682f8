"""The exporter's own health: errors it caught and events it dropped, by where they happened."""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("flare_exporter")


class ExporterHealth:
    """Counts of caught errors (by component) and dropped events (by queue).

    Increments come from several threads; a lost increment under a race is acceptable, a lock shared
    with the scrape is not. Each component's first error is logged once, so a failing hook cannot
    flood the training job's log.
    """

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def error(self, component: str, error: BaseException | None = None, count: int = 1) -> None:
        if self.errors[component] == 0:
            log.warning(
                "flare-exporter: %s failed (%r); counting further failures silently", component, error
            )
        self.errors[component] += count

    def drop(self, queue: str, count: int = 1) -> None:
        self.dropped[queue] += count
