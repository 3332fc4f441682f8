"""A profiler capture reduced on the node (rank/profile_summary.py): a GPU Kineto trace and a CPU trace
built here in the documented format with hand-computed breakdowns, a real CPU trace of a few steps on a
one-rank gloo group, the classifier at its thresholds (a rank that waits for a slower peer included),
hostile traces, and Holistic Trace Analysis as an oracle where it is installed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from flare_exporter import label_values
from flare_exporter.policies import BOTTLENECKS, ProfilePolicy
from flare_exporter.rank import profile_summary
from flare_exporter.rank.profile_summary import TraceError, classify, compare, is_communication, summarize

POLICY = ProfilePolicy()
T0 = 1_000_000  # microseconds
HOST, GPU = 100, 0  # pids
COMPUTE_STREAM, NCCL_STREAM = 7, 13
GEMM = "ampere_sgemm_128x64_nn"
NCCL = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float> >"
DATA = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


# ---------------------------------------------------------------------------------------------------------
# factories


def complete(
    cat: str, name: str, ts: float, dur: float, pid: Any = HOST, tid: Any = HOST, **args: Any
) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def memory(allocated: int, device: int, device_type: int, ts: float) -> dict:
    args = {"Total Allocated": allocated, "Device Id": device, "Device Type": device_type, "Bytes": 0}
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": HOST, "tid": HOST,
            "ts": ts, "args": args}  # fmt: skip


class Launcher:
    """Device events with the cudaLaunchKernel (or cudaMemcpyAsync) call that issued each, `delay` before."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.correlation = 0

    def device(self, cat: str, name: str, ts: float, dur: float, stream: int, delay: float) -> None:
        self.correlation += 1
        runtime = "cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync"
        self.events.append(complete("cuda_runtime", runtime, ts - delay, 4, correlation=self.correlation))
        self.events.append(
            complete(cat, name, ts, dur, GPU, stream, device=0, stream=stream, correlation=self.correlation)
        )


def gpu_trace(steps: int = 2) -> dict[str, Any]:
    """`steps` steps (two) of 1000 us. Per step, from its start (us): the data loader 0-40; on the device a
    memcpy HtoD 50-100, a GEMM 100-400, an NCCL all-reduce 300-600 on its own stream (100 under the GEMM), 20
    kernels of 5 us every 10 us from 600, a GEMM 800-900, a memcpy DtoH 900-920, a memset 920-930.
    Launch delays: 8 us for the short kernels, 30 for the GEMMs, 50 for NCCL."""
    launcher = Launcher()
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": GPU, "tid": 0, "args": {"name": "GPU 0"}},
    ]
    for step in range(steps):
        start = T0 + 1000 * step
        events.append(complete("user_annotation", f"ProfilerStep#{step + 1}", start, 1000))
        events.append(complete("gpu_user_annotation", f"ProfilerStep#{step + 1}", start + 50, 880, GPU, 7))
        events.append(complete("user_annotation", DATA, start, 40))
        events.append(complete("cpu_op", "aten::mm", start + 45, 20))
        launcher.device("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", start + 50, 50, COMPUTE_STREAM, 10)
        launcher.device("kernel", GEMM, start + 100, 300, COMPUTE_STREAM, 30)
        launcher.device("kernel", NCCL, start + 300, 300, NCCL_STREAM, 50)
        for index in range(20):
            launcher.device("kernel", ELEMENTWISE, start + 600 + 10 * index, 5, COMPUTE_STREAM, 8)
        launcher.device("kernel", GEMM, start + 800, 100, COMPUTE_STREAM, 30)
        launcher.device("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", start + 900, 20, COMPUTE_STREAM, 10)
        launcher.device("gpu_memset", "Memset (Device)", start + 920, 10, COMPUTE_STREAM, 10)
    events += launcher.events
    events += [memory(1000, 0, 1, T0 + 1), memory(5000, 0, 1, T0 + 2), memory(3000, 0, 1, T0 + 3)]
    events += [memory(200, -1, 0, T0 + 4), memory(100, -1, 0, T0 + 5)]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
            "deviceProperties": [], "traceEvents": events}  # fmt: skip


def cpu_trace() -> dict[str, Any]:
    """One step of 100 us. The training thread: the data loader 0-8 (aten::stack 2-6 in it), aten::linear
    10-40 (aten::addmm 15-35 in it), a backward function 50-80 that issues c10d::allreduce_ 60-65; gloo's
    worker thread runs gloo:all_reduce 62-90."""
    return {
        "traceEvents": [
            complete("user_annotation", "ProfilerStep#1", 0, 100),
            complete("user_annotation", DATA, 0, 8),
            complete("cpu_op", "aten::stack", 2, 4),
            complete("cpu_op", "aten::linear", 10, 30),
            complete("cpu_op", "aten::addmm", 15, 20),
            complete("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 50, 30),
            complete("cpu_op", "c10d::allreduce_", 60, 5),
            complete("user_annotation", "gloo:all_reduce", 62, 28, HOST, 101),
            complete("user_annotation", "Optimizer.step#SGD.step", 90, 5),
        ]
    }


def summary_with(
    span: float = 1.0,
    steps: int = 1,
    data: float = 0.0,
    communication: float = 0.0,
    transfer: float = 0.0,
    host_gap: float = 0.0,
    short_share: float = 0.0,
    kind: str = "gpu",
) -> dict[str, Any]:
    """A summary with the seconds the classifier reads."""
    return {
        "kind": kind,
        "steps": steps,
        "step": {"source": "ProfilerStep", "count": steps},
        "time": {
            "span_seconds": span,
            "exposed_communication_seconds": communication,
            "exposed_copy_seconds": transfer,
            "host_gap_seconds": host_gap,
        },
        "data_loader": {"count": steps, "seconds": data},
        "short": {"seconds_share": short_share},
    }


def assert_adds_up(summary: Mapping[str, Any]) -> None:
    time_ = summary["time"]
    parts = (
        time_["compute_seconds"]
        + time_["exposed_communication_seconds"]
        + time_["exposed_copy_seconds"]
        + time_["other_seconds"]
    )
    assert parts == pytest.approx(time_["busy_seconds"], abs=5e-9)
    assert time_["busy_seconds"] + time_["idle_seconds"] == pytest.approx(time_["span_seconds"], abs=5e-9)
    assert time_["communication_seconds"] == pytest.approx(
        time_["exposed_communication_seconds"] + time_["overlap_seconds"], abs=5e-9
    )


def size(summary: Any) -> int:
    return len(json.dumps(summary))


# ---------------------------------------------------------------------------------------------------------
# (a) a GPU Kineto trace


def test_gpu_trace_breakdown_is_the_hand_computed_one():
    summary = summarize(gpu_trace(), steps=2)
    us = 1e-6
    assert summary["kind"] == "gpu"
    assert summary["step"] == {
        "source": "ProfilerStep",
        "count": 2,
        "mean_seconds": pytest.approx(1000 * us, abs=1e-9),
        "max_seconds": pytest.approx(1000 * us, abs=1e-9),
        "total_seconds": pytest.approx(2000 * us, abs=1e-9),
    }
    expected = {
        "span_seconds": 1880,  # 50 of step 1 to 930 of step 2
        "busy_seconds": 1560,  # per step: 50-600, 20 x 5, 800-930
        "idle_seconds": 320,  # per step 19 x 5 between the short kernels and 795-800; 930-1050 between steps
        "host_gap_seconds": 280,  # the idle time less step 2's data loader (1000-1040)
        "compute_seconds": 1000,  # per step 300 + 100 + 100
        "communication_seconds": 600,
        "copy_seconds": 140,
        "exposed_communication_seconds": 400,  # 400-600
        "exposed_copy_seconds": 140,
        "other_seconds": 20,  # the memsets
        "overlap_seconds": 200,  # 300-400
    }
    for key, microseconds in expected.items():
        assert summary["time"][key] == pytest.approx(microseconds * us, abs=1e-9), key
    assert summary["time"]["overlap_share"] == pytest.approx(1 / 3, abs=1e-6)
    assert_adds_up(summary)
    assert summary["data_loader"] == {"count": 2, "seconds": pytest.approx(80 * us, abs=1e-9)}
    assert summary["step_seconds"] == pytest.approx(1000 * us, abs=1e-9)
    assert summary["shares"] == {
        "compute": pytest.approx(1000 / 1880, abs=1e-6),
        "communication": pytest.approx(600 / 1880, abs=1e-6),
        "exposed_communication": pytest.approx(400 / 1880, abs=1e-6),
        "copy": pytest.approx(140 / 1880, abs=1e-6),
        "idle": pytest.approx(320 / 1880, abs=1e-6),
        "data": pytest.approx(80 / 1880, abs=1e-6),
    }
    assert tuple(summary["shares"]) == label_values.PROFILE_PARTS


def test_gpu_trace_kernels_short_kernels_launch_delays_and_memory():
    summary = summarize(gpu_trace(), steps=2)
    us = 1e-6
    assert summary["top"]["of"] == "kernels"
    assert [(entry["name"], entry["count"]) for entry in summary["top"]["entries"]] == [
        (GEMM, 4),
        (NCCL[: profile_summary.NAME_CHARS], 2),
        (ELEMENTWISE, 40),
    ]
    assert [entry["seconds"] for entry in summary["top"]["entries"]] == pytest.approx(
        [800 * us, 600 * us, 200 * us]
    )
    assert summary["short"] == {
        "of": "kernels",
        "threshold_seconds": 1e-5,
        "count": 40,
        "total": 46,
        "share": pytest.approx(40 / 46, abs=1e-6),
        "seconds": pytest.approx(200 * us, abs=1e-9),
        "seconds_share": pytest.approx(200 / 1600, abs=1e-6),  # of the kernels' 1600 us
    }
    # 40 delays of 8 us, 4 of 30, 2 of 50 (the memcpys' cudaMemcpyAsync are not launches)
    assert summary["launch"] == {
        "of": "launch_delay",
        "count": 46,
        "median_seconds": pytest.approx(8 * us, abs=1e-9),
        "p90_seconds": pytest.approx(30 * us, abs=1e-9),
    }
    assert summary["memory"] == [
        {"device_type": 0, "device": -1, "peak_bytes": 200},
        {"device_type": 1, "device": 0, "peak_bytes": 5000},
    ]
    assert summary["events"]["skipped"] == 0
    assert size(summary) < 2048


def test_gpu_trace_is_compute_bound_with_its_evidence():
    bottleneck, evidence = classify(summarize(gpu_trace(), steps=2), POLICY)
    assert bottleneck == "compute_bound"
    assert evidence["decided_by"] is None
    assert evidence["policy_version"] == POLICY.version
    assert evidence["shares"] == {
        "data": pytest.approx(80 / 1880, abs=1e-6),
        "communication": pytest.approx(400 / 1880, abs=1e-6),
        "transfer": pytest.approx(140 / 1880, abs=1e-6),
        "host_gap": pytest.approx(280 / 1880, abs=1e-6),
        "short_kernels": pytest.approx(0.125, abs=1e-6),
    }
    assert evidence["thresholds"] == {
        "data": 0.3, "communication": 0.5, "transfer": 0.3, "host_gap": 0.3, "short_kernels": 0.5
    }  # fmt: skip


def test_a_shorter_threshold_moves_the_short_kernels():
    summary = summarize(gpu_trace(), steps=2, short_seconds=4e-6)
    assert summary["short"]["count"] == 0
    assert summarize(gpu_trace(), steps=2, short_seconds=1e-3)["short"]["count"] == 46


# ---------------------------------------------------------------------------------------------------------
# a CPU trace (gloo): the training thread and gloo's worker thread


def test_cpu_trace_breakdown_is_the_hand_computed_one():
    summary = summarize(cpu_trace(), steps=1)
    us = 1e-6
    assert summary["kind"] == "cpu"
    expected = {
        "span_seconds": 100,
        "busy_seconds": 74,  # 2-6, 10-40, 50-90
        "idle_seconds": 26,
        "host_gap_seconds": 22,  # less the data loader's 0-2 and 6-8
        "compute_seconds": 59,  # 2-6, 10-40, 50-60, 65-80: the ops outside communication
        "communication_seconds": 30,  # 60-65 on the training thread, 62-90 on gloo's
        "copy_seconds": 0,
        "exposed_communication_seconds": 15,  # 80-90
        "exposed_copy_seconds": 0,
        "other_seconds": 0,
        "overlap_seconds": 15,  # 65-80: gloo runs while the backward computes
    }
    for key, microseconds in expected.items():
        assert summary["time"][key] == pytest.approx(microseconds * us, abs=1e-9), key
    assert_adds_up(summary)
    # self time: nested ops counted once
    top = {entry["name"]: (entry["seconds"], entry["total_seconds"]) for entry in summary["top"]["entries"]}
    assert list(top)[:3] == [
        "gloo:all_reduce",
        "autograd::engine::evaluate_function: AddmmBackward0",
        "aten::addmm",
    ]
    assert top["aten::linear"] == pytest.approx((10 * us, 30 * us))
    assert top["c10d::allreduce_"] == pytest.approx((5 * us, 5 * us))
    assert "Optimizer.step#SGD.step" not in top and "ProfilerStep#1" not in top
    # the top-level ops 2-6, 10-40, 50-80 of the training thread: gaps of 4 and 10
    assert summary["launch"] == {
        "of": "thread_gaps",
        "count": 2,
        "median_seconds": pytest.approx(7 * us),
        "p90_seconds": pytest.approx(10 * us),
        "total_seconds": pytest.approx(14 * us),
    }
    assert (summary["short"]["of"], summary["short"]["count"], summary["short"]["total"]) == ("ops", 1, 3)
    assert summary["data_loader"] == {"count": 1, "seconds": pytest.approx(8 * us)}


def test_cpu_trace_without_annotations_takes_the_busiest_thread_and_the_busy_span():
    trace = cpu_trace()
    trace["traceEvents"] = [event for event in trace["traceEvents"] if event["name"] != "ProfilerStep#1"]
    summary = summarize(trace, steps=2)
    assert summary["step"]["source"] == "span"
    assert summary["time"]["span_seconds"] == pytest.approx(88e-6)  # 2 to 90
    assert summary["step"]["mean_seconds"] == pytest.approx(44e-6)
    assert_adds_up(summary)


def test_communication_names():
    for name in ("gloo:all_reduce", "c10d::allreduce_", "record_param_comms", "nccl:all_reduce",
                 "_c10d_functional::all_gather_into_tensor", "c10d::send", "my_alltoall"):  # fmt: skip
        assert is_communication(name), name
    for name in ("aten::broadcast_tensors", "aten::mm", "Optimizer.step#SGD.step", "aten::copy_"):
        assert not is_communication(name), name


# ---------------------------------------------------------------------------------------------------------
# (b) a real CPU trace: a tiny model on a one-rank gloo group, an all-reduce per step, a DataLoader


def test_real_cpu_trace_of_a_gloo_job(tmp_path: Path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.data import DataLoader, TensorDataset

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", world_size=1, rank=0, store=dist.HashStore())
    path = tmp_path / "trace.json"
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(TensorDataset(torch.randn(48, 32), torch.randn(48, 1)), batch_size=8)
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
            profile_memory=True,
        ) as prof:
            for inputs, targets in loader:
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                optimizer.step()
                prof.step()
    finally:
        dist.destroy_process_group()
    summary = summarize(json.loads(path.read_text()), steps=3)
    assert summary["kind"] == "cpu"
    assert summary["step"]["source"] == "ProfilerStep" and summary["step"]["count"] == 3
    time_ = summary["time"]
    assert time_["communication_seconds"] > 0
    assert time_["compute_seconds"] > 0
    assert summary["data_loader"]["seconds"] > 0 and summary["data_loader"]["count"] == 3
    assert time_["copy_seconds"] == 0 and time_["other_seconds"] == 0
    assert_adds_up(summary)
    assert summary["top"]["entries"] and summary["launch"]["count"] > 0
    assert summary["memory"] and summary["memory"][0]["peak_bytes"] > 0
    assert summary["events"]["skipped"] == 0
    assert size(summary) < profile_summary.MAX_SUMMARY_BYTES
    bottleneck, evidence = classify(summary, POLICY)
    assert bottleneck in BOTTLENECKS and evidence["policy_version"] == POLICY.version


# ---------------------------------------------------------------------------------------------------------
# (c) the classifier at its thresholds


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({}, "compute_bound"),
        ({"data": 0.3}, "input_bound"),
        ({"data": 0.299999}, "compute_bound"),
        ({"communication": 0.5}, "communication_bound"),
        ({"communication": 0.499999}, "compute_bound"),
        ({"data": 0.3, "communication": 0.6}, "input_bound"),  # in the order they are tried
        ({"transfer": 0.3}, "transfer_bound"),
        ({"transfer": 0.3, "communication": 0.5}, "communication_bound"),
        ({"host_gap": 0.3}, "launch_bound"),
        ({"host_gap": 0.299999}, "compute_bound"),
        ({"host_gap": 0.3, "transfer": 0.3}, "transfer_bound"),
        ({"short_share": 0.5}, "launch_bound"),
        ({"short_share": 0.499999}, "compute_bound"),
    ],
)
def test_classes_at_their_thresholds(seconds: dict[str, Any], expected: str):
    bottleneck, evidence = classify(summary_with(**seconds), POLICY)
    assert bottleneck == expected
    named = {"short_share": "short_kernels"}
    for name, value in seconds.items():
        assert evidence["shares"][named.get(name, name)] == pytest.approx(value)
    decided = {"input_bound": "data", "communication_bound": "communication", "transfer_bound": "transfer"}
    if expected in decided:
        assert evidence["decided_by"] == decided[expected]
    assert evidence["policy_version"] == POLICY.version


def test_short_kernels_count_on_gpus_only():
    assert classify(summary_with(short_share=0.9, kind="cpu"), POLICY)[0] == "compute_bound"


def test_the_policy_moves_the_thresholds_and_its_version():
    policy = ProfilePolicy(version=7, input_share=0.1)
    bottleneck, evidence = classify(summary_with(data=0.1), policy)
    assert bottleneck == "input_bound"
    assert evidence["policy_version"] == 7 and evidence["thresholds"]["data"] == 0.1


def test_a_rank_that_waits_for_a_slower_peer_is_not_communication_bound():
    # 2 steps of 0.5 s: it waits 0.3 s a step in collectives, the slowest rank (the last to arrive) 0.05
    waiting = summary_with(span=1.0, steps=2, communication=0.6)
    slow = summary_with(span=1.0, steps=2, communication=0.1, data=0.4)
    other = summary_with(span=1.0, steps=2, communication=0.5)
    assert classify(waiting, POLICY)[0] == "communication_bound"  # alone, it would be
    bottleneck, evidence = classify(waiting, POLICY, peers=[slow, other])
    assert bottleneck == "compute_bound"
    assert evidence["exposed_communication_per_step_seconds"] == pytest.approx(0.3)
    assert evidence["least_peer_exposed_communication_per_step_seconds"] == pytest.approx(0.05)
    assert evidence["waiting_for_peers_seconds"] == pytest.approx(0.5)
    assert evidence["judged_span_seconds"] == pytest.approx(0.5)
    assert evidence["shares"]["communication"] == pytest.approx(0.2)  # 0.1 of the 0.5 s it did not wait
    assert evidence["peers"] == 2
    # the slowest rank keeps its own class
    bottleneck, evidence = classify(slow, POLICY, peers=[waiting, other])
    assert bottleneck == "input_bound" and evidence["waiting_for_peers_seconds"] == 0
    assert evidence["shares"]["data"] == pytest.approx(0.4)


def test_a_job_whose_every_rank_communicates_is_communication_bound():
    ranks = [
        summary_with(communication=0.6),
        summary_with(communication=0.55),
        summary_with(communication=0.7),
    ]
    for index, rank in enumerate(ranks):
        peers = ranks[:index] + ranks[index + 1 :]
        assert classify(rank, POLICY, peers)[0] == "communication_bound"


def test_peers_are_compared_per_step():
    # the same 0.3 s a step, over 2 steps and over 4
    bottleneck, evidence = classify(
        summary_with(steps=2, communication=0.6), POLICY, [summary_with(span=2.0, steps=4, communication=1.2)]
    )
    assert bottleneck == "communication_bound" and evidence["waiting_for_peers_seconds"] == 0


def test_malformed_summaries():
    with pytest.raises(TraceError):
        classify([], POLICY)  # type: ignore[arg-type]
    bottleneck, evidence = classify({"time": "x", "step": None, "steps": "many"}, POLICY, peers=[None, 3, {}])  # type: ignore[list-item]
    assert bottleneck == "compute_bound" and evidence["peers"] == 1


def test_compare_names_the_ops_that_differ_most():
    def with_top(steps: int, entries: dict[str, float]) -> dict[str, Any]:
        listed = [{"name": name, "count": 1, "seconds": seconds} for name, seconds in entries.items()]
        return {"steps": steps, "step": {"count": steps}, "top": {"of": "ops", "entries": listed}}

    a = with_top(2, {"aten::mm": 0.2, "gloo:all_reduce": 0.4, "aten::add_": 0.02})
    b = with_top(4, {"aten::mm": 0.4, "gloo:all_reduce": 2.0, "aten::sleep": 0.8})
    rows = compare(a, b)
    assert [row["name"] for row in rows] == ["gloo:all_reduce", "aten::sleep", "aten::add_", "aten::mm"]
    assert rows[0] == {
        "name": "gloo:all_reduce",
        "a_seconds": 0.2,
        "b_seconds": 0.5,
        "difference_seconds": 0.3,
    }
    assert rows[1]["a_seconds"] is None and rows[1]["difference_seconds"] == pytest.approx(0.2)
    assert rows[2]["b_seconds"] is None and rows[2]["difference_seconds"] == pytest.approx(-0.01)
    assert rows[3]["difference_seconds"] == 0
    many = with_top(1, {f"op{index}": index / 100 for index in range(40)})
    assert len(compare(many, with_top(1, {}))) == profile_summary.TOP
    assert compare({}, {"top": "x"}) == []
    with pytest.raises(TraceError):
        compare(None, a)  # type: ignore[arg-type]


def test_compare_two_real_captures():
    slower = gpu_trace()
    for event in slower["traceEvents"]:
        if event.get("name") == NCCL:
            event["dur"] = 600
    rows = compare(summarize(gpu_trace(), 2), summarize(slower, 2))
    assert rows[0]["name"] == NCCL[: profile_summary.NAME_CHARS]
    assert rows[0]["difference_seconds"] == pytest.approx(300e-6)  # per step


# ---------------------------------------------------------------------------------------------------------
# (d) hostile traces


class Exploding(Mapping):
    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("boom")

    def __iter__(self) -> Iterator[str]:
        return iter(["traceEvents"])

    def __len__(self) -> int:
        return 1


HOSTILE: list[Any] = [
    None,
    [],
    "traceEvents",
    42,
    {},
    {"traceEvents": None},
    {"traceEvents": "X"},
    {"traceEvents": {"ph": "X"}},
    {"traceEvents": []},
    {"traceEvents": [None, 1, "x", [], {}]},
    {"traceEvents": [{"ph": "X"}, {"ph": "X", "name": 3, "ts": 1, "dur": 1}]},
    {"traceEvents": [complete("cpu_op", "a", float("nan"), 1), complete("cpu_op", "a", 1, float("inf"))]},
    {"traceEvents": [complete("cpu_op", "a", 10**400, 1), complete("cpu_op", "a", True, 1)]},
    {"traceEvents": [complete("cpu_op", "a", 1, -5), complete("kernel", "k", 1e300, 1e300)]},
    {"traceEvents": [complete("cpu_op", "a", 1, 2, pid={"x": 1}), complete("cpu_op", "a", 1, 2, tid=[1])]},
    {"traceEvents": [{"ph": "i", "name": "[memory]", "args": "x"}]},
    Exploding(),
]


@pytest.mark.parametrize("trace", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_traces_raise_trace_error_only(trace: Any):
    with pytest.raises(TraceError):
        summarize(trace, steps=1)


@pytest.mark.parametrize("steps", [0, -1, True, 1.5, "3", None])
def test_steps_must_be_a_positive_int(steps: Any):
    with pytest.raises(TraceError, match="steps"):
        summarize(cpu_trace(), steps)


def test_malformed_events_beside_good_ones_are_skipped_and_counted():
    trace = cpu_trace()
    junk = [
        None,
        {"ph": "X", "name": "a", "ts": "1", "dur": 1},
        complete("cpu_op", "a", 1, 10**400),
        complete("kernel", "k", float("nan"), 1),
        complete(["cat"], "a", 1, 1),  # type: ignore[arg-type]
        {"ph": "i", "name": "[memory]", "args": {"Total Allocated": "lots", "Device Id": 0}},
        {"ph": "i", "name": "[memory]", "args": {"Total Allocated": 10**400, "Device Id": 0}},
        {"ph": "i", "name": "[memory]", "args": {"Total Allocated": 5, "Device Id": [0]}},
        complete("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation={"x": 1}),
    ]
    trace["traceEvents"] += junk
    summary = summarize(trace, steps=1)
    assert summary["events"] == {"read": 9 + len(junk), "skipped": 5}
    assert summary["time"] == summarize(cpu_trace(), steps=1)["time"]
    assert summary["memory"] == []


def test_too_many_events(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(profile_summary, "MAX_EVENTS", 5)
    with pytest.raises(TraceError, match="more than the 5"):
        summarize(cpu_trace(), steps=1)


def test_memory_devices_are_bounded():
    trace = cpu_trace()
    trace["traceEvents"] += [memory(device, device, 1, 5) for device in range(100)]
    assert len(summarize(trace, steps=1)["memory"]) == profile_summary.MEMORY_DEVICES


def test_100k_events_of_hostile_names_stay_under_16_kb_in_bounded_time():
    bases = ["\U0001f525" * 400, "\x00\x01\n" * 300, "nccl" + "x" * 5000]  # an emoji escapes to 12 bytes
    events = []
    for index in range(100_000):
        name = f"{index}{bases[index % 3]}"  # distinct in their first 120 characters
        if index % 2:
            events.append(complete("cpu_op", name, index * 3.0, 2.5 + index % 7, tid=index % 50))
        else:
            events.append(
                complete("kernel", name, index * 3.0, 1.0 + index % 11, GPU, index % 8, correlation=index)
            )
            events.append(complete("cuda_runtime", "cudaLaunchKernel", index * 3.0 - 2, 1, correlation=index))
    start = time.perf_counter()
    gpu = summarize({"traceEvents": events}, steps=5)
    cpu = summarize({"traceEvents": [event for event in events if event["cat"] == "cpu_op"]}, steps=5)
    elapsed = time.perf_counter() - start
    for summary in (gpu, cpu):
        assert size(summary) < profile_summary.MAX_SUMMARY_BYTES, size(summary)
        assert 1 <= len(summary["top"]["entries"]) <= profile_summary.TOP
        assert all(len(entry["name"]) <= profile_summary.NAME_CHARS for entry in summary["top"]["entries"])
        assert all(entry["name"].isprintable() for entry in summary["top"]["entries"])
        assert_adds_up(summary)
    assert gpu["events"]["read"] == 150_000 and gpu["launch"]["count"] == 50_000
    assert elapsed < 60, elapsed  # linear: a few seconds on a shared core; a quadratic step takes hours


def test_the_longest_escaped_names_drop_the_last_entries():
    # 120 astral characters: 1440 bytes of JSON a name; ten of them and 16 devices' memory exceed 16 KB
    events = [
        complete("kernel", chr(0x1F600 + index) * 200, index * 100.0, 50 + index, GPU, 7)
        for index in range(12)
    ]
    events += [memory(2**40, device, 1, 1) for device in range(20)]
    summary = summarize({"traceEvents": events}, steps=1)
    assert size(summary) < profile_summary.MAX_SUMMARY_BYTES
    assert 5 <= len(summary["top"]["entries"]) < profile_summary.TOP
    assert summary["top"]["entries"][0]["name"] == chr(0x1F600 + 11) * profile_summary.NAME_CHARS


# ---------------------------------------------------------------------------------------------------------
# (e) Holistic Trace Analysis as an oracle


def test_temporal_breakdown_agrees_with_holistic_trace_analysis(tmp_path: Path):
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        pytest.skip("HolisticTraceAnalysis (hta) is not installed: a test oracle, not a dependency")
    # HTA leaves a trace's last iteration out, but not the device ops it launched: give it a third step
    # whose device ran nothing, so that it reads the two steps flare's summary reads
    trace = gpu_trace(steps=3)
    device = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
    trace["traceEvents"] = [
        event
        for event in trace["traceEvents"]
        if not (event.get("cat") in device and event.get("ts", 0) >= T0 + 2000)
    ]
    (tmp_path / "rank-0.json").write_text(json.dumps(trace))
    frame = TraceAnalysis(trace_dir=str(tmp_path)).get_temporal_breakdown(visualize=False)
    theirs = frame.iloc[0]
    ours = summarize(gpu_trace(), steps=2)["time"]
    span = ours["span_seconds"]
    mine = {
        "idle_time_pctg": 100 * ours["idle_seconds"] / span,
        "compute_time_pctg": 100 * ours["compute_seconds"] / span,
        "non_compute_time_pctg": 100 * (ours["busy_seconds"] - ours["compute_seconds"]) / span,
    }
    for column, value in mine.items():
        assert float(theirs[column]) == pytest.approx(value, abs=1.0), column
