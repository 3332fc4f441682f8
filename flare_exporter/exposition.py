"""The scrape path: run every collector safely, add per-collector meta-metrics, serve /metrics."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric

from .collectors import Collector, Families
from .health import ExporterHealth

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
                output.extend(list(collector.collect(families)))  # all of it, or nothing
                ok = 1
            except Exception as error:
                self.health.error(f"collector_{collector.name}", error)
                ok = 0
            success.add_metric(families.labels(collector.name), ok)
            duration.add_metric(families.labels(collector.name), time.perf_counter() - started)
        return output + [success, duration]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingServerIPv6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes must not flood the job's log
        pass


def make_app(registry: CollectorRegistry) -> Any:
    """WSGI app serving only /metrics and /healthz; nothing on a rank can be triggered over HTTP."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"flare-exporter serves /metrics and /healthz only\n"]

    return app


class MetricsServer:
    """The rank's HTTP endpoint, on a daemon thread that sleeps until a request comes.

    Unlike socketserver's serve_forever, which wakes every 0.5 s to look for a shutdown request, the
    loop blocks in select() until a connection arrives: an idle endpoint costs the host nothing, and on
    a machine with no core to spare it never preempts training. close() wakes it with a connection.
    """

    def __init__(self, registry: CollectorRegistry, addr: str, port: int) -> None:
        self.addr = addr
        server_class = _ThreadingServerIPv6 if ":" in addr else _ThreadingServer
        self._server = make_server(addr, port, make_app(registry), server_class, handler_class=_QuietHandler)
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


def serve(registry: CollectorRegistry, addr: str, port: int, rank: int) -> MetricsServer | None:
    """Start the endpoint; if the port is taken or the address unusable, warn and return None."""
    try:
        return MetricsServer(registry, addr, port)
    except OSError as error:
        reason = (
            "is already in use" if error.errno == errno.EADDRINUSE else f"cannot be bound ({error.strerror})"
        )
        log.warning(
            "flare-exporter: port %d on %s %s; rank %d serves no metrics, training continues "
            "(set FLARE_PORT to another base port)",
            port,
            addr,
            reason,
            rank,
        )
        return None
