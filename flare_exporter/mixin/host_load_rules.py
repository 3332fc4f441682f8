"""Recording rules and the alert of a busy host: engine/host_load.py's rules in PromQL.

Per run and host, the median of its ranks' readings (flare_host_*, rank/host_load.py), whether the host is
busy by HostLoadPolicy, and the least slowdown of its ranks against their own best. FlareHostBusy fires where
every rank of a busy host is job_slowdown slower than its own best: the host's load, not a rank's fault.
FlareJobSlowdown (straggler_rules.straggler_alerts) stays quiet where every host of the run is busy
(BUSY_EVERYWHERE): its slowdown is the hosts' then.
"""

from __future__ import annotations

from .. import spec
from ..policies import HostLoadPolicy
from .rule_model import Alert, Recording, Thresholds, link, selector

HOST_CPUS = spec.series("flare_host_cpus")
HOST_CPU_PRESSURE_FLOOR_RATIO = spec.series("flare_host_cpu_pressure_floor_ratio")
HOST_CPU_PRESSURE_RATIO = spec.series("flare_host_cpu_pressure_ratio")
HOST_RUNNABLE_TASKS = spec.series("flare_host_runnable_tasks")
STRAGGLER_SLOWDOWN_RATIO = spec.series("flare_straggler_slowdown_ratio")

BUSY = "run_host:flare_host:busy"
SLOWED = "run_host:flare_straggler_slowdown_ratio:min"
HOSTS = "count by (run, host) (run_rank:flare_rank_info:host)"
# runs whose every host is busy (a job-wide slowdown there is the hosts'): for `unless on (run)`
BUSY_EVERYWHERE = f"count by (run) ({BUSY}) >= count by (run) ({HOSTS})"


def _per_host(rank_expr: str, how: str = "quantile by (run, host) (0.5,") -> str:
    """`rank_expr` (one series per run and rank) joined to each rank's host, then aggregated per host."""
    joined = f"  ({rank_expr})\n  * on (run, rank) group_left (host) run_rank:flare_rank_info:host"
    return f"{how}\n{joined}\n)"


def host_load_recording_rules(t: Thresholds) -> list[Recording]:
    policy = HostLoadPolicy()
    s = selector(t)
    pressure, floor = (
        "run_host:flare_host_cpu_pressure_ratio:median",
        "run_host:flare_host_cpu_pressure_floor_ratio:median",
    )
    per_cpu = "run_host:flare_host_runnable_per_cpu:median"
    return [
        Recording(pressure, _per_host(f"max by (run, rank) ({HOST_CPU_PRESSURE_RATIO}{s})")),
        Recording(floor, _per_host(f"max by (run, rank) ({HOST_CPU_PRESSURE_FLOOR_RATIO}{s})")),
        Recording(
            per_cpu,
            _per_host(
                f"max by (run, rank) ({HOST_RUNNABLE_TASKS}{s})\n"
                f"  / on (run, rank) max by (run, rank) ({HOST_CPUS}{s})",
            ),
        ),
        # busy (its value: the pressure, or the runnable tasks per CPU where the host has no PSI)
        Recording(
            BUSY,
            f"(\n  {pressure} >= {policy.cpu_pressure:g}\n"
            f"  and on (run, host) ({pressure} - on (run, host) {floor} >= {policy.pressure_rise:g})\n)\n"
            f"or ({per_cpu} >= {policy.runnable_per_cpu:g} unless on (run, host) {pressure})",
        ),
        Recording(
            SLOWED,
            _per_host(f"max by (run, rank) ({STRAGGLER_SLOWDOWN_RATIO}{s})", "min by (run, host) ("),
        ),
    ]


def host_load_alerts(t: Thresholds) -> list[Alert]:
    return [
        Alert(
            "FlareHostBusy",
            f"{SLOWED} >= {1 + t.stragglers.job_slowdown:g}\nand on (run, host) {BUSY}",
            t.straggler_for,
            "warning",
            "Host {{ $labels.host }} of run {{ $labels.run }} is busy: its ranks slowed alike",
            "Every rank of run {{ $labels.run }} on host {{ $labels.host }} takes at least "
            '{{ $value | printf "%.2f" }} times its own best step time, while the host\'s runnable tasks '
            f"wait for its CPUs more than ever before in the run (`{HOST_CPU_PRESSURE_RATIO}`): the "
            "host's load (other processes, data workers, another job), not a rank's fault. Find what else "
            "runs there.",
            "flarehostbusy",
            link("overview"),
        )
    ]
