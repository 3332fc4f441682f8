"""Run the sharded deployment of docs/scaling.md on loopback: VictoriaMetrics as the store, vmagent shards
scraping the ranks into it, vmalert evaluating `flare rules` against it and paging a real Alertmanager (for
the tests, and to try the deployment on one machine).

Debian's `victoria-metrics` package ships the three binaries (single-node VictoriaMetrics, vmagent,
vmalert). Each process keeps its log (and the store its data) in its own work directory; readiness is
awaited through each one's HTTP API, as with Prometheus (prometheus.ServerProcess).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any, TypeVar

from ..engine import promql
from ..mixin import rule_model, rules_render
from .alertmanager import AlertmanagerProcess, WebhookReceiver, local_config
from .alertmanager import find_binary as find_alertmanager
from .prometheus import ServerProcess, scrape_config, wait_for

STORE, AGENT, RULER = "victoria-metrics", "vmagent", "vmalert"
_Server = TypeVar("_Server", bound=ServerProcess)


def find_binary(name: str) -> str | None:
    return shutil.which(name)


def can_run() -> bool:
    """Whether the store, the scraper, the rule evaluator and Alertmanager are all installed."""
    return all(find_binary(name) for name in (STORE, AGENT, RULER)) and find_alertmanager() is not None


def _binary(name: str, binary: str | None) -> str:
    found = binary or find_binary(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed (apt-get install victoria-metrics)")
    return found


def _get_json(url: str, path: str, timeout: float = 2.0) -> Any:
    """The JSON at GET url+path; None where the server does not answer (yet) or answers no JSON."""
    try:
        with promql.urlopen(url, path, timeout=timeout) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


class VictoriaMetricsProcess(ServerProcess):
    """Single-node VictoriaMetrics in `work_dir`: remote write at `write_url`, the Prometheus query API at
    `url`.

    `latency_offset` is -search.latencyOffset ("": its default, 30 s): VictoriaMetrics answers a query at a
    time within it of now as of that much earlier, which holds vmalert's rules that far behind the ranks,
    and each rule that reads another's result that much more (docs/scaling.md); 1.79 takes no less than
    1 s. `dedup_interval` is -dedup.minScrapeInterval, for scrapers that replicate each target (vmagent's
    -promscrape.cluster.replicationFactor above 1): one sample per series is kept per interval.
    """

    name = STORE
    listen_flag = "-httpListenAddr"

    def __init__(
        self,
        work_dir: str,
        latency_offset: str = "1s",
        dedup_interval: str = "",
        retention: str = "1d",
        binary: str | None = None,
    ) -> None:
        flags = [
            f"-storageDataPath={os.path.join(work_dir, 'data')}",
            f"-retentionPeriod={retention}",
            "-memory.allowedPercent=20",  # its caches, on a machine the ranks share
        ]
        if latency_offset:
            flags.append(f"-search.latencyOffset={latency_offset}")
        if dedup_interval:
            flags.append(f"-dedup.minScrapeInterval={dedup_interval}")
        super().__init__(work_dir, _binary(STORE, binary), None, flags)
        self.write_url = f"{self.url}/api/v1/write"

    def answers(self) -> bool:
        """Ready once it answers a query."""
        try:
            return bool(promql.query(self.url, "1", timeout=2))
        except promql.PrometheusError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return promql.query(self.url, expr, at=at)


class VmagentProcess(ServerProcess):
    """vmagent member `member` of `members`, scraping its share of the ranks in `file_sd_dir` (the same
    scrape job as Prometheus's, prometheus.scrape_config) every `scrape_interval` and writing them to
    `write_url`; its unsent samples wait in `work_dir`.

    vmagent reads file_sd files every -promscrape.fileSDCheckInterval (5 minutes by default): 1 s here, so
    that a rank is scraped as soon as it writes its file. The members share the targets by a hash of each
    target's labels: a target goes to one member (`replication` members with replication above 1, and the
    store then needs dedup)."""

    listen_flag = "-httpListenAddr"
    config_flag = "-promscrape.config"

    def __init__(
        self,
        work_dir: str,
        file_sd_dir: str,
        write_url: str,
        member: int = 0,
        members: int = 1,
        scrape_interval: str = "1s",
        replication: int = 1,
        binary: str | None = None,
    ) -> None:
        self.name = f"{AGENT}-{member}"
        job = scrape_config(file_sd_dir, scrape_interval)
        for sd_config in job["file_sd_configs"]:
            sd_config.pop("refresh_interval", None)  # vmagent's is a flag, and it rejects the key
        flags = [
            f"-remoteWrite.url={write_url}",
            f"-remoteWrite.tmpDataPath={os.path.join(work_dir, 'remote-write')}",
            "-promscrape.fileSDCheckInterval=1s",
            "-memory.allowedPercent=20",  # its caches, on a machine the ranks share
            "-promscrape.dropOriginalLabels=false",  # each target's discovered labels, in its targets API
        ]
        if members > 1:
            flags += [
                f"-promscrape.cluster.membersCount={members}",
                f"-promscrape.cluster.memberNum={member}",
                f"-promscrape.cluster.replicationFactor={replication}",
            ]
        super().__init__(work_dir, _binary(AGENT, binary), {"scrape_configs": [job]}, flags)

    def answers(self) -> bool:
        """Ready once its targets API answers."""
        return self.targets() is not None

    def targets(self) -> list[dict[str, Any]] | None:
        """The targets this member scrapes (the API's activeTargets); None where it does not answer."""
        found = _get_json(self.url, "/api/v1/targets", timeout=10)  # a busy vmagent answers late, not never
        if not isinstance(found, dict) or found.get("status") != "success":
            return None
        return list(found["data"]["activeTargets"])


class VmalertProcess(ServerProcess):
    """vmalert evaluating `rule_file` every `interval` against the store at `store_url`, sending alerts to
    the Alertmanager at `notifier_url`, writing the recording rules' results and the alerts' state back to
    the store, and reading that state from it when it restarts (so that a `for:` goes on where it was)."""

    name = RULER
    listen_flag = "-httpListenAddr"

    def __init__(
        self,
        work_dir: str,
        rule_file: str,
        store_url: str,
        notifier_url: str,
        interval: str = "1s",
        binary: str | None = None,
    ) -> None:
        flags = [
            f"-rule={os.path.abspath(rule_file)}",
            f"-datasource.url={store_url}",
            f"-remoteWrite.url={store_url}",
            f"-remoteRead.url={store_url}",
            f"-notifier.url={notifier_url}",
            f"-evaluationInterval={interval}",
            f"-remoteWrite.flushInterval={interval}",  # 5 s by default: the recording rules' results late
        ]
        super().__init__(work_dir, _binary(RULER, binary), None, flags)

    def answers(self) -> bool:
        """Ready once it lists the rule groups it loaded."""
        return bool(self.groups())

    def groups(self) -> list[dict[str, Any]]:
        """The rule groups it evaluates, each with its rules and their last evaluation's state (`health`,
        `lastError`, `evaluationTime`), from its Prometheus-compatible rules API."""
        found = _get_json(self.url, "/api/v1/rules")
        if not isinstance(found, dict) or found.get("status") != "success":
            return []
        return list(found["data"]["groups"])


class ShardedStack:
    """The deployment of docs/scaling.md: `shards` vmagents scraping the ranks in `file_sd_dir` every
    `scrape_seconds` into VictoriaMetrics; vmalert evaluating `flare rules` (for `hang_seconds`, every
    for: `for_`, the slow groups every `slow_interval`, by default at every evaluation) at the scrape
    interval, sending to an Alertmanager with the example configuration, which pages `pages`. The store
    runs with -search.latencyOffset `latency_offset` ("": its default, 30 s)."""

    def __init__(
        self,
        work_dir: str,
        file_sd_dir: str,
        hang_seconds: float,
        shards: int = 2,
        scrape_seconds: int = 1,
        for_: str = "0s",
        slow_interval: str = "",
        latency_offset: str = "1s",
    ) -> None:
        interval = f"{scrape_seconds}s"
        thresholds = rule_model.Thresholds(
            hang_seconds=hang_seconds, scrape_interval_seconds=scrape_seconds, slow_interval=slow_interval
        )
        os.makedirs(work_dir, exist_ok=True)
        self.rule_file = os.path.join(work_dir, "flare.rules.yml")
        with open(self.rule_file, "w") as out:
            out.write(rules_render.render(thresholds.with_for(for_)))
        self.pages = WebhookReceiver()
        self.servers: list[ServerProcess] = []
        paging = local_config(self.pages.url, wait=interval)
        self.alertmanager = self._started(AlertmanagerProcess(os.path.join(work_dir, "alertmanager"), paging))
        self.store = self._started(VictoriaMetricsProcess(os.path.join(work_dir, STORE), latency_offset))
        self.agents = [
            self._started(
                VmagentProcess(
                    os.path.join(work_dir, f"{AGENT}-{member}"),
                    file_sd_dir,
                    self.store.write_url,
                    member,
                    shards,
                    interval,
                )
            )
            for member in range(shards)
        ]
        self.ruler = self._started(
            VmalertProcess(
                os.path.join(work_dir, RULER), self.rule_file, self.store.url, self.alertmanager.url, interval
            )
        )

    def _started(self, server: _Server) -> _Server:
        self.servers.append(server)
        return server

    def wait_ready(self) -> None:
        try:
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.stop()
            raise

    def scraped_by_shard(self) -> list[set[str]]:
        """The targets (host:port) each shard scrapes, in member order."""
        return [{target["labels"]["instance"] for target in agent.targets() or []} for agent in self.agents]

    def await_every_rank(self, run: str, ranks: int, timeout: float = 60.0) -> None:
        """Wait until the store holds `ranks` ranks' flare_rank_info of `run`."""
        expr = f'count(flare_rank_info{{run="{run}"}}) == {ranks}'
        wait_for(lambda: self.store.query(expr), timeout, f"the store to hold every rank of run {run}")

    def log_tails(self, servers: Sequence[ServerProcess] = ()) -> str:
        return "\n".join(f"--- {server.name}\n{server.log_tail()}" for server in servers or self.servers)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.pages.stop()
