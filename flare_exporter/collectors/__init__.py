"""Collectors: one concern per module, each turning part of FlareState into metric families."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

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
        buckets, total = histogram.snapshot()
        family.add_metric(self.labels(*values), buckets=buckets, sum_value=total)
