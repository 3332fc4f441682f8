"""The scrape path: run every collector safely, add per-collector meta-metrics, serve /metrics.

The endpoint serves GET /metrics and GET /healthz and nothing else (404; other methods 405): nothing on a
rank can be triggered, dumped or run over HTTP. With a web config file (web_config.py) it speaks TLS,
optionally requires verified client certificates, and requires basic auth on every path.
"""

from __future__ import annotations

import errno
import gzip
import json
import logging
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cache, lru_cache, partial
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from .. import label_values
from . import web_config
from .collectors import Collector, Families
from .exporter_health import ExporterHealth
from .http_server import HttpServer, Response
from .last_word import ScrapeTimes
from .sample_lines import NotPlain, is_legacy_name, sample_prefix
from .web_config import BasicAuth, WebConfig, WebConfigError

log = logging.getLogger("flare_exporter")


class FlareCollector:
    """Runs each collector on every scrape; a failing collector is reported, never fails the scrape.

    `prepare`, if given, runs once at the start of each scrape, before the collectors (the timing manager's
    drain, which every collector's state waits for), its failure reported under `prepare_component`.
    """

    def __init__(
        self,
        collectors: Sequence[Collector],
        common_values: Any,
        health: ExporterHealth,
        prepare: Callable[[], None] | None = None,
        prepare_component: str = "",
    ) -> None:
        seen: dict[str, str] = {}
        for collector in collectors:
            for name in collector.metrics:
                if name in seen:
                    raise ValueError(f"metric {name} is exported by both {seen[name]} and {collector.name}")
                seen[name] = collector.name
        self.collectors = list(collectors)
        self.common_values = common_values  # callable returning (rank, run): the identity can change
        self.health = health
        self.prepare = prepare
        self.prepare_component = prepare_component

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
        if self.prepare is not None:
            try:
                self.prepare()
            except Exception as error:  # the collectors show what they have
                self.health.error(self.prepare_component, error)
        for collector in self.collectors:
            started = time.perf_counter()
            try:
                # all of it, or nothing; a family without samples is left out, as Go exporters do
                output.extend([family for family in collector.collect(families) if _has_samples(family)])
                ok = 1
            except Exception as error:
                self.health.error(f"collector_{collector.name}", error)
                ok = 0
            success.add_metric(families.labels(collector.name), ok)
            elapsed = round(time.perf_counter() - started, 7)  # 0.1 µs: the clock's noise is coarser
            duration.add_metric(families.labels(collector.name), elapsed)
        return output + [success, duration]


def _has_samples(family: Metric) -> bool:
    series = getattr(family, "series", None)  # a SeriesFamily's, whose samples are built when read
    return bool(series) if series is not None else bool(family.samples)


_PLAIN_TYPES = {"counter": ("_total", "counter"), "gauge": ("", "gauge"), "info": ("_info", "gauge")}


def _family_text(metric: Metric, output: list[str]) -> None:
    kind = metric.type
    suffix, shown = _PLAIN_TYPES.get(kind, ("", kind))
    if kind not in _PLAIN_TYPES and kind != "histogram":
        raise NotPlain(kind)
    name = metric.name + suffix
    if not is_legacy_name(name):
        raise NotPlain(name)
    documentation = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    output.append(f"# HELP {name} {documentation}\n# TYPE {name} {shown}\n")
    series = getattr(metric, "series", None)
    if series is not None:  # a flare family's (SeriesFamily): each line's prefix is kept by its Lines
        for lines, values in series:
            if lines.prefixes is None:
                raise NotPlain(name)
            output.extend(map(_line, lines.prefixes, values))
        return
    for sample in metric.samples:
        if (
            sample.timestamp is not None
            or sample.exemplar is not None
            or sample.name.endswith(("_created", "_gsum", "_gcount"))
        ):
            raise NotPlain(sample.name)
        output.append(_line(sample_prefix(sample.name, sample.labels), sample.value))


def _line(prefix: str, value: float) -> str:
    return prefix + _value_text(value) + "\n"


SHORT_INT = 1_000_000  # from here on floatToGoString writes an int with an exponent, as Go does


def _value_text(value: float) -> str:
    """A sample's value as Go exporters write it: 1 and 0 rather than 1.0 and 0.0 (a tenth of the lines)."""
    if value.__class__ is int and -SHORT_INT < value < SHORT_INT:
        return str(value)  # what floatToGoString writes for it, at a fifth of the cost (bucket counts)
    text = floatToGoString(value)
    return text[:-2] if text.endswith(".0") else text


def render_text(registry: CollectorRegistry) -> bytes:
    """The text format (0.0.4) of `registry`: what prometheus_client's generate_latest writes, but for
    integral values written as Go exporters write them (1, not 1.0).

    Several times faster for flare's families: the scrape path runs on the rank's host, beside training, and
    holds the GIL the training thread needs after each op. flare's families (collectors.SeriesFamily) hand
    over each series' numbers and the text of its lines up to their values, kept from one scrape to the next
    (collectors.Lines), so a page is written without a sample object: in C++ where flare's extension is
    built (csrc/text_format.cpp), else in Python. A family it does not write itself (another type, a
    _created sample, a timestamp, a name that needs escaping) sends the whole registry through
    generate_latest.
    """
    metrics = list(registry.collect())
    native = _native_text_format()
    text = native(metrics) if native is not None else python_text_format(metrics)
    return text if text is not None else generate_latest(registry)


def python_text_format(metrics: Iterable[Metric]) -> bytes | None:
    """The text of `metrics` written in Python, or None if one of them needs prometheus_client's writer."""
    output: list[str] = []
    try:
        for metric in metrics:
            _family_text(metric, output)
    except NotPlain:
        return None
    return "".join(output).encode("utf-8")


@cache
def _native_text_format() -> Callable[[list[Metric]], bytes | None] | None:
    """The extension's render_text (csrc/text_format.cpp) where flare's extension is built and torch is
    already imported (in a rank, always); else None, and the text is written in Python."""
    if "torch" not in sys.modules:
        return None  # loading the extension would import torch, for a process that has no use for it
    from . import cpp_recorder

    extension = cpp_recorder.load()
    return getattr(extension, "render_text", None)


def metrics_body(
    registry: CollectorRegistry, accept_encoding: str = ""
) -> tuple[bytes, list[tuple[str, str]]]:
    """The /metrics response body and headers: the text format, gzip-compressed if the client accepts it."""
    return _encoded(render_text(registry), accept_encoding)


def _encoded(text: bytes, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
    """The response body of `text` and its headers: gzip-compressed if the client accepts it."""
    headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)]
    if "gzip" in accept_encoding:
        # a sixth of the bytes, at a tenth of level 9's CPU; no modification time (as Go's writer), which
        # lets zlib write the header and checksum in the same call
        return gzip.compress(text, compresslevel=1, mtime=0), [*headers, ("Content-Encoding", "gzip")]
    return text, headers


# The most sample names one request may ask for (name[]); beyond, the request is answered 400. flare's
# pages have a few hundred.
MAX_NAMES = 1024


@lru_cache(maxsize=16)
def requested_names(query: str) -> frozenset[str] | None:
    """The sample names a /metrics request asks for alone (`name[]=...`, repeated, as Prometheus's client
    libraries read it), or None: every sample. ValueError beyond MAX_NAMES. Kept for the next request with
    the same query (`flare diagnose` asks every rank the same); Prometheus's scrapes have none."""
    if not query:
        return None
    names = urllib.parse.parse_qs(query).get("name[]")
    if names is None:
        return None
    if len(names) > MAX_NAMES:
        raise ValueError(f"more than {MAX_NAMES} name[] parameters")
    return frozenset(names)


def only_samples(text: bytes, names: Collection[str]) -> bytes:
    """The text format `text` with only the samples named in `names` (sample names: a histogram's _count is
    asked for as such), each family's HELP and TYPE lines before its first sample kept, and no family
    that keeps none: what prometheus_client serves for `name[]`."""
    wanted = {name.encode("utf-8") for name in names}
    kept: list[bytes] = []
    header: list[bytes] = []
    family = b""
    header_kept = False
    for line in text.split(b"\n"):
        if line.startswith(b"# "):
            parts = line.split(b" ", 3)
            if len(parts) > 2 and parts[1] in (b"HELP", b"TYPE"):
                if parts[2] != family:
                    family, header, header_kept = parts[2], [], False
                header.append(line)
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if name and name in wanted:
            if not header_kept:
                kept.extend(header)
                header_kept = True
            kept.append(line)
    return b"".join(line + b"\n" for line in kept)


# Scrapes that arrive within this long of a render get the same body: a scraper hammering a rank (a dozen
# dashboards, a misconfigured Prometheus) costs it at most 1 / RENDER_REUSE_SECONDS renders a second,
# and no scrape interval is short enough to notice values half a second old.
RENDER_REUSE_SECONDS = 0.5


class RenderCache:
    """The last /metrics body per encoding, reused by scrapes within RENDER_REUSE_SECONDS of its render.

    Its lock is taken by scrape threads only, and makes concurrent scrapes wait for one render rather than
    each rendering the same thing; the training thread never touches it.
    """

    def __init__(self, registry: CollectorRegistry, max_age: float = RENDER_REUSE_SECONDS) -> None:
        self.registry = registry
        self.max_age = max_age
        self.renders = 0
        self._bodies: dict[bool, tuple[float, tuple[bytes, list[tuple[str, str]]]]] = {}
        self._lock = threading.Lock()

    def body(self, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
        return self.timed_body(accept_encoding)[1]

    def timed_body(self, accept_encoding: str) -> tuple[float, tuple[bytes, list[tuple[str, str]]]]:
        """The body and its headers, after the monotonic time its render started (what it can show)."""
        gzipped = "gzip" in accept_encoding
        with self._lock:
            now = time.monotonic()
            cached = self._bodies.get(gzipped)
            if cached is not None and now - cached[0] < self.max_age:
                return cached
            body = metrics_body(self.registry, "gzip" if gzipped else "")
            self._bodies[gzipped] = (now, body)
            self.renders += 1
            return now, body

    def only(self, names: Collection[str], accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
        """The body of only the samples `names` names (only_samples), of the last text body (body)."""
        return self.timed_only(names, accept_encoding)[1]

    def timed_only(
        self, names: Collection[str], accept_encoding: str
    ) -> tuple[float, tuple[bytes, list[tuple[str, str]]]]:
        rendered_at, (text, _) = self.timed_body("")
        return rendered_at, _encoded(only_samples(text, names), accept_encoding)


def make_app(
    registry: CollectorRegistry,
    auth: BasicAuth | None = None,
    headers: Mapping[str, str] | None = None,
    scrapes: ScrapeTimes | None = None,
    profiler: Profiles | None = None,
) -> Any:
    """WSGI app serving only GET /metrics and GET /healthz; nothing on a rank can be triggered over HTTP,
    but a profiler capture where the rank was started with `profile: on` (`profiler`): POST
    /profile?steps=N arms one, GET /profile says what runs and what the last found (JSON).

    With `auth`, every path answers 401 until the request carries a configured user's credentials.
    `headers` are added to every response (a web config's http_server_config.headers). `scrapes`, if given,
    records when each /metrics request arrived and, once HttpServer has sent it, when the render it was
    answered from started.
    """
    extra_headers = list((headers or {}).items())
    bodies = RenderCache(registry)

    def app(environ: dict, start_response: Any) -> Iterable[bytes]:
        def respond(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, headers + extra_headers)

        if auth is not None and not auth.check(environ.get("HTTP_AUTHORIZATION")):
            respond("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Basic")])
            return [b"Unauthorized\n"]
        path = environ.get("PATH_INFO", "")
        if path == "/profile" and profiler is not None:
            return _profile_answer(profiler, environ, respond)
        if path not in ("/metrics", "/healthz"):
            respond("404 Not Found", [("Content-Type", "text/plain")])
            return [b"flare-exporter serves /metrics and /healthz only\n"]
        if environ.get("REQUEST_METHOD", "GET") != "GET":
            respond("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"flare-exporter answers GET only\n"]
        if path == "/metrics":
            try:
                names = requested_names(environ.get("QUERY_STRING", ""))
            except ValueError as error:
                respond("400 Bad Request", [("Content-Type", "text/plain")])
                return [f"{error}\n".encode()]
            if scrapes is not None:
                scrapes.started(time.monotonic())
            encoding = environ.get("HTTP_ACCEPT_ENCODING", "")
            rendered_at, (body, metric_headers) = (
                bodies.timed_body(encoding) if names is None else bodies.timed_only(names, encoding)
            )
            respond("200 OK", metric_headers)
            return [body] if scrapes is None else Response([body], partial(scrapes.sent, rendered_at))
        respond("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    return app


class Profiles(Protocol):
    """What the endpoint asks of the rank's profiler (rank/profiler.py)."""

    def request(
        self, steps: int, trigger: str = ..., peer_of: int | None = ...
    ) -> tuple[int, dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...


HTTP_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 409: "Conflict", 429: "Too Many Requests"}


def _profile_answer(profiler: Profiles, environ: dict, respond: Callable[..., Any]) -> list[bytes]:
    """POST /profile?steps=N[&trigger=alert|peer&of=RANK]: arm a capture (202) or say why not; GET
    /profile: its status (200)."""
    method = environ.get("REQUEST_METHOD", "GET")
    if method == "GET":
        status, answer = 200, profiler.status()
    elif method == "POST":
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        trigger = query.get("trigger", ["asked"])[0]
        try:
            steps = int(query.get("steps", ["1"])[0])
            peer_of = int(query["of"][0]) if trigger == "peer" else None
        except (ValueError, KeyError):
            status, answer = 400, {"error": "steps (and of, with trigger=peer) must be whole numbers"}
        else:
            if trigger in label_values.PROFILE_ASKED_TRIGGERS:
                status, answer = profiler.request(steps, trigger, peer_of)
            else:
                allowed = ", ".join(label_values.PROFILE_ASKED_TRIGGERS)
                status, answer = 400, {"error": f"trigger must be one of {allowed}"}
    else:
        respond("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, POST")])
        return [b"/profile answers GET and POST only\n"]
    respond(f"{status} {HTTP_REASONS.get(status, '')}", [("Content-Type", "application/json")])
    return [json.dumps(answer).encode() + b"\n"]


class MetricsServer:
    """The rank's HTTP(S) endpoint: make_app served by an HttpServer (one thread, asleep until a request)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        addr: str,
        port: int,
        web: WebConfig | None = None,
        ssl_context: ssl.SSLContext | None = None,
        health: ExporterHealth | None = None,
        scrapes: ScrapeTimes | None = None,
        profiler: Profiles | None = None,
    ) -> None:
        self.addr = addr
        self.scheme = "https" if ssl_context is not None else "http"
        self.auth = web.authenticator() if web is not None else None
        self.scrapes = scrapes or ScrapeTimes()
        app = make_app(registry, self.auth, web.headers if web is not None else None, self.scrapes, profiler)
        self.http = HttpServer(addr, port, app, ssl_context, health)
        self.port = self.http.port

    def close(self) -> None:
        self.http.close()


def serve(
    registry: CollectorRegistry,
    addr: str,
    port: int,
    rank: int,
    web_config_file: str = "",
    health: ExporterHealth | None = None,
    scrapes: ScrapeTimes | None = None,
    profiler: Profiles | None = None,
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
        return MetricsServer(registry, addr, port, web, context, health, scrapes, profiler)
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
