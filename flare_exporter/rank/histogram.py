"""A histogram with one writer thread and lock-free readers.

The training thread and the timing manager each own the histograms they write, so observing never
takes a lock that a scrape could hold. A scrape copies the bucket list (one C-level copy under the GIL)
and derives the count from that copy, so the buckets it exposes are always cumulative and consistent.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache
from itertools import accumulate


class Histogram:
    """Bucket counts for `bounds` (upper bounds, `le`), plus +Inf; written by one thread only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(
        self, bounds: tuple[float, ...], counts: list[int] | None = None, total: float = 0.0
    ) -> None:
        self.bounds = bounds
        self.counts = counts if counts is not None else [0] * (len(bounds) + 1)
        self.sum = total

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[int], float]:
        """Cumulative bucket counts ending with +Inf's (the count), and the sum."""
        counts = self.counts.copy()
        total = self.sum
        return list(accumulate(counts)), total

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs ending with +Inf, and the sum."""
        counts, total = self.cumulative()
        return list(zip(bucket_labels(self.bounds), counts, strict=True)), total


@lru_cache(maxsize=64)
def bucket_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The `le` label values of `bounds` and +Inf, formatted once per set of bounds."""
    return (*(repr(float(bound)) for bound in bounds), "+Inf")
