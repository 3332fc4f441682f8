"""The bounded values labels may take, and the histogram buckets: one definition each.

The metric spec (spec.py) declares which labels each metric carries; this module says what those labels
may hold, so that collectors, rules, dashboards and the engine agree on every op, role, phase and bucket.
"""

from __future__ import annotations


def log_buckets(lowest: float, highest: float, per_decade: int) -> tuple[float, ...]:
    """Log-spaced bucket bounds from `lowest` to `highest`, `per_decade` bounds per factor of ten."""
    bounds: list[float] = []
    exponent = 0
    while True:
        bound = float(f"{lowest * 10 ** (exponent / per_decade):.3g}")
        if not bounds or bound > bounds[-1]:  # rounding can repeat a bound when per_decade is large
            bounds.append(bound)
        if bound >= highest * 0.9999:
            return tuple(bounds)
        exponent += 1


COLLECTIVE_OPS = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
)

# Point-to-point ops: their own kind, with a peer and no group-wide sequence number (flare_p2p_*).
POINT_TO_POINT_OPS = frozenset({"send", "recv", "recv_anysource"})
ANY_PEER = "any"  # the peer label of a receive from any source


def point_to_point_direction(op: str) -> str:
    """send for a send, recv for either receive."""
    return "send" if op == "send" else "recv"


def peer_label(peer: int) -> str:
    """A point-to-point op's peer as a label: its global rank, or `any` (a receive from any source)."""
    return str(peer) if peer >= 0 else ANY_PEER


GROUP_ROLES = ("world", "dp", "tp", "pp", "ep", "cp", "other")
IN_FLIGHT_STATES = ("issued", "started")
TERMINATION_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
ACTIVITIES = ("collective", "data", "compute")
# Where a step's time goes (flare_step_phase_seconds_total; rank/perf.py); compute: the rest of the step.
# bubble: waits in sends and receives (a pipeline stage waiting for the stages before and after it)
STEP_PHASES = ("data", "optimizer", "collective", "bubble", "host", "transfer", "compute")
# The role the straggler windows give a send's or receive's wait: the bubble phase, not a group's collectives
P2P_ROLE = "p2p"

COLLECTIVE_DURATION_BUCKETS = log_buckets(1e-5, 100.0, 2)  # 10 µs .. 100 s, 15 bounds
STEP_DURATION_BUCKETS = log_buckets(1e-3, 1000.0, 2)  # 1 ms .. 1000 s, 13 bounds
ISSUE_LATENCY_BUCKETS = log_buckets(1e-7, 10.0, 5)  # 100 ns .. 10 s, 41 bounds (ILD)
# host_gap: the training thread's time between ops in the host dispatch windows (rank/dispatch.py); its drift
# only (flare_ild_drift_*), no histogram
ILD_DISTRIBUTIONS = ("kernel_issue", "host_dispatch", "host_gap")
CANARY_MEASUREMENTS = (
    "gemm_flops",
    "allreduce_busbw",
    "allgather_busbw",
    "h2d_copy",
    "d2h_copy",
    "storage_read",
    "gpu_pcie_width",
    "gpu_clock_ok",
)  # in the order a verdict names them: a rank slow at compute is slow at everything after it
CANARY_MAX_STORAGE_PATHS = 8
CANARY_SCOPES = (
    "device",
    "intra_host",
    "inter_host",
    *(f"path{index}" for index in range(CANARY_MAX_STORAGE_PATHS)),
)
CANARY_PHASES = ("preflight", "in_flight")
PROFILE_OUTCOMES = ("captured", "failed")
# What armed a capture: a person (`flare profile`), a page (`flare profile --on-alert`), a peer whose own
# signals fired (for a healthy capture beside its own), or the rank's own signals (profile_on_anomaly)
PROFILE_TRIGGERS = ("asked", "alert", "peer", "straggler", "ild_shift", "canary_failed")
PROFILE_ASKED_TRIGGERS = PROFILE_TRIGGERS[:3]  # those an HTTP request may name
# Where a captured step's time went (profile_summary.py): shares of the capture's step time
PROFILE_PARTS = ("compute", "communication", "exposed_communication", "copy", "idle", "data")

# The reasons of flare_gpu_clock_event_active that slow a busy GPU against the user's wishes: what a
# straggler verdict and the rules report (the others: idle, an application's clock setting, sync boost).
GPU_SLOWDOWN_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
