"""Scrape ranks' /metrics directly, many at once; no Prometheus needed.

Well-formed lines are read by a strict line parser; anything else goes to prometheus_client's own parser.

Ranks secured by a web config file are scraped over https (a CA file to verify them, a client certificate
if they require one) with basic auth: see `Client`.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import ssl
import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple


class ScrapeError(RuntimeError):
    """A target could not be scraped or parsed; the message names the target and the reason."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


# A rank's exposition is tens of KiB; anything this large is not one, and is not read further.
MAX_EXPOSITION_BYTES = 64 * 1024 * 1024
READ_BYTES = 65536
ACCEPT = "text/plain;version=0.0.4"  # the text format; flare's endpoint and Prometheus's clients serve it


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
            for key, raw in pairs:
                labels[key] = _ESCAPED.sub(lambda m: _UNESCAPE[m.group(0)], raw) if "\\" in raw else raw
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
    return asyncio.run(_fetch_text(target, timeout, via or Client(), names))


async def _fetch_text(target: str, timeout: float, via: Client, names: Collection[str]) -> str:
    """fetch, on the running event loop: one HTTP/1.0 GET (no chunked answer; the rank closes after it)."""
    scheme, host, port, path = _address(target, via.scheme)
    if names:
        path += ("&" if "?" in path else "?") + _names_query(frozenset(names))
    context = (via.ssl_context or ssl.create_default_context()) if scheme == "https" else None
    try:
        body = await asyncio.wait_for(_exchange(host, port, path, via, context), timeout)
    except ScrapeError as error:
        raise ScrapeError(f"{target}: {error}") from None
    except asyncio.TimeoutError:
        raise ScrapeError(f"{target}: cannot scrape (timed out)") from None
    except (OSError, EOFError, ValueError) as error:  # refused, reset, TLS (ssl.SSLError is an OSError)
        raise ScrapeError(f"{target}: cannot scrape ({_reason(error)})") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError(f"{target}: exposition is not UTF-8") from None


def _address(target: str, scheme: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path and query) of a target: host:port (its /metrics), [v6 address]:port, or
    a URL; ScrapeError if it names no port."""
    url = urllib.parse.urlsplit(target if "://" in target else f"{scheme}://{target}/metrics")
    try:
        port = url.port or {"http": 80, "https": 443}[url.scheme]
    except (ValueError, KeyError):
        raise ScrapeError(f"{target}: not a host:port or an http(s) URL") from None
    if not url.hostname:
        raise ScrapeError(f"{target}: not a host:port or an http(s) URL")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return url.scheme, url.hostname, port, path


async def _exchange(
    host: str, port: int, path: str, via: Client, context: ssl.SSLContext | None
) -> bytes:
    """The response body of GET `path`; ScrapeError (without the target) for an answer that is not a whole
    exposition."""
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if context else None
    )
    try:
        named = f"[{host}]" if ":" in host else host
        headers = "".join(f"{key}: {value}\r\n" for key, value in via.headers().items())
        writer.write(
            f"GET {path} HTTP/1.0\r\nHost: {named}:{port}\r\nAccept: {ACCEPT}\r\n"
            f"Connection: close\r\n{headers}\r\n".encode("latin-1")
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise ScrapeError("cannot scrape (response head too large)") from None
        except asyncio.IncompleteReadError:
            raise ScrapeError("cannot scrape (connection closed before a response)") from None
        status, _, fields = head.decode("latin-1").partition("\r\n")
        parts = status.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ScrapeError(f"cannot scrape (not an HTTP response: {status[:80]!r})")
        if parts[1] != "200":
            raise ScrapeError(f"cannot scrape (HTTP {' '.join(parts[1:])[:80]})")
        lines = (line.partition(":") for line in fields.split("\r\n") if line)
        header = {name.strip().lower(): value.strip() for name, _, value in lines}
        if "chunked" in header.get("transfer-encoding", "").lower():
            raise ScrapeError("cannot scrape (a chunked answer to an HTTP/1.0 request)")
        return await _read_body(reader, header.get("content-length"))
    finally:
        writer.close()


async def _read_body(reader: asyncio.StreamReader, length: str | None) -> bytes:
    """The body: Content-Length bytes if the head gives it (fewer: truncated), else up to the end."""
    if length is not None:
        expected = int(length)
        if expected > MAX_EXPOSITION_BYTES:
            raise ScrapeError(f"exposition larger than {MAX_EXPOSITION_BYTES} bytes, not read")
        try:
            return await reader.readexactly(expected)
        except asyncio.IncompleteReadError as error:
            missing = expected - len(error.partial)
            raise ScrapeError(f"cannot scrape (truncated response: {missing} bytes missing)") from None
    chunks, size = [], 0
    while chunk := await reader.read(READ_BYTES):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_EXPOSITION_BYTES:
            raise ScrapeError(f"exposition larger than {MAX_EXPOSITION_BYTES} bytes, not read")
    return b"".join(chunks)


def _reason(error: BaseException) -> str:
    """An OSError's reason as the system says it (`Connection refused`), else its text."""
    if isinstance(error, OSError) and error.strerror and not isinstance(error, ssl.SSLError):
        if error.errno and error.errno > 0:  # asyncio says `Connect call failed (address)`
            return f"[Errno {error.errno}] {os.strerror(error.errno)}"
        return error.strerror
    return str(error) or type(error).__name__


@lru_cache(maxsize=8)
def _names_query(names: frozenset[str]) -> str:
    """`name[]=a&name[]=b...`, once per set of names: quoting them cost more than the rest of a request."""
    return urllib.parse.urlencode([("name[]", name) for name in sorted(names)])


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
    samples (those `wanted`, see scrape) or to the ScrapeError it raised. One thread, one event loop:
    threads with urllib cost 2 ms of CPU a rank, mostly in the interpreter's lock and urllib's layers;
    this, under 1 ms with the parse."""
    client = via or Client()

    async def everything() -> list[list[Sample] | ScrapeError]:
        slots = asyncio.Semaphore(max(1, workers))

        async def one(target: str) -> list[Sample] | ScrapeError:
            async with slots:
                try:
                    return parse(await _fetch_text(target, timeout, client, wanted or ()), target, wanted)
                except ScrapeError as error:
                    return error

        return await asyncio.gather(*(one(target) for target in targets))

    if not targets:
        return {}
    return dict(zip(targets, asyncio.run(everything()), strict=True))


def labels_of(samples: list[Sample], name: str) -> dict[str, str]:
    """The labels of the first sample named `name` (e.g. flare_rank_info), or {} if there is none."""
    return next((sample.labels for sample in samples if sample.name == name), {})


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample named `name` whose labels include `labels`."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None
