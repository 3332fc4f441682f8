"""HTTP GETs of ranks' /metrics on one event loop: scrape.fetch and scrape.scrape_all.

One thread for every rank of a direct scrape: asyncio streams, an HTTP/1.0 GET each (the rank answers with
Content-Length or closes at the end; never chunked), TLS and basic auth as the Client says, each exchange
within its timeout. Imported only when a command scrapes: asyncio is 30 ms of start-up.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import urllib.parse
from collections.abc import Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, TypeVar

from .rank_auth import Client
from .samples import MAX_EXPOSITION_BYTES, Sample, ScrapeError, parse

READ_BYTES = 65536
ACCEPT = "text/plain;version=0.0.4"  # the text format; flare's endpoint and Prometheus's clients serve it
T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """`coroutine`'s result, on an event loop of its own: on this thread, or, where this thread already runs
    one (a notebook, an asyncio program calling flare), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def scrape_all(
    targets: list[str], timeout: float, workers: int, via: Client, wanted: Collection[str] | None
) -> dict[str, list[Sample] | ScrapeError]:
    """scrape.scrape_all's answer: every target at most `workers` at once, each parsed as it comes."""
    slots = asyncio.Semaphore(max(1, workers))

    async def one(target: str) -> list[Sample] | ScrapeError:
        async with slots:
            try:
                return parse(await fetch_text(target, timeout, via, wanted or ()), target, wanted)
            except ScrapeError as error:
                return error

    return dict(zip(targets, await asyncio.gather(*(one(target) for target in targets)), strict=True))


async def fetch_text(target: str, timeout: float, via: Client, names: Collection[str]) -> str:
    """scrape.fetch, on the running event loop: one HTTP/1.0 GET (no chunked answer; the rank closes
    after it)."""
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


async def _exchange(host: str, port: int, path: str, via: Client, context: ssl.SSLContext | None) -> bytes:
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
