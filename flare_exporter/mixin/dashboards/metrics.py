"""Every metric a panel names, checked against the spec (or a recording rule) when this module is imported."""

from __future__ import annotations

from ... import spec
from .. import dashboard_rules, perf_rules, rule_model, rules

THRESHOLDS = rule_model.Thresholds()
RECORDED = frozenset(recording.record for recording in rules.all_recordings(THRESHOLDS))
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})  # what Prometheus itself writes, besides the spec's


def _defined(name: str) -> str:
    """`name`, or ValueError when neither the spec, a recording rule nor Prometheus defines it."""
    if name not in spec.all_series_names() | RECORDED | PROMETHEUS_SERIES:
        raise ValueError(f"dashboards name {name}, which neither the spec nor a recording rule defines")
    return name


def _histogram(name: str) -> str:
    """`name`, or ValueError when the spec does not declare it as a histogram."""
    if spec.BY_NAME.get(name, None) is None or spec.BY_NAME[name].type != spec.HISTOGRAM:
        raise ValueError(f"dashboards use {name} as a histogram; the spec does not declare it as one")
    return name


UP = _defined("up")
ALERTS = _defined("ALERTS")
RANK_INFO = _defined("flare_rank_info")
GROUP_INFO = _defined("flare_process_group_info")
STEPS = _defined("flare_steps_total")
STEP_DURATION = _histogram("flare_step_duration_seconds")
HEARTBEAT = _defined("flare_heartbeat_timestamp_seconds")
COLLECTIVE_DURATION = _histogram("flare_collective_duration_seconds")
COLLECTIVE_BYTES = _defined("flare_collective_bytes_total")
LAST_ISSUED = _defined("flare_collective_last_issued_seq")
LAST_COMPLETED = _defined("flare_collective_last_completed_seq")
IN_FLIGHT_INFO = _defined("flare_collective_in_flight_info")
IN_FLIGHT_SEQ = _defined("flare_collective_in_flight_seq")
IN_FLIGHT_STARTED = _defined("flare_collective_in_flight_started_timestamp_seconds")
STACK_INFO = _defined("flare_rank_stack_info")
EXCEPTION_INFO = _defined("flare_rank_exception_info")
KERNEL_ILD = _histogram("flare_kernel_issue_latency_seconds")
DISPATCH_ILD = _histogram("flare_host_dispatch_latency_seconds")
DRIFT_KS = _defined("flare_ild_drift_ks")
DRIFT_W1 = _defined("flare_ild_drift_wasserstein_seconds")
OP_SHIFT = _defined("flare_ild_op_shift_seconds")
WINDOW_STEP = _defined("flare_straggler_window_step_seconds")
WINDOW_WAIT = _defined("flare_straggler_window_wait_seconds")
BEST_STEP = _defined("flare_straggler_best_step_seconds")
SLOWDOWN = _defined("flare_straggler_slowdown_ratio")
GPU_UP = _defined("flare_gpu_health_up")
GPU_CLOCK_EVENT = _defined("flare_gpu_clock_event_active")
GPU_SM_CLOCK = _defined("flare_gpu_sm_clock_hertz")
GPU_SM_CLOCK_MAX = _defined("flare_gpu_sm_clock_max_hertz")
GPU_TEMPERATURE = _defined("flare_gpu_temperature_celsius")
GPU_POWER = _defined("flare_gpu_power_watts")
GPU_POWER_LIMIT = _defined("flare_gpu_power_limit_watts")
GPU_PCIE_GEN = _defined("flare_gpu_pcie_link_generation")
GPU_PCIE_GEN_MAX = _defined("flare_gpu_pcie_link_generation_max")
GPU_PCIE_WIDTH = _defined("flare_gpu_pcie_link_width")
GPU_PCIE_WIDTH_MAX = _defined("flare_gpu_pcie_link_width_max")
GPU_PCIE_REPLAYS = _defined("flare_gpu_pcie_replays_total")
GPU_ECC = _defined("flare_gpu_ecc_errors_total")
GPU_XID_EVENTS = _defined("flare_gpu_xid_events_total")
GPU_LAST_XID = _defined("flare_gpu_last_xid")
GPU_NVLINK = _defined("flare_gpu_nvlink_errors_total")
GPU_REMAPPED = _defined("flare_gpu_remapped_rows")
GPU_REMAP_PENDING = _defined("flare_gpu_row_remap_pending")
GPU_REMAP_FAILED = _defined("flare_gpu_row_remap_failed")
EXPORTER_ERRORS = _defined("flare_exporter_errors_total")
EXPORTER_DROPPED = _defined("flare_exporter_dropped_events_total")
COLLECTOR_SUCCESS = _defined("flare_exporter_collector_success")
COLLECTOR_DURATION = _defined("flare_exporter_collector_duration_seconds")
GROUP_MAX_AGE = _defined("run_group:flare_collective_in_flight:max_age_seconds")
GROUP_RANK_BEHIND = _defined("run_group_rank:flare_collective_issued:behind")
# The straggler alert's score: each rank's robust z below the median wait share, its lowest over the last
# windows (the slow signals' rule group records it).
STRAGGLER_SCORE = _defined("run_rank:flare_straggler_score:held")
# where the step time goes (rank/perf.py) and what each rank cost the job (the flare.perf rules)
PHASE_SECONDS = _defined("flare_step_phase_seconds_total")
PHASE_STEPS = _defined("flare_step_phase_steps_total")
MODEL_FLOPS = _defined("flare_model_flops_per_step")
ACHIEVED_FLOPS = _defined("flare_achieved_flops")
MFU = _defined("flare_mfu_ratio")
PHASE_PER_STEP = _defined(perf_rules.PER_STEP)
PHASE_SHARE = _defined(perf_rules.SHARE)
BOTTLENECK = _defined(perf_rules.BOTTLENECK)
LOST_BY_RANK = _defined(perf_rules.LOST_BY_RANK)
LOST_BY_HOST = _defined(perf_rules.LOST_BY_HOST)
COLLECTIVE_ROLE_SHARE = _defined(perf_rules.ROLE_SHARE)
# the hardware canary (rank/canary.py)
CANARY_RELATIVE = _defined("flare_canary_relative")
CANARY_FAILED = _defined("flare_canary_failed")
CANARY_EWMA = _defined("flare_canary_ewma_ratio")
CANARY_DURATION = _defined("flare_canary_duration_seconds")
# the ranks heatmaps' buckets, counted by the flare.dashboards rules
STEP_TIME_RANKS = _defined(dashboard_rules.STEP_TIME_RANKS)
WAIT_SHARE_RANKS = _defined(dashboard_rules.WAIT_SHARE_RANKS)
DRIFT_KS_RANKS = _defined(dashboard_rules.DRIFT_KS_RANKS)
