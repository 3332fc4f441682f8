"""Collectors: one concern per module, each turning part of FlareState into metric families."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cache, lru_cache
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from ... import spec
from ..histogram import Histogram, bucket_labels
from ..sample_lines import NotPlain, sample_prefix


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
        """An empty family of the spec's metric `name`, like the one prometheus_client built and checked
        once (its constructors check the name, unit and labels every time; a scrape makes fifty)."""
        family_class, checked, label_names = _checked(name)
        return family_class(checked, label_names)

    def labels(self, *values: str) -> list[str]:
        return [*self.common_values, *values]

    def add_histogram(self, family: Any, values: tuple[str, ...], histogram: Histogram) -> None:
        """One series of a histogram family: its lines (each bucket, _count, _sum), kept once per series,
        and this scrape's numbers."""
        counts, total = histogram.cumulative()
        lines = _histogram_lines(family.name, (*self.common_values, *values), histogram.bounds)
        family.series.append((lines, [*counts, counts[-1], total]))  # _count: the +Inf bucket's


class Lines:
    """The lines of one series: each one's sample name and labels and, where the text format can write them
    as they are, the text before its value (`prefixes`; None where a label needs prometheus_client's
    writer). Kept from one scrape to the next (_sample_lines, _histogram_lines)."""

    __slots__ = ("names", "labels", "prefixes")

    def __init__(self, names: tuple[str, ...], labels: tuple[dict[str, str], ...]) -> None:
        self.names = names
        self.labels = labels
        try:
            self.prefixes: tuple[str, ...] | None = tuple(map(sample_prefix, names, labels))
        except NotPlain:
            self.prefixes = None


class SeriesFamily(Metric):
    """A family whose series are numbers (`series`: (Lines, values) per series): the text format writes
    each line's kept prefix and its value, with no sample object built; `samples` builds
    prometheus_client's samples from them for any other reader."""

    def __init__(self, checked: Metric, label_names: tuple[str, ...]) -> None:
        """Empty, with the public attributes of `checked`, a family prometheus_client built of the same
        metric: Metric's constructor, which checks them again, is not run."""
        self.name = checked.name
        self.documentation = checked.documentation
        self.unit = checked.unit
        self.type = checked.type
        self.label_names = label_names
        self.series: list[tuple[Lines, list[float]]] = []

    @property
    def samples(self) -> list[Sample]:  # type: ignore[override]
        return [
            Sample(name, labels, value)
            for lines, values in self.series
            for name, labels, value in zip(lines.names, lines.labels, values, strict=True)
        ]

    def _add_line(self, sample_name: str, labels: Sequence[str], value: float) -> None:
        """One sample line of the series `labels` (values, in the family's label order)."""
        lines = _sample_lines(sample_name, self.label_names, tuple(labels))
        self.series.append((lines, [value]))


NO_TIMESTAMPS = "a flare family's samples carry no timestamp, created time or exemplar"


class GaugeFamily(SeriesFamily, GaugeMetricFamily):
    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        if timestamp is not None:
            raise TypeError(f"{self.name}: {NO_TIMESTAMPS}")
        self._add_line(self.name, labels, value)


class CounterFamily(SeriesFamily, CounterMetricFamily):
    def add_metric(
        self,
        labels: Sequence[str],
        value: float,
        created: float | None = None,
        timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        if created is not None or timestamp is not None or exemplar is not None:
            raise TypeError(f"{self.name}: {NO_TIMESTAMPS}")
        self._add_line(_counter_sample_name(self.name), labels, value)


class HistogramFamily(SeriesFamily, HistogramMetricFamily):
    def add_metric(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{self.name}: a histogram's series are added by Families.add_histogram")


# spec type -> (flare's family, prometheus_client's, which checks the name, unit and labels)
FAMILY_CLASSES: dict[str, tuple[type[SeriesFamily], Callable[..., Metric]]] = {
    spec.COUNTER: (CounterFamily, CounterMetricFamily),
    spec.GAUGE: (GaugeFamily, GaugeMetricFamily),
    spec.INFO: (GaugeFamily, GaugeMetricFamily),
    spec.HISTOGRAM: (HistogramFamily, HistogramMetricFamily),
}


@cache  # one entry per metric of the spec
def _checked(name: str) -> tuple[type[SeriesFamily], Metric, tuple[str, ...]]:
    """The spec's metric `name`: flare's family class, prometheus_client's family of it, its label names."""
    metric = spec.BY_NAME[name]
    family_class, checking_class = FAMILY_CLASSES[metric.type]
    label_names = _label_names(name)
    checked = checking_class(metric.name, metric.help, labels=label_names, unit=metric.unit)
    return family_class, checked, label_names


# Per series, its lines. Shared by every scrape's families, which nothing modifies; bounded like the series
# themselves (label values are bounded by the spec; a changing one, a stack's frames, is one series).
@lru_cache(maxsize=1024)
def _histogram_lines(name: str, values: tuple[str, ...], bounds: tuple[float, ...]) -> Lines:
    labels = dict(zip(_label_names(name), values, strict=True))
    names = (name + "_bucket",) * (len(bounds) + 1) + (name + "_count", name + "_sum")
    return Lines(names, (*({**labels, "le": le} for le in bucket_labels(bounds)), labels, labels))


@lru_cache(maxsize=4096)
def _sample_lines(sample_name: str, label_names: tuple[str, ...], values: tuple[str, ...]) -> Lines:
    return Lines((sample_name,), (dict(zip(label_names, values, strict=True)),))


@cache  # one entry per counter of the spec
def _counter_sample_name(name: str) -> str:
    return name + "_total"


@cache  # one entry per metric of the spec
def _label_names(name: str) -> tuple[str, ...]:
    return (*spec.COMMON_LABELS, *spec.BY_NAME[name].labels)
