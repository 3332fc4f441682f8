"""The series budget: a realistic rank, every signal on, exports at most 300 series; no label is unbounded.

The rank is a virtual cluster's (flare_exporter.local.testing.virtual_cluster): three process groups
(world, data
parallel, tensor parallel) and every op they issue, straggler windows, both issue-latency distributions with
their drift, GPU health through the fake NVML (throttling on the straggler), a collective in flight and a
stack sample. Series are counted in what the exporter really renders, parsed back.
"""

from __future__ import annotations

import re
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.utils import floatToGoString

from flare_exporter import label_values
from flare_exporter.config import Config
from flare_exporter.engine.scrape import parse
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.collectors import Families
from flare_exporter.rank.collectors.gpu_health import GpuHealthCollector
from flare_exporter.rank.exposition import render_text
from flare_exporter.rank.gpu_health import CLOCK_EVENT_REASONS
from flare_exporter.rank.stall import FRAMES_MAX_CHARS
from flare_exporter.rank.timing import CollectiveStats

SERIES_BUDGET = 300  # per rank, every signal on at its defaults (docs/scaling.md: "budget 300")
BYTES_BUDGET = 40 * 1024  # uncompressed text; the issue's goal is 32 KiB (benchmarks/footprint.py reports it)

# Labels that say who a rank is: only on flare_rank_info, one value per rank.
IDENTITY_LABELS = {"host", "local_rank", "world_size", "backend", "pid", "gpu_uuid", "pci_bus_id"}

# the host's load, read at each render (rank/host_load.py): it changes from one render to the next
HOST_LOAD_NOW = (
    rb"flare_host_cpu_pressure_ratio|flare_host_runnable_tasks|flare_host_cpus|"
    rb"flare_training_thread_cpu_ratio"
)


def rendered(world: int, faults: vc.Faults, ranks: range | list[int] | None = None) -> dict[int, str]:
    now = time.perf_counter()
    chosen = range(world) if ranks is None else ranks
    return {rank: vc.render(vc.rank_state(rank, world, "budget", now, faults)).decode() for rank in chosen}


def busiest_faults(now: float) -> vc.Faults:
    return vc.Faults(hung=5, hung_at=now - 600.0, straggler=3)


def test_a_realistic_rank_with_every_signal_on_stays_within_the_series_budget():
    now = time.perf_counter()
    for rank in (3, 5, 11):  # the straggler (throttled GPU), the hung rank (stack sample), a waiting rank
        text = vc.render(vc.rank_state(rank, 1024, "budget", now, busiest_faults(now))).decode()
        samples = parse(text)
        names = {sample.name for sample in samples}
        # every signal is really there: a budget met by rendering less would prove nothing
        for expected in (
            "flare_rank_info",
            "flare_process_group_info",
            "flare_collective_duration_seconds_bucket",
            "flare_collective_last_issued_seq",
            "flare_kernel_issue_latency_seconds_bucket",
            "flare_host_dispatch_latency_seconds_bucket",
            "flare_ild_drift_ks",
            "flare_straggler_window_wait_seconds",
            "flare_gpu_health_up",
            "flare_gpu_clock_event_active",
            "flare_gpu_nvlink_errors_total",
            "flare_rank_stack_info",
            "flare_exporter_collector_success",
        ):
            assert expected in names, (rank, expected)
        groups = {s.labels["group"] for s in samples if s.name == "flare_process_group_info"}
        ops = {
            (s.labels["group"], s.labels["op"])
            for s in samples
            if s.name == "flare_collective_duration_seconds_count"
        }
        assert len(groups) == 3 and len(ops) == 5, (groups, ops)
        assert [s.value for s in samples if s.name == "flare_gpu_health_up"] == [1.0]
        assert len(samples) <= SERIES_BUDGET, f"rank {rank}: {len(samples)} series (budget {SERIES_BUDGET})"
        assert len(text.encode()) <= BYTES_BUDGET, f"rank {rank}: {len(text.encode())} bytes"


def test_the_budget_counts_every_rendered_series():
    """The count is of lines really rendered: one more op in a group is one histogram more, 18 series."""
    now = time.perf_counter()
    state = vc.rank_state(11, 64, "budget", now)
    before = len(parse(vc.render(state).decode()))
    state.manager.stats[("world", "alltoall")] = CollectiveStats()
    state.manager.stats[("world", "alltoall")].durations.observe(0.01)
    after = len(parse(vc.render(state).decode()))
    buckets = len(label_values.COLLECTIVE_DURATION_BUCKETS) + 1
    assert after - before >= buckets + 2  # buckets, +Inf, _sum, _count (and the bytes counter)


def test_no_label_holds_an_unbounded_value():
    now = time.perf_counter()
    faults = busiest_faults(now)
    small = rendered(16, faults)
    large = rendered(64, faults, [0, 3, 5, 11, 17, 42, 63])

    def values(pages: dict[int, str]) -> dict[str, dict[str, set[str]]]:
        found: dict[str, dict[str, set[str]]] = {}
        for text in pages.values():
            for sample in parse(text):
                for label, value in sample.labels.items():
                    found.setdefault(label, {}).setdefault(sample.name, set()).add(value)
        return found

    seen = values(small)
    config = Config()
    vocabulary = {
        "le": {"+Inf"}
        | {
            floatToGoString(bound)
            for buckets in (
                label_values.COLLECTIVE_DURATION_BUCKETS,
                label_values.STEP_DURATION_BUCKETS,
                label_values.ISSUE_LATENCY_BUCKETS,
            )
            for bound in buckets
        },
        "op": set(label_values.COLLECTIVE_OPS),
        "role": set(label_values.GROUP_ROLES),
        "state": set(label_values.IN_FLIGHT_STATES),
        "activity": set(label_values.ACTIVITIES),
        "distribution": set(label_values.ILD_DISTRIBUTIONS),
        "ago": {str(ago) for ago in range(config.straggler_windows)},
        "reason": {name for name, _ in CLOCK_EVENT_REASONS},
    }
    for label, by_metric in seen.items():
        every = set().union(*by_metric.values())
        if label in ("rank", "run"):
            continue
        if label in IDENTITY_LABELS:
            assert set(by_metric) == {"flare_rank_info"}, (label, set(by_metric))
            continue
        if label in vocabulary:
            assert every <= vocabulary[label], (label, every - vocabulary[label])
            continue
        if label == "frames":
            assert all(len(value) <= FRAMES_MAX_CHARS for value in every)
            continue
        if (
            label == "group"
        ):  # stable names: a role and a short hash of the members, at most max_groups a rank
            assert all(re.fullmatch(r"world|[a-z_]+-[0-9a-f]{8}", value) for value in every), every
            continue
        # anything else (ECC type, NVLink counter, collector, size, ...) is a fixed word list: it must not
        # grow with the number of ranks, and holds no number that grows with time (seq, timestamp)
        grown = values(large).get(label, {})
        assert set().union(*grown.values()) <= every | {"64"}, (label, set().union(*grown.values()) - every)
        assert len(every) <= 32, (label, every)


def test_the_fast_renderer_writes_what_generate_latest_writes(text_format):
    from flare_exporter.engine import scrape

    now = time.perf_counter()
    state = vc.rank_state(5, 64, "budget", now, busiest_faults(now))
    registry = build_registry(state)
    unstable = re.compile(
        rb"^(flare_exporter_collector_duration_seconds\{[^}]*\}|flare_heartbeat\S+|(?:"
        + HOST_LOAD_NOW
        + rb")\S*) \S+\n",
        re.MULTILINE,
    )
    fast = unstable.sub(b"", render_text(registry)).decode()
    reference = unstable.sub(b"", generate_latest(registry)).decode()
    metadata = [line for line in fast.splitlines() if line.startswith("#")]
    assert metadata == [line for line in reference.splitlines() if line.startswith("#")]
    assert [(s.name, s.labels, s.value) for s in scrape.parse(fast)] == [
        (s.name, s.labels, s.value) for s in scrape.parse(reference)
    ]
    assert " 1\n" in fast and " 1.0\n" not in fast  # integral values as Go writes them


@pytest.mark.parametrize(
    "value",
    [
        0,
        1,
        -1,
        48_000,
        999_999,
        -999_999,
        1_000_000,
        -1_000_000,
        2_415_919_104,
        10**17,
        -(10**17),
        True,
        0.0,
        1.0,
        -0.5,
        2.415919104e11,
        1e-7,
        float("inf"),
        float("-inf"),
        float("nan"),
    ],
)
def test_a_value_is_written_as_prometheus_client_writes_it_but_integral_without_dot_zero(value):
    from flare_exporter.rank.exposition import _value_text

    expected = floatToGoString(value)
    assert _value_text(value) == expected.removesuffix(".0")


@pytest.mark.parametrize("writer", ["native", "python"])
def test_sample_lines_kept_between_scrapes_render_what_a_fresh_render_writes(monkeypatch, writer):
    from flare_exporter.rank import collectors, exposition

    if writer == "python":
        monkeypatch.setattr(exposition, "_native_text_format", lambda: None)

    now = time.perf_counter()
    # what changes from one render to the next: collector times, Unix times converted at each render, and the
    # host's load, read at each render
    unstable = re.compile(
        rb"^(flare_exporter_collector_duration_seconds|flare_\w+_timestamp_seconds|" + HOST_LOAD_NOW + rb")"
        rb"(\{[^}]*\})? \S+\n",
        re.MULTILINE,
    )

    def rendered(registry, fresh=False) -> bytes:  # type: ignore[no-untyped-def]
        if fresh:  # no line kept from an earlier render
            collectors._sample_lines.cache_clear()
            collectors._histogram_lines.cache_clear()
        return unstable.sub(b"", exposition.render_text(registry))

    state = vc.rank_state(5, 64, "budget", now, busiest_faults(now))
    registry = build_registry(state)
    first = rendered(registry)
    assert first == rendered(registry, fresh=True) and collectors._sample_lines.cache_info().currsize > 40
    vc.advance(state, 5, 64, 40, now + 4.0, busiest_faults(now))  # values move on, labels stay
    again = rendered(registry)
    assert collectors._sample_lines.cache_info().hits > 0
    assert again == rendered(registry, fresh=True) and again != first
    other = build_registry(vc.rank_state(6, 64, "budget", now, busiest_faults(now)))  # another rank's labels
    assert rendered(other) == rendered(other, fresh=True) and b'rank="6"' in rendered(other)


def test_gpu_health_series_come_from_the_fake_nvml():
    state = vc.rank_state(2, 16, "budget", time.perf_counter())
    names = {family.name for family in GpuHealthCollector(state).collect(Families(("2", "budget")))}
    assert "flare_gpu_temperature_celsius" in names


def test_the_fast_parser_reads_what_prometheus_clients_parser_reads():
    """scrape.parse reads well-formed lines itself (a direct scrape parses every rank); same samples."""
    from prometheus_client.parser import text_string_to_metric_families

    from flare_exporter.engine import samples

    now = time.perf_counter()
    pages = [
        vc.render(vc.rank_state(rank, 16, 'a "quoted"\\run\n', now, busiest_faults(now)))
        for rank in (3, 5, 9)
    ]
    for page in pages:
        text = page.decode()
        careful = [
            (sample.name, dict(sample.labels), repr(float(sample.value)))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
        fast = samples._parse_plain(text)
        assert fast is not None
        assert [(s.name, s.labels, repr(s.value)) for s in fast] == careful
        assert (
            samples._parse_plain(text.replace("} ", "}  ", 1)) is None
        )  # not exactly a line: the careful one
        wanted = {"flare_rank_info", "flare_collective_last_issued_seq"}
        assert [s for s in fast if s.name in wanted] == samples._parse_plain(text, wanted)
        second_family = text.index("\n# HELP ", text.index("\n# HELP ") + 1) + 1
        for stray in ("# a comment\n", "garbage\n", "# TYPE x summary\n", "x 1 2 3\n"):
            between = text[:second_family] + stray + text[second_family:]
            assert samples._parse_plain(between) is None, stray  # between two families
            assert samples._parse_plain(text + stray) is None, stray  # after the last
        assert samples._parse_plain(text[:second_family] + "\n" + text[second_family:]) == fast
