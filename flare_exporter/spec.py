"""The metric spec: every metric flare-exporter exports, declared once.

Collectors, the README's metric table, rules and dashboards all read this module; a test fails when
anything names a `flare_` metric that is not declared here. Every series also carries the constant
labels `rank` and `run` (`COMMON_LABELS`), which are not repeated per metric. The values the metrics'
labels may take, and the histograms' buckets, are declared in label_values.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .causes import EXCEPTION_CAUSES
from .label_values import (
    COLLECTIVE_DURATION_BUCKETS,
    ISSUE_LATENCY_BUCKETS,
    PROFILE_OUTCOMES,
    PROFILE_PARTS,
    PROFILE_TRIGGERS,
    STEP_DURATION_BUCKETS,
    TERMINATION_SIGNALS,
)

COMMON_LABELS = ("rank", "run")

COUNTER, GAUGE, HISTOGRAM, INFO = "counter", "gauge", "histogram", "info"
UNITS = ("seconds", "bytes", "")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its exposed name, type, unit, help text, labels beyond rank/run, and buckets.

    `help` is served on every scrape, so it is one short sentence; `detail` says the rest, in the docs only.
    """

    name: str
    type: str
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    detail: str = ""

    def __post_init__(self) -> None:
        problems = []
        if not self.name.startswith("flare_"):
            problems.append("name must start with flare_")
        if self.type not in (COUNTER, GAUGE, HISTOGRAM, INFO):
            problems.append(f"unknown type {self.type!r}")
        if self.unit not in UNITS:
            problems.append(f"unknown unit {self.unit!r}")
        base = self.name.removesuffix("_total")
        if self.unit and not base.endswith("_" + self.unit):
            problems.append(f"name must end in _{self.unit} (its unit)")
        if (self.type == COUNTER) != self.name.endswith("_total"):
            problems.append("counters, and only counters, end in _total")
        if (self.type == INFO) != self.name.endswith("_info"):
            problems.append("info metrics, and only they, end in _info")
        if (self.type == HISTOGRAM) != bool(self.buckets):
            problems.append("histograms, and only they, declare buckets")
        if list(self.buckets) != sorted(set(self.buckets)):
            problems.append("buckets must be strictly increasing")
        if set(self.labels) & set(COMMON_LABELS):
            problems.append("rank and run are common labels; do not declare them")
        if problems:
            raise ValueError(f"metric {self.name}: " + "; ".join(problems))


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "flare_rank_info",
        INFO,
        "",
        "Identity of this rank (join on rank with group_left).",
        ("host", "local_rank", "world_size", "backend", "gpu_uuid", "pci_bus_id", "pid", "switch", "rack"),
        detail="switch and rack: the `topology` config key (empty when unset).",
    ),
    MetricSpec(
        "flare_process_group_info",
        INFO,
        "",
        "A process group of this rank: name, role, size, recorder, this rank's position in it.",
        ("group", "role", "size", "recorder", "group_rank"),
        detail=(
            "recorder: cpp (flare's C++ backend, no Python on the training thread) or python (hooks). "
            "group_rank: the rank's rank in the group (a pipeline group's: its stage)."
        ),
    ),
    MetricSpec(
        "flare_exporter_build_info",
        INFO,
        "",
        "Versions this rank runs (flare-exporter, torch, Python) and whether flare's C++ recorder is loaded.",
        ("version", "torch", "python", "cpp_recorder"),
        detail="cpp_recorder: cpp when flare's C++ recorder (its torch extension) is loaded, else python.",
    ),
    MetricSpec(
        "flare_world_size",
        GAUGE,
        "",
        "Ranks in this rank's job (its world size).",
        detail=(
            "What liveness counts against: a run with fewer ranks seen than its world size has ranks that "
            "never reported (FlareRanksMissing); `flare diagnose` counts them down."
        ),
    ),
    MetricSpec(
        "flare_hang_threshold_seconds",
        GAUGE,
        "seconds",
        "Seconds a collective may stay unfinished before this rank counts it as a hang.",
        detail=(
            "The rank's hang_seconds config key. `flare diagnose` judges the run by it (the largest of its "
            "ranks') when it is not told a threshold itself (--hang-seconds, FLARE_HANG_SECONDS, "
            "hang_seconds in its config file)."
        ),
    ),
    MetricSpec(
        "flare_collective_duration_seconds",
        HISTOGRAM,
        "seconds",
        "Time from issuing a collective to its completion.",
        ("group", "op"),
        COLLECTIVE_DURATION_BUCKETS,
        detail="Device time from CUDA events on GPUs, completion of the work on CPU/gloo.",
    ),
    MetricSpec(
        "flare_collective_bytes_total",
        COUNTER,
        "bytes",
        "Bytes this rank contributed to completed collectives.",
        ("group", "op"),
        detail="Its input; for scatter and receives, what it received.",
    ),
    MetricSpec(
        "flare_shim_collective_duration_seconds",
        HISTOGRAM,
        "seconds",
        "Device time of the NCCL calls the launch shim sampled.",
        ("op",),
        COLLECTIVE_DURATION_BUCKETS,
        detail=(
            "The collectives flare_collective_duration_seconds counts by group, seen from below Python "
            "(docs/shim.md), where NCCL calls carry no group name: compare them, do not add them up. "
            "Calls grouped by ncclGroupStart/End time the whole group. Absent without the shim."
        ),
    ),
    MetricSpec(
        "flare_shim_collective_bytes_total",
        COUNTER,
        "bytes",
        "Bytes of the NCCL calls the launch shim sampled.",
        ("op",),
        detail="Their element count times the element size. Absent without the shim.",
    ),
    MetricSpec(
        "flare_collective_last_issued_seq",
        GAUGE,
        "",
        "Last sequence number this rank issued in the group.",
        ("group",),
        detail="Starts at 1.",
    ),
    MetricSpec(
        "flare_collective_last_completed_seq",
        GAUGE,
        "",
        "Highest sequence number completed in the group.",
        ("group",),
    ),
    MetricSpec(
        "flare_collective_in_flight_info",
        INFO,
        "",
        "Op and state of the oldest unfinished collective.",
        ("group", "op", "state"),
        detail=(
            "State issued: handed to the backend; started: running on the device. Absent when nothing is in "
            "flight."
        ),
    ),
    MetricSpec(
        "flare_collective_in_flight_seq",
        GAUGE,
        "",
        "Sequence number of the oldest unfinished collective.",
        ("group",),
        detail="Sends and receives are not collectives: see flare_p2p_in_flight_started_timestamp_seconds.",
    ),
    MetricSpec(
        "flare_collective_in_flight_bytes",
        GAUGE,
        "bytes",
        "Payload of the oldest unfinished collective.",
        ("group",),
    ),
    MetricSpec(
        "flare_collective_in_flight_started_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time the oldest unfinished collective was issued.",
        ("group",),
    ),
    MetricSpec(
        "flare_p2p_issued_total",
        COUNTER,
        "",
        "Sends or receives this rank issued to or from a peer in the group.",
        ("group", "peer", "direction"),
        detail=(
            "peer: the other side's global rank (`any` for a receive from any source); direction: send or "
            "recv. Counted apart from the collectives, as the flight recorder's p2p_seq_id: the n-th send "
            "from A to B matches B's n-th receive from A. One series per peer this rank exchanged with."
        ),
    ),
    MetricSpec(
        "flare_p2p_completed_total",
        COUNTER,
        "",
        "Sends or receives to or from a peer in the group that completed.",
        ("group", "peer", "direction"),
        detail="On gloo a send or receive completes when its wait() returns.",
    ),
    MetricSpec(
        "flare_p2p_bytes_total",
        COUNTER,
        "bytes",
        "Bytes of completed sends or receives to or from a peer in the group.",
        ("group", "peer", "direction"),
    ),
    MetricSpec(
        "flare_p2p_duration_seconds",
        HISTOGRAM,
        "seconds",
        "Time from issuing a send or receive to its completion, as the backend reports it.",
        ("group", "direction"),
        COLLECTIVE_DURATION_BUCKETS,
        detail=(
            "gloo: until the op's wait() returned (a send completes once its peer received); NCCL: device "
            "time from CUDA events."
        ),
    ),
    MetricSpec(
        "flare_p2p_in_flight_started_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time the oldest unfinished send or receive to or from the peer was issued, per direction.",
        ("group", "peer", "direction"),
        detail="Absent when no send or receive to or from the peer is in flight in the group.",
    ),
    MetricSpec(
        "flare_p2p_in_flight_bytes",
        GAUGE,
        "bytes",
        "Payload of the oldest unfinished send or receive to or from the peer, per direction.",
        ("group", "peer", "direction"),
    ),
    MetricSpec(
        "flare_rank_stack_info",
        INFO,
        "",
        "What the stalled training thread is doing.",
        ("activity", "frames"),
        detail=(
            "Present after stall_seconds without progress: its activity (collective, data or compute) and "
            "innermost Python frames (file:line function, innermost first, at most 3 and 240 characters)."
        ),
    ),
    MetricSpec(
        "flare_rank_exception_info",
        INFO,
        "",
        "The exception (type and cause) that is ending this rank.",
        ("type", "cause"),
        detail=(
            "Present from the moment it is raised out of the training script. type: the exception's class "
            "name (at most 64 characters); cause: one of " + ", ".join(EXCEPTION_CAUSES) + ", from its root "
            "cause (flare_exporter/causes.py: a DataLoader worker's exception, or the innermost of its "
            "chain); communication is what a survivor of a lost peer raises (secondary)."
        ),
    ),
    MetricSpec(
        "flare_rank_exception_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time the exception ending this rank was raised.",
        detail="Raised out of the training script.",
    ),
    MetricSpec(
        "flare_rank_terminated_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time this rank received a signal that ends it.",
        ("signal", "sender"),
        detail=(
            "signal: " + ", ".join(TERMINATION_SIGNALS) + " (where the default action would end the rank; "
            "a handler of the script's own is left alone). sender: launcher when the rank runs under "
            "torchrun's elastic agent or Slurm's srun (which stop the survivors of a failed rank this way), "
            "else unknown."
        ),
    ),
    # the profiler
    MetricSpec(
        "flare_profile_captures_total",
        COUNTER,
        "",
        "Profiler captures this rank ended, by outcome.",
        ("outcome",),
        detail="outcome: " + ", ".join(PROFILE_OUTCOMES) + ". Present where the rank runs with profile: on.",
    ),
    MetricSpec(
        "flare_profile_armed_total",
        COUNTER,
        "",
        "Captures this rank armed, by what asked for them.",
        ("trigger",),
        detail="trigger: " + ", ".join(PROFILE_TRIGGERS) + ". Present where the rank runs with profile: on.",
    ),
    MetricSpec(
        "flare_profile_refused_total",
        COUNTER,
        "",
        "Capture requests refused: one was running, or the cooldown after the last had not passed.",
    ),
    MetricSpec(
        "flare_profile_last_end_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time the last capture ended.",
    ),
    MetricSpec(
        "flare_profile_bottleneck_info",
        INFO,
        "",
        "The bottleneck class of the last capture, from its summary.",
        ("bottleneck",),
        detail="The perf monitor's classes (input_bound, communication_bound, ..., compute_bound).",
    ),
    MetricSpec(
        "flare_profile_step_seconds",
        GAUGE,
        "seconds",
        "Mean step time of the last capture.",
    ),
    MetricSpec(
        "flare_profile_share_ratio",
        GAUGE,
        "",
        "Share of the last capture's step time in each part.",
        ("part",),
        detail="part: " + ", ".join(PROFILE_PARTS) + " (exposed_communication: not overlapped by compute).",
    ),
    # issue latency (ILD)
    MetricSpec(
        "flare_kernel_issue_latency_seconds",
        HISTOGRAM,
        "seconds",
        "Device start minus host launch of sampled kernels.",
        (),
        ISSUE_LATENCY_BUCKETS,
        detail=(
            "A stalling host drains the device queue and the distribution collapses toward zero. Present "
            "only where a launch source exists (CUDA, the fake device)."
        ),
    ),
    MetricSpec(
        "flare_host_dispatch_latency_seconds",
        HISTOGRAM,
        "seconds",
        "Sampled framework ops' time from dispatch to return.",
        (),
        ISSUE_LATENCY_BUCKETS,
        detail=(
            "One step in ild_dispatch_every_steps; on GPUs an op returns at its launch, on CPU after its "
            "execution."
        ),
    ),
    MetricSpec(
        "flare_ild_drift_ks",
        GAUGE,
        "",
        "Kolmogorov-Smirnov statistic, window vs baseline.",
        ("distribution",),
        detail=(
            "Largest CDF difference (0..1) over the histogram buckets, against this rank's own baseline; "
            "absent until both have enough samples. distribution: kernel_issue, host_dispatch, host_gap "
            "(the training thread's gaps between top-level ops in the host dispatch windows; no histogram "
            "of its own)."
        ),
    ),
    MetricSpec(
        "flare_ild_drift_wasserstein_seconds",
        GAUGE,
        "seconds",
        "Wasserstein-1 distance, window vs baseline.",
        ("distribution",),
        detail=(
            "Over the histogram buckets' log-midpoints, against this rank's own baseline; absent until both "
            "have enough samples."
        ),
    ),
    MetricSpec(
        "flare_ild_op_shift_seconds",
        GAUGE,
        "seconds",
        "Delay added to every op since the baseline.",
        ("distribution",),
        detail=(
            "Host dispatch only. Weighted median over ops (by baseline stability) of each op's fastest "
            "time per sampled step minus its baseline's, after the part proportional to each op's time (a "
            "slower core) is taken out; native timer only; absent until the window has ops with a baseline."
        ),
    ),
    MetricSpec(
        "flare_steps_total",
        COUNTER,
        "",
        "Optimizer steps taken by this rank.",
        detail="The first optimizer that steps counts.",
    ),
    MetricSpec(
        "flare_step_duration_seconds",
        HISTOGRAM,
        "seconds",
        "Time between consecutive optimizer steps on this rank.",
        (),
        STEP_DURATION_BUCKETS,
    ),
    MetricSpec(
        "flare_heartbeat_timestamp_seconds",
        GAUGE,
        "seconds",
        "Unix time of the training thread's last progress.",
        detail="An optimizer step or a collective issued.",
    ),
    # stragglers and GPU health
    MetricSpec(
        "flare_straggler_window_step_seconds",
        GAUGE,
        "seconds",
        "Mean step time over one straggler window.",
        ("ago",),
        detail="ago=0 is the last closed window, ago=1 the one before, ... (straggler_windows of them).",
    ),
    MetricSpec(
        "flare_straggler_window_wait_seconds",
        GAUGE,
        "seconds",
        "Mean collective time per step over the window.",
        ("ago",),
        detail=(
            "Same window as flare_straggler_window_step_seconds. Issue to completion, summed over the step's "
            "collectives; a straggler waits least, the others wait for it."
        ),
    ),
    MetricSpec(
        "flare_straggler_last_window",
        GAUGE,
        "",
        "Number of the last closed straggler window.",
        detail="Window n holds steps n*straggler_window_steps+2 onwards, the same steps on every rank.",
    ),
    MetricSpec(
        "flare_straggler_best_step_seconds",
        GAUGE,
        "seconds",
        "The rank's lowest window mean step time so far.",
    ),
    MetricSpec(
        "flare_straggler_slowdown_ratio",
        GAUGE,
        "",
        "Last window's mean step time over the best.",
        detail="Best: the rank's own lowest window mean so far; 1: as fast as it has ever been.",
    ),
    # what the rank's host is doing to it (rank/host_load.py): read with a slowdown (engine/host_load.py)
    MetricSpec(
        "flare_host_cpu_pressure_ratio",
        GAUGE,
        "",
        "Share of the last 10 s some runnable task on the host waited for a CPU.",
        detail="Linux PSI's /proc/pressure/cpu some avg10; absent where the kernel has no PSI.",
    ),
    MetricSpec(
        "flare_host_cpu_pressure_floor_ratio",
        GAUGE,
        "",
        "The lowest flare_host_cpu_pressure_ratio read as the rank closed its straggler windows.",
        detail="The host at its quietest while the job ran: a slowdown with the pressure risen above it is "
        "the host's load.",
    ),
    MetricSpec(
        "flare_host_runnable_tasks",
        GAUGE,
        "",
        "Runnable tasks on the host now (its run queue).",
        detail="/proc/stat procs_running, the reading thread included: beside flare_host_cpus.",
    ),
    MetricSpec(
        "flare_host_cpus",
        GAUGE,
        "",
        "CPUs the rank may run on (its affinity).",
    ),
    MetricSpec(
        "flare_training_thread_cpu_ratio",
        GAUGE,
        "",
        "The training thread's CPU time over wall time since the last reading.",
        detail="Over at least 1 s; the main thread's. Low while the thread waits (collectives, data, a "
        "device) or while a busy host keeps it off the cores.",
    ),
    # where the step time goes (rank/perf.py), MFU, and what the badput ledger charges (engine/perf.py)
    MetricSpec(
        "flare_step_phase_seconds_total",
        COUNTER,
        "seconds",
        "Seconds of this rank's steps spent in each phase.",
        ("phase",),
        detail=(
            "Over the steps in flare_step_phase_steps_total. data: in the DataLoader iterator's next; "
            "optimizer: in optimizer.step; collective: waiting for collectives with no newer one issued "
            "(from each burst's last issue to its completion: not overlapped by compute); host: the training "
            "thread's time between top-level ops outside data and optimizer (interpreter, GIL waits, garbage "
            "collection, the script's sleeps; a gap in which a collective completed is its wait, not host), "
            "timed in the host dispatch windows, a step between windows given the last measured steps' "
            "share; absent where not measured (no windows, GPU processes); compute: the rest of the step. "
            "transfer: reserved (not measured yet). The badput ledger charges the rank with the least "
            "collective time per step with the others' excess (`flare stragglers`)."
        ),
    ),
    MetricSpec(
        "flare_step_phase_steps_total",
        COUNTER,
        "",
        "Steps accounted in flare_step_phase_seconds_total.",
    ),
    MetricSpec(
        "flare_step_collective_seconds_total",
        COUNTER,
        "seconds",
        "The collective phase of this rank's steps by the role of the group waited on.",
        ("role",),
        detail=(
            "Sums to the collective phase of flare_step_phase_seconds_total. Within a busy period of "
            "overlapping collectives, the exposed part (from the period's last issue to its end) is the "
            "role's of the last-issued collective's group (flare_process_group_info: dp, tp, pp, ep, cp, "
            "world, other). Present for the roles of the rank's process groups, 0 until waited on."
        ),
    ),
    MetricSpec(
        "flare_model_flops_per_step",
        GAUGE,
        "",
        "Model FLOPs of one training step.",
        detail=(
            "Counted by torch.utils.flop_counter on one sampled step (perf_flops_step), or configured "
            "(model_flops_per_step)."
        ),
    ),
    MetricSpec(
        "flare_achieved_flops",
        GAUGE,
        "",
        "Model FLOPs per second over the last steps.",
        detail="flare_model_flops_per_step over the mean step time of the last perf_window_steps steps.",
    ),
    MetricSpec(
        "flare_mfu_ratio",
        GAUGE,
        "",
        "Model FLOPs utilization: achieved over peak FLOP/s.",
        detail="Peak: peak_flops, else the dense BF16 peak of the GPU model by its NVML name; else absent.",
    ),
    MetricSpec(
        "flare_gpu_health_up",
        GAUGE,
        "",
        "1 if NVML answered at the last poll, else 0.",
        detail=(
            "0 with no NVML, no GPU, or GPU health disabled; the other flare_gpu_ series are present only "
            "when it is 1."
        ),
    ),
    MetricSpec(
        "flare_gpu_clock_event_active",
        GAUGE,
        "",
        "1 while NVML reports this throttle reason, else 0.",
        ("reason",),
        detail="NVML's clock-event (once throttle) reasons: one series per reason of a fixed list.",
    ),
    MetricSpec("flare_gpu_sm_clock_hertz", GAUGE, "", "Current SM clock of the rank's GPU."),
    MetricSpec("flare_gpu_sm_clock_max_hertz", GAUGE, "", "Maximum SM clock of the rank's GPU."),
    MetricSpec("flare_gpu_temperature_celsius", GAUGE, "", "GPU core temperature."),
    MetricSpec("flare_gpu_power_watts", GAUGE, "", "GPU power draw."),
    MetricSpec("flare_gpu_power_limit_watts", GAUGE, "", "Enforced GPU power limit."),
    MetricSpec("flare_gpu_pcie_link_generation", GAUGE, "", "Current PCIe link generation of the GPU."),
    MetricSpec("flare_gpu_pcie_link_generation_max", GAUGE, "", "Maximum PCIe link generation of the GPU."),
    MetricSpec("flare_gpu_pcie_link_width", GAUGE, "", "Current PCIe link width (lanes) of the GPU."),
    MetricSpec("flare_gpu_pcie_link_width_max", GAUGE, "", "Maximum PCIe link width (lanes) of the GPU."),
    MetricSpec("flare_gpu_pcie_replays_total", COUNTER, "", "PCIe replay counter of the GPU."),
    MetricSpec(
        "flare_gpu_ecc_errors_total",
        COUNTER,
        "",
        "GPU memory ECC errors since the driver loaded, by type.",
        ("type",),
        detail="Volatile counts, by type: corrected, uncorrected.",
    ),
    MetricSpec(
        "flare_gpu_xid_events_total",
        COUNTER,
        "",
        "Critical XID events NVML delivered for the rank's GPU.",
        detail="Since the exporter started.",
    ),
    MetricSpec(
        "flare_gpu_last_xid",
        GAUGE,
        "",
        "Code of the last critical XID event on the rank's GPU.",
        detail="Absent until one happens.",
    ),
    MetricSpec(
        "flare_gpu_nvlink_errors_total",
        COUNTER,
        "",
        "NVLink errors of the GPU, summed over its links.",
        ("counter",),
        detail="By counter: replay, recovery, crc_flit, crc_data; summed over the active links.",
    ),
    MetricSpec(
        "flare_gpu_remapped_rows",
        GAUGE,
        "",
        "GPU memory rows remapped, by cause.",
        ("cause",),
    ),
    MetricSpec(
        "flare_gpu_row_remap_pending",
        GAUGE,
        "",
        "1 if a row remapping is pending, else 0.",
        detail="It takes effect at the next GPU reset.",
    ),
    MetricSpec(
        "flare_gpu_row_remap_failed",
        GAUGE,
        "",
        "1 if a row remapping failed (replace the GPU), else 0.",
    ),
    # the canary (rank/canary.py): benchmarks of the rank's hardware before the first step and in flight
    MetricSpec(
        "flare_canary_value",
        GAUGE,
        "",
        "Last canary measurement of this rank, in base units (FLOP/s, bytes/s, or a ratio).",
        ("measurement", "scope", "phase"),
        detail=(
            "measurement: gemm_flops, allreduce_busbw, allgather_busbw (nccl-tests' bus bandwidth), "
            "h2d_copy, d2h_copy, storage_read (bytes/s), gpu_pcie_width (current over maximum lanes), "
            "gpu_clock_ok (0 while a slowdown reason is active); scope: device, intra_host (ranks sharing a "
            "host), inter_host (one rank per host), path0.. (canary_storage_paths, in order); phase: "
            "preflight, in_flight."
        ),
    ),
    MetricSpec(
        "flare_canary_relative",
        GAUGE,
        "",
        "Preflight measurement over the job's median for the same measurement and scope.",
        ("measurement", "scope"),
        detail="1: as fast as the job's median rank; canary_relative_floor is the pass line.",
    ),
    MetricSpec(
        "flare_canary_failed",
        GAUGE,
        "",
        "1 if this rank failed the canary's policy for this measurement, else 0.",
        ("measurement", "scope", "phase"),
        detail=(
            "preflight: below an absolute floor (canary_min_*) or below canary_relative_floor of the job's "
            "median; in_flight: below canary_in_flight_fraction of the rank's own preflight value."
        ),
    ),
    MetricSpec(
        "flare_canary_ewma_ratio",
        GAUGE,
        "",
        "Exponentially weighted moving average of in-flight measurements over the preflight value.",
        ("measurement", "scope"),
    ),
    MetricSpec(
        "flare_canary_drift",
        GAUGE,
        "",
        "1 while the in-flight average is below the drift band (canary_drift_band), else 0.",
        ("measurement", "scope"),
    ),
    MetricSpec(
        "flare_canary_preflight_passed",
        GAUGE,
        "",
        "1 if every rank passed the preflight, 0 if one failed (the same value on every rank).",
        detail="Absent until the preflight ran; under canary=enforce a failed one ends the job (exit 75).",
    ),
    MetricSpec(
        "flare_canary_runs_total",
        COUNTER,
        "",
        "Canary runs completed, by phase.",
        ("phase",),
    ),
    MetricSpec(
        "flare_canary_duration_seconds",
        GAUGE,
        "seconds",
        "Wall time of the last canary run, by phase.",
        ("phase",),
    ),
    MetricSpec(
        "flare_exporter_errors_total",
        COUNTER,
        "",
        "Errors the exporter caught instead of raising, by component.",
        ("component",),
    ),
    MetricSpec(
        "flare_exporter_dropped_events_total",
        COUNTER,
        "",
        "Events not turned into metrics, by queue.",
        ("queue",),
        detail=(
            "A bounded queue or table was full (completed_collectives, polled_collectives, process_groups, "
            "ild_events, ...), or the collective failed (failed_collectives)."
        ),
    ),
    MetricSpec(
        "flare_exporter_collector_success",
        GAUGE,
        "",
        "1 if the collector succeeded on this scrape, else 0.",
        ("collector",),
    ),
    MetricSpec(
        "flare_exporter_collector_duration_seconds",
        GAUGE,
        "seconds",
        "Time the collector took on this scrape.",
        ("collector",),
    ),
)

BY_NAME: dict[str, MetricSpec] = {}
for _metric in METRICS:
    if _metric.name in BY_NAME:
        raise ValueError(f"metric {_metric.name} is declared twice")
    BY_NAME[_metric.name] = _metric


def exposed_series_names(metric: MetricSpec) -> tuple[str, ...]:
    """The sample names Prometheus stores for a metric (histograms expose three)."""
    if metric.type == HISTOGRAM:
        return (metric.name + "_bucket", metric.name + "_sum", metric.name + "_count")
    return (metric.name,)


def all_series_names() -> frozenset[str]:
    """Every sample name the exporter may expose; rules and dashboards may only name these."""
    return frozenset(name for metric in METRICS for name in exposed_series_names(metric))


_SERIES = all_series_names()


def series(name: str) -> str:
    """`name`, a sample name the exporter exposes (a declared metric, or a declared histogram's _bucket,
    _sum or _count); ValueError otherwise. Code that names a metric takes the name through here (or
    histogram), once, where the module is imported, so that a misspelt or undeclared one fails at once."""
    if name not in _SERIES:
        raise ValueError(f"{name} is no series of a metric the spec declares (flare_exporter/spec.py)")
    return name


def histogram(name: str) -> str:
    """`name`, a metric the spec declares as a histogram; ValueError otherwise."""
    if name not in BY_NAME or BY_NAME[name].type != HISTOGRAM:
        raise ValueError(f"{name} is no histogram the spec declares (flare_exporter/spec.py)")
    return name
