"""The shim's ring from Python: parsing bytes, reading a file, feeding the histograms (no gcc)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from flare_exporter import label_values
from flare_exporter.config import Config
from flare_exporter.engine.scrape import parse
from flare_exporter.rank import launch, shim
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.ild import IssueLatency
from flare_exporter.rank.shim import HEADER, RECORD, NativeRecord, RingFormatError, RingReader, ShimFeed
from flare_exporter.rank.state import FlareState

CUDA_LAUNCH_KERNEL, NCCL_ALL_REDUCE, NCCL_SEND = 1, 16, 21


def ring_bytes(capacity: int, records: dict[int, tuple], write_index: int, **counters: int) -> bytearray:
    """A ring as the shim lays it out; `records`: record number -> (api, result, host, start, end, bytes)."""
    buffer = bytearray(HEADER.size + capacity * RECORD.size)
    HEADER.pack_into(
        buffer,
        0,
        shim.RING_MAGIC,
        shim.RING_VERSION,
        HEADER.size,
        RECORD.size,
        capacity,
        write_index,
        counters.get("sampled", 0),
        counters.get("dropped", 0),
        counters.get("overwritten", 0),
        counters.get("errors", 0),
        4321,  # pid
        1,  # events ready
        64,
        1,
        counters.get("created_ns", 123),
        3,  # device
        0,
    )
    for index, (api, result, host, start, end, nbytes) in records.items():
        offset = HEADER.size + (index % capacity) * RECORD.size
        RECORD.pack_into(buffer, offset, index + 1, api, 0, result, host, start, end, nbytes, 0x77, 99, 0)
    return buffer


def kernel(host_ns: int, latency_ns: int, result: int = 0) -> tuple:
    return (CUDA_LAUNCH_KERNEL, result, host_ns, host_ns + latency_ns, host_ns + latency_ns, 0)


def test_the_header_is_parsed_field_by_field():
    header = shim.parse_header(ring_bytes(8, {}, 5, sampled=9, dropped=3, overwritten=1, errors=2))
    assert (header.capacity, header.write_index, header.sampled, header.dropped) == (8, 5, 9, 3)
    assert (header.overwritten, header.errors, header.pid, header.events_state) == (1, 2, 4321, "ready")
    assert (header.kernel_sample_every, header.nccl_sample_every) == (64, 1)
    assert (header.created_ns, header.device) == (123, 3)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda ring: ring.__setitem__(slice(0, 8), b"NOTARING"), "bad magic"),
        (lambda ring: ring.__setitem__(slice(8, 12), (2).to_bytes(4, "little")), "unsupported"),
        (lambda ring: ring.__setitem__(slice(20, 24), (6).to_bytes(4, "little")), "capacity 6"),
        (lambda ring: ring.__delitem__(slice(HEADER.size + RECORD.size, None)), "capacity 8"),
        (lambda ring: ring.__delitem__(slice(100, None)), "shorter than its header"),
    ],
)
def test_a_damaged_header_is_refused(damage, message):
    ring = ring_bytes(8, {}, 0)
    damage(ring)
    with pytest.raises(RingFormatError, match=message):
        shim.parse_header(ring)


def test_records_are_typed_and_read_from_a_position():
    ring = ring_bytes(8, {0: kernel(1000, 500), 1: (NCCL_ALL_REDUCE, 0, 2000, 2100, 5100, 4096)}, 2)
    header = shim.parse_header(ring)
    records, lost, position = shim.parse_records(ring, header, 0)
    assert (lost, position) == (0, 2)
    assert records[0] == NativeRecord(0, "cudaLaunchKernel", 0, 0, 1000, 1500, 1500, 0, 0x77, 99)
    assert records[0].is_kernel and records[0].issue_latency_seconds == pytest.approx(500e-9)
    assert not records[1].is_kernel and records[1].duration_seconds == pytest.approx(3000e-9)
    assert records[1].nbytes == 4096
    assert shim.parse_records(ring, header, 1)[0] == records[1:]


def test_records_overwritten_before_the_read_count_as_lost():
    capacity = 8
    write_index = capacity + 3  # records 0..2 were overwritten by 8..10
    ring = ring_bytes(capacity, {index: kernel(index, 10) for index in range(3, write_index)}, write_index)
    records, lost, position = shim.parse_records(ring, shim.parse_header(ring), 0)
    assert lost == 3 and position == write_index
    assert [record.number for record in records] == list(range(3, write_index))


def test_a_slot_being_rewritten_is_skipped_and_counted():
    ring = ring_bytes(8, {index: kernel(index, 10) for index in range(4)}, 4)
    RECORD.pack_into(ring, HEADER.size + 2 * RECORD.size, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # seq 0: writing
    records, lost, _ = shim.parse_records(ring, shim.parse_header(ring), 0)
    assert lost == 1 and [record.number for record in records] == [0, 1, 3]


def test_step_at_counts_the_steps_completed_before_the_launch():
    steps, times = [5, 6, 7], [10.0, 11.0, 12.0]
    assert shim.step_at(steps, times, 10.5, current_step=9) == 5
    assert shim.step_at(steps, times, 12.0, current_step=9) == 7
    assert shim.step_at(steps, times, 9.0, current_step=9) == 4  # before the oldest kept boundary
    assert shim.step_at([], [], 9.0, current_step=9) == 9


def test_every_nccl_function_maps_to_a_spec_op():
    assert set(shim.NCCL_OPS) == set(shim.NCCL_APIS.values())
    assert set(shim.NCCL_OPS.values()) <= set(label_values.COLLECTIVE_OPS)


def test_the_reader_waits_for_the_file_then_reads_only_new_records(tmp_path):
    path = tmp_path / "flare-hooks-1"
    health = ExporterHealth()
    reader = RingReader(path, health)
    assert reader.read() == []  # the shim creates the ring at its first sampled call
    path.write_bytes(ring_bytes(8, {0: kernel(0, 10), 1: kernel(1, 10)}, 2, sampled=5, dropped=3, errors=1))
    assert [record.number for record in reader.read()] == [0, 1]
    assert health.dropped == {"native_ring": 3} and health.errors == {"native_shim": 1}
    records = {index: kernel(index, 10) for index in range(2, 13)}
    path.write_bytes(ring_bytes(8, records, 13, sampled=20, dropped=7, errors=4))
    assert [record.number for record in reader.read()] == list(range(5, 13))
    assert reader.lost == 3  # records 2..4 were overwritten before this read
    assert health.dropped == {"native_ring": 7, "native_ring_overrun": 3}
    assert health.errors == {"native_shim": 4}
    assert reader.read() == []
    reader.close()


def test_a_ring_recreated_under_our_pid_is_read_from_its_start(tmp_path):
    path = tmp_path / "flare-hooks-1"
    path.write_bytes(ring_bytes(8, {index: kernel(index, 10) for index in range(2, 10)}, 10, dropped=5))
    reader = RingReader(path, ExporterHealth())
    assert len(reader.read()) == 8 and reader.position == 10
    with open(path, "r+b") as ring:  # in place, as the shim's O_TRUNC + ftruncate leaves the same file
        ring.write(ring_bytes(8, {0: kernel(0, 10), 1: kernel(1, 10)}, 2, dropped=1, created_ns=456))
    assert [record.number for record in reader.read()] == [0, 1]
    assert reader.health.dropped["native_ring"] == 6


def test_kernel_samples_are_tagged_with_the_step_they_were_launched_in(tmp_path):
    health = ExporterHealth()
    boundaries = [(1, 1.0), (2, 2.0), (3, 3.0)]
    steps = SimpleNamespace(  # StepTracker's reads
        boundaries_after=lambda step: [boundary for boundary in boundaries if boundary[0] > step], steps=3
    )
    latency = IssueLatency("kernel_issue", Config())
    tagged: list[tuple[int, float]] = []
    latency.add = lambda step, seconds: tagged.append((step, seconds))  # type: ignore[method-assign]
    path = tmp_path / "ring"
    path.write_bytes(ring_bytes(8, {0: kernel(500_000_000, 1000), 1: kernel(2_500_000_000, 2000)}, 2))
    ShimFeed(RingReader(path, health), latency, steps)()
    assert tagged == [(0, pytest.approx(1e-6)), (2, pytest.approx(2e-6))]


def test_the_feed_puts_kernels_into_ild_and_nccl_calls_into_stats_of_their_own(tmp_path):
    health = ExporterHealth()
    latency = IssueLatency("kernel_issue", Config())
    records = {
        0: kernel(1_000, 2_000_000),
        1: kernel(2_000, 3_000_000),
        2: kernel(3_000, 50_000, result=98),  # a failed launch: its timing means nothing
        3: (NCCL_ALL_REDUCE, 0, 5_000, 6_000, 4_006_000, 4096),
        4: (NCCL_SEND, 0, 7_000, 8_000, 1_008_000, 512),
    }
    path = tmp_path / "ring"
    path.write_bytes(ring_bytes(8, records, 5))
    feed = ShimFeed(RingReader(path, health), latency)
    feed()
    assert sum(latency.histogram.counts) == 2 and latency.active
    assert latency.histogram.sum == pytest.approx(5e-3)
    assert feed.failed_calls == 1
    allreduce = feed.collectives["allreduce"]
    assert sum(allreduce.durations.counts) == 1 and allreduce.durations.sum == pytest.approx(4e-3)
    assert allreduce.bytes_total == 4096
    assert feed.collectives["send"].bytes_total == 512
    assert set(feed.collectives) == {"allreduce", "send"}


def test_a_rank_exports_the_shims_nccl_calls_by_op_in_metrics_of_their_own(tmp_path):
    """Not in the groups' collective metrics, which count the same collectives; without the shim, nothing."""
    identity = RankIdentity(rank=0, local_rank=0, world_size=1, run="r", host="h", pid=os.getpid())
    state = FlareState.create(Config(gpu_health=False), identity)
    assert state.ild is not None and state.shim_feed is None
    assert "shim" not in generate_latest(build_registry(state)).decode()  # no series, no collector
    path = tmp_path / "ring"
    records = {
        0: (NCCL_ALL_REDUCE, 0, 5_000, 6_000, 4_006_000, 4096),
        1: (NCCL_SEND, 0, 7_000, 8_000, 9_000, 512),
    }
    path.write_bytes(ring_bytes(8, records, 2))
    state.shim_feed = ShimFeed(RingReader(path, state.health), state.ild.kernel_issue)
    state.shim_feed()
    samples = parse(generate_latest(build_registry(state)).decode())
    shim_samples = {(s.name, s.labels.get("op")): s for s in samples if s.name.startswith("flare_shim_")}
    assert shim_samples["flare_shim_collective_bytes_total", "allreduce"].value == 4096
    assert shim_samples["flare_shim_collective_bytes_total", "send"].value == 512
    assert shim_samples["flare_shim_collective_duration_seconds_count", "allreduce"].value == 1
    assert shim_samples["flare_shim_collective_duration_seconds_sum", "allreduce"].value == pytest.approx(
        4e-3
    )
    assert all(set(s.labels) <= {"rank", "run", "op", "le"} for s in shim_samples.values())
    assert not [s for s in samples if s.name.startswith("flare_collective_duration")]
    assert ("flare_exporter_collector_success", "shim") in {
        (s.name, s.labels.get("collector")) for s in samples
    }


def test_attach_does_nothing_without_the_shim():
    identity = RankIdentity(rank=0, local_rank=0, world_size=1, run="r", host="h", pid=os.getpid())
    state = FlareState.create(Config(), identity)
    assert state.ild is not None
    assert not shim.shim_loaded()
    assert not any(isinstance(hook, ShimFeed) for hook in state.manager.after_drain)
    feed = shim.attach(state.ild, state.manager, state.steps, state.health, loaded=True)
    hooks = state.manager.after_drain
    assert feed is not None and hooks.index(feed) == hooks.index(state.ild.refresh) - 1  # before the drift


def test_shim_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /opt/flare/cuda_hooks/build/libflare_hooks.so\n")
    assert shim.shim_loaded(str(maps))
    other = tmp_path / "other-maps"
    other.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert not shim.shim_loaded(str(other))
    assert not shim.shim_loaded(str(tmp_path / "absent"))


def test_shim_without_a_built_library_exits_2_and_says_how_to_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(shim.LIBRARY_ENV, str(tmp_path / "missing" / shim.LIBRARY_NAME))
    assert launch.main(["--shim", str(tmp_path / "train.py")]) == 2
    error = capsys.readouterr().err
    assert "make -C cuda_hooks" in error and str(tmp_path / "missing") in error
    assert len(error.strip().splitlines()) == 1


def test_the_shim_library_is_found_in_the_checkout_or_where_the_variable_points(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    assert shim.library_path({}) == repo / "cuda_hooks" / "build" / shim.LIBRARY_NAME
    assert shim.library_path({"FLARE_SHIM_LIB": str(tmp_path / "new.so")}) == tmp_path / "new.so"
