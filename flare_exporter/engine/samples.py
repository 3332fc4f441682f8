"""Samples of a rank's /metrics: the text format parsed, and the lookups the engine makes in them."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import NamedTuple


class ScrapeError(RuntimeError):
    """A target could not be scraped or parsed; the message names the target and the reason."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


# A rank's exposition is tens of KiB; anything this large is not one, and is not read further.
MAX_EXPOSITION_BYTES = 64 * 1024 * 1024


# One sample line exactly as exporters write it (flare's included): name, labels, value, optional timestamp.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\n"])*"'
_SAMPLE_LINE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{({_LABEL}(?:,{_LABEL})*)\}})?"
    r" ([+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|Inf|NaN))(?: -?[0-9]+)?"
)
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\n"])*)"')
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TYPE_LINE = re.compile(r"# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (?:counter|gauge|histogram|untyped)")
_ESCAPED = re.compile(r'\\[\\n"]')
_UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _parse_plain(text: str, wanted: Collection[str] | None = None) -> list[Sample] | None:
    """The samples of a well-formed text exposition, line by line; None at the first line that is not
    exactly one (prometheus_client's parser then decides). Several times faster: a direct scrape parses
    every rank of the job. With `wanted`, lines of other sample names are skipped unread."""
    samples = []
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            if line.startswith("# HELP ") or _TYPE_LINE.fullmatch(line):
                continue
            return None
        if wanted is not None:
            name = line[: line.find("{")] if "{" in line else line.split(" ", 1)[0]
            if name not in wanted and _METRIC_NAME.fullmatch(name):
                continue
        match = _SAMPLE_LINE.fullmatch(line)
        if match is None:
            return None
        name, label_text, value = match.groups()
        labels = {}
        if label_text:
            pairs = _LABEL_PAIR.findall(label_text)
            if "\\" in label_text:
                pairs = [(key, _ESCAPED.sub(lambda m: _UNESCAPE[m.group(0)], raw)) for key, raw in pairs]
            labels = dict(pairs)
            if len(labels) != len(pairs):
                return None  # a label given twice
        samples.append(Sample(name, labels, float(value)))
    return samples


def parse(text: str, target: str = "", wanted: Collection[str] | None = None) -> list[Sample]:
    """Samples of a Prometheus text exposition; ScrapeError (and nothing else) if it is malformed.

    `wanted`: the sample names the caller reads (None: all); the others may be left out."""
    if text.endswith("\n"):  # a complete exposition; a cut one goes to the careful parser
        fast = _parse_plain(text, wanted)
        if fast is not None:
            return fast
    # here, not at the top: only what the line parser cannot read comes here, and the import is slow
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [
            Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if wanted is None or sample.name in wanted
        ]
    except Exception as error:  # the parser's errors are not all ValueError; no input may crash the CLI
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise ScrapeError(f"{target or 'exposition'}: malformed exposition ({reason})") from None


def labels_of(samples: list[Sample], name: str) -> dict[str, str]:
    """The labels of the first sample named `name` (e.g. flare_rank_info), or {} if there is none."""
    return next((sample.labels for sample in samples if sample.name == name), {})


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample named `name` whose labels include `labels`."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None
