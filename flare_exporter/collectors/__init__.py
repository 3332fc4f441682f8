"""Collectors: one concern per module, each turning part of FlareState into metric families."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from .. import spec
from ..histogram import Histogram, bucket_labels


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
        """An empty family of the spec's metric `name`: a copy of one built once (prometheus_client's
        constructors validate the name, unit and labels every time; a scrape makes fifty)."""
        prototype = _prototype(name)
        family = object.__new__(prototype.__class__)
        family.__dict__.update(prototype.__dict__)
        family.samples = []
        return family

    def labels(self, *values: str) -> list[str]:
        return [*self.common_values, *values]

    def add_histogram(self, family: Any, values: tuple[str, ...], histogram: Histogram) -> None:
        """One series of a histogram family (a HistogramFamily): its lines (each bucket, _count, _sum) kept
        once per series, and this scrape's numbers."""
        counts, total = histogram.cumulative()
        lines = _histogram_lines(family.name, (*self.common_values, *values), histogram.bounds)
        family.series.append((lines, [*counts, counts[-1], total]))  # _count: the +Inf bucket's


class HistogramLines:
    """The lines of one histogram series: each one's sample name and labels and, where the text format can
    write them as they are, the text before its value (`prefixes`; None where a label needs
    prometheus_client's writer)."""

    __slots__ = ("names", "labels", "prefixes")

    def __init__(self, name: str, labels: dict[str, str], bounds: tuple[float, ...]) -> None:
        from ..exposition import NotPlain, sample_prefix  # the exposition module imports this one

        bucket, count, total = _histogram_sample_names(name)
        self.names = (bucket,) * (len(bounds) + 1) + (count, total)
        self.labels = (*({**labels, "le": le} for le in bucket_labels(bounds)), labels, labels)
        try:
            self.prefixes: tuple[str, ...] | None = tuple(map(sample_prefix, self.names, self.labels))
        except NotPlain:
            self.prefixes = None


class HistogramFamily(HistogramMetricFamily):
    """A histogram family whose series are numbers (`series`: (HistogramLines, values) per series, added by
    Families.add_histogram): the text format writes each line's kept prefix and value, with no sample
    object built; `samples` builds prometheus_client's samples from them for any other reader."""

    series: list[tuple[HistogramLines, list[float]]]

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        return [
            Sample(name, labels, value)
            for lines, values in self.series
            for name, labels, value in zip(lines.names, lines.labels, values, strict=True)
        ]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        if samples:
            raise TypeError("a HistogramFamily's series are added by Families.add_histogram")
        self.series = []

    def add_metric(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a HistogramFamily's series are added by Families.add_histogram")


class _CounterFamily(CounterMetricFamily):
    """prometheus_client's counter family, its samples named by the same str object at every scrape."""

    def add_metric(
        self,
        labels: Sequence[str],
        value: float,
        created: float | None = None,
        timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        if created is not None:
            super().add_metric(labels, value, created, timestamp, exemplar)
            return
        name = _counter_sample_name(self.name)
        labels_dict = dict(zip(self._labelnames, labels, strict=True))
        self.samples.append(Sample(name, labels_dict, value, timestamp, exemplar))


@cache  # one entry per metric of the spec
def _prototype(name: str) -> Metric:
    metric = spec.BY_NAME[name]
    family_class = {
        spec.COUNTER: _CounterFamily,
        spec.GAUGE: GaugeMetricFamily,
        spec.INFO: GaugeMetricFamily,
        spec.HISTOGRAM: HistogramFamily,
    }[metric.type]
    return family_class(metric.name, metric.help, labels=_label_names(name), unit=metric.unit)


# Per histogram series, its lines. Shared by every scrape's families, which nothing modifies; bounded like
# the series themselves (label values are bounded by the spec).
@lru_cache(maxsize=1024)
def _histogram_lines(name: str, values: tuple[str, ...], bounds: tuple[float, ...]) -> HistogramLines:
    return HistogramLines(name, dict(zip(_label_names(name), values, strict=True)), bounds)


# A scrape's sample names and label values are the same str objects from one scrape to the next wherever
# they can be: the C++ text format keeps each sample's formatted labels by their identity.
@cache  # one entry per histogram of the spec
def _histogram_sample_names(name: str) -> tuple[str, str, str]:
    return name + "_bucket", name + "_count", name + "_sum"


@cache  # one entry per counter of the spec
def _counter_sample_name(name: str) -> str:
    return name + "_total"


@lru_cache(maxsize=256)
def number_label(number: int) -> str:
    """`str(number)` as a label value, the same str object at every scrape."""
    return str(number)


@cache  # one entry per metric of the spec
def _label_names(name: str) -> tuple[str, ...]:
    return (*spec.COMMON_LABELS, *spec.BY_NAME[name].labels)
