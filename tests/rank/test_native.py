"""The native shim built with gcc and run against fake CUDA runtime, driver and NCCL libraries.

Each test runs cuda_hooks/build's launch_driver (or Python) with LD_PRELOAD=libflare_hooks.so in a
subprocess that keeps its ring (FLARE_SHIM_KEEP_RING=1), then parses the ring with flare_exporter.rank.shim.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import pytest

from flare_exporter import label_values
from flare_exporter.rank import shim

REPO = Path(__file__).resolve().parents[2]
EVENT_DELAY_NS = 2_000_000  # the fake device reaches an event recorded on a caller's stream 2 ms later
NCCL_DURATION_NS = 3_000_000
KERNEL_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
NCCL_APIS = tuple(shim.NCCL_APIS.values())
NCCL_STREAM_BIT = 1 << 31  # launch_driver's threads mode marks its allreduce streams with it


@dataclass(frozen=True)
class Built:
    shim: Path
    fakes: Path
    driver: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The shim, the fakes and the driver, built warning-free by cuda_hooks/Makefile into a temporary dir."""
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.skip("gcc and make are needed to build the native shim (cuda_hooks/)")
    build = tmp_path_factory.mktemp("cuda_hooks")
    subprocess.run(
        ["make", "-s", "-C", str(REPO / "cuda_hooks"), f"BUILD={build}", "EXTRA_CFLAGS=-Werror", "testing"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return Built(build / shim.LIBRARY_NAME, build / "fakes", build / "launch_driver")


@dataclass
class Run:
    lines: list[dict]
    header: shim.RingHeader | None
    records: list[shim.NativeRecord]
    lost: int

    def by_api(self, api: str) -> list[shim.NativeRecord]:
        return [record for record in self.records if record.api == api]


def shim_environment(
    built: Built, ring_dir: Path, preload: bool = True, device_delay_ns: int = EVENT_DELAY_NS, **settings: int
) -> dict[str, str]:
    environ = {
        **os.environ,
        "FLARE_SHIM_RING_DIR": str(ring_dir),
        "FLARE_SHIM_KEEP_RING": "1",
        "FAKE_CUDA_EVENT_DELAY_NS": str(device_delay_ns),
        "FAKE_NCCL_DURATION_NS": str(NCCL_DURATION_NS),
        "OMP_NUM_THREADS": "1",
    }
    if preload:
        environ["LD_PRELOAD"] = str(built.shim)
    environ.update({f"FLARE_SHIM_{name.upper()}": str(value) for name, value in settings.items()})
    return environ


def read_ring(ring_dir: Path) -> tuple[shim.RingHeader | None, list[shim.NativeRecord], int]:
    rings = list(ring_dir.glob("flare-hooks-*"))
    assert len(rings) <= 1, rings
    if not rings:
        return None, [], 0
    data = rings[0].read_bytes()
    header = shim.parse_header(data)
    records, lost, _ = shim.parse_records(data, header, 0)
    return header, records, lost


def drive(
    built: Built, tmp_path: Path, libraries: str, *mode: str, preload: bool = True, **settings: int
) -> Run:
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    result = subprocess.run(
        [str(built.driver), str(built.fakes), libraries, *mode],
        env=shim_environment(built, ring_dir, preload, **settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[-1] == {"flush": 0, "shim": preload}
    return Run(lines[:-1], *read_ring(ring_dir))


def test_every_symbol_is_intercepted_and_forwarded_unchanged(built, tmp_path):
    run = drive(built, tmp_path, "cudart,cuda,nccl", "forward", sample_every=1, nccl_sample_every=1)
    calls = {line["api"]: line for line in run.lines}
    assert set(calls) == {*KERNEL_APIS, *NCCL_APIS, "group", "last_error"}
    for api in (*KERNEL_APIS, *NCCL_APIS):
        assert calls[api]["args_match"], api  # the fake received exactly what the caller passed
        assert calls[api]["ok"] == 0, api
        assert calls[api]["error"] == calls[api]["expected_error"] != 0, api  # the fake's error came back
        # the shim saw the call (the only way a record gets into the ring) and kept what it returned
        assert sorted(record.result for record in run.by_api(api) if not record.flags) == [
            0,
            calls[api]["expected_error"],
        ], api
    assert calls["group"]["results"] == [0, 0, 0, 0]
    grouped = [record for record in run.records if record.flags & shim.GROUPED]
    assert sorted(record.api for record in grouped) == ["ncclAllReduce", "ncclSend"]
    # calls inside a group are timed up to its ncclGroupEnd: both end together, after their collectives
    assert len({record.device_end_ns for record in grouped}) == 1
    assert min(record.duration_seconds for record in grouped) >= 0.9 * NCCL_DURATION_NS / 1e9
    # the shim's own failed cudaEventRecord (injected) is counted, not left in the caller's last error
    assert calls["last_error"] == {"api": "last_error", "launch": 0, "last_error": 0}
    header = run.header
    assert header is not None and header.events_state == "ready"
    assert header.errors == 1 and header.dropped == 1
    assert header.write_index == len(run.records) == header.sampled - header.dropped == 2 * 11 + 2
    for record in run.records:
        assert record.stream == (0x7770 if record.api in NCCL_APIS else 0x3330)
        assert record.thread_id > 0
        if record.is_kernel:  # on a stream nothing else occupies: the fake device's delay
            assert record.issue_latency_seconds == pytest.approx(EVENT_DELAY_NS / 1e9, abs=1e-3)
    sizes = {record.api: record.nbytes for record in run.records}
    assert sizes["ncclReduceScatter"] == 1000 * 4 * 4  # float32, recvcount x 4 ranks (ncclCommCount)
    assert {sizes[api] for api in NCCL_APIS if api != "ncclReduceScatter"} == {1000 * 4}
    assert {sizes[api] for api in KERNEL_APIS} == {0}


def test_without_the_shim_the_driver_runs_the_same_and_no_ring_appears(built, tmp_path):
    run = drive(built, tmp_path, "cudart,cuda,nccl", "forward", preload=False)
    assert {line["api"] for line in run.lines if line.get("args_match")} == {*KERNEL_APIS, *NCCL_APIS}
    assert run.header is None


WARM_UP_LAUNCHES = 64  # cudaLaunchKernel calls on launch_driver's main thread, streams 1..64


def expected_samples(
    threads: int, iterations: int, kernel_every: int, nccl_every: int
) -> set[tuple[int, int]]:
    """(api number, stream) of every call launch_driver's threads mode should sample."""
    apis = (1, 2, 3, 4)  # iteration % 4 picks the kernel API
    expected = {(1, launch + 1) for launch in range(WARM_UP_LAUNCHES) if (launch + 1) % kernel_every == 0}
    for thread in range(threads):
        nccl_calls = 0
        for iteration in range(iterations):
            stream = ((thread + 1) << 32) | (iteration + 1)
            if (iteration + 1) % kernel_every == 0:  # a thread's every-th call of the family is sampled
                expected.add((apis[iteration % 4], stream))
            if iteration % 16 == 15:
                nccl_calls += 1
                if nccl_calls % nccl_every == 0:
                    expected.add((16, stream | NCCL_STREAM_BIT))
    return expected


API_NUMBERS = {name: number for number, name in shim.API_NAMES.items()}


def test_one_call_in_n_is_sampled_per_thread_from_eight_threads(built, tmp_path):
    threads, iterations, kernel_every, nccl_every = 8, 2000, 5, 3
    # a pool and a queue larger than all samples: nothing can be dropped, so every sample is a record
    run = drive(
        built,
        tmp_path,
        "cudart,cuda,nccl",
        "threads",
        str(threads),
        str(iterations),
        sample_every=kernel_every,
        nccl_sample_every=nccl_every,
        events=8192,
        queue=8192,
    )
    expected = expected_samples(threads, iterations, kernel_every, nccl_every)
    assert run.lines[0]["runtime_launches"] == WARM_UP_LAUNCHES + threads * iterations // 2
    assert run.lines[0]["driver_launches"] == threads * iterations // 2
    assert run.lines[0]["nccl_calls"] == threads * (iterations // 16)
    header = run.header
    assert header is not None
    assert header.sampled == len(expected) and header.dropped == 0 and header.errors == 0
    assert run.lost == 0 and header.write_index == len(run.records)
    assert {(API_NUMBERS[record.api], record.stream) for record in run.records} == expected
    threads_seen = {record.stream >> 32: record.thread_id for record in run.records}
    assert len(threads_seen) == threads + 1 and len(set(threads_seen.values())) == threads + 1
    for record in run.records:
        assert threads_seen[record.stream >> 32] == record.thread_id  # no record mixes two launches


def test_concurrent_launches_drop_and_wrap_around_and_the_counts_add_up(built, tmp_path):
    threads, iterations = 8, 20000
    # 8 threads outrun 32 events and a 32-slot queue (drops); the first 32 samples always find an event and a
    # slot, so the 16-record ring wraps around however little the resolver runs while they launch
    run = drive(
        built,
        tmp_path,
        "cudart,cuda,nccl",
        "threads",
        str(threads),
        str(iterations),
        device_delay_ns=0,
        sample_every=2,
        nccl_sample_every=1,
        ring_records=16,
        events=32,
        queue=32,
        poll_us=20,
    )
    expected = expected_samples(threads, iterations, 2, 1)
    header = run.header
    assert header is not None and header.capacity == 16
    assert header.sampled == len(expected)
    assert header.dropped > 0 and header.write_index > header.capacity
    assert header.write_index + header.dropped == header.sampled  # every sample is a record or a drop
    assert header.overwritten == header.write_index - header.capacity
    assert run.lost == header.write_index - header.capacity and len(run.records) == header.capacity
    seen = [(API_NUMBERS[record.api], record.stream) for record in run.records]
    assert len(set(seen)) == len(seen) and set(seen) <= expected  # whole records of real samples only
    newest = list(range(header.write_index - header.capacity, header.write_index))
    assert [record.number for record in run.records] == newest


def test_the_ring_wraps_around_and_counts_what_it_overwrote(built, tmp_path):
    run = drive(built, tmp_path, "cudart,cuda,nccl", "forward", sample_every=1, ring_records=16)
    header = run.header
    assert header is not None and header.capacity == 16
    assert header.write_index == 2 * 11 + 2 and header.overwritten == header.write_index - 16
    assert run.lost == header.overwritten and len(run.records) == 16
    newest = list(range(header.write_index - 16, header.write_index))
    assert [record.number for record in run.records] == newest
    assert [record.api for record in run.records][-2:] == ["ncclAllReduce", "ncclSend"]  # the group, last


def test_without_the_runtime_calls_are_forwarded_and_nothing_is_recorded(built, tmp_path):
    run = drive(built, tmp_path, "cuda,nccl", "forward", sample_every=1)
    calls = {line["api"]: line for line in run.lines}
    assert set(calls) == {"cuLaunchKernel", "cuLaunchKernelEx", *NCCL_APIS, "group"}
    for line in calls.values():
        assert line["api"] == "group" or (line["args_match"] and line["error"] == line["expected_error"])
    header = run.header
    assert header is not None and header.events_state == "unavailable"
    assert header.write_index == 0 and header.dropped == header.sampled > 0 and header.errors >= 1


def test_a_runtime_outside_the_global_scope_is_still_found(built, tmp_path):
    # as for a CUDA runtime that is a dependency of an extension loaded with RTLD_LOCAL
    run = drive(built, tmp_path, "cudart-local,nccl", "forward", sample_every=1)
    calls = {line["api"]: line for line in run.lines}
    for api in ("cudaLaunchKernel", "cudaLaunchKernelExC"):
        assert calls[api]["args_match"] and (calls[api]["ok"], calls[api]["error"]) == (0, 98)
        assert len(run.by_api(api)) == 2
    assert run.header is not None and run.header.events_state == "ready"


INTEGRATION = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    from ctypes import POINTER, Structure, c_int, c_size_t, c_uint, c_void_p

    for name in ("libcudart.so", "libnccl.so"):  # as torch loads its CUDA libraries: globally
        ctypes.CDLL(os.path.join(sys.argv[1], name), mode=os.RTLD_GLOBAL)
    kernels, collectives = int(sys.argv[2]), int(sys.argv[3])

    from flare_exporter.rank import shim
    from flare_exporter.config import Config
    from flare_exporter.rank.identity import RankIdentity
    from flare_exporter.rank.state import FlareState

    identity = RankIdentity(rank=0, local_rank=0, world_size=1, run="native", host="h", pid=os.getpid())
    state = FlareState.create(Config(), identity)  # attaches the ring reader: the shim is preloaded
    feeds = [hook for hook in state.manager.after_drain if isinstance(hook, shim.ShimFeed)]

    class Dim3(Structure):
        _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]

    process = ctypes.CDLL(None)  # the global scope, where the preloaded shim comes first
    launch = process.cudaLaunchKernel
    launch.argtypes = [c_void_p, Dim3, Dim3, POINTER(c_void_p), c_size_t, c_void_p]
    all_reduce = process.ncclAllReduce
    all_reduce.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    results = [launch(None, Dim3(1, 1, 1), Dim3(32, 1, 1), None, 0, 0x3330) for _ in range(kernels)]
    results += [all_reduce(None, None, 256, 7, 0, None, 0x7770) for _ in range(collectives)]
    assert process.flare_hooks_flush(10000) == 0

    latency = state.ild.kernel_issue
    stats = state.shim_feed.collectives
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state.manager.drain()  # as the manager thread and every scrape do
        allreduce = stats.get("allreduce")
        if allreduce is not None and sum(allreduce.durations.counts) >= collectives:
            break
        time.sleep(0.01)
    allreduce = stats["allreduce"]
    print(json.dumps({
        "feeds": len(feeds),
        "windows_use_the_recorder": state.ild.dispatch.launches_from_shim,
        "results": sorted(set(results)),
        "kernel_counts": latency.histogram.counts,
        "kernel_sum": latency.histogram.sum,
        "active": latency.active,
        "allreduce_count": sum(allreduce.durations.counts),
        "allreduce_counts": allreduce.durations.counts,
        "allreduce_sum": allreduce.durations.sum,
        "allreduce_bytes": allreduce.bytes_total,
        "ops": sorted(stats),
        "groups": sorted({group for group, _ in state.manager.stats}),
        "dropped": dict(state.health.dropped),
        "errors": dict(state.health.errors),
    }))
    """
)


@pytest.mark.process
def test_the_package_reads_the_ring_into_the_ild_and_collective_histograms(built, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(INTEGRATION)
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    kernels, every, collectives = 400, 8, 20
    result = subprocess.run(
        [sys.executable, str(script), str(built.fakes), str(kernels), str(collectives)],
        env={**shim_environment(built, ring_dir, sample_every=every), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["feeds"] == 1 and seen["results"] == [0] and seen["active"]
    assert seen["windows_use_the_recorder"]  # launches are sampled below Python: no dispatch mode needed
    assert seen["dropped"] == {} and seen["errors"] == {}
    assert sum(seen["kernel_counts"]) == kernels // every
    # the fake device's 2 ms: the mean, and most samples in the histogram bucket that holds 2 ms
    assert seen["kernel_sum"] / (kernels // every) == pytest.approx(EVENT_DELAY_NS / 1e9, rel=0.2)
    bounds = label_values.ISSUE_LATENCY_BUCKETS
    bucket = next(index for index, bound in enumerate(bounds) if bound >= EVENT_DELAY_NS / 1e9)
    assert seen["kernel_counts"][bucket] >= 0.9 * (kernels // every)
    assert seen["ops"] == ["allreduce"] and seen["groups"] == []  # in the shim's metrics, not a group's
    assert seen["allreduce_count"] == collectives and seen["allreduce_bytes"] == collectives * 256 * 4
    durations = seen["allreduce_sum"] / collectives
    assert durations == pytest.approx(NCCL_DURATION_NS / 1e9, rel=0.2)
    header, records, _ = read_ring(ring_dir)
    assert header is not None and header.pid != os.getpid()
    latencies = [record.issue_latency_seconds for record in records if record.is_kernel]
    assert median(latencies) == pytest.approx(EVENT_DELAY_NS / 1e9, abs=1e-4)


@pytest.mark.process
def test_flare_run_shim_reexecutes_with_the_shim_preloaded(built, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os\n"
        "from flare_exporter.rank import shim\n"
        "print(json.dumps({'loaded': shim.shim_loaded(), 'preload': os.environ['LD_PRELOAD'],"
        " 'marker': os.environ.get('FLARE_SHIM_REEXEC')}))\n"
    )
    other = built.fakes / "libcuda.so"  # any library already in LD_PRELOAD stays, after the shim
    environ = {
        **os.environ,
        "FLARE_SHIM_LIB": str(built.shim),
        "LD_PRELOAD": str(other),
        "PYTHONPATH": str(REPO),
        "FLARE_GPU_HEALTH": "false",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "flare_exporter.launch", "--shim", "--port", "0", str(script)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"loaded": True, "preload": f"{built.shim}:{other}", "marker": None}
    assert Counter(line for line in result.stderr.splitlines() if "flare-run:" in line) == Counter()


def test_a_ranks_collective_time_leaves_out_the_shims_view_of_the_same_collectives():
    from flare_exporter.engine import prometheus_source, records

    series = {
        "flare_rank_info": [({"rank": "0", "run": "r", "world_size": "1", "host": "h"}, 1.0)],
        "flare_collective_duration_seconds_sum": [
            ({"rank": "0", "run": "r", "group": "world", "op": "allreduce"}, 2.0),
            ({"rank": "0", "run": "r", "group": "tp-1a2b", "op": "allgather"}, 1.0),
        ],
        "flare_shim_collective_duration_seconds_sum": [({"rank": "0", "run": "r", "op": "allreduce"}, 3.0)],
    }
    snapshot = records.build_snapshot(series, {0: records.Liveness(True)}, 1000.0, "r")
    assert snapshot.ranks[0].collective_seconds == 3.0  # world and tp, not the shim's 3 s again
    queries = " ".join(prometheus_source.PROMETHEUS_QUERIES.values())
    assert "flare_shim_" not in queries and not any("shim" in name for name in records.SNAPSHOT_METRICS)
