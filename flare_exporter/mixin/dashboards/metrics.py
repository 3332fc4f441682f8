"""Every metric a panel names, looked up in the spec (or the recording rules) when this module is imported."""

from __future__ import annotations

from ... import spec
from .. import dashboard_rules, perf_rules, rule_model, rules

THRESHOLDS = rule_model.Thresholds()
RECORDED = frozenset(recording.record for recording in rules.all_recordings(THRESHOLDS))
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})  # what Prometheus itself writes, besides the spec's


def _defined(name: str) -> str:
    """`name`, a recording rule's or Prometheus's own series, else one the spec declares (spec.series:
    ValueError otherwise)."""
    return name if name in RECORDED | PROMETHEUS_SERIES else spec.series(name)


ALERTS = _defined("ALERTS")
RANK_INFO = spec.series("flare_rank_info")
GROUP_INFO = spec.series("flare_process_group_info")
STEPS = spec.series("flare_steps_total")
STEP_DURATION = spec.histogram("flare_step_duration_seconds")
HEARTBEAT = spec.series("flare_heartbeat_timestamp_seconds")
COLLECTIVE_DURATION = spec.histogram("flare_collective_duration_seconds")
COLLECTIVE_BYTES = spec.series("flare_collective_bytes_total")
LAST_ISSUED = spec.series("flare_collective_last_issued_seq")
LAST_COMPLETED = spec.series("flare_collective_last_completed_seq")
IN_FLIGHT_INFO = spec.series("flare_collective_in_flight_info")
IN_FLIGHT_STARTED = spec.series("flare_collective_in_flight_started_timestamp_seconds")
STACK_INFO = spec.series("flare_rank_stack_info")
EXCEPTION_INFO = spec.series("flare_rank_exception_info")
KERNEL_ILD = spec.histogram("flare_kernel_issue_latency_seconds")
DISPATCH_ILD = spec.histogram("flare_host_dispatch_latency_seconds")
DRIFT_KS = spec.series("flare_ild_drift_ks")
DRIFT_W1 = spec.series("flare_ild_drift_wasserstein_seconds")
OP_SHIFT = spec.series("flare_ild_op_shift_seconds")
WINDOW_STEP = spec.series("flare_straggler_window_step_seconds")
WINDOW_WAIT = spec.series("flare_straggler_window_wait_seconds")
BEST_STEP = spec.series("flare_straggler_best_step_seconds")
SLOWDOWN = spec.series("flare_straggler_slowdown_ratio")
GPU_UP = spec.series("flare_gpu_health_up")
GPU_CLOCK_EVENT = spec.series("flare_gpu_clock_event_active")
GPU_SM_CLOCK = spec.series("flare_gpu_sm_clock_hertz")
GPU_SM_CLOCK_MAX = spec.series("flare_gpu_sm_clock_max_hertz")
GPU_TEMPERATURE = spec.series("flare_gpu_temperature_celsius")
GPU_POWER = spec.series("flare_gpu_power_watts")
GPU_POWER_LIMIT = spec.series("flare_gpu_power_limit_watts")
GPU_PCIE_GEN = spec.series("flare_gpu_pcie_link_generation")
GPU_PCIE_GEN_MAX = spec.series("flare_gpu_pcie_link_generation_max")
GPU_PCIE_WIDTH = spec.series("flare_gpu_pcie_link_width")
GPU_PCIE_WIDTH_MAX = spec.series("flare_gpu_pcie_link_width_max")
GPU_PCIE_REPLAYS = spec.series("flare_gpu_pcie_replays_total")
GPU_ECC = spec.series("flare_gpu_ecc_errors_total")
GPU_XID_EVENTS = spec.series("flare_gpu_xid_events_total")
GPU_LAST_XID = spec.series("flare_gpu_last_xid")
GPU_NVLINK = spec.series("flare_gpu_nvlink_errors_total")
GPU_REMAPPED = spec.series("flare_gpu_remapped_rows")
GPU_REMAP_PENDING = spec.series("flare_gpu_row_remap_pending")
GPU_REMAP_FAILED = spec.series("flare_gpu_row_remap_failed")
EXPORTER_ERRORS = spec.series("flare_exporter_errors_total")
EXPORTER_DROPPED = spec.series("flare_exporter_dropped_events_total")
COLLECTOR_SUCCESS = spec.series("flare_exporter_collector_success")
COLLECTOR_DURATION = spec.series("flare_exporter_collector_duration_seconds")
GROUP_MAX_AGE = _defined("run_group:flare_collective_in_flight:max_age_seconds")
GROUP_RANK_BEHIND = _defined("run_group_rank:flare_collective_issued:behind")
# The straggler alert's score: each rank's robust z below the median wait share, its lowest over the last
# windows (the slow signals' rule group records it).
STRAGGLER_SCORE = _defined("run_rank:flare_straggler_score:held")
# where the step time goes (rank/perf.py) and what each rank cost the job (the flare.perf rules)
PHASE_SECONDS = spec.series("flare_step_phase_seconds_total")
PHASE_STEPS = spec.series("flare_step_phase_steps_total")
MODEL_FLOPS = spec.series("flare_model_flops_per_step")
ACHIEVED_FLOPS = spec.series("flare_achieved_flops")
MFU = spec.series("flare_mfu_ratio")
PHASE_PER_STEP = _defined(perf_rules.PER_STEP)
PHASE_SHARE = _defined(perf_rules.SHARE)
BOTTLENECK = _defined(perf_rules.BOTTLENECK)
LOST_BY_RANK = _defined(perf_rules.LOST_BY_RANK)
LOST_BY_HOST = _defined(perf_rules.LOST_BY_HOST)
COLLECTIVE_ROLE_SHARE = _defined(perf_rules.ROLE_SHARE)
# the hardware canary (rank/canary.py)
CANARY_RELATIVE = spec.series("flare_canary_relative")
CANARY_FAILED = spec.series("flare_canary_failed")
CANARY_EWMA = spec.series("flare_canary_ewma_ratio")
CANARY_DURATION = spec.series("flare_canary_duration_seconds")
# the ranks heatmaps' buckets, counted by the flare.dashboards rules
STEP_TIME_RANKS = _defined(dashboard_rules.STEP_TIME_RANKS)
WAIT_SHARE_RANKS = _defined(dashboard_rules.WAIT_SHARE_RANKS)
DRIFT_KS_RANKS = _defined(dashboard_rules.DRIFT_KS_RANKS)
