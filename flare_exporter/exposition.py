"""The scrape path: run every collector safely, add per-collector meta-metrics, serve /metrics.

The endpoint serves GET /metrics and GET /healthz and nothing else (404; other methods 405): nothing on a
rank can be triggered, dumped or run over HTTP. With a web config file (web_config.py) it speaks TLS,
optionally requires verified client certificates, and requires basic auth on every path.
"""

from __future__ import annotations

import errno
import gzip
import logging
import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from . import web_config
from .collectors import Collector, Families
from .health import ExporterHealth
from .web_config import BasicAuth, WebConfig, WebConfigError

log = logging.getLogger("flare_exporter")


class FlareCollector:
    """Runs each collector on every scrape; a failing collector is reported, never fails the scrape."""

    def __init__(self, collectors: Sequence[Collector], common_values: Any, health: ExporterHealth) -> None:
        seen: dict[str, str] = {}
        for collector in collectors:
            for name in collector.metrics:
                if name in seen:
                    raise ValueError(f"metric {name} is exported by both {seen[name]} and {collector.name}")
                seen[name] = collector.name
        self.collectors = list(collectors)
        self.common_values = common_values  # callable returning (rank, run): the identity can change
        self.health = health

    def describe(self) -> Iterable[Metric]:
        families = Families(("", ""))
        names = [name for collector in self.collectors for name in collector.metrics]
        names += ["flare_exporter_collector_success", "flare_exporter_collector_duration_seconds"]
        return [families.new(name) for name in names]

    def collect(self) -> Iterable[Metric]:
        families = Families(self.common_values())
        success = families.new("flare_exporter_collector_success")
        duration = families.new("flare_exporter_collector_duration_seconds")
        output: list[Metric] = []
        for collector in self.collectors:
            started = time.perf_counter()
            try:
                # all of it, or nothing; a family without samples is left out, as Go exporters do
                output.extend([family for family in collector.collect(families) if family.samples])
                ok = 1
            except Exception as error:
                self.health.error(f"collector_{collector.name}", error)
                ok = 0
            success.add_metric(families.labels(collector.name), ok)
            elapsed = round(time.perf_counter() - started, 7)  # 0.1 µs: the clock's noise is coarser
            duration.add_metric(families.labels(collector.name), elapsed)
        return output + [success, duration]


class _NotPlain(Exception):
    """A family render_text does not write itself (generate_latest does)."""


_LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z").match
_LABEL_NAMES: set[str] = set()  # label names seen to need no escaping
_PLAIN_TYPES = {"counter": ("_total", "counter"), "gauge": ("", "gauge"), "info": ("_info", "gauge")}


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _family_text(metric: Metric, output: list[str]) -> None:
    kind = metric.type
    suffix, shown = _PLAIN_TYPES.get(kind, ("", kind))
    if kind not in _PLAIN_TYPES and kind != "histogram":
        raise _NotPlain(kind)
    name = metric.name + suffix
    if not _LEGACY_NAME(name):
        raise _NotPlain(name)
    documentation = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    output.append(f"# HELP {name} {documentation}\n# TYPE {name} {shown}\n")
    for sample in metric.samples:
        if (
            sample.timestamp is not None
            or sample.exemplar is not None
            or sample.name.endswith(("_created", "_gsum", "_gcount"))
        ):
            raise _NotPlain(sample.name)
        labels = sample.labels
        if not _LABEL_NAMES.issuperset(labels):
            for key in labels:
                if not _LEGACY_NAME(key) or key.startswith("__"):
                    raise _NotPlain(key)
                _LABEL_NAMES.add(key)
        if labels:
            text = ",".join(f'{key}="{_escape_value(value)}"' for key, value in sorted(labels.items()))
            output.append(f"{sample.name}{{{text}}} {_value_text(sample.value)}\n")
        else:
            output.append(f"{sample.name} {_value_text(sample.value)}\n")


def _value_text(value: float) -> str:
    """A sample's value as Go exporters write it: 1 and 0 rather than 1.0 and 0.0 (a tenth of the lines)."""
    text = floatToGoString(value)
    return text[:-2] if text.endswith(".0") else text


def render_text(registry: CollectorRegistry) -> bytes:
    """The text format (0.0.4) of `registry`: what prometheus_client's generate_latest writes, but for
    integral values written as Go exporters write them (1, not 1.0).

    Several times faster for flare's families (no per-label name validation): the scrape path runs on the
    rank's host, beside training. A family it does not write itself (another type, a _created sample, a
    timestamp, a name that needs escaping) sends the whole registry through generate_latest.
    """
    output: list[str] = []
    try:
        for metric in registry.collect():
            _family_text(metric, output)
    except _NotPlain:
        return generate_latest(registry)
    return "".join(output).encode("utf-8")


def metrics_body(
    registry: CollectorRegistry, accept_encoding: str = ""
) -> tuple[bytes, list[tuple[str, str]]]:
    """The /metrics response body and headers: the text format, gzip-compressed if the client accepts it."""
    body = render_text(registry)
    headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)]
    if "gzip" in accept_encoding:
        body = gzip.compress(body, compresslevel=1)  # a sixth of the bytes, at a tenth of level 9's CPU
        headers.append(("Content-Encoding", "gzip"))
    return body, headers


# A connection's TLS handshake, request and response must each finish within this, so a client that
# connects and goes silent holds one thread for a while, never the endpoint.
REQUEST_TIMEOUT_SECONDS = 10.0
# Connections served at once; beyond it a connection is closed unanswered and counted as dropped, so a
# flood of connections costs the rank bounded threads and memory.
MAX_CONNECTIONS = 64


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    ssl_context: ssl.SSLContext | None = None
    health: ExporterHealth | None = None
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # replaced per server in MetricsServer

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            if self.health is not None:
                self.health.drop("http_connections")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Serve one connection on its own thread; the TLS handshake happens here, not in accept()."""
        request.settimeout(REQUEST_TIMEOUT_SECONDS)
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        try:
            secured = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError as error:  # ssl.SSLError included: a plain-HTTP client, a bad or missing cert
            if self.health is not None:
                self.health.error("http_tls_handshake", error)
            return
        try:
            super().finish_request(secured, client_address)
        finally:
            secured.close()

    def handle_error(self, request: Any, client_address: Any) -> None:  # count, never print a traceback
        if self.health is not None:
            self.health.error("http_server")


class _ThreadingServerIPv6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:  # scrapes must not flood the job's log
        pass


def make_app(
    registry: CollectorRegistry, auth: BasicAuth | None = None, headers: Mapping[str, str] | None = None
) -> Any:
    """WSGI app serving only GET /metrics and GET /healthz; nothing on a rank can be triggered over HTTP.

    With `auth`, every path answers 401 until the request carries a configured user's credentials.
    `headers` are added to every response (a web config's http_server_config.headers).
    """
    extra_headers = list((headers or {}).items())

    def app(environ: dict, start_response: Any) -> Iterable[bytes]:
        def respond(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, headers + extra_headers)

        if auth is not None and not auth.check(environ.get("HTTP_AUTHORIZATION")):
            respond("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Basic")])
            return [b"Unauthorized\n"]
        path = environ.get("PATH_INFO", "")
        if path not in ("/metrics", "/healthz"):
            respond("404 Not Found", [("Content-Type", "text/plain")])
            return [b"flare-exporter serves /metrics and /healthz only\n"]
        if environ.get("REQUEST_METHOD", "GET") != "GET":
            respond("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"flare-exporter answers GET only\n"]
        if path == "/metrics":
            body, metric_headers = metrics_body(registry, environ.get("HTTP_ACCEPT_ENCODING", ""))
            respond("200 OK", metric_headers)
            return [body]
        respond("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    return app


class MetricsServer:
    """The rank's HTTP endpoint, on a daemon thread that sleeps until a request comes.

    Unlike socketserver's serve_forever, which wakes every 0.5 s to look for a shutdown request, the
    loop blocks in select() until a connection arrives: an idle endpoint costs the host nothing, and on
    a machine with no core to spare it never preempts training. close() wakes it with a connection.
    Each connection is served on its own thread (TLS handshake included), at most MAX_CONNECTIONS at once.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        addr: str,
        port: int,
        web: WebConfig | None = None,
        ssl_context: ssl.SSLContext | None = None,
        health: ExporterHealth | None = None,
    ) -> None:
        self.addr = addr
        self.scheme = "https" if ssl_context is not None else "http"
        server_class = _ThreadingServerIPv6 if ":" in addr else _ThreadingServer
        self.auth = web.authenticator() if web is not None else None
        app = make_app(registry, self.auth, web.headers if web is not None else None)
        self._server = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
        self._server.ssl_context = ssl_context  # type: ignore[attr-defined]
        self._server.health = health  # type: ignore[attr-defined]
        self._server.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # type: ignore[attr-defined]
        self.port = self._server.server_port
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="flare-http", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            while not self._closing:
                if selector.select(timeout=None) and not self._closing:
                    self._server._handle_request_noblock()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._closing = True
        wake_host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.addr, self.addr)
        try:
            with socket.create_connection((wake_host, self.port), timeout=1):
                pass
        except OSError:  # cannot wake it: it is a daemon thread and ends with the process
            pass
        self._thread.join(timeout=2)
        self._server.server_close()


def serve(
    registry: CollectorRegistry,
    addr: str,
    port: int,
    rank: int,
    web_config_file: str = "",
    health: ExporterHealth | None = None,
) -> MetricsServer | None:
    """Start the endpoint; if it cannot be served as configured, warn once and return None.

    A taken port, an unusable address and an unusable web config file all end the same way: one warning
    line, no endpoint, training continues. An endpoint is never served with less security than its web
    config file asks for.
    """
    web, context = None, None
    if web_config_file:
        try:
            web, context = web_config.load(web_config_file)
        except WebConfigError as error:
            log.warning("flare-exporter: %s; rank %d serves no metrics, training continues", error, rank)
            return None
    try:
        return MetricsServer(registry, addr, port, web, context, health)
    except (OSError, OverflowError) as error:  # OverflowError: a port beyond 65535 (base port + local rank)
        if isinstance(error, OverflowError):
            reason = "is not a valid port"
        elif error.errno == errno.EADDRINUSE:
            reason = "is already in use"
        else:
            reason = f"cannot be bound ({error.strerror})"
        log.warning(
            "flare-exporter: port %d on %s %s; rank %d serves no metrics, training continues "
            "(set FLARE_PORT to another base port)",
            port,
            addr,
            reason,
            rank,
        )
        return None
