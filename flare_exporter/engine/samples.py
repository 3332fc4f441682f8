"""Samples of a rank's /metrics: the text format parsed, and the lookups the engine makes in them."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, NamedTuple


class ScrapeError(RuntimeError):
    """A target could not be scraped or parsed; the message names the target and the reason."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


# A rank's exposition is tens of KiB; anything this large is not one, and is not read further.
MAX_EXPOSITION_BYTES = 64 * 1024 * 1024


# One sample line exactly as exporters write it (flare's included): name, labels, value, optional timestamp.
# A label value is runs of plain characters between escapes: unrolled so, `re` reads it a third faster than
# with one alternation per character, and a direct scrape of thousands of ranks is mostly label values.
_LABEL_VALUE = r'[^"\\\n]*(?:\\[\\n"][^"\\\n]*)*'
_LABEL = rf'[a-zA-Z_][a-zA-Z0-9_]*="{_LABEL_VALUE}"'
_SAMPLE_LINE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{({_LABEL}(?:,{_LABEL})*)\}})?"
    r" ([+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|Inf|NaN))(?: -?[0-9]+)?"
)
_LABEL_PAIR = re.compile(rf'([a-zA-Z_][a-zA-Z0-9_]*)="({_LABEL_VALUE})"')
_ESCAPED = re.compile(r'\\[\\n"]')
_UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


# Every line of a text at once, anchored at line ends: a sample line (its name, labels and value captured), or
# a HELP line, a TYPE line of the four types or an empty line (nothing captured). After the text's last
# newline, the pattern matches the empty string once more.
_LINES = re.compile(
    rf"^(?:{_SAMPLE_LINE.pattern}"
    r"|# HELP [^\n]*|# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (?:counter|gauge|histogram|untyped)|)$",
    re.MULTILINE,
)


def _parse_plain(text: str, wanted: Collection[str] | None = None) -> list[Sample] | None:
    """The samples of a well-formed text exposition (ending in a newline); None where any line is not
    exactly a sample, a HELP or TYPE line or empty (prometheus_client's parser then decides). Several times
    faster: a direct scrape parses every rank of the job. One pattern finds every line it knows in the
    whole text at once, and it must find them all. With `wanted`, samples of other names are left out."""
    lines = _LINES.findall(text)
    if len(lines) != text.count("\n") + 1:
        return None
    samples = []
    read: dict[str, dict[str, str] | None] = {"": {}}  # a page repeats its label texts: each is read once
    for name, label_text, value in lines:
        if not name or (wanted is not None and name not in wanted):
            continue
        labels = read.get(label_text, _UNREAD)
        if labels is _UNREAD:
            labels = read[label_text] = _labels(label_text)
        if labels is None:
            return None
        samples.append(Sample(name, labels, float(value)))
    return samples


_UNREAD: dict[str, str] = {}


def _labels(label_text: str) -> dict[str, str] | None:
    """The labels of a sample line's `{...}` text (already matched as well-formed); None if one is given
    twice. Without an escape, every quote in the text delimits a value: splitting at them is twice as
    fast as the pattern."""
    if "\\" in label_text:
        pairs: list[Any] = [
            (key, _ESCAPED.sub(lambda m: _UNESCAPE[m.group(0)], raw))
            for key, raw in _LABEL_PAIR.findall(label_text)
        ]
    else:
        pairs = [pair.split('="', 1) for pair in label_text[:-1].split('",')]
    labels = dict(pairs)
    return labels if len(labels) == len(pairs) else None


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
