"""Scrape ranks' /metrics directly, many at once; no Prometheus needed.

Well-formed lines are read by a strict line parser; anything else goes to prometheus_client's own parser.

Ranks secured by a web config file are scraped over https (a CA file to verify them, a client certificate
if they require one) with basic auth: see `Client`.
"""

from __future__ import annotations

import base64
import re
import ssl
from collections.abc import Collection
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Client:
    """How to reach ranks: scheme, TLS context (CA, client certificate) and basic auth credentials."""

    scheme: str = "http"
    ssl_context: ssl.SSLContext | None = None
    username: str = ""
    password: str = ""

    def headers(self) -> dict[str, str]:
        if not self.username:
            return {}
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode("ascii")
        return {"Authorization": "Basic " + token}


def client(
    scheme: str = "http",
    ca_file: str = "",
    cert_file: str = "",
    key_file: str = "",
    username: str = "",
    password: str = "",
) -> Client:
    """A Client; ScrapeError naming the file if a CA or client certificate cannot be loaded."""
    context = None
    if scheme == "https":
        try:
            context = ssl.create_default_context(cafile=ca_file or None)
        except (OSError, ssl.SSLError) as error:
            raise ScrapeError(f"CA file {ca_file}: cannot load it ({error})") from None
        if cert_file:
            try:
                context.load_cert_chain(cert_file, key_file or None)
            except (OSError, ssl.SSLError) as error:
                raise ScrapeError(f"client certificate {cert_file}: cannot load it ({error})") from None
    elif scheme != "http":
        raise ScrapeError(f"scheme {scheme!r}: expected http or https")
    return Client(scheme, context, username, password)


def fetch(target: str, timeout: float = 5.0, via: Client | None = None, names: Collection[str] = ()) -> str:
    """The text at <scheme>://target/metrics (target is host:port, or a URL), within `timeout` seconds, of
    only the samples `names` names where the rank serves them alone (`name[]`, as Prometheus's client
    libraries do; flare's endpoint does) and of every sample where it does not."""
    from . import rank_client  # here: asyncio's import is 30 ms of a command that may not scrape

    return rank_client.run(rank_client.fetch_text(target, timeout, via or Client(), names))


def scrape(
    target: str, timeout: float = 5.0, via: Client | None = None, wanted: Collection[str] | None = None
) -> list[Sample]:
    """The samples at `target`; with `wanted`, only those named in it, asked of the rank alone (see fetch)."""
    return parse(fetch(target, timeout, via, wanted or ()), target, wanted)


def scrape_all(
    targets: list[str],
    timeout: float = 5.0,
    workers: int = 64,
    via: Client | None = None,
    wanted: Collection[str] | None = None,
) -> dict[str, list[Sample] | ScrapeError]:
    """Scrape every target concurrently, at most `workers` at once, each within `timeout`; each maps to its
    samples (those `wanted`, see scrape) or to the ScrapeError it raised. One thread, one event loop
    (rank_client): threads with urllib cost 2 ms of CPU a rank, mostly in the interpreter's lock and
    urllib's layers; this, under 1 ms with the parse."""
    if not targets:
        return {}
    from . import rank_client

    return rank_client.run(rank_client.scrape_all(targets, timeout, workers, via or Client(), wanted))


def labels_of(samples: list[Sample], name: str) -> dict[str, str]:
    """The labels of the first sample named `name` (e.g. flare_rank_info), or {} if there is none."""
    return next((sample.labels for sample in samples if sample.name == name), {})


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample named `name` whose labels include `labels`."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None
