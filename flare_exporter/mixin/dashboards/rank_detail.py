"""One rank in depth: identity, progress, where its step time goes, collectives, where it is stalled, GPU, its
canary, issue latency, exporter."""

from __future__ import annotations

from ... import spec
from . import canary, perf
from .metrics import (
    BEST_STEP,
    COLLECTIVE_DURATION,
    COLLECTOR_DURATION,
    COLLECTOR_SUCCESS,
    DISPATCH_ILD,
    DRIFT_KS,
    EXCEPTION_INFO,
    EXPORTER_DROPPED,
    EXPORTER_ERRORS,
    GPU_CLOCK_EVENT,
    GPU_ECC,
    GPU_LAST_XID,
    GPU_NVLINK,
    GPU_PCIE_GEN,
    GPU_PCIE_GEN_MAX,
    GPU_PCIE_REPLAYS,
    GPU_PCIE_WIDTH,
    GPU_PCIE_WIDTH_MAX,
    GPU_POWER,
    GPU_POWER_LIMIT,
    GPU_REMAP_FAILED,
    GPU_REMAP_PENDING,
    GPU_REMAPPED,
    GPU_SM_CLOCK,
    GPU_SM_CLOCK_MAX,
    GPU_TEMPERATURE,
    GPU_UP,
    GPU_XID_EVENTS,
    HEARTBEAT,
    KERNEL_ILD,
    RANK_INFO,
    STACK_INFO,
    STEP_DURATION,
    STEPS,
    WINDOW_STEP,
    WINDOW_WAIT,
)
from .model import (
    DRIFT,
    GPU,
    HANG_STEPS,
    KERNEL,
    LIVENESS_WINDOW,
    RANK_TITLE,
    RANK_UID,
    RATE,
    STALLED,
    THE_RANK,
    THE_RANK_IN_GROUPS,
    THE_RANK_LAST_WINDOW,
    Dashboard,
    Panel,
    Row,
    Target,
    in_flight_age,
    liveness,
    quantile,
    stat,
    table,
    timeseries,
)

IDENTITY = ("rank", *spec.BY_NAME[RANK_INFO].labels)
NEEDS_GPU = frozenset({GPU})


def rank_detail() -> Dashboard:
    """The rank detail dashboard (its $rank is one rank)."""
    return Dashboard(
        RANK_UID,
        RANK_TITLE,
        "Everything about one rank: identity, progress, where its step time goes, collectives, what it is "
        "doing when stalled, its GPU's health, its canary measurements, its issue latency and the "
        "exporter's own health.",
        (
            _identity_and_progress(),
            _step_and_collective_times(),
            perf.rank_row(),
            _in_flight_and_stalled(),
            _gpu_clocks_and_power(),
            _gpu_link_and_errors(),
            canary.rank_row(),
            _latency_and_exporter_health(),
        ),
        single_rank=True,
    )


def _identity_and_progress() -> Row:
    """Who the rank is, whether it is up, how far it got and when it last moved."""
    return (
        table(
            "Identity",
            "The rank's flare_rank_info: host, local rank, GPU UUID and PCI bus id (to join "
            "dcgm-exporter's series), pid.",
            f"max by ({', '.join(IDENTITY)}) ({RANK_INFO}{THE_RANK})",
            width=12,
            height=5,
            hide_columns=("Time", "Value"),
        ),
        stat(
            "Up",
            f"1: the rank reports (its flare_rank_info is scraped); 0: it reported within the last "
            f"{LIVENESS_WINDOW} and no longer does.",
            liveness(THE_RANK, "rank"),
            width=4,
            height=5,
            unit="bool_yes_no",
            steps=((None, "red"), (1, "green")),
        ),
        stat("Steps", "Optimizer steps taken.", f"max({STEPS}{THE_RANK})", width=4, height=5, count=True),
        stat(
            "Since last progress",
            "Seconds since the training thread last stepped or issued a collective.",
            f"time() - max({HEARTBEAT}{THE_RANK})",
            width=4,
            height=5,
            unit="s",
            steps=HANG_STEPS,
        ),
    )


def _step_and_collective_times() -> Row:
    """The rank's step time, its wait in collectives per window, and its collectives' durations."""
    return (
        timeseries(
            "Step time",
            "p50 and p90 of the step duration histogram, and the rank's best straggler window.",
            Target(quantile(0.5, STEP_DURATION, THE_RANK, "rank"), "p50"),
            Target(quantile(0.9, STEP_DURATION, THE_RANK, "rank"), "p90"),
            Target(f"max({BEST_STEP}{THE_RANK})", "best window"),
            width=8,
            height=8,
            unit="s",
        ),
        timeseries(
            "Step and collective wait per window",
            "Mean step time and time per step in collectives over the last straggler window.",
            Target(f"max({WINDOW_STEP}{THE_RANK_LAST_WINDOW})", "step"),
            Target(f"max({WINDOW_WAIT}{THE_RANK_LAST_WINDOW})", "wait"),
            width=8,
            height=8,
            unit="s",
        ),
        timeseries(
            "Collective duration p90 by group and op",
            "The rank's collectives in the selected groups.",
            Target(quantile(0.9, COLLECTIVE_DURATION, THE_RANK_IN_GROUPS, "group, op"), "{{group}} {{op}}"),
            width=8,
            height=8,
            unit="s",
        ),
    )


def _in_flight_and_stalled() -> Row:
    """What the rank waits in, and where its training thread is stuck (or the exception that ended it)."""
    return (
        table(
            "In flight now",
            "The rank's oldest unfinished collective per group: op, state, sequence number and age.",
            in_flight_age("group, op, state", THE_RANK_IN_GROUPS),
            width=12,
            height=7,
            unit="s",
            needs=frozenset({STALLED}),
            hide_columns=("Time",),
            value_name="age",
        ),
        table(
            "Stalled in / exception",
            "Present while the training thread has made no progress for stall_seconds: what it "
            "does and its innermost frames; or the exception that ended the rank.",
            f"max by (activity, frames, type) ({STACK_INFO}{THE_RANK} or {EXCEPTION_INFO}{THE_RANK})",
            width=12,
            height=7,
            needs=frozenset({STALLED}),
            hide_columns=("Time", "Value"),
        ),
    )


def _gpu_clocks_and_power() -> Row:
    """Why the rank's GPU is throttled, and its clock, temperature and power against their limits."""
    return (
        Panel(
            "state-timeline",
            "GPU clock-event (throttle) reasons",
            "1 while NVML reports the reason on the rank's GPU. GPU health answered: flare_gpu_health_up.",
            (
                Target(f"max by (reason) ({GPU_CLOCK_EVENT}{THE_RANK})", "{{reason}}"),
                Target(f"max({GPU_UP}{THE_RANK})", "NVML answered"),
            ),
            width=8,
            height=8,
            unit="bool_on_off",
            needs=NEEDS_GPU,
            steps=((None, "transparent"), (1, "orange")),
        ),
        timeseries(
            "SM clock vs max",
            "A clock below its maximum with a throttle reason active slows the whole job.",
            Target(f"max({GPU_SM_CLOCK}{THE_RANK})", "SM clock"),
            Target(f"max({GPU_SM_CLOCK_MAX}{THE_RANK})", "max"),
            width=8,
            height=8,
            unit="hertz",
            needs=NEEDS_GPU,
        ),
        timeseries(
            "Temperature",
            "GPU core temperature.",
            Target(f"max({GPU_TEMPERATURE}{THE_RANK})", "temperature"),
            width=4,
            height=8,
            unit="celsius",
            needs=NEEDS_GPU,
        ),
        timeseries(
            "Power vs limit",
            "GPU power draw and its enforced limit.",
            Target(f"max({GPU_POWER}{THE_RANK})", "power"),
            Target(f"max({GPU_POWER_LIMIT}{THE_RANK})", "limit"),
            width=4,
            height=8,
            unit="watt",
            needs=NEEDS_GPU,
        ),
    )


def _gpu_link_and_errors() -> Row:
    """The GPU's PCIe link against its maximum, its errors, and its memory's row remapping."""
    return (
        timeseries(
            "PCIe link vs max",
            "Current and maximum PCIe generation and width: a downgraded link slows transfers.",
            Target(f"max({GPU_PCIE_GEN}{THE_RANK})", "generation"),
            Target(f"max({GPU_PCIE_GEN_MAX}{THE_RANK})", "generation max"),
            Target(f"max({GPU_PCIE_WIDTH}{THE_RANK})", "width"),
            Target(f"max({GPU_PCIE_WIDTH_MAX}{THE_RANK})", "width max"),
            width=8,
            height=7,
            count=True,
            needs=NEEDS_GPU,
        ),
        timeseries(
            "GPU errors",
            "Increase over the interval of PCIe replays, ECC errors, XID events and NVLink errors.",
            Target(f"max(increase({GPU_PCIE_REPLAYS}{THE_RANK}[{RATE}]))", "PCIe replays"),
            Target(f"max by (type) (increase({GPU_ECC}{THE_RANK}[{RATE}]))", "ECC {{type}}"),
            Target(f"max(increase({GPU_XID_EVENTS}{THE_RANK}[{RATE}]))", "XID events"),
            Target(f"max by (counter) (increase({GPU_NVLINK}{THE_RANK}[{RATE}]))", "NVLink {{counter}}"),
            width=8,
            height=7,
            count=True,
            needs=NEEDS_GPU,
        ),
        timeseries(
            "Memory row remapping and last XID",
            "Remapped rows by cause, remapping pending or failed (replace the GPU), and the code of "
            "the last critical XID.",
            Target(
                f"max by (__name__, cause) ({GPU_REMAPPED}{THE_RANK} or {GPU_REMAP_PENDING}{THE_RANK}\n"
                f" or {GPU_REMAP_FAILED}{THE_RANK} or {GPU_LAST_XID}{THE_RANK})",
                "{{__name__}} {{cause}}",
            ),
            width=8,
            height=7,
            count=True,
            needs=NEEDS_GPU,
        ),
    )


def _latency_and_exporter_health() -> Row:
    """The rank's issue latency and its drift, and whether its exporter is healthy and how long it takes."""
    return (
        timeseries(
            "Issue latency p50 / p90",
            "Kernel issue latency (GPUs, the fake device) and host dispatch latency of this rank.",
            Target(quantile(0.5, KERNEL_ILD, THE_RANK, "rank"), "kernel issue p50"),
            Target(quantile(0.9, KERNEL_ILD, THE_RANK, "rank"), "kernel issue p90"),
            Target(quantile(0.5, DISPATCH_ILD, THE_RANK, "rank"), "host dispatch p50"),
            Target(quantile(0.9, DISPATCH_ILD, THE_RANK, "rank"), "host dispatch p90"),
            width=6,
            height=7,
            unit="s",
            needs=frozenset({KERNEL}),
        ),
        timeseries(
            "ILD drift from baseline (KS)",
            "Kolmogorov-Smirnov drift of both distributions from this rank's baseline (0: same "
            "distribution, 100%: disjoint).",
            Target(f"max by (distribution) ({DRIFT_KS}{THE_RANK})", "{{distribution}}"),
            width=6,
            height=7,
            unit="percentunit",
            needs=frozenset({DRIFT}),
            min=0,
            max=1,
        ),
        timeseries(
            "Exporter problems",
            "Collectors failing (1 each), and errors caught and events dropped over the interval, by "
            "component and queue.",
            Target(
                f"max by (collector) (1 - {COLLECTOR_SUCCESS}{THE_RANK})\n"
                f"or sum by (component) (increase({EXPORTER_ERRORS}{THE_RANK}[{RATE}]))\n"
                f"or sum by (queue) (increase({EXPORTER_DROPPED}{THE_RANK}[{RATE}]))",
                "{{collector}}{{component}}{{queue}}",
            ),
            width=6,
            height=7,
            count=True,
        ),
        timeseries(
            "Collection time",
            "Time each of the rank's collectors took on the scrape.",
            Target(f"max by (collector) ({COLLECTOR_DURATION}{THE_RANK})", "{{collector}}"),
            width=6,
            height=7,
            unit="s",
        ),
    )
