"""Scrape ranks' /metrics directly, with prometheus_client's own parser; no Prometheus needed."""

from __future__ import annotations

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class ScrapeError(RuntimeError):
    """A target could not be scraped or parsed; the message names the target and the reason."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str, target: str = "") -> list[Sample]:
    """Samples of a Prometheus text exposition; ScrapeError if it is malformed."""
    try:
        return [
            Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except (ValueError, TypeError, IndexError, KeyError) as error:
        raise ScrapeError(f"{target or 'exposition'}: malformed exposition ({error})") from None


def fetch(target: str, timeout: float = 5.0) -> str:
    """The text at http://target/metrics (target is host:port)."""
    url = target if "://" in target else f"http://{target}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return str(response.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        raise ScrapeError(f"{target}: cannot scrape ({getattr(error, 'reason', error)})") from None
    except UnicodeDecodeError:
        raise ScrapeError(f"{target}: exposition is not UTF-8") from None


def scrape(target: str, timeout: float = 5.0) -> list[Sample]:
    return parse(fetch(target, timeout), target)


def scrape_all(
    targets: list[str], timeout: float = 5.0, workers: int = 64
) -> dict[str, list[Sample] | ScrapeError]:
    """Scrape every target concurrently; each maps to its samples or to the ScrapeError it raised."""

    def one(target: str) -> list[Sample] | ScrapeError:
        try:
            return scrape(target, timeout)
        except ScrapeError as error:
            return error

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers, len(targets))) as pool:
        return dict(zip(targets, pool.map(one, targets), strict=True))


def labels_of(samples: list[Sample], name: str) -> dict[str, str]:
    """The labels of the first sample named `name` (e.g. flare_rank_info), or {} if there is none."""
    return next((sample.labels for sample in samples if sample.name == name), {})


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample named `name` whose labels include `labels`."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None
