"""Prometheus recording and alert rules, gathered in groups (RULE_GROUPS) from one set of thresholds
(rule_model.Thresholds): what `flare rules` prints (rules_cli.py; the document: rules_render.py).

Here the rules of the ranks' liveness (down, never seen, a host down, the first to raise), of a run that
died, and of the exporter's own health; each other family in its module: the collectives
(collective_rules.py), issue latency (ild_rules.py), stragglers (straggler_rules.py), the GPU's health
(gpu_rules.py), a busy host (host_load_rules.py), the canary (canary_rules.py), the step breakdown
(perf_rules.py) and what the dashboards count (dashboard_rules.py).

The slow signals' rules (issue latency, stragglers, GPU slowdowns, the exporter's own health) form one group,
`flare.slow_signals`, evaluated every `slow_interval` (1m) rather than at every evaluation as the fast ones
(liveness, hangs, GPU errors): their inputs are windows of many steps and their alerts hold for minutes,
while at thousands of ranks they are most of Prometheus's rule work (docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import spec
from ..durations import duration_seconds
from .canary_rules import canary_alerts
from .collective_rules import collective_alerts, collective_recordings
from .dashboard_rules import dashboard_recording_rules
from .gpu_rules import gpu_error_alerts, gpu_error_recordings, gpu_slowdown_alerts
from .host_load_rules import host_load_alerts, host_load_recording_rules
from .ild_rules import ild_recording_rules, issue_latency_alerts
from .perf_rules import perf_recording_rules
from .rule_model import CULPRIT_ALERTS as CULPRIT_ALERTS  # re-exported: the rules' public names
from .rule_model import DASHBOARD_PATHS as DASHBOARD_PATHS
from .rule_model import Alert, Recording, Thresholds, link, selector, up_selector
from .rule_model import with_host as _with_host
from .straggler_rules import straggler_alerts, straggler_recording_rules, straggler_summary_rules

COLLECTIVE_IN_FLIGHT_INFO = spec.series("flare_collective_in_flight_info")
EXPORTER_COLLECTOR_SUCCESS = spec.series("flare_exporter_collector_success")
EXPORTER_DROPPED_EVENTS_TOTAL = spec.series("flare_exporter_dropped_events_total")
EXPORTER_ERRORS_TOTAL = spec.series("flare_exporter_errors_total")
RANK_EXCEPTION_INFO = spec.series("flare_rank_exception_info")
RANK_EXCEPTION_TIMESTAMP_SECONDS = spec.series("flare_rank_exception_timestamp_seconds")
RANK_INFO = spec.series("flare_rank_info")
RANK_TERMINATED_TIMESTAMP_SECONDS = spec.series("flare_rank_terminated_timestamp_seconds")
WORLD_SIZE = spec.series("flare_world_size")

# ---------------------------------------------------------------------------------------------------------
# recording rules: per rank, per group and per run aggregates the alerts are made of


def recording_rules(t: Thresholds) -> list[Recording]:
    """What the fast alerts read: each rank's host and liveness, collectives in flight and who is behind."""
    return [*_rank_recordings(t), *collective_recordings(t)]


RANK_SEEN = "run_rank_host:flare_rank_info:last_seen_timestamp_seconds"


def _rank_recordings(t: Thresholds) -> list[Recording]:
    """Each rank's host, whether it is down without an exception, and when it raised one."""
    s = selector(t)
    return [
        # When each rank was last seen on each host, remembered for the lookback: its newest scrape, else
        # this recording's own last value while younger than that. Two instant selections of a series a rank
        # each evaluation: last_over_time over the lookback read every scrape of the hour (240 samples a
        # rank at 15 s), twice, every evaluation.
        Recording(
            RANK_SEEN,
            f"max by (run, rank, host) (timestamp({RANK_INFO}{s}))\n"
            f"or ({RANK_SEEN} > time() - {duration_seconds(t.lookback, 'lookback'):g})",
        ),
        # Every rank's host, one series per rank: the one it was last seen on, else no host (a rank that
        # died before its first scrape); alerts join it to name the host.
        Recording(
            "run_rank:flare_rank_info:host",
            f"group by (run, rank, host) (topk by (run, rank) (1, {RANK_SEEN}))\n"
            "or on (run, rank)\n"
            f"  group by (run, rank) (up{up_selector(t)})",
        ),
        # A rank that Prometheus cannot scrape and that recorded no exception and no termination signal:
        # killed, frozen, or cut off. Its target is down (`up` == 0, where the targets' labels carry the
        # rank), or its own series went stale while its run's other ranks still answer (where they do not:
        # a dead pod that Kubernetes discovery drops, whose `up` never had a rank).
        Recording(
            "run_rank:flare_rank_down:no_exception",
            _with_host(
                f"(\n  max by (run, rank) (up{up_selector(t)}) == 0\n"
                "  or 0 * (\n"
                f"    max by (run, rank) ({RANK_SEEN})\n"
                f"    unless on (run, rank) {RANK_INFO}{s}\n"
                f"    and on (run) {RANK_INFO}{s}\n"
                "  )\n)\n"
                f"unless on (run, rank) last_over_time({RANK_EXCEPTION_INFO}{s}[{t.lookback}])\n"
                # a survivor its launcher stopped (SIGTERM) said so: it is not down without a word
                "unless on (run, rank) "
                f"last_over_time({RANK_TERMINATED_TIMESTAMP_SECONDS}{s}[{t.lookback}])"
            ),
        ),
        Recording(
            "run_rank:flare_rank_exception:timestamp_seconds",
            f"max by (run, rank) (last_over_time({RANK_EXCEPTION_TIMESTAMP_SECONDS}{s}[{t.lookback}]))",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------
# alert rules


def rank_alerts(t: Thresholds) -> list[Alert]:
    settle = 2 * t.scrape_interval_seconds
    first_exception = (
        "run_rank:flare_rank_exception:timestamp_seconds\n"
        "  == on (run) group_left min by (run) (run_rank:flare_rank_exception:timestamp_seconds)"
    )
    return [
        Alert(
            "FlareRankDown",
            "run_rank:flare_rank_down:no_exception",
            t.rank_down_for,
            "critical",
            "Rank {{ $labels.rank }} of run {{ $labels.run }} is down",
            "Prometheus cannot scrape rank {{ $labels.rank }} (host {{ $labels.host }}) of run "
            "{{ $labels.run }} and the rank recorded no exception: it was killed, froze, or lost its host "
            "or network. The other ranks will hang in their next collective with it.",
            "flarerankdown",
            link("rank", "rank"),
        ),
        Alert(
            "FlareRanksMissing",
            f"max by (run) ({WORLD_SIZE}{selector(t)})\n"
            "- count by (run) (run_rank:flare_rank_info:host)\n"
            "> 0",
            t.rank_down_for,
            "critical",
            "{{ $value }} rank(s) of run {{ $labels.run }} never reported",
            "Run {{ $labels.run }} has {{ $value }} fewer ranks than its world size that Prometheus ever "
            "scraped: their processes never started their exporters, or no service discovery target "
            "reaches them (a pod that never started, a port taken, a network policy). Ranks seen and then "
            "lost page as FlareRankDown.",
            "flareranksmissing",
            link("overview"),
        ),
        Alert(
            "FlareHostDown",
            "count by (run, host) (run_rank:flare_rank_down:no_exception) >= 2\n"
            "and on (run, host)\n"
            "  count by (run, host) (run_rank:flare_rank_down:no_exception)\n"
            "  == count by (run, host) (run_rank:flare_rank_info:host)",
            t.rank_down_for,
            "critical",
            "Host {{ $labels.host }} of run {{ $labels.run }} is down",
            "All {{ $value }} ranks of run {{ $labels.run }} on host {{ $labels.host }} stopped answering "
            "without an exception: the host, its network or its power failed, not one rank.",
            "flarehostdown",
            link("overview"),
        ),
        Alert(
            "FlareRankFailed",
            _with_host(
                f"{first_exception}\n"
                f"  and on (run) (time() - min by (run) (run_rank:flare_rank_exception:timestamp_seconds) "
                f">= {settle:g})\n"
                "  unless on (run) run_rank:flare_rank_down:no_exception"
            )
            + "\n* on (run, rank) group_left (type) max by (run, rank, type) "
            f"(last_over_time({RANK_EXCEPTION_INFO}{selector(t)}[{t.lookback}]))",
            t.rank_failed_for,
            "critical",
            "Rank {{ $labels.rank }} of run {{ $labels.run }} raised {{ $labels.type }} first",
            "Rank {{ $labels.rank }} (host {{ $labels.host }}) of run {{ $labels.run }} raised "
            "{{ $labels.type }} out of the training script at {{ $value | humanizeTimestamp }}, before any "
            "other rank did: the others' errors follow from it. Its traceback is in its incident file.",
            "flarerankfailed",
            link("rank", "rank"),
        ),
    ]


DEAD_RUN = "run:flare_run:dead"
FIRST_FAILURE = "run_rank:flare_rank_primary_exception:timestamp_seconds"
SILENT = "run_rank:flare_rank_gone:silent"
LAST_OP = "run_rank_group:flare_collective_in_flight:last_op"
ODD_OP = "run_rank_group:flare_collective_in_flight:odd_op"


def dead_run_recordings(t: Thresholds) -> list[Recording]:
    """Runs whose ranks are all gone, and each rank's last word in them (engine/post_mortem.py's rules 1, 2).

    A rank's own exception is one whose cause is not a survivor's (communication: a peer's reset, a
    timeout). A rank is silent when it left no exception and no termination signal."""
    s, w = selector(t), t.dead_run_window
    own = selector(t, 'cause!="communication"')
    return [
        Recording(
            DEAD_RUN,
            f"max by (run) (last_over_time({RANK_INFO}{s}[{w}]))\n"
            f"unless on (run) max by (run) ({RANK_INFO}{s})",
        ),
        Recording(
            FIRST_FAILURE,
            f"max by (run, rank) (last_over_time({RANK_EXCEPTION_TIMESTAMP_SECONDS}{s}[{w}]))\n"
            f"* on (run, rank) group_left (type, cause)\n"
            f"  max by (run, rank, type, cause) (last_over_time({RANK_EXCEPTION_INFO}{own}[{w}]))",
        ),
        Recording(
            SILENT,
            f"max by (run, rank, host) (last_over_time({RANK_INFO}{s}[{w}]))\n"
            f"unless on (run, rank) last_over_time({RANK_EXCEPTION_INFO}{s}[{w}])\n"
            f"unless on (run, rank) last_over_time({RANK_TERMINATED_TIMESTAMP_SECONDS}{s}[{w}])",
        ),
        *_last_op_recordings(t),
    ]


def _last_op_recordings(t: Thresholds) -> list[Recording]:
    """Each rank's last collective in flight in each group (the newest op series), and the ranks whose op
    a strict majority of the group's did not share (rule 3: a mismatch the run died of)."""
    flights = selector(t)
    ops = f"count by (run, group, op) ({LAST_OP})"
    return [
        Recording(
            LAST_OP,
            "topk by (run, rank, group) (1, max by (run, rank, group, op) "
            f"(max_over_time(timestamp({COLLECTIVE_IN_FLIGHT_INFO}{flights})[{t.dead_run_window}:5s])))",
        ),
        Recording(
            ODD_OP,
            f"group by (run, rank, group, op) ({LAST_OP})\n* on (run, group, op) group_left {ops}\n"
            f"< on (run, group) group_left max by (run, group) ({ops})",
        ),
    ]


def dead_run_alerts(t: Thresholds) -> list[Alert]:
    """A run that is gone: the rank that raised its own exception first; else the ranks gone silent while
    others left a word; else, where ranks failed in a collective, the ranks whose last collective differed
    from the majority's (a run that ended normally leaves no word, and pages not)."""
    s, w = selector(t), t.dead_run_window
    spoke = (
        f"count by (run) (last_over_time({RANK_EXCEPTION_INFO}{s}[{w}]))\n"
        f"  or count by (run) (last_over_time({RANK_TERMINATED_TIMESTAMP_SECONDS}{s}[{w}]))"
    )
    first = f"bottomk by (run) (1, {FIRST_FAILURE}) and on (run) {DEAD_RUN}"
    silent = (
        f'label_replace({SILENT}, "cause", "node_failure", "", "")\n'
        f"  and on (run) {DEAD_RUN}\n  and on (run) ({spoke})\n  unless on (run) {FIRST_FAILURE}"
    )
    failed = f"count by (run) (last_over_time({RANK_EXCEPTION_INFO}{s}[{w}]))"
    mismatched = (
        f'label_replace({ODD_OP}, "cause", "collective_mismatch", "", "")\n'
        f"  and on (run) {DEAD_RUN}\n  and on (run) {failed}\n"
        f"  unless on (run) {FIRST_FAILURE}\n  unless on (run) {SILENT}"
    )
    return [
        Alert(
            "FlareRunDied",
            f"{first}\nor\n{silent}\nor\n{mismatched}",
            t.dead_run_for,
            "critical",
            "Run {{ $labels.run }} died: rank {{ $labels.rank }} first ({{ $labels.cause }})",
            "Every rank of run {{ $labels.run }} is gone. Rank {{ $labels.rank }} ended it: "
            "{{ if $labels.type }}it raised {{ $labels.type }}{{ else if $labels.op }}it issued "
            "{{ $labels.op }} in group {{ $labels.group }} where the others issued another collective"
            "{{ else }}it vanished "
            "without a word (killed, frozen or its host lost){{ end }}, cause {{ $labels.cause }}; the other "
            "ranks failed or were "
            "stopped after it. `flare report` gives the timeline and the root cause.",
            "flarerundied",
            link("rank", "rank"),
        )
    ]


def exporter_alerts(t: Thresholds) -> list[Alert]:
    not_failed = selector(t, 'queue!="failed_collectives"')  # a failed collective is not the exporter's
    return [
        Alert(
            "FlareExporterErrors",
            f"sum by (run, rank, component) (increase({EXPORTER_ERRORS_TOTAL}{selector(t)}"
            f"[{t.exporter_window}]) > 0)",
            t.exporter_for,
            "warning",
            "The exporter of rank {{ $labels.rank }} reports {{ $labels.component }} errors",
            "flare-exporter on rank {{ $labels.rank }} of run {{ $labels.run }} caught "
            "{{ $value | humanize }} errors in {{ $labels.component }} over the last "
            f"{t.exporter_window}; training goes on, but some of its signals may be missing.",
            "flareexportererrors",
            link("rank", "rank"),
        ),
        Alert(
            "FlareExporterDroppingEvents",
            f"sum by (run, rank, queue) (increase({EXPORTER_DROPPED_EVENTS_TOTAL}"
            f"{not_failed}[{t.exporter_window}]) > 0)",
            t.exporter_for,
            "warning",
            "The exporter of rank {{ $labels.rank }} drops events from {{ $labels.queue }}",
            "flare-exporter on rank {{ $labels.rank }} of run {{ $labels.run }} dropped "
            "{{ $value | humanize }} events from its {{ $labels.queue }} queue or table over the last "
            f"{t.exporter_window} instead of blocking training: its timings undercount.",
            "flareexporterdroppingevents",
            link("rank", "rank"),
        ),
        Alert(
            "FlareExporterCollectorFailing",
            f"max by (run, rank, collector) ({EXPORTER_COLLECTOR_SUCCESS}{selector(t)} == 0)",
            t.exporter_for,
            "warning",
            "The {{ $labels.collector }} collector of rank {{ $labels.rank }} fails",
            "The {{ $labels.collector }} collector of flare-exporter on rank {{ $labels.rank }} of run "
            "{{ $labels.run }} fails on every scrape; its series are missing.",
            "flareexportercollectorfailing",
            link("rank", "rank"),
        ),
        Alert(
            "FlareRankScrapesLate",
            _with_host(
                f"{duration_seconds(t.exporter_window, 'exporter_window'):g}\n"
                f"/ max by (run, rank) (count_over_time({RANK_INFO}{selector(t)}[{t.exporter_window}]))\n"
                f"> {SCRAPES_LATE_FACTOR * t.scrape_interval_seconds:g}\n"
                # a rank seen a whole window ago: one that started within it has fewer samples anyway
                "and on (run, rank)\n"
                f"  max by (run, rank) ({RANK_INFO}{selector(t)} offset {t.exporter_window})"
            ),
            t.exporter_for,
            "warning",
            "Prometheus scrapes rank {{ $labels.rank }} of run {{ $labels.run }} late",
            f"Over the last {t.exporter_window}, Prometheus scraped rank {{{{ $labels.rank }}}} (host "
            "{{ $labels.host }}) of run {{ $labels.run }} once every {{ $value | humanizeDuration }} on "
            f"average, against {t.scrape_interval_seconds:g}s configured: its scrapes lag (a shard, or a "
            "Prometheus behind on its targets). The hang alerts do not judge a rank on a scrape older than "
            "the evidence against it, so they may name its group's culprit late.",
            "flarerankscrapeslate",
            link("rank", "rank"),
        ),
    ]


SCRAPES_LATE_FACTOR = 2  # FlareRankScrapesLate: a rank scraped this many times less often than configured


@dataclass(frozen=True)
class RuleGroup:
    """One group of the rules file: its recording rules, then the alerts (which may read them)."""

    name: str
    recordings: tuple[Callable[[Thresholds], list[Recording]], ...] = ()
    alerts: tuple[Callable[[Thresholds], list[Alert]], ...] = ()
    slow: bool = False  # evaluated every Thresholds.slow_interval

    def recording_rules(self, t: Thresholds) -> list[Recording]:
        return [recording for make in self.recordings for recording in make(t)]

    def alert_rules(self, t: Thresholds) -> list[Alert]:
        return [alert for make in self.alerts for alert in make(t)]


RULE_GROUPS = (
    RuleGroup("flare.recording", recordings=(recording_rules,)),
    RuleGroup("flare.ranks", alerts=(rank_alerts,)),
    # slow: its windows look back dead_run_window, and a dead run waits a minute for its page anyway
    RuleGroup("flare.dead_runs", recordings=(dead_run_recordings,), alerts=(dead_run_alerts,), slow=True),
    RuleGroup("flare.collectives", alerts=(collective_alerts,)),
    RuleGroup("flare.gpu_errors", recordings=(gpu_error_recordings,), alerts=(gpu_error_alerts,)),
    # One group, so that Prometheus evaluates these one after another, on one core: as four groups, each on
    # its own schedule, their evaluations could meet and take both cores (at 6,144 ranks the straggler
    # group's once took 9.7 s instead of 1.8 s).
    RuleGroup(
        "flare.slow_signals",
        recordings=(
            ild_recording_rules,
            straggler_recording_rules,
            straggler_summary_rules,
            host_load_recording_rules,
        ),
        alerts=(
            issue_latency_alerts,
            straggler_alerts,
            host_load_alerts,
            gpu_slowdown_alerts,
            exporter_alerts,
        ),
        slow=True,
    ),
    # the canary measures once in many steps: a minute's evaluation loses nothing
    RuleGroup("flare.canary", alerts=(canary_alerts,), slow=True),
    # where the step time goes and what each rank cost the job (perf_rules.py): rates over minutes
    RuleGroup("flare.perf", recordings=(perf_recording_rules,), slow=True),
    RuleGroup("flare.dashboards", recordings=(dashboard_recording_rules,), slow=True),
)


def all_alerts(t: Thresholds) -> list[Alert]:
    return [alert for group in RULE_GROUPS for alert in group.alert_rules(t)]


def all_recordings(t: Thresholds) -> list[Recording]:
    return [recording for group in RULE_GROUPS for recording in group.recording_rules(t)]
