"""Grafana dashboards, generated from the metric spec and the rules' thresholds (`dashboards/`).

    python -m flare_exporter.mixin.dashboards [--out dashboards/] [--check]

Four dashboards, linked to each other and sharing the variables `$datasource`, `$run`, `$group` and
`$rank`: the run at a glance, the collectives of the process groups, issue latency (ILD), and one rank in
depth. They are built with Grafana's own Python builders (grafana-foundation-sdk, in the `dev` extra) and
committed as JSON ready for file provisioning; a test regenerates them and fails when they differ, runs
every panel's query against a real Prometheus, and checks that panels name only metrics the spec or a
recording rule defines. Each panel names its metrics through the constants below, checked against the
spec when this module is imported: a renamed metric is a one-line fix here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import spec
from ..policies import IldPolicy
from . import rules

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dashboards"
TAG = "flare"
DATASOURCE = "${datasource}"
THRESHOLDS = rules.Thresholds()
RECORDED = frozenset(recording.record for recording in rules.all_recordings(THRESHOLDS))
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})  # what Prometheus itself writes, besides the spec's


def _defined(name: str) -> str:
    if name not in spec.all_series_names() | RECORDED | PROMETHEUS_SERIES:
        raise ValueError(f"dashboards name {name}, which neither the spec nor a recording rule defines")
    return name


def _histogram(name: str) -> str:
    if spec.BY_NAME.get(name, None) is None or spec.BY_NAME[name].type != spec.HISTOGRAM:
        raise ValueError(f"dashboards use {name} as a histogram; the spec does not declare it as one")
    return name


# ---------------------------------------------------------------------------------------------------------
# every metric a panel names

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

# What a panel needs beyond an ordinary CPU job (the tests feed those panels from a job that has it).
GPU = "gpu"  # GPU health from NVML (the fake NVML on CPU)
KERNEL = "kernel"  # kernel launches (the fake device on CPU)
DRIFT = "ild_drift"  # an ILD baseline and a window after it
RULES = "rules"  # Prometheus evaluating alerts/flare.rules.yml
FIRING = "firing"  # an alert firing
STALLED = "stalled"  # a collective in flight and a rank stalled (a hang)
NEEDS = frozenset({GPU, KERNEL, DRIFT, RULES, FIRING, STALLED})


# ---------------------------------------------------------------------------------------------------------
# what the dashboards are made of: plain records, turned into Grafana's JSON by `build`


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    format: str = "time_series"  # or "table", "heatmap"


@dataclass(frozen=True)
class Panel:
    kind: str  # timeseries, heatmap, table, stat, gauge, bargauge, state-timeline
    title: str
    description: str
    targets: tuple[Target, ...]
    width: int
    height: int
    unit: str = ""
    needs: frozenset[str] = frozenset()
    min: float | None = None
    max: float | None = None
    steps: tuple[tuple[float | None, str], ...] = ()  # thresholds: (from value, color); None is the base
    repeat: str = ""  # a variable: one copy of the panel per value
    links: tuple[tuple[str, str], ...] = ()  # data links: (title, url)
    hide_columns: tuple[str, ...] = ()  # tables: columns not shown


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[Panel, ...], ...]
    single_rank: bool = False  # $rank is one rank (the rank dashboard), else any number of them

    @property
    def panels(self) -> tuple[Panel, ...]:
        return tuple(panel for row in self.rows for panel in row)

    @property
    def path(self) -> str:
        return f"/d/{self.uid}/{slug(self.title)}"


def slug(title: str) -> str:
    """Grafana's URL slug of a dashboard title."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def sel(*matchers: str, rank: str = 'rank=~"$rank"') -> str:
    """A selector for the dashboard's run (and ranks), with the rules' extra matchers."""
    parts = ['run="$run"', *([rank] if rank else []), *matchers]
    if THRESHOLDS.selector:
        parts.append(THRESHOLDS.selector)
    return "{" + ", ".join(parts) + "}"


RATE = "$__rate_interval"
ONE_RANK = 'rank="$rank"'
HANG = THRESHOLDS.hang_seconds
HANG_STEPS: tuple[tuple[float | None, str], ...] = ((None, "green"), (HANG / 2, "orange"), (HANG, "red"))


def _mean_step(s: str) -> str:
    return (
        f"sum by (rank) (rate({STEP_DURATION}_sum{s}[{RATE}]))\n"
        f"/ sum by (rank) (rate({STEP_DURATION}_count{s}[{RATE}]))"
    )


def _quantile(q: float, histogram: str, s: str, by: str) -> str:
    return f"histogram_quantile({q:g}, sum by ({by}, le) (rate({histogram}_bucket{s}[{RATE}])))"


def _bus_bandwidth(s_group: str) -> str:
    """Bytes per second of collective time per rank, times nccl-tests' bus factor for the op's algorithm."""
    members = f"count by (group) ({GROUP_INFO}{S_RUN_GROUP})"
    factors = (
        ("allreduce.*", f"2 * ({members} - 1) / {members}"),
        ("allgather.*|reduce_scatter.*|alltoall.*", f"({members} - 1) / {members}"),
        ("broadcast|reduce|gather|scatter|send|recv.*", f"0 * {members} + 1"),
    )
    parts = []
    for ops, factor in factors:
        s = s_group[:-1] + f', op=~"{ops}"}}'
        parts.append(
            f"(sum by (group, op) (rate({COLLECTIVE_BYTES}{s}[{RATE}]))\n"
            f" / sum by (group, op) (rate({COLLECTIVE_DURATION}_sum{s}[{RATE}])))\n"
            f"* on (group) group_left () ({factor})"
        )
    return "\n or ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# the four dashboards

OVERVIEW_UID, COLLECTIVES_UID, ILD_UID, RANK_UID = (
    "flare-overview",
    "flare-collectives",
    "flare-issue-latency",
    "flare-rank",
)
RANK_TITLE = "Flare / Rank detail"
RANK_LINK = (
    f"/d/{RANK_UID}/{slug(RANK_TITLE)}?var-datasource=${{datasource}}&var-run=${{run}}"
    "&var-rank=${__data.fields.rank}&${__url_time_range}"
)
VERDICT_COLUMNS = ("alertname", "rank", "host", "group", "severity", "type", "mismatch")


GROUP_MATCH = 'group=~"$group"'
S = sel()  # the run's selected ranks
S_GROUP = sel(GROUP_MATCH)  # ... in the selected groups
S_RUN_GROUP = sel(GROUP_MATCH, rank="")
FIRING_ALERTS = ALERTS + sel('alertstate="firing"', rank="")
R = sel(rank=ONE_RANK)  # the rank of the rank dashboard
R_GROUP = sel(GROUP_MATCH, rank=ONE_RANK)
LAST_WINDOW = sel('ago="0"')  # the last closed straggler window
R_LAST_WINDOW = sel('ago="0"', rank=ONE_RANK)


def overview() -> Dashboard:
    return Dashboard(
        OVERVIEW_UID,
        "Flare / Run overview",
        "The run at a glance: which ranks are up, how fast they step, what the alerts (the rules engine's "
        "verdicts in PromQL) name, and whether a process group is hung.",
        (
            (
                Panel(
                    "stat",
                    "Ranks up",
                    "Ranks Prometheus scrapes successfully.",
                    (Target(f"sum({UP}{S})", instant=True),),
                    6,
                    4,
                    "none",
                ),
                Panel(
                    "stat",
                    "Ranks down",
                    "Ranks whose target Prometheus cannot scrape (FlareRankDown names them).",
                    (Target(f"sum(1 - {UP}{S})", instant=True),),
                    6,
                    4,
                    "none",
                    steps=((None, "green"), (1, "red")),
                ),
                Panel(
                    "stat",
                    "Slowest rank's step rate",
                    "Optimizer steps per second of the slowest rank.",
                    (Target(f"min(rate({STEPS}{S}[{RATE}]))", instant=True),),
                    6,
                    4,
                    "none",
                ),
                Panel(
                    "stat",
                    "Firing alerts",
                    "Flare alerts firing for this run (the verdict table below lists them).",
                    (Target(f"count({FIRING_ALERTS})", instant=True),),
                    6,
                    4,
                    "none",
                    needs=frozenset({FIRING}),
                    steps=((None, "green"), (1, "red")),
                ),
            ),
            (
                Panel(
                    "state-timeline",
                    "Ranks up / down",
                    "1: Prometheus scraped the rank; 0: it did not.",
                    (Target(f"max by (rank) ({UP}{S})", "rank {{rank}}"),),
                    12,
                    8,
                    steps=((None, "red"), (1, "green")),
                ),
                Panel(
                    "timeseries",
                    "Step rate by rank",
                    "Optimizer steps per second of each rank.",
                    (Target(f"sum by (rank) (rate({STEPS}{S}[{RATE}]))", "rank {{rank}}"),),
                    12,
                    8,
                    "none",
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "Step time spread across ranks",
                    "Each rank's mean step time over the interval: the fastest, the median and the slowest "
                    "rank. A wide gap is a straggler (the Collectives dashboard says which rank).",
                    (
                        Target(f"min(\n{_mean_step(S)}\n)", "fastest rank"),
                        Target(f"quantile(0.5,\n{_mean_step(S)}\n)", "median rank"),
                        Target(f"max(\n{_mean_step(S)}\n)", "slowest rank"),
                    ),
                    12,
                    8,
                    "s",
                ),
                Panel(
                    "timeseries",
                    "Slowdown against each rank's own best",
                    "The last straggler window's mean step time over the rank's own best window (1: as fast "
                    "as it has ever been).",
                    (Target(f"max by (rank) ({SLOWDOWN}{S})", "rank {{rank}}"),),
                    12,
                    8,
                    "none",
                    steps=((None, "green"), (1.5, "orange"), (3, "red")),
                ),
            ),
            (
                Panel(
                    "table",
                    "Current verdicts (firing alerts)",
                    "The alerts mirror the rules engine's verdicts (`flare diagnose`), so in Prometheus the "
                    "current verdicts are the run's firing ALERTS: alertname is the kind, rank the culprit, "
                    "host or group the fault domain. Click a rank for its detail; `flare diagnose "
                    "--prometheus URL --run RUN` adds the evidence.",
                    (Target(FIRING_ALERTS, instant=True, format="table"),),
                    14,
                    9,
                    needs=frozenset({FIRING}),
                    links=(("Rank detail", RANK_LINK),),
                    hide_columns=("Time", "Value", "__name__", "alertstate", "run"),
                ),
                Panel(
                    "bargauge",
                    "Hang state per process group",
                    "Age of each group's oldest unfinished collective (0: nothing in flight). At "
                    f"{HANG:g} s (hang_seconds) the group is hung and FlareCollectiveHang fires.",
                    (
                        Target(
                            f"max by (group) ({GROUP_MAX_AGE}{S_RUN_GROUP})\n"
                            f"or max by (group) (0 * {LAST_COMPLETED}{S_RUN_GROUP})",
                            "{{group}}",
                            instant=True,
                        ),
                    ),
                    10,
                    9,
                    "s",
                    needs=frozenset({RULES}),
                    min=0,
                    max=HANG * 1.2,
                    steps=HANG_STEPS,
                ),
            ),
        ),
    )


def collectives() -> Dashboard:
    return Dashboard(
        COLLECTIVES_UID,
        "Flare / Collectives",
        "The process groups' collectives: how long they take, how much they move, which rank waits least "
        "(the straggler the others wait for) and how far each rank is behind its group.",
        (
            (
                Panel(
                    "heatmap",
                    "Collective duration",
                    "Issue-to-completion time of the selected groups' collectives on the selected ranks.",
                    (
                        Target(
                            f"sum by (le) (rate({COLLECTIVE_DURATION}_bucket{S_GROUP}[{RATE}]))",
                            "{{le}}",
                            format="heatmap",
                        ),
                    ),
                    12,
                    9,
                    "s",
                ),
                Panel(
                    "timeseries",
                    "Collective duration p50 / p99 by group and op",
                    "Quantiles of the collective duration histogram over the selected ranks.",
                    (
                        Target(
                            _quantile(0.5, COLLECTIVE_DURATION, S_GROUP, "group, op"), "{{group}} {{op}} p50"
                        ),
                        Target(
                            _quantile(0.99, COLLECTIVE_DURATION, S_GROUP, "group, op"), "{{group}} {{op}} p99"
                        ),
                    ),
                    12,
                    9,
                    "s",
                ),
            ),
            (
                Panel(
                    "bargauge",
                    "Ranks ordered by collective wait (the straggler waits least)",
                    "Mean time per step each rank spent in collectives over the last straggler window, "
                    "least first: in a synchronous job every rank waits for the slowest, so the straggler "
                    "is at the top.",
                    (
                        Target(
                            f"sort(max by (rank) ({WINDOW_WAIT}{LAST_WINDOW}))", "rank {{rank}}", instant=True
                        ),
                    ),
                    12,
                    8,
                    "s",
                    min=0,
                ),
                Panel(
                    "timeseries",
                    "Collective wait and step time per window by rank",
                    "Solid: mean step time of the last window; the wait series: time per step in "
                    "collectives. A straggler steps longest and waits least.",
                    (
                        Target(f"max by (rank) ({WINDOW_STEP}{LAST_WINDOW})", "step, rank {{rank}}"),
                        Target(f"max by (rank) ({WINDOW_WAIT}{LAST_WINDOW})", "wait, rank {{rank}}"),
                    ),
                    12,
                    8,
                    "s",
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "Bus bandwidth by group and op",
                    "Bytes per second of collective time on each rank, times the op's bus factor as "
                    "nccl-tests defines it (all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all "
                    "(n-1)/n, others 1; n the group's size): comparable with the link's bandwidth.",
                    (Target(_bus_bandwidth(S_GROUP), "{{group}} {{op}}"),),
                    12,
                    8,
                    "Bps",
                ),
                Panel(
                    "timeseries",
                    "Sequence-number lag per group",
                    "How many collectives each rank is behind the furthest rank of its group (issued), and "
                    "how many it issued that have not completed. A rank behind while the group waits is "
                    "the hang's culprit.",
                    (
                        Target(
                            f"max by (group) ({LAST_ISSUED}{S_GROUP})\n"
                            f"- on (group) group_right max by (group, rank) ({LAST_ISSUED}{S_GROUP})",
                            "behind, {{group}} rank {{rank}}",
                        ),
                        Target(
                            f"max by (group, rank) ({LAST_ISSUED}{S_GROUP})\n"
                            f"- max by (group, rank) ({LAST_COMPLETED}{S_GROUP})",
                            "unfinished, {{group}} rank {{rank}}",
                        ),
                    ),
                    12,
                    8,
                    "none",
                ),
            ),
            (
                Panel(
                    "table",
                    "In flight now",
                    "Each rank's oldest unfinished collective per group: op, state (issued: handed to the "
                    "backend; started: running on the device) and its age in seconds.",
                    (
                        Target(
                            f"max by (group, rank, op, state) (\n"
                            f"  (time() - {IN_FLIGHT_STARTED}{S_GROUP})\n"
                            f"  * on (run, group, rank) group_left (op, state) {IN_FLIGHT_INFO}{S_GROUP}\n)",
                            instant=True,
                            format="table",
                        ),
                    ),
                    12,
                    8,
                    "s",
                    needs=frozenset({STALLED}),
                    links=(("Rank detail", RANK_LINK),),
                    hide_columns=("Time",),
                ),
                Panel(
                    "timeseries",
                    "Collectives per second by group and op",
                    "Completed collectives per second, summed over the selected ranks.",
                    (
                        Target(
                            f"sum by (group, op) (rate({COLLECTIVE_DURATION}_count{S_GROUP}[{RATE}]))",
                            "{{group}} {{op}}",
                        ),
                    ),
                    12,
                    8,
                    "none",
                ),
            ),
        ),
    )


def issue_latency() -> Dashboard:
    def heatmap(histogram: str, what: str, needs: frozenset[str]) -> Panel:
        return Panel(
            "heatmap",
            f"{what}, rank $rank",
            f"Distribution of the {what.lower()} on this rank (one panel per selected rank).",
            (Target(f"sum by (le) (rate({histogram}_bucket{S}[{RATE}]))", "{{le}}", format="heatmap"),),
            24,  # Grafana sizes the copies: 24 / ranks wide, at least 6
            8,
            "s",
            needs=needs,
            repeat="rank",
        )

    def now_and_before(histogram: str, what: str, needs: frozenset[str]) -> Panel:
        return Panel(
            "timeseries",
            f"{what}: current vs since start",
            "p50 per rank over the last interval (current) and over every sample since the rank started "
            "(dominated by the baseline steps early in a run). The drift panels compare the current window "
            "with each rank's own calibrated baseline.",
            (
                Target(_quantile(0.5, histogram, S, "rank"), "current p50, rank {{rank}}"),
                Target(
                    f"histogram_quantile(0.5, sum by (rank, le) ({histogram}_bucket{S}))",
                    "since start p50, rank {{rank}}",
                ),
            ),
            12,
            8,
            "s",
            needs=needs,
        )

    return Dashboard(
        ILD_UID,
        "Flare / Issue latency",
        "Issue-latency distributions (ILD): kernel issue latency (device start minus host launch; a "
        "stalling host collapses it toward zero) and host dispatch latency (grows under CPU contention), "
        "each rank against its own baseline.",
        (
            (heatmap(KERNEL_ILD, "Kernel issue latency", frozenset({KERNEL})),),
            (heatmap(DISPATCH_ILD, "Host dispatch latency", frozenset()),),
            (
                now_and_before(KERNEL_ILD, "Kernel issue latency", frozenset({KERNEL})),
                now_and_before(DISPATCH_ILD, "Host dispatch latency", frozenset()),
            ),
            (
                Panel(
                    "timeseries",
                    "KS drift from baseline",
                    "Kolmogorov-Smirnov statistic between the current window and the rank's baseline "
                    "(0: same distribution, 1: disjoint).",
                    (
                        Target(
                            f"max by (rank, distribution) ({DRIFT_KS}{S})", "{{distribution}}, rank {{rank}}"
                        ),
                    ),
                    8,
                    8,
                    "none",
                    needs=frozenset({DRIFT}),
                    min=0,
                    max=1,
                ),
                Panel(
                    "timeseries",
                    "Wasserstein drift from baseline",
                    "Wasserstein-1 distance between the current window and the rank's baseline, in seconds.",
                    (
                        Target(
                            f"max by (rank, distribution) ({DRIFT_W1}{S})", "{{distribution}}, rank {{rank}}"
                        ),
                    ),
                    8,
                    8,
                    "s",
                    needs=frozenset({DRIFT}),
                ),
                Panel(
                    "gauge",
                    "KS drift now",
                    "The largest KS drift of each rank over both distributions; a shift on one rank points "
                    "at its host, on every rank at a job-wide change.",
                    (Target(f"max by (rank) ({DRIFT_KS}{S})", "rank {{rank}}", instant=True),),
                    8,
                    8,
                    "none",
                    needs=frozenset({DRIFT}),
                    min=0,
                    max=1,
                    steps=((None, "green"), (0.3, "orange"), (0.6, "red")),
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "Per-op shift of host dispatch",
                    "The delay the current window adds to every op, from each op's fastest time per sampled "
                    "step against its baseline (stable ops weigh most). A uniform host slowdown too small "
                    "to move KS or W1 shows here; the engine names a rank from "
                    f"{IldPolicy().op_shift_seconds * 1e9:g} ns.",
                    (Target(f"max by (rank) ({OP_SHIFT}{S})", "rank {{rank}}"),),
                    24,
                    8,
                    "s",
                    needs=frozenset({DRIFT}),
                ),
            ),
        ),
    )


IDENTITY = ("rank", *spec.BY_NAME[RANK_INFO].labels)


def rank_detail() -> Dashboard:
    gpu = frozenset({GPU})
    return Dashboard(
        RANK_UID,
        RANK_TITLE,
        "Everything about one rank: identity, progress, collectives, what it is doing when stalled, its "
        "issue latency, its GPU's health and the exporter's own health.",
        (
            (
                Panel(
                    "table",
                    "Identity",
                    "The rank's flare_rank_info: host, local rank, GPU UUID and PCI bus id (to join "
                    "dcgm-exporter's series), pid.",
                    (
                        Target(
                            f"max by ({', '.join(IDENTITY)}) ({RANK_INFO}{R})",
                            instant=True,
                            format="table",
                        ),
                    ),
                    12,
                    5,
                    hide_columns=("Time", "Value"),
                ),
                Panel(
                    "stat",
                    "Up",
                    "1: Prometheus scrapes the rank.",
                    (Target(f"max({UP}{R})", instant=True),),
                    4,
                    5,
                    "none",
                    steps=((None, "red"), (1, "green")),
                ),
                Panel(
                    "stat",
                    "Steps",
                    "Optimizer steps taken.",
                    (Target(f"max({STEPS}{R})", instant=True),),
                    4,
                    5,
                    "none",
                ),
                Panel(
                    "stat",
                    "Since last progress",
                    "Seconds since the training thread last stepped or issued a collective.",
                    (Target(f"time() - max({HEARTBEAT}{R})", instant=True),),
                    4,
                    5,
                    "s",
                    steps=HANG_STEPS,
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "Step time",
                    "p50 and p90 of the step duration histogram, and the rank's best straggler window.",
                    (
                        Target(_quantile(0.5, STEP_DURATION, R, "rank"), "p50"),
                        Target(_quantile(0.9, STEP_DURATION, R, "rank"), "p90"),
                        Target(f"max({BEST_STEP}{R})", "best window"),
                    ),
                    8,
                    8,
                    "s",
                ),
                Panel(
                    "timeseries",
                    "Step and collective wait per window",
                    "Mean step time and time per step in collectives over the last straggler window.",
                    (
                        Target(f"max({WINDOW_STEP}{R_LAST_WINDOW})", "step"),
                        Target(f"max({WINDOW_WAIT}{R_LAST_WINDOW})", "wait"),
                    ),
                    8,
                    8,
                    "s",
                ),
                Panel(
                    "timeseries",
                    "Collective duration p90 by group and op",
                    "The rank's collectives in the selected groups.",
                    (Target(_quantile(0.9, COLLECTIVE_DURATION, R_GROUP, "group, op"), "{{group}} {{op}}"),),
                    8,
                    8,
                    "s",
                ),
            ),
            (
                Panel(
                    "table",
                    "In flight now",
                    "The rank's oldest unfinished collective per group: op, state, sequence number and age.",
                    (
                        Target(
                            f"max by (group, op, state) (\n"
                            f"  (time() - {IN_FLIGHT_STARTED}{R_GROUP})\n"
                            f"  * on (run, group, rank) group_left (op, state) {IN_FLIGHT_INFO}{R_GROUP}\n)",
                            instant=True,
                            format="table",
                        ),
                    ),
                    12,
                    7,
                    "s",
                    needs=frozenset({STALLED}),
                    hide_columns=("Time",),
                ),
                Panel(
                    "table",
                    "Stalled in / exception",
                    "Present while the training thread has made no progress for stall_seconds: what it "
                    "does and its innermost frames; or the exception that ended the rank.",
                    (
                        Target(
                            f"max by (activity, frames, type) ({STACK_INFO}{R} or {EXCEPTION_INFO}{R})",
                            instant=True,
                            format="table",
                        ),
                    ),
                    12,
                    7,
                    needs=frozenset({STALLED}),
                    hide_columns=("Time", "Value"),
                ),
            ),
            (
                Panel(
                    "state-timeline",
                    "GPU clock-event (throttle) reasons",
                    "1 while NVML reports the reason on the rank's GPU. GPU health answered: "
                    "flare_gpu_health_up.",
                    (
                        Target(f"max by (reason) ({GPU_CLOCK_EVENT}{R})", "{{reason}}"),
                        Target(f"max({GPU_UP}{R})", "NVML answered"),
                    ),
                    8,
                    8,
                    needs=gpu,
                    steps=((None, "transparent"), (1, "orange")),
                ),
                Panel(
                    "timeseries",
                    "SM clock vs max",
                    "A clock below its maximum with a throttle reason active slows the whole job.",
                    (
                        Target(f"max({GPU_SM_CLOCK}{R})", "SM clock"),
                        Target(f"max({GPU_SM_CLOCK_MAX}{R})", "max"),
                    ),
                    8,
                    8,
                    "hertz",
                    needs=gpu,
                ),
                Panel(
                    "timeseries",
                    "Temperature",
                    "GPU core temperature.",
                    (Target(f"max({GPU_TEMPERATURE}{R})", "temperature"),),
                    4,
                    8,
                    "celsius",
                    needs=gpu,
                ),
                Panel(
                    "timeseries",
                    "Power vs limit",
                    "GPU power draw and its enforced limit.",
                    (
                        Target(f"max({GPU_POWER}{R})", "power"),
                        Target(f"max({GPU_POWER_LIMIT}{R})", "limit"),
                    ),
                    4,
                    8,
                    "watt",
                    needs=gpu,
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "PCIe link vs max",
                    "Current and maximum PCIe generation and width: a downgraded link slows transfers.",
                    (
                        Target(f"max({GPU_PCIE_GEN}{R})", "generation"),
                        Target(f"max({GPU_PCIE_GEN_MAX}{R})", "generation max"),
                        Target(f"max({GPU_PCIE_WIDTH}{R})", "width"),
                        Target(f"max({GPU_PCIE_WIDTH_MAX}{R})", "width max"),
                    ),
                    8,
                    7,
                    "none",
                    needs=gpu,
                ),
                Panel(
                    "timeseries",
                    "GPU errors",
                    "Increase over the interval of PCIe replays, ECC errors, XID events and NVLink errors.",
                    (
                        Target(f"max(increase({GPU_PCIE_REPLAYS}{R}[{RATE}]))", "PCIe replays"),
                        Target(f"max by (type) (increase({GPU_ECC}{R}[{RATE}]))", "ECC {{type}}"),
                        Target(f"max(increase({GPU_XID_EVENTS}{R}[{RATE}]))", "XID events"),
                        Target(f"max by (counter) (increase({GPU_NVLINK}{R}[{RATE}]))", "NVLink {{counter}}"),
                    ),
                    8,
                    7,
                    "none",
                    needs=gpu,
                ),
                Panel(
                    "timeseries",
                    "Memory row remapping and last XID",
                    "Remapped rows by cause, remapping pending or failed (replace the GPU), and the code of "
                    "the last critical XID.",
                    (
                        Target(
                            f"max by (__name__, cause) ({GPU_REMAPPED}{R} or {GPU_REMAP_PENDING}{R}\n"
                            f" or {GPU_REMAP_FAILED}{R} or {GPU_LAST_XID}{R})",
                            "{{__name__}} {{cause}}",
                        ),
                    ),
                    8,
                    7,
                    "none",
                    needs=gpu,
                ),
            ),
            (
                Panel(
                    "timeseries",
                    "Issue latency p50 / p90",
                    "Kernel issue latency (GPUs, the fake device) and host dispatch latency of this rank.",
                    (
                        Target(_quantile(0.5, KERNEL_ILD, R, "rank"), "kernel issue p50"),
                        Target(_quantile(0.9, KERNEL_ILD, R, "rank"), "kernel issue p90"),
                        Target(_quantile(0.5, DISPATCH_ILD, R, "rank"), "host dispatch p50"),
                        Target(_quantile(0.9, DISPATCH_ILD, R, "rank"), "host dispatch p90"),
                    ),
                    8,
                    7,
                    "s",
                    needs=frozenset({KERNEL}),
                ),
                Panel(
                    "timeseries",
                    "ILD drift from baseline (KS)",
                    "Kolmogorov-Smirnov drift of both distributions from this rank's baseline.",
                    (Target(f"max by (distribution) ({DRIFT_KS}{R})", "{{distribution}}"),),
                    8,
                    7,
                    "none",
                    needs=frozenset({DRIFT}),
                    min=0,
                    max=1,
                ),
                Panel(
                    "timeseries",
                    "Exporter health",
                    "Collectors failing (1), and errors and dropped events over the interval, by component "
                    "and queue; the collectors' scrape durations are in the exporter's own series.",
                    (
                        Target(
                            f"max by (collector) (1 - {COLLECTOR_SUCCESS}{R})\n"
                            f"or sum by (component) (increase({EXPORTER_ERRORS}{R}[{RATE}]))\n"
                            f"or sum by (queue) (increase({EXPORTER_DROPPED}{R}[{RATE}]))",
                            "{{collector}}{{component}}{{queue}}",
                        ),
                        Target(f"max by (collector) ({COLLECTOR_DURATION}{R})", "{{collector}} scrape time"),
                    ),
                    8,
                    7,
                    "none",
                ),
            ),
        ),
        single_rank=True,
    )


def dashboards() -> tuple[Dashboard, ...]:
    return (overview(), collectives(), issue_latency(), rank_detail())


# ---------------------------------------------------------------------------------------------------------
# Grafana's JSON, through Grafana's own builders (grafana-foundation-sdk: the `dev` extra)


def _layout(dashboard: Dashboard) -> list[tuple[Panel, dict[str, int]]]:
    """Each panel with its grid position: rows top to bottom, panels left to right."""
    placed, y = [], 0
    for row in dashboard.rows:
        x = 0
        for panel in row:
            placed.append((panel, {"x": x, "y": y, "w": panel.width, "h": panel.height}))
            x += panel.width
        if x > 24:
            raise ValueError(f"{dashboard.uid}: a row is {x} columns wide (at most 24)")
        y += max(panel.height for panel in row)
    return placed


def build(dashboard: Dashboard, others: Iterable[Dashboard] = ()) -> dict[str, Any]:
    """The dashboard's JSON model, linked to `others`."""
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as models

    datasource = models.DataSourceRef(type_val="prometheus", uid=DATASOURCE)
    result = (
        builders.Dashboard(dashboard.title)
        .uid(dashboard.uid)
        .description(dashboard.description)
        .tags([TAG])
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .with_variable(builders.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            _query_variable(builders, models, datasource, "run", f"label_values({RANK_INFO}, run)")
        )
        .with_variable(
            _query_variable(
                builders,
                models,
                datasource,
                "group",
                f'label_values({GROUP_INFO}{{run="$run"}}, group)',
                multi=True,
            )
        )
        .with_variable(
            _query_variable(
                builders,
                models,
                datasource,
                "rank",
                f'label_values({UP}{{run="$run", rank!=""}}, rank)',
                multi=not dashboard.single_rank,
            )
        )
        .annotation(
            builders.AnnotationQuery()
            .name("Flare alerts")
            .datasource(datasource)
            .enable(True)
            .icon_color("red")
            .expr(FIRING_ALERTS)
        )
    )
    for other in others:
        result = result.link(
            builders.DashboardLink(other.title.removeprefix("Flare / "))
            .type(models.DashboardLinkType.LINK)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .url(other.path)
            .include_vars(True)
            .keep_time(True)
            .tooltip(other.description)
        )
    for number, (panel, position) in enumerate(_layout(dashboard), start=1):
        result = result.with_panel(_panel(panel, number, position, datasource))
    # written as Grafana's typed model reads it back, defaults filled in: a fixed point of the check
    return typed_round_trip(json.loads(json.dumps(result.build(), cls=JSONEncoder)))


def _query_variable(
    builders: Any, models: Any, datasource: Any, name: str, query: str, multi: bool = False
) -> Any:
    variable = (
        builders.QueryVariable(name)
        .label(name.capitalize())
        .datasource(datasource)
        .query(query)
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.NUMERICAL_ASC if name == "rank" else models.VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def _panel(panel: Panel, number: int, position: dict[str, int], datasource: Any) -> Any:
    from grafana_foundation_sdk.builders import (
        bargauge,
        common,
        gauge,
        heatmap,
        prometheus,
        stat,
        statetimeline,
        table,
        timeseries,
    )
    from grafana_foundation_sdk.builders import dashboard as builders
    from grafana_foundation_sdk.models import common as common_models
    from grafana_foundation_sdk.models import dashboard as models
    from grafana_foundation_sdk.models import prometheus as prometheus_models

    kinds: dict[str, Any] = {
        "timeseries": timeseries.Panel,
        "heatmap": heatmap.Panel,
        "table": table.Panel,
        "stat": stat.Panel,
        "gauge": gauge.Panel,
        "bargauge": bargauge.Panel,
        "state-timeline": statetimeline.Panel,
    }
    built = (
        kinds[panel.kind]()
        .id(number)
        .title(panel.title)
        .description(panel.description)
        .datasource(datasource)
        .grid_pos(models.GridPos(x=position["x"], y=position["y"], w=position["w"], h=position["h"]))
    )
    for index, target in enumerate(panel.targets):
        query = (
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + index))
            .datasource(datasource)
            .expr(target.expr)
            .format(prometheus_models.PromQueryFormat(target.format))
        )
        query = query.instant() if target.instant else query.range()
        if target.legend:
            query = query.legend_format(target.legend)
        built = built.with_target(query)
    if panel.unit:
        built = built.unit(panel.unit)
    if panel.min is not None:
        built = built.min(panel.min)
    if panel.max is not None:
        built = built.max(panel.max)
    if panel.steps:
        built = built.thresholds(
            builders.ThresholdsConfig()
            .mode(models.ThresholdsMode.ABSOLUTE)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .steps([models.Threshold(value=value, color=color) for value, color in panel.steps])
        )
    if panel.repeat:
        built = built.repeat(panel.repeat).repeat_direction("h")
    if panel.links:
        built = built.override_by_name(
            "rank",
            [
                models.DynamicConfigValue(
                    id_val="links", value=[{"title": title, "url": url} for title, url in panel.links]
                )
            ],
        )
    if panel.hide_columns:
        built = built.with_transformation(
            models.DataTransformerConfig(
                id_val="organize", options={"excludeByName": {name: True for name in panel.hide_columns}}
            )
        )
    legend = (
        common.VizLegendOptions()
        .display_mode(common_models.LegendDisplayMode.LIST)  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
        .placement(common_models.LegendPlacement.BOTTOM)
        .show_legend(True)
    )
    last = common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
    if panel.kind in ("timeseries", "state-timeline"):
        built = built.legend(legend)
    if panel.kind in ("stat", "gauge", "bargauge"):
        built = built.reduce_options(last)
    if panel.kind == "table":
        built = built.show_header(True)
    if panel.kind == "bargauge":
        built = built.orientation(common_models.VizOrientation.HORIZONTAL)
    if panel.kind == "heatmap":
        built = (
            built.calculate(False)
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common_models.HeatmapCellLayout.LE))  # type: ignore[arg-type]  # the SDK's StrEnums, under mypy for Python 3.10
            .y_axis(heatmap.YAxisConfig().unit(panel.unit or "s"))
        )
    return built


def all_json() -> dict[str, dict[str, Any]]:
    """{file name: JSON model} of every dashboard, each linked to the others."""
    every = dashboards()
    return {
        f"{dashboard.uid}.json": build(dashboard, [other for other in every if other is not dashboard])
        for dashboard in every
    }


def render(model: Mapping[str, Any]) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------------------
# checks: the names a query uses, the JSON's invariants

METRIC_BEFORE_SELECTOR = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*\{")


def queries(model: Mapping[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard JSON model: panels' targets and annotations."""
    found = [target["expr"] for panel in model.get("panels", []) for target in panel.get("targets", [])]
    found += [item["expr"] for item in model.get("annotations", {}).get("list", []) if "expr" in item]
    return found


def names_in(expr: str) -> set[str]:
    """The series an expression names: flare_ series, recording rules and anything before a `{`."""
    return rules.names_in(expr) | set(METRIC_BEFORE_SELECTOR.findall(expr))


def unknown_metrics(models: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names in the dashboards' queries that neither the spec, a recording rule, nor Prometheus defines."""
    named: set[str] = set()
    for model in models:
        for expr in queries(model):
            named |= names_in(expr)
        for variable in model.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                named |= names_in(variable["query"])
    return named - spec.all_series_names() - RECORDED - PROMETHEUS_SERIES


VARIABLES = ("datasource", "run", "group", "rank")


def problems(models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What is wrong with the dashboards' JSON models (empty: nothing), beyond what Grafana's types say."""
    found: list[str] = []
    uids = {model["uid"]: name for name, model in models.items()}
    paths = {f"/d/{model['uid']}/{slug(model['title'])}" for model in models.values()}
    for name, model in models.items():
        where = name
        if model.get("schemaVersion", 0) < 36:
            found.append(f"{where}: schemaVersion {model.get('schemaVersion')} is older than 36")
        if not re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", model.get("uid", "")):
            found.append(f"{where}: uid {model.get('uid')!r} is not a valid Grafana uid")
        variables = [variable["name"] for variable in model.get("templating", {}).get("list", [])]
        if variables != list(VARIABLES):
            found.append(f"{where}: variables are {variables}, not {list(VARIABLES)}")
        for link in model.get("links", []):
            if link.get("url", "").split("?")[0] not in paths or link["url"].startswith(
                f"/d/{model['uid']}/"
            ):
                found.append(f"{where}: link {link.get('url')!r} is not another flare dashboard")
        panels = model.get("panels", [])
        ids = [panel.get("id") for panel in panels]
        if len(set(ids)) != len(ids) or None in ids:
            found.append(f"{where}: panel ids are not unique: {ids}")
        cells: dict[tuple[int, int], str] = {}
        for panel in panels:
            title = f"{where}: panel {panel.get('title')!r}"
            grid = panel.get("gridPos", {})
            x, y, w, h = (grid.get(key, -1) for key in ("x", "y", "w", "h"))
            if x < 0 or y < 0 or w < 1 or h < 1 or x + w > 24:
                found.append(f"{title}: gridPos {grid} is outside the 24-column grid")
            for column in range(max(x, 0), min(x + w, 24)):
                for line in range(max(y, 0), max(y, 0) + max(h, 0)):
                    if (column, line) in cells:
                        found.append(f"{title} overlaps {cells[column, line]!r}")
                        break
                    cells[column, line] = str(panel.get("title"))
                else:
                    continue
                break
            if panel.get("datasource") != {"type": "prometheus", "uid": DATASOURCE}:
                found.append(f"{title}: datasource is not ${{datasource}}")
            targets = panel.get("targets", [])
            if not targets:
                found.append(f"{title}: no query")
            ref_ids = [target.get("refId") for target in targets]
            if None in ref_ids or len(set(ref_ids)) != len(ref_ids):
                found.append(f"{title}: refIds {ref_ids} are missing or repeated")
            for target in targets:
                if target.get("datasource") != {"type": "prometheus", "uid": DATASOURCE}:
                    found.append(f"{title}: query {target.get('refId')} has no ${{datasource}}")
                if not target.get("expr"):
                    found.append(f"{title}: query {target.get('refId')} has no expression")
            for override in panel.get("fieldConfig", {}).get("overrides", []):
                for prop in override.get("properties", []):
                    for link in prop.get("value", []) if prop.get("id") == "links" else []:
                        uid = link["url"].split("/")[2] if link["url"].startswith("/d/") else ""
                        if uid not in uids:
                            found.append(f"{title}: data link {link['url']!r} is not a flare dashboard")
    return found


def typed_round_trip(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model read by Grafana's typed dashboard model (the foundation SDK's) and written back."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import dashboard as models

    register_default_plugins()  # panels' options and Prometheus queries decode into their own types
    return dict(json.loads(json.dumps(models.Dashboard.from_json(dict(model)), cls=JSONEncoder)))


# ---------------------------------------------------------------------------------------------------------
# queries with the dashboard's variables filled in (what Grafana sends), for the tests and the previews


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with $name and ${name} replaced by values[name], longest names first."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def variable_query_as_promql(query: str) -> str:
    """A `label_values(selector, label)` variable query as the PromQL that lists the same values."""
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip(), re.S)
    if not match:
        raise ValueError(f"not a label_values query: {query!r}")
    return f"group by ({match.group(2)}) ({match.group(1)})"


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool
    needs: frozenset[str] = field(default_factory=frozenset)


def panel_queries() -> list[PanelQuery]:
    """Every query of every panel, with what its signal needs."""
    found = []
    for dashboard in dashboards():
        for panel in dashboard.panels:
            for index, target in enumerate(panel.targets):
                found.append(
                    PanelQuery(
                        dashboard.uid,
                        panel.title,
                        chr(ord("A") + index),
                        target.expr,
                        target.instant,
                        panel.needs,
                    )
                )
        found.append(
            PanelQuery(
                dashboard.uid, "annotation: Flare alerts", "", FIRING_ALERTS, True, frozenset({FIRING})
            )
        )
    return found


# ---------------------------------------------------------------------------------------------------------
# python -m flare_exporter.mixin.dashboards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flare_exporter.mixin.dashboards", description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory of the JSON files")
    parser.add_argument("--check", action="store_true", help="fail if the files differ from the output")
    args = parser.parse_args(argv)
    out = Path(args.out)
    models = all_json()
    stale = []
    for name, model in models.items():
        path = out / name
        text = render(model)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            f"flare: stale dashboards (run python -m flare_exporter.mixin.dashboards): {', '.join(stale)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
