"""The single-writer histogram: Prometheus bucket semantics, cumulative snapshots, sum."""

from __future__ import annotations

import pytest

from flare_exporter.rank.histogram import Histogram

BOUNDS = (0.1, 1.0, 10.0)


def buckets_of(histogram: Histogram) -> dict[str, int]:
    return dict(histogram.snapshot()[0])


def test_empty_histogram():
    buckets, total = Histogram(BOUNDS).snapshot()
    assert buckets == [("0.1", 0), ("1.0", 0), ("10.0", 0), ("+Inf", 0)]
    assert total == 0.0


@pytest.mark.parametrize(
    ("value", "first_bucket"),
    [(0.0, "0.1"), (0.05, "0.1"), (0.1, "0.1"), (0.5, "1.0"), (1.0, "1.0"), (10.0, "10.0"), (11.0, "+Inf")],
)
def test_value_lands_in_its_le_bucket(value, first_bucket):
    histogram = Histogram(BOUNDS)
    histogram.observe(value)
    buckets = histogram.snapshot()[0]
    counts = [count for _, count in buckets]
    index = [le for le, _ in buckets].index(first_bucket)
    assert counts == [0] * index + [1] * (len(buckets) - index)


def test_snapshot_is_cumulative_and_ends_with_count():
    histogram = Histogram(BOUNDS)
    values = [0.01, 0.1, 0.2, 1.0, 5.0, 50.0, 100.0]
    for value in values:
        histogram.observe(value)
    buckets, total = histogram.snapshot()
    assert buckets == [("0.1", 2), ("1.0", 4), ("10.0", 5), ("+Inf", 7)]
    assert buckets[-1] == ("+Inf", len(values))
    assert total == pytest.approx(sum(values))


def test_snapshot_does_not_change_with_later_observations():
    histogram = Histogram(BOUNDS)
    histogram.observe(0.5)
    before = histogram.snapshot()
    histogram.observe(0.5)
    assert before == ([("0.1", 0), ("1.0", 1), ("10.0", 1), ("+Inf", 1)], 0.5)
    assert buckets_of(histogram)["+Inf"] == 2


def test_small_bounds_are_formatted_as_floats():
    histogram = Histogram((1e-5, 1.0))
    assert [le for le, _ in histogram.snapshot()[0]] == ["1e-05", "1.0", "+Inf"]
