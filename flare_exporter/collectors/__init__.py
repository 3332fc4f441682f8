"""Collectors: one concern per module, each turning part of FlareState into metric families."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from .. import spec
from ..histogram import Histogram


class Collector(Protocol):
    """A collector: a name, the spec metrics it exports, and a collect() that builds them."""

    @property
    def name(self) -> str: ...

    @property
    def metrics(self) -> Sequence[str]: ...

    def collect(self, families: Families) -> Iterable[Metric]: ...


class Families:
    """Builds metric families from the spec, with the rank's constant labels (rank, run) first."""

    def __init__(self, common_values: tuple[str, str]) -> None:
        self.common_values = common_values

    def new(self, name: str) -> Any:
        metric = spec.BY_NAME[name]
        labels = list(spec.COMMON_LABELS) + list(metric.labels)
        family_class = {
            spec.COUNTER: CounterMetricFamily,
            spec.GAUGE: GaugeMetricFamily,
            spec.INFO: GaugeMetricFamily,
            spec.HISTOGRAM: HistogramMetricFamily,
        }[metric.type]
        return family_class(metric.name, metric.help, labels=labels, unit=metric.unit)

    def labels(self, *values: str) -> list[str]:
        return [*self.common_values, *values]

    def add_histogram(self, family: Any, values: tuple[str, ...], histogram: Histogram) -> None:
        """The samples HistogramMetricFamily.add_metric adds (each bucket, _count, _sum), built with less
        work per bucket: a scrape adds hundreds of buckets."""
        buckets, total = histogram.snapshot()
        name = family.name
        labels = dict(zip(_label_names(name), self.labels(*values), strict=True))
        bucket = name + "_bucket"
        family.samples.extend([Sample(bucket, {**labels, "le": le}, count) for le, count in buckets])
        family.samples.append(Sample(name + "_count", labels, buckets[-1][1]))
        family.samples.append(Sample(name + "_sum", dict(labels), total))


@cache  # one entry per metric of the spec
def _label_names(name: str) -> tuple[str, ...]:
    return (*spec.COMMON_LABELS, *spec.BY_NAME[name].labels)
