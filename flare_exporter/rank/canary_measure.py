"""The canary's measurements, run on the training thread of a rank between steps (never during one): a GEMM,
collective bus bandwidth on the canary's own groups, host<->device copies, storage reads, NVML's state.

Each returns a number in base units (FLOP/s, bytes/s, a ratio). Every benchmark is bounded in time or in
iterations, so that a throttled rank shows as slow rather than stuck.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import label_values
from .canary_verdict import bus_bandwidth

CPU_GEMM_SIZE = 256  # float32; one GEMM takes a few ms on a core
GPU_GEMM_SIZE = 8192  # bfloat16; 1.1 TFLOP, a few ms on a current GPU
CPU_COLLECTIVE_BYTES = 4 << 20
GPU_COLLECTIVE_BYTES = 256 << 20
COPY_BYTES = 256 << 20
READ_CHUNK = 1 << 20


def gemm_size(device: torch.device, configured: int) -> int:
    if configured:
        return configured
    return GPU_GEMM_SIZE if device.type == "cuda" else CPU_GEMM_SIZE


def collective_bytes(device: torch.device, configured: int) -> int:
    if configured:
        return configured
    return GPU_COLLECTIVE_BYTES if device.type == "cuda" else CPU_COLLECTIVE_BYTES


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_flops(device: torch.device, size: int, seconds: float) -> float:
    """FLOP/s of back-to-back size x size GEMMs for about `seconds` (after one untimed warm-up), in
    wall time: a rank whose process is throttled or stopped counts the time it lost."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    output = torch.empty(size, size, device=device, dtype=dtype)
    torch.mm(left, right, out=output)
    synchronize(device)
    iterations, started = 0, time.perf_counter()
    while True:
        torch.mm(left, right, out=output)
        iterations += 1
        if device.type == "cuda" and iterations % 8:
            continue  # a GPU queues GEMMs: check the clock once per 8, after waiting for them
        synchronize(device)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2.0 * size**3 * iterations / elapsed


def collective_busbw(op: str, group: Any, payload_bytes: int, iterations: int, device: torch.device) -> float:
    """nccl-tests' bus bandwidth of `op` (allreduce, allgather) on `group`: the mean time of `iterations`
    after one warm-up, from a barrier on the group that every member leaves together."""
    ranks = dist.get_world_size(group)
    elements = max(1, payload_bytes // 4)
    tensor = torch.ones(elements, device=device, dtype=torch.float32)
    outputs = torch.empty(elements * ranks, device=device, dtype=torch.float32)

    def once() -> None:
        if op == "allreduce":
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_gather_single(outputs, tensor, group=group)

    once()
    synchronize(device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iterations):
        once()
    synchronize(device)
    seconds = (time.perf_counter() - started) / iterations
    measured_bytes = tensor.nbytes if op == "allreduce" else outputs.nbytes
    return bus_bandwidth(op, measured_bytes, seconds, ranks)


def copy_bandwidth(device: torch.device, direction: str, payload_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of one pinned host<->device copy (`h2d` or `d2h`), after a warm-up; GPUs only."""
    host = torch.empty(payload_bytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
    source, target = (host, on_device) if direction == "h2d" else (on_device, host)
    target.copy_(source, non_blocking=True)
    synchronize(device)
    started = time.perf_counter()
    target.copy_(source, non_blocking=True)
    synchronize(device)
    return payload_bytes / (time.perf_counter() - started)


def files_under(path: str) -> Iterator[str]:
    """`path` itself if it is a file (or a pipe), else the files under it, in a stable order."""
    if not os.path.isdir(path):
        yield path
        return
    for directory, subdirectories, names in os.walk(path):
        subdirectories.sort()
        for name in sorted(names):
            yield os.path.join(directory, name)


def storage_read(path: str, max_bytes: int, max_seconds: float) -> float:
    """Bytes/s reading the files at `path` until `max_bytes` or `max_seconds`, whichever comes first. Each
    file's cached pages are dropped first where the kernel allows (posix_fadvise), so that the read goes to
    the storage rather than to memory; 0 if nothing could be read."""
    read, started = 0, time.perf_counter()
    deadline = started + max_seconds
    for name in files_under(path):
        try:
            read += _read_file(name, max_bytes - read, deadline)
        except OSError:
            continue
        if read >= max_bytes or time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - started
    return read / elapsed if read and elapsed > 0 else 0.0


def _read_file(name: str, budget: int, deadline: float) -> int:
    read = 0
    with open(name, "rb", buffering=0) as handle:
        try:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass  # a pipe, or a file system that does not say
        while read < budget and time.perf_counter() < deadline:
            chunk = handle.read(min(READ_CHUNK, budget - read))
            if not chunk:
                break
            read += len(chunk)
    return read


def gpu_state(monitor: Any) -> dict[str, float]:
    """From a fresh NVML read (the rank's GpuHealthMonitor, right after the GEMM loaded the GPU): the PCIe
    link's current width over its maximum, and gpu_clock_ok, 0 while a slowdown reason is active. Empty
    without NVML."""
    if monitor is None:
        return {}
    monitor.poll()
    reading = monitor.reading if monitor.up else None
    if reading is None:
        return {}
    values: dict[str, float] = {}
    if reading.pcie_link_width and reading.pcie_link_width_max:
        values["gpu_pcie_width"] = reading.pcie_link_width / reading.pcie_link_width_max
    if reading.clock_events:
        slowed = any(reading.clock_events.get(reason) for reason in label_values.GPU_SLOWDOWN_REASONS)
        values["gpu_clock_ok"] = 0.0 if slowed else 1.0
    return values
