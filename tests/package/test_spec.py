"""The metric spec: every declared metric obeys the naming conventions, and bad declarations are rejected."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from flare_exporter import label_values, spec


def make_spec(**overrides):
    """A valid gauge MetricSpec, with `overrides` applied."""
    fields = {"name": "flare_test_value", "type": spec.GAUGE, "unit": "", "help": "A test metric."}
    fields.update(overrides)
    return spec.MetricSpec(**fields)


@pytest.mark.parametrize("metric", spec.METRICS, ids=lambda metric: metric.name)
def test_declared_metric_follows_conventions(metric):
    assert metric.name.startswith("flare_")
    assert metric.help.strip()
    assert (metric.type == spec.COUNTER) == metric.name.endswith("_total")
    assert (metric.type == spec.INFO) == metric.name.endswith("_info")
    if metric.unit:
        assert metric.name.removesuffix("_total").endswith("_" + metric.unit)
    assert not set(metric.labels) & set(spec.COMMON_LABELS)
    assert len(set(metric.labels)) == len(metric.labels)
    if metric.type == spec.HISTOGRAM:
        assert list(metric.buckets) == sorted(set(metric.buckets))
    else:
        assert metric.buckets == ()


def test_metric_names_are_unique_and_indexed():
    names = [metric.name for metric in spec.METRICS]
    assert len(names) == len(set(names))
    assert set(spec.BY_NAME) == set(names)


def test_valid_spec_is_accepted():
    assert make_spec().name == "flare_test_value"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"name": "test_value"}, "flare_"),
        ({"name": "flare_things", "type": spec.COUNTER}, "_total"),
        ({"name": "flare_things_total"}, "_total"),  # a gauge must not end in _total
        ({"name": "flare_wait_milliseconds", "unit": "seconds"}, "_seconds"),
        ({"name": "flare_wait_seconds", "unit": "bytes"}, "_bytes"),
        ({"name": "flare_wait_seconds", "unit": "minutes"}, "unknown unit"),
        ({"type": "summary"}, "unknown type"),
        ({"name": "flare_thing", "type": spec.INFO}, "_info"),
        ({"type": spec.HISTOGRAM}, "buckets"),  # a histogram without buckets
        ({"buckets": (1.0, 2.0)}, "buckets"),  # a gauge with buckets
        ({"type": spec.HISTOGRAM, "buckets": (1.0, 0.5, 2.0)}, "strictly increasing"),
        ({"type": spec.HISTOGRAM, "buckets": (1.0, 1.0, 2.0)}, "strictly increasing"),
        ({"labels": ("rank",)}, "common labels"),
        ({"labels": ("group", "run")}, "common labels"),
    ],
)
def test_bad_spec_is_rejected(overrides, problem):
    with pytest.raises(ValueError, match=problem) as raised:
        make_spec(**overrides)
    assert "metric " + overrides.get("name", "flare_test_value") in str(raised.value)


def test_counter_with_unit_keeps_unit_before_total():
    metric = make_spec(name="flare_sent_bytes_total", type=spec.COUNTER, unit="bytes")
    assert metric.unit == "bytes"


@pytest.mark.parametrize(
    ("lowest", "highest", "per_decade"), [(1e-5, 100.0, 2), (1e-3, 1000.0, 2), (1.0, 1e4, 5)]
)
def test_log_buckets_are_log_spaced_and_cover_the_range(lowest, highest, per_decade):
    bounds = label_values.log_buckets(lowest, highest, per_decade)
    assert bounds[0] == pytest.approx(lowest)
    assert bounds[-1] == pytest.approx(highest)
    assert all(low < high for low, high in pairwise(bounds))
    assert len(bounds) == round(math.log10(highest / lowest) * per_decade) + 1
    step = 10 ** (1 / per_decade)
    for low, high in pairwise(bounds):
        assert high / low == pytest.approx(step, rel=0.01)


def test_spec_bucket_constants():
    assert len(label_values.COLLECTIVE_DURATION_BUCKETS) == 15
    assert label_values.COLLECTIVE_DURATION_BUCKETS[0] == pytest.approx(1e-5)
    assert label_values.COLLECTIVE_DURATION_BUCKETS[-1] == pytest.approx(100.0)
    assert len(label_values.STEP_DURATION_BUCKETS) == 13


def test_exposed_series_names_of_a_histogram():
    histogram = spec.BY_NAME["flare_collective_duration_seconds"]
    assert spec.exposed_series_names(histogram) == (
        "flare_collective_duration_seconds_bucket",
        "flare_collective_duration_seconds_sum",
        "flare_collective_duration_seconds_count",
    )


def test_all_series_names():
    names = spec.all_series_names()
    for metric in spec.METRICS:
        if metric.type == spec.HISTOGRAM:
            assert {metric.name + suffix for suffix in ("_bucket", "_sum", "_count")} <= names
            assert metric.name not in names
        else:
            assert metric.name in names
    histograms = sum(metric.type == spec.HISTOGRAM for metric in spec.METRICS)
    assert len(names) == len(spec.METRICS) + 2 * histograms


def test_series_and_histogram_look_names_up_in_the_spec():
    assert spec.series("flare_rank_info") == "flare_rank_info"
    assert spec.series("flare_collective_duration_seconds_sum") == "flare_collective_duration_seconds_sum"
    assert spec.histogram("flare_collective_duration_seconds") == "flare_collective_duration_seconds"
    with pytest.raises(ValueError, match="flare_rank_infos"):
        spec.series("flare_rank_infos")
    with pytest.raises(ValueError, match="flare_rank_info is no histogram"):
        spec.histogram("flare_rank_info")
    with pytest.raises(ValueError):
        spec.series("flare_collective_duration_seconds")  # a histogram exposes _bucket, _sum and _count
