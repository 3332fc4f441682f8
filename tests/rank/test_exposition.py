"""The scrape path: safe collectors, per-collector meta-metrics, the WSGI app and the server's start."""

from __future__ import annotations

import gzip
import io
import logging
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from wsgiref.util import setup_testing_defaults

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank.collectors import Families
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.exposition import (
    MAX_NAMES,
    FlareCollector,
    RenderCache,
    make_app,
    only_samples,
    python_text_format,
    serve,
)
from flare_exporter.rank.last_word import ScrapeTimes


class StepsCollector:
    name = "steps"
    metrics = ("flare_steps_total",)

    def collect(self, families: Families):
        total = families.new("flare_steps_total")
        total.add_metric(families.labels(), 12)
        return [total]


class BrokenCollector:
    name = "broken"
    metrics = ("flare_heartbeat_timestamp_seconds",)

    def collect(self, families: Families):
        raise RuntimeError("cannot read state")


def make_registry(*collectors, health: ExporterHealth | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FlareCollector(list(collectors), lambda: ("3", "run-1"), health or ExporterHealth()))
    return registry


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every exposed sample, parsed back from the text format, by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def labels(collector: str) -> tuple:
    return tuple(sorted({"collector": collector, "rank": "3", "run": "run-1"}.items()))


def test_collector_output_carries_rank_and_run():
    exposed = samples(make_registry(StepsCollector()))
    assert exposed[("flare_steps_total", (("rank", "3"), ("run", "run-1")))] == 12
    assert exposed[("flare_exporter_collector_success", labels("steps"))] == 1
    assert ("flare_exporter_collector_duration_seconds", labels("steps")) in exposed


def test_failing_collector_does_not_fail_the_scrape():
    health = ExporterHealth()
    registry = make_registry(BrokenCollector(), StepsCollector(), health=health)
    exposed = samples(registry)
    assert exposed[("flare_exporter_collector_success", labels("broken"))] == 0
    assert exposed[("flare_exporter_collector_success", labels("steps"))] == 1
    assert exposed[("flare_steps_total", (("rank", "3"), ("run", "run-1")))] == 12
    assert not any(name == "flare_heartbeat_timestamp_seconds" for name, _ in exposed)
    assert health.errors["collector_broken"] == 1
    samples(registry)
    assert health.errors["collector_broken"] == 2


def test_prepare_runs_once_before_the_collectors_and_its_failure_is_counted_not_raised():
    calls: list[str] = []

    class Watching(StepsCollector):
        def collect(self, families: Families):
            calls.append("collect")
            return super().collect(families)

    def prepare() -> None:
        calls.append("prepare")
        if len(calls) > 2:
            raise RuntimeError("drain failed")

    health = ExporterHealth()
    registry = CollectorRegistry()
    collector = FlareCollector([Watching()], lambda: ("3", "run-1"), health, prepare, "timing_manager")
    registry.register(collector)
    assert calls == []  # registering describes, it does not collect
    samples(registry)
    assert calls == ["prepare", "collect"]
    exposed = samples(registry)  # prepare fails: the collectors still show what they have
    assert calls == ["prepare", "collect", "prepare", "collect"]
    assert exposed[("flare_steps_total", (("rank", "3"), ("run", "run-1")))] == 12
    assert health.errors["timing_manager"] == 1


def test_two_collectors_declaring_one_metric_are_rejected():
    class AnotherSteps(StepsCollector):
        name = "other_steps"

    with pytest.raises(ValueError, match="flare_steps_total") as raised:
        FlareCollector([StepsCollector(), AnotherSteps()], lambda: ("0", "r"), ExporterHealth())
    assert "steps" in str(raised.value) and "other_steps" in str(raised.value)


def test_registry_rejects_a_second_flare_collector():
    registry = make_registry(StepsCollector())
    with pytest.raises(ValueError):
        registry.register(FlareCollector([StepsCollector()], lambda: ("0", "r"), ExporterHealth()))


def call_app(app, path: str, query: str = "", encoding: str = "") -> tuple[str, dict[str, str], bytes]:
    environ: dict = {"PATH_INFO": path, "QUERY_STRING": query, "HTTP_ACCEPT_ENCODING": encoding}
    setup_testing_defaults(environ)
    environ["wsgi.input"] = io.BytesIO()
    response: dict = {}

    def start_response(status, headers, exc_info=None):
        response["status"] = status
        response["headers"] = dict(headers)

    body = b"".join(app(environ, start_response))
    return response["status"], response["headers"], body


def test_app_serves_metrics():
    status, headers, body = call_app(make_app(make_registry(StepsCollector())), "/metrics")
    assert status.startswith("200")
    assert headers["Content-Type"].startswith("text/plain")
    assert b'flare_steps_total{rank="3",run="run-1"} 12\n' in body


def test_app_serves_only_the_samples_asked_for_and_refuses_an_endless_list():
    app = make_app(make_registry(StepsCollector()))
    status, _, everything = call_app(app, "/metrics")
    status, _, asked = call_app(app, "/metrics", "name[]=flare_steps_total&name[]=flare_nothing")
    assert status.startswith("200") and asked == only_samples(everything, {"flare_steps_total"})
    assert asked.count(b"\n") == 3 and b'flare_steps_total{rank="3",run="run-1"} 12\n' in asked
    status, headers, body = call_app(app, "/metrics", "name[]=flare_exporter_collector_success", "gzip")
    assert headers["Content-Encoding"] == "gzip" and b"collector_success{" in gzip.decompress(body)
    assert b"flare_steps_total" not in gzip.decompress(body)
    status, _, body = call_app(app, "/metrics", "&".join(f"name[]=m{i}" for i in range(MAX_NAMES + 1)))
    assert status.startswith("400") and f"more than {MAX_NAMES}".encode() in body


class CountingCollector(StepsCollector):
    """flare_steps_total = the number of times it was collected."""

    def __init__(self) -> None:
        self.calls = 0

    def collect(self, families: Families):
        self.calls += 1
        total = families.new("flare_steps_total")
        total.add_metric(families.labels(), self.calls)
        return [total]


def test_scrapes_close_together_share_one_render_per_encoding():
    collector = CountingCollector()
    cache = RenderCache(make_registry(collector), max_age=60)
    plain = [cache.body("") for _ in range(5)]
    gzipped = [cache.body("gzip, deflate") for _ in range(5)]
    assert collector.calls == 2 and cache.renders == 2  # one render per encoding
    assert all(body == plain[0] for body in plain) and all(body == gzipped[0] for body in gzipped)
    assert b'flare_steps_total{rank="3",run="run-1"} 1\n' in plain[0][0]
    assert b'flare_steps_total{rank="3",run="run-1"} 2\n' in gzip.decompress(gzipped[0][0])
    assert ("Content-Encoding", "gzip") in gzipped[0][1]


def test_a_render_older_than_its_max_age_is_redone():
    collector = CountingCollector()
    cache = RenderCache(make_registry(collector), max_age=0.0)
    first, second = cache.body(""), cache.body("")
    assert collector.calls == 2
    assert b"} 1\n" in first[0] and b"} 2\n" in second[0]


def test_concurrent_scrapes_wait_for_one_render():
    collector = CountingCollector()
    cache = RenderCache(make_registry(collector), max_age=60)
    with ThreadPoolExecutor(max_workers=8) as pool:
        bodies = list(pool.map(lambda _: cache.body("gzip"), range(32)))
    assert collector.calls == 1 and len({body for body, _ in bodies}) == 1


def test_scrapes_are_recorded_when_they_start_and_once_the_server_has_sent_them():
    scrapes = ScrapeTimes()
    app = make_app(make_registry(StepsCollector()), scrapes=scrapes)
    before = time.monotonic()
    status, _, _ = call_app(app, "/metrics")
    assert status.startswith("200") and len(scrapes.starts) == 1 and scrapes.starts[0] >= before
    assert scrapes.completed is None  # answered, but no HttpServer sent it
    call_app(app, "/healthz")
    assert len(scrapes.starts) == 1  # only /metrics counts
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0, scrapes=scrapes)
    assert server is not None and server.scrapes is scrapes
    try:
        for _ in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
                assert b"flare_steps_total" in response.read()
        completed = scrapes.completed
        assert completed is not None and completed[0] >= before and completed[1] <= time.time()
        assert scrapes.completed_after(before) and not scrapes.completed_after(time.monotonic())
        interval = scrapes.interval()
        assert interval is not None and 0 <= interval < 10
    finally:
        server.close()


def test_app_serves_healthz():
    status, _, body = call_app(make_app(make_registry()), "/healthz")
    assert status.startswith("200")
    assert body == b"ok\n"


@pytest.mark.parametrize("path", ["/", "/metricsx", "/debug", "/favicon.ico"])
def test_app_serves_nothing_else(path):
    status, _, body = call_app(make_app(make_registry(StepsCollector())), path)
    assert status.startswith("404")
    assert b"flare_steps_total" not in body


def test_serve_on_a_taken_port_warns_and_returns_none(caplog):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="flare_exporter"):
            assert serve(make_registry(), "127.0.0.1", port, rank=5) is None
    warnings = [r for r in caplog.records if r.name == "flare_exporter" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(port) in warnings[0].getMessage()
    assert "rank 5" in warnings[0].getMessage()


def test_serve_on_a_free_port_serves_metrics():
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0)
    assert server is not None
    try:
        assert server.port != 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
            connection.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            response = b""
            while chunk := connection.recv(65536):
                response += chunk
        assert response.startswith(b"HTTP/1.0 200")
        assert b"flare_steps_total" in response
    finally:
        server.close()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_serve_on_ipv6_loopback():
    try:
        server = serve(make_registry(StepsCollector()), "::1", 0, rank=0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    if server is None:
        pytest.skip("no IPv6 loopback here")
    try:
        with urllib.request.urlopen(f"http://[::1]:{server.port}/metrics", timeout=10) as response:
            assert b"flare_steps_total" in response.read()
    finally:
        server.close()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_app_answers_get_only(method):
    app = make_app(make_registry(StepsCollector()))
    environ: dict = {"PATH_INFO": "/metrics", "REQUEST_METHOD": method}
    setup_testing_defaults(environ)
    environ["wsgi.input"] = io.BytesIO()
    response: dict = {}
    body = b"".join(
        app(environ, lambda status, headers, exc_info=None: response.update(status=status, h=headers))
    )
    assert response["status"].startswith("405") and ("Allow", "GET") in response["h"]
    assert b"flare_steps_total" not in body


def test_serve_beyond_the_last_port_warns_and_returns_none(caplog):
    with caplog.at_level(logging.WARNING, logger="flare_exporter"):
        assert serve(make_registry(), "127.0.0.1", 65535 + 7, rank=7) is None  # base port + local rank
    messages = [r.getMessage() for r in caplog.records if r.name == "flare_exporter"]
    assert len(messages) == 1 and "is not a valid port" in messages[0] and "rank 7" in messages[0]


def test_connections_beyond_the_limit_are_dropped_and_counted():
    health = ExporterHealth()
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0, health=health)
    assert server is not None
    server.http.max_connections = 1
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:  # holds the slot
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read()
            assert health.dropped["http_connections"] >= 1
            silent.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")  # its request ends, and frees the slot
            assert silent.recv(100).startswith(b"HTTP/1.0 200")

        def answered() -> bool:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{server.port}/metrics", timeout=10
                ) as response:
                    return b"flare_steps_total" in response.read()
            except OSError:
                return False

        assert wait_for(answered, 30, "the endpoint to answer again")
    finally:
        server.close()


def hostile_families() -> list:
    """Families flare's writers must write exactly as the Python one does: escapes, unicode, every kind of
    value, no labels, info and histogram types."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )

    gauge = GaugeMetricFamily(
        "flare_odd", 'help with \\ a backslash,\na newline and "quotes"', labels=["a", "b"]
    )
    for value in ['quote " here', "back\\slash", "new\nline", "ünï©ødé ✓", "", "z", "Z", "é"]:
        gauge.add_metric([value, "x"], 1.5)
    values = [0, 1, -1, 999_999, 1_000_000, -(10**17), 2**70, True, False, 0.0, -0.0, 1e-7, 0.1, 123456.0]
    values += [1234567.0, 2.415919104e11, 1e16, 1.5e300, -2.5e-300, float("inf"), float("-inf"), float("nan")]
    for index, value in enumerate(values):
        gauge.add_metric([str(index), "v"], value)
    plain = GaugeMetricFamily("flare_plain", "no labels at all", value=3)
    counter = CounterMetricFamily("flare_things", "Things.", labels=["kind"])
    counter.add_metric(["a"], 7)
    info = InfoMetricFamily("flare_build", "Build.", value={"version": "1.2", "commit": "abc"})
    histogram = HistogramMetricFamily("flare_wait_seconds", "Waits.", labels=["op"])
    histogram.add_metric(["allreduce"], [("0.001", 2), ("1.0", 5), ("+Inf", 6)], sum_value=1.25)
    return [gauge, plain, counter, info, histogram]


class Fixed:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


@pytest.mark.parametrize(
    "names, lines",
    [
        (
            {
                "flare_wait_seconds_count",
                "flare_wait_seconds_sum",
                "flare_things_total",
                "flare_build_info",
                "x",
            },
            10,
        ),
        ({"flare_odd"}, 2 + 30),
        ({"flare_plain", "flare_wait_seconds_bucket"}, 3 + 5),
        ({"flare_wait_seconds", "flare_things"}, 0),  # family names: no sample is named so
        (set(), 0),
    ],
)
def test_the_samples_asked_for_are_what_prometheus_client_serves_for_them(names, lines):
    registry = CollectorRegistry(auto_describe=True)
    registry.register(Fixed(hostile_families()))
    expected = generate_latest(registry.restricted_registry(names))
    assert only_samples(generate_latest(registry), names) == expected
    assert len(expected.splitlines()) == lines


def test_the_native_text_format_writes_what_the_python_one_writes():
    from conftest import torch_extension

    native = torch_extension().render_text
    metrics = hostile_families()
    text = native(metrics)
    assert text == python_text_format(metrics)
    assert b'a="quote \\" here"' in text and b'a="new\\nline"' in text and b"\\\\ a backslash" in text
    assert b"2.415919104e+11" in text and b" NaN\n" in text and b" -Inf\n" in text and b" 999999\n" in text
    flare = build_flare_families()
    assert native(flare) == python_text_format(flare) and len(flare) > 40


def test_a_scrape_keeps_each_series_lines_and_builds_them_anew_only_for_new_labels():
    """A series' lines (collectors.Lines: its samples' names, labels and text up to the value) are kept from
    one scrape to the next, by the series' label values: the next scrape hands over the same objects;
    another rank's series (another `rank` label) get their own."""
    import time

    from flare_exporter.local.testing import virtual_cluster as vc
    from flare_exporter.rank.attach import build_registry

    def series_lines(rank: int) -> list:
        now = time.perf_counter()
        state = vc.rank_state(rank, 64, "run-1", now, vc.Faults(hung=5, hung_at=now - 600.0, straggler=3))
        registry = build_registry(state)
        return [(family.name, lines) for family in registry.collect() for lines, _ in family.series]

    first, second, other = series_lines(37), series_lines(37), series_lines(38)
    assert [name for name, _ in first] == [name for name, _ in second] and len(first) > 60
    assert all(lines is again for (_, lines), (_, again) in zip(first, second, strict=True))
    assert not {id(lines) for _, lines in first} & {id(lines) for _, lines in other}
    assert all(lines.prefixes is not None for _, lines in first)


def test_flare_families_are_written_from_their_series_as_prometheus_client_writes_their_samples(monkeypatch):
    """A flare family (collectors.SeriesFamily) keeps each series' numbers and its lines' prefixes (Lines,
    kept per series), and builds no sample; the text both writers make of it is prometheus_client's, and its
    samples, read, are the ones prometheus_client's families make. A line that only prometheus_client can
    write sends the page to it, which reads the samples."""
    from conftest import torch_extension
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    from flare_exporter.rank.collectors import Lines, SeriesFamily
    from flare_exporter.rank.exposition import render_text
    from flare_exporter.rank.histogram import Histogram, bucket_labels

    native = torch_extension().render_text
    families = Families(("3", 'run "one"\\two\nthree'))
    names = ("duration_seconds", "bytes_total", "last_issued_seq")
    ours = [families.new(f"flare_collective_{name}") for name in names]
    histogram, counter, gauge = ours
    theirs = [
        HistogramMetricFamily(histogram.name, histogram.documentation, labels=["rank", "run", "group", "op"]),
        CounterMetricFamily(counter.name, counter.documentation, labels=["rank", "run", "group", "op"]),
        GaugeMetricFamily(gauge.name, gauge.documentation, labels=["rank", "run", "group"]),
    ]
    bounds = (0.001, 0.01, 0.1)
    for op, counts, total in (("allreduce", [2, 0, 3, 1], 4.25), ("broadcast", [0, 0, 0, 0], 0.0)):
        families.add_histogram(histogram, ("world", op), Histogram(bounds, counts, total))
        cumulative = list(zip(bucket_labels(bounds), accumulate(counts), strict=True))
        theirs[0].add_metric([*families.common_values, "world", op], cumulative, total)
        counter.add_metric(families.labels("world", op), 4096)
        theirs[1].add_metric([*families.common_values, "world", op], 4096)
    gauge.add_metric(families.labels("world"), 17)
    theirs[2].add_metric([*families.common_values, "world"], 17)

    built = SeriesFamily.samples
    reads = []  # neither writer builds the samples
    counted = property(lambda family: reads.append(family) or built.fget(family), built.fset)
    monkeypatch.setattr(SeriesFamily, "samples", counted)
    text, python_text = native(ours), python_text_format(ours)
    assert reads == [] and text == python_text == python_text_format(theirs)
    assert [family.samples for family in ours] == [family.samples for family in theirs]
    assert [len(family.series) for family in ours] == [2, 2, 1]
    labels = b'rank="3",run="run \\"one\\"\\\\two\\nthree"'
    assert b'_bucket{group="world",le="0.01",op="allreduce",' + labels + b"} 2\n" in text
    assert b'_sum{group="world",op="allreduce",' + labels + b"} 4.25\n" in text
    assert b'bytes_total{group="world",op="broadcast",' + labels + b"} 4096\n" in text
    with pytest.raises(TypeError):
        histogram.add_metric(["3", "run", "world", "gather"], [("+Inf", 1)], 1.0)
    with pytest.raises(TypeError):  # what the text format would have to hand to prometheus_client
        gauge.add_metric(families.labels("world"), 1, timestamp=5.0)
    with pytest.raises(TypeError):
        counter.add_metric(families.labels("world", "gather"), 1, created=5.0)

    odd = families.new("flare_step_duration_seconds")
    odd.series.append((Lines(("flare_step_duration_seconds_sum",), ({"__reserved": "x"},)), [0.5]))
    assert odd.series[0][0].prefixes is None
    assert native([*ours, odd]) is None and python_text_format([*ours, odd]) is None
    registry = CollectorRegistry(auto_describe=True)
    registry.register(Fixed([*ours, odd]))
    assert b'flare_step_duration_seconds_sum{__reserved="x"} 0.5\n' in render_text(registry)


@pytest.mark.parametrize(
    "name",
    ["flare_collective_duration_seconds", "flare_collective_bytes_total", "flare_collective_last_issued_seq"],
)
def test_a_flare_family_has_what_prometheus_client_gives_its_own(name):
    """A flare family is not built by Metric's constructor, only shaped like prometheus_client's families
    (collectors.SeriesFamily): if theirs gain an attribute, which their writers may read, this fails."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    ours = Families(("0", "r")).new(name)
    kinds = {"histogram": HistogramMetricFamily, "counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
    theirs = kinds[ours.type](ours.name, ours.documentation, labels=ours.label_names, unit=ours.unit)
    assert set(vars(theirs)) == {"name", "documentation", "unit", "type", "samples", "_labelnames"}
    assert [getattr(ours, key) for key in ("name", "documentation", "unit", "type", "samples")] == [
        getattr(theirs, key) for key in ("name", "documentation", "unit", "type", "samples")
    ]
    assert ours.label_names == theirs._labelnames and ours == theirs


def build_flare_families() -> list:
    import time

    from flare_exporter.local.testing import virtual_cluster as vc
    from flare_exporter.rank.attach import build_registry

    now = time.perf_counter()
    state = vc.rank_state(3, 64, "run-1", now, vc.Faults(hung=5, hung_at=now - 600.0, straggler=3))
    return list(build_registry(state).collect())


@pytest.mark.parametrize(
    "spoil",
    [
        "timestamp",
        "exemplar",
        "created",
        "summary",
        "bad name",
        "reserved label",
        "label not str",
        "value str",
    ],
)
def test_what_the_native_text_format_cannot_write_it_leaves_to_prometheus_client(spoil):
    from conftest import torch_extension
    from prometheus_client.core import Exemplar, Metric, SummaryMetricFamily
    from prometheus_client.samples import Sample

    native = torch_extension().render_text
    gauge = Metric("flare_spoilt", "Spoilt.", "gauge")
    sample = {
        "timestamp": Sample("flare_spoilt", {}, 1.0, 12.5),
        "exemplar": Sample("flare_spoilt", {}, 1.0, None, Exemplar({"trace": "a"}, 1.0)),
        "created": Sample("flare_spoilt_created", {}, 1.0),
        "reserved label": Sample("flare_spoilt", {"__name": "x"}, 1.0),
        "label not str": Sample("flare_spoilt", {"a": 3}, 1.0),
        "value str": Sample("flare_spoilt", {}, "1.5"),
    }.get(spoil, Sample("flare_spoilt", {}, 1.0))
    gauge.samples.append(sample)
    if spoil == "summary":
        gauge = SummaryMetricFamily("flare_spoilt", "Spoilt.", count_value=1, sum_value=2.0)
    elif spoil == "bad name":
        gauge.name = "flare-spoilt"
    metrics = [*hostile_families(), gauge]
    assert native(metrics) is None
    assert native(hostile_families()) is not None
    if spoil not in ("label not str", "value str"):  # Python fails on these, as prometheus_client does
        assert python_text_format(metrics) is None


def test_render_text_falls_back_to_prometheus_client_for_a_family_it_cannot_write(text_format):
    from prometheus_client.core import Exemplar, Metric
    from prometheus_client.samples import Sample

    from flare_exporter.rank.exposition import render_text

    class Odd:
        def collect(self):
            metric = Metric("flare_odd", "Odd.", "gauge")
            metric.samples.append(Sample("flare_odd", {}, 2.0, None, Exemplar({"trace": "a"}, 1.0)))
            return [metric]

    steps = b'flare_steps_total{rank="3",run="run-1"} 12'
    alone = make_registry(StepsCollector())
    assert steps + b"\n" in render_text(alone)  # flare's writer: integral values as Go writes them
    registry = make_registry(StepsCollector())
    registry.register(Odd())
    assert steps + b".0\n" in render_text(registry)  # generate_latest's, for the whole registry
