"""The stores scale.py runs against, each paging a real Alertmanager: one Prometheus with flare's rules
(alertmanager.AlertingStack), or vmagent shards writing to VictoriaMetrics with the rules in vmalert
(victoria_metrics.ShardedStack). Runs in the benchmark's process: starts them, says what their processes
cost (CPU, memory, samples ingested) and times their rule groups' evaluations.

Rule groups' evaluation times: Prometheus's /api/v1/rules gives each group's last `evaluationTime`, with
its `lastEvaluation`; vmalert's (1.79) gives each rule's but not the group's, so vmalert's own
`vmalert_iteration_duration_seconds` (_sum, _count per group) are read instead: a poll that finds a
group's count one higher has that evaluation's seconds. `RuleWatch` polls either every POLL_SECONDS. Each
rule's `evaluationTime` is its own in Prometheus and in vmalert's alerting rules; a vmalert recording rule's
runs from its group's evaluation timestamp (1.79's RecordingRule.Exec), so it holds the rules before it.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from cli_runs import BenchError

from flare_exporter.engine import scrape
from flare_exporter.local import victoria_metrics
from flare_exporter.local.alertmanager import AlertingStack, WebhookReceiver, can_alert
from flare_exporter.local.prometheus import ServerProcess
from flare_exporter.mixin.rules import Thresholds

PROMETHEUS, VICTORIA_METRICS = "prometheus", "victoria-metrics"
STORES = (PROMETHEUS, VICTORIA_METRICS)
POLL_SECONDS = 2.0
ANSWER_TIMEOUT_S = 120.0  # a store's own figures, asked of a store that thousands of ranks keep busy
NEVER = "0001-01-01T00:00:00Z"  # the lastEvaluation of a group not evaluated yet (both APIs)


def installed(name: str) -> bool:
    return can_alert() if name == PROMETHEUS else victoria_metrics.can_run()


def get(url: str, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def metrics_of(url: str, timeout: float = 30) -> list[scrape.Sample]:
    return scrape.parse(get(url + "/metrics", timeout).decode())


def total(samples: list[scrape.Sample], name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (0 where there is none)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(key) == value for key, value in labels.items())
    )


class Store:
    """A running store: `url` is the query API `flare diagnose` asks, `rules_url` the rules API's server,
    `components` its processes by name (each serves /metrics), `pages` the webhook Alertmanager pages."""

    name = ""
    cumulative_recordings = False  # a recording rule's evaluationTime holds its group's rules before it
    failures = ("", "")  # (component, counter of the rule evaluations that failed)
    ingested = ("", "")  # (component, counter of the samples it appends)
    series = ("", "", {})  # (component, gauge of the series it holds, labels)

    def __init__(
        self,
        stack: AlertingStack | victoria_metrics.ShardedStack,
        url: str,
        rules_url: str,
        components: dict[str, ServerProcess],
    ) -> None:
        self.stack, self.url, self.rules_url, self.components = stack, url, rules_url, components
        self.pages: WebhookReceiver = stack.pages
        self.alertmanager_url = stack.alertmanager.url

    def wait_ready(self) -> None:
        self.stack.wait_ready()

    def stop(self) -> None:
        self.stack.stop()

    def check_alive(self) -> None:
        for name, server in self.components.items():
            if server.process.poll() is not None:
                raise BenchError(f"{name} exited with {server.process.returncode}: {server.log_tail(3)}")

    def metrics(self) -> dict[str, list[scrape.Sample]]:
        """Each component's own /metrics now; BenchError naming the one that does not answer."""
        found = {}
        for name, server in self.components.items():
            try:
                found[name] = metrics_of(server.url, ANSWER_TIMEOUT_S)
            except (OSError, ValueError) as error:
                raise BenchError(f"{name}: no answer at {server.url}/metrics: {error_line(error)}") from None
        return found

    def active_alerts(self, run: str) -> list[dict[str, Any]]:
        """The alerts of run `run` that Alertmanager holds active now (inhibited ones too)."""
        query = urllib.parse.urlencode({"active": "true", "filter": f'run="{run}"'})
        return list(json.loads(get(f"{self.alertmanager_url}/api/v2/alerts?{query}")))

    def failed_evaluations(self) -> float:
        """Rule evaluations that failed since the store started."""
        component, counter = self.failures
        return total(self.metrics()[component], counter)

    def rule_groups(self, timeout: float = 30) -> list[dict[str, Any]]:
        """The groups of the rules API (/api/v1/rules), each with its `interval` and its rules."""
        return list(json.loads(get(self.rules_url + "/api/v1/rules", timeout))["data"]["groups"])

    def answered_rule_groups(self) -> list[dict[str, Any]]:
        """rule_groups(), with BenchError naming the API where it does not answer in ANSWER_TIMEOUT_S."""
        try:
            return self.rule_groups(ANSWER_TIMEOUT_S)
        except (OSError, ValueError, KeyError) as error:
            raise BenchError(f"no answer at {self.rules_url}/api/v1/rules: {error_line(error)}") from None

    def new_evaluations(self) -> list[tuple[str, float]]:
        """(group, seconds) of each rule group evaluation since the last call."""
        raise NotImplementedError


class PrometheusStore(Store):
    name = PROMETHEUS
    failures = (PROMETHEUS, "prometheus_rule_evaluation_failures_total")
    ingested = (PROMETHEUS, "prometheus_tsdb_head_samples_appended_total")
    series = (PROMETHEUS, "prometheus_tsdb_head_series", {})

    def __init__(self, work_dir: str, targets_dir: str, hang_seconds: int, interval: int) -> None:
        # every for: 0s, so that the pages come in minutes; the slow groups' interval as the rules ship
        stack = AlertingStack(work_dir, targets_dir, hang_seconds, interval, "0s", Thresholds.slow_interval)
        components: dict[str, ServerProcess] = {PROMETHEUS: stack.prometheus}
        super().__init__(stack, stack.prometheus.url, stack.prometheus.url, components)
        self._seen: dict[str, str] = {}

    def new_evaluations(self) -> list[tuple[str, float]]:
        found = []
        for group in self.rule_groups():
            name, last = group["name"], group.get("lastEvaluation", NEVER)
            if last != NEVER and self._seen.get(name) != last:
                self._seen[name] = last
                found.append((name, float(group["evaluationTime"])))
        return found


ITERATION = "vmalert_iteration_duration_seconds"


class VictoriaMetricsStore(Store):
    name = VICTORIA_METRICS
    cumulative_recordings = True
    failures = (victoria_metrics.RULER, "vmalert_execution_errors_total")
    ingested = (victoria_metrics.STORE, "vm_rows_inserted_total")
    series = (victoria_metrics.STORE, "vm_cache_entries", {"type": "storage/hour_metric_ids"})

    def __init__(
        self, work_dir: str, targets_dir: str, hang_seconds: int, interval: int, shards: int
    ) -> None:
        stack = victoria_metrics.ShardedStack(
            work_dir, targets_dir, hang_seconds, shards, interval, "0s", Thresholds.slow_interval
        )
        components: dict[str, ServerProcess] = {
            server.name: server for server in (stack.store, *stack.agents, stack.ruler)
        }
        super().__init__(stack, stack.store.url, stack.ruler.url, components)
        self._iterations: dict[str, tuple[float, float]] = {}

    def new_evaluations(self) -> list[tuple[str, float]]:
        samples = metrics_of(self.components[victoria_metrics.RULER].url)
        found = []
        for sample in samples:
            if sample.name != ITERATION + "_count":
                continue
            group = sample.labels["group"]
            seconds = total(samples, ITERATION + "_sum", group=group)
            count, before = sample.value, self._iterations.get(group, (0.0, 0.0))
            if count > before[0]:
                evaluations = int(count - before[0])
                found += [(group, (seconds - before[1]) / evaluations)] * evaluations
                self._iterations[group] = (count, seconds)
        return found


def open_store(name: str, work_dir: str, targets_dir: str, hang_seconds: int, interval: int) -> Store:
    """Start store `name` (STORES) in `work_dir`, scraping the ranks listed in `targets_dir`."""
    os.makedirs(work_dir, exist_ok=True)
    if name == PROMETHEUS:
        return PrometheusStore(work_dir, targets_dir, hang_seconds, interval)
    return VictoriaMetricsStore(work_dir, targets_dir, hang_seconds, interval, shards=2)


class RuleWatch:
    """Every rule group evaluation of `store` while it runs (a thread polling every POLL_SECONDS)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seconds: dict[str, list[float]] = {}
        self.intervals: dict[str, float] = {}  # group -> seconds
        self.failed_polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"rule-watch-{store.name}", daemon=True)

    def __enter__(self) -> RuleWatch:
        groups = self.store.answered_rule_groups()
        self.intervals = {group["name"]: float(group["interval"]) for group in groups}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):  # a sampling period: the groups run on their own clock
            try:
                for group, seconds in self.store.new_evaluations():
                    self.seconds.setdefault(group, []).append(seconds)
            except (OSError, ValueError, KeyError):  # a store busy past the timeout: this poll is lost
                self.failed_polls += 1

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per group: its interval, and the median and the longest of its evaluations seen, in seconds and
        as a share of the interval."""
        out = {}
        for name, interval in self.intervals.items():
            seen = self.seconds.get(name, [])
            median = statistics.median(seen) if seen else None
            out[name] = {
                "interval_seconds": interval,
                "evaluations": len(seen),
                "median_seconds": median,
                "max_seconds": max(seen) if seen else None,
                "median_share_of_interval": None if median is None else median / interval,
            }
        return out


def rule_problems(groups: list[dict[str, Any]]) -> dict[str, str]:
    """group/rule -> the last error of each rule whose last evaluation failed."""
    return {
        f"{group['name']}/{rule['name']}": rule.get("lastError", "")
        for group in groups
        for rule in group["rules"]
        if rule.get("lastError")
    }


def slowest_rules(groups: list[dict[str, Any]], count: int, cumulative_recordings: bool) -> dict[str, float]:
    """The `count` rules whose last evaluation took longest, with its seconds. Where `cumulative_recordings`
    (vmalert 1.79), a recording rule's evaluationTime runs from its group's evaluation timestamp, so it holds
    the rules before it in the group too: its own is the difference with the recording rule before it, and
    the first one's is unknown (left out: the time from that timestamp to the group's start is in it)."""
    rules = []
    for group in groups:
        before: float | None = None
        for rule in group["rules"]:
            took: float | None = float(rule.get("evaluationTime", 0.0))
            if cumulative_recordings and rule.get("type") == "recording":
                took, before = (None if before is None else max(0.0, took - before)), took
            if took is not None:
                rules.append((rule["name"], took))
    return dict(sorted(rules, key=lambda item: -item[1])[:count])


def cpu_and_memory(
    before: dict[str, list[scrape.Sample]], after: dict[str, list[scrape.Sample]], seconds: float
) -> dict[str, Any]:
    """Each component's CPU (cores: CPU seconds per second between the two snapshots) and resident
    memory (at `after`), and their totals."""
    cores = {
        name: (
            total(after[name], "process_cpu_seconds_total") - total(before[name], "process_cpu_seconds_total")
        )
        / seconds
        for name in after
    }
    resident = {name: total(after[name], "process_resident_memory_bytes") for name in after}
    return {
        "cpu_cores": sum(cores.values()),
        "cpu_cores_by_process": cores,
        "resident_bytes": sum(resident.values()),
        "resident_bytes_by_process": resident,
    }


def ingestion(
    store: Store,
    before: dict[str, list[scrape.Sample]],
    after: dict[str, list[scrape.Sample]],
    seconds: float,
) -> dict[str, float]:
    """Samples appended per second between the snapshots, and the series the store holds at `after`."""
    component, counter = store.ingested
    where, gauge, labels = store.series
    appended = total(after[component], counter) - total(before[component], counter)
    return {"samples_per_second": appended / seconds, "series": total(after[where], gauge, **labels)}


def error_line(error: BaseException) -> str:
    """One line of an error of a store's run."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} from {error.url}"
    return " ".join(str(error).split())[:500]
