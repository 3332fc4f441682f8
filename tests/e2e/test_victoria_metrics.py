"""The sharded deployment of docs/scaling.md, end to end: a real 4-rank gloo job scraped by two vmagent shards
into VictoriaMetrics, `flare rules` in vmalert paging a real Alertmanager, and `flare diagnose` asking the
store. Rank 2 gets stuck in compute before a collective: the hang culprit page and the engine both name it.
Then rank 1 is killed: the rank-down page and the engine name it alone.

Also what the engine does about the store's latency offset (VictoriaMetrics holds back its newest samples
from a query at "now", 30 s by default): against stand-ins that record what they are asked, and against a
real VictoriaMetrics at its defaults.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import flare_json

from flare_exporter.engine import cli, promql, scrape
from flare_exporter.local import victoria_metrics
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.victoria_metrics import ShardedStack, VictoriaMetricsProcess
from flare_exporter.local.workloads import train_ddp
from flare_exporter.mixin.rules import CULPRIT_ALERTS

needs_binaries = pytest.mark.skipif(
    not victoria_metrics.can_run(), reason="victoria-metrics, vmagent, vmalert or alertmanager not installed"
)

RUN = "sharded"
RANKS = 4
STUCK = 2
KILLED = 1
SHARDS = 2
HANG_SECONDS = 3
# the stuck rank stops after some seconds of training, as in a job that ran a while: VictoriaMetrics shows a
# query a series that it had not held before (a rank's first scrape, a recording rule's first result) up to
# 10 s after it first answered that query without it, and each rule that reads another rule's new series adds
# that much (docs/scaling.md)
STEP_SECONDS = 0.05
FAULT_STEP = 300
SALT = "__param_shard_salt"  # see share_targets


# ---------------------------------------------------------------------------------------------------------
# the latency offset, against stand-ins


@contextlib.contextmanager
def stand_in(names_itself: bool) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A store that answers every query with one sample whose value says whether it was asked with nocache=1
    (1) or not (0), naming itself in the X-Server-Hostname header as VictoriaMetrics does where
    `names_itself`; its URL and the parameters of every request, in order."""
    asked: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
            asked.append(params)
            fresh = params.get("nocache") == "1"
            data: object = ["r"] if "/label/" in self.path else {
                "resultType": "vector",
                "result": [{"metric": {}, "value": [time.time(), "1" if fresh else "0"]}],
            }  # fmt: skip
            body = json.dumps({"status": "success", "data": data}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if names_itself:
                self.send_header("X-Server-Hostname", "vm-0")
            self.end_headers()
            self.wfile.write(body)

    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", asked
        finally:
            server.shutdown()
            thread.join(timeout=10)


def value(url: str) -> str:
    (item,) = promql.query(url, "x", at=time.time())
    return str(item["value"][1])


def test_a_store_that_holds_back_its_newest_samples_is_asked_for_them_and_prometheus_is_not():
    def queries(asked: list[dict[str, str]]) -> list[tuple[str | None, str | None]]:
        return [(params.get("query"), params.get("nocache")) for params in asked]

    with stand_in(names_itself=True) as (url, asked):
        assert value(url) == "1"  # asked time() first: it names itself, so the query says nocache=1
        assert queries(asked) == [("time()", None), ("x", "1")]
        assert value(url) == "1"  # known from then on: asked so at once
        assert queries(asked) == [("time()", None), ("x", "1"), ("x", "1")]
    with stand_in(names_itself=True) as (url, asked):
        assert promql.label_values(url, "run", "up", 0, 1) == ["r"]
        assert value(url) == "1"
        assert queries(asked) == [("time()", None), (None, "1"), ("x", "1")]
    with stand_in(names_itself=False) as (url, asked):
        assert [value(url), value(url)] == ["0", "0"]
        promql.label_values(url, "run", "up", 0, 1)
        assert queries(asked) == [("time()", None), ("x", None), ("x", None), (None, None)]


@pytest.mark.prometheus
@needs_binaries
def test_flare_reads_the_newest_samples_of_a_victoria_metrics_at_its_default_latency_offset(tmp_path):
    """Samples up to now, of which a query at now with the default -search.latencyOffset (30 s) sees only
    those 30 s old: promql sees the newest."""
    with VictoriaMetricsProcess(str(tmp_path / "vm"), latency_offset="") as store:
        now = time.time()
        lines = "".join(f"probe {i} {round((now - 40 + i) * 1000)}\n" for i in range(41))
        request = urllib.request.Request(f"{store.url}/api/v1/import/prometheus", data=lines.encode())
        urllib.request.urlopen(request, timeout=10).close()

        def newest() -> float | None:
            found = promql.query(store.url, "timestamp(probe)", at=time.time())
            return float(found[0]["value"][1]) if found else None

        seen = wait_for(lambda: (newest() or 0) >= now - 1, 30, "the newest sample")
        assert seen
        # what a query at now without nocache=1 (Prometheus's) gets: the samples of 30 s before
        asked_at = time.time()
        params = urllib.parse.urlencode({"query": "timestamp(probe)", "time": repr(asked_at)})
        with urllib.request.urlopen(f"{store.url}/api/v1/query?{params}", timeout=10) as response:
            (held_back,) = json.load(response)["data"]["result"]
        assert float(held_back["value"][1]) <= asked_at - 25


# ---------------------------------------------------------------------------------------------------------
# the deployment, end to end


def rank_targets(file_sd_dir: Path) -> list[dict]:
    """The ranks' own file_sd entries (FLARE_FILE_SD_DIR), once every rank has written its file."""
    files = sorted(file_sd_dir.glob("*.json"))
    if len(files) < RANKS:
        return []
    try:
        return [entry for path in files for entry in json.loads(path.read_text())]
    except ValueError:  # a file being written
        return []


def share_targets(stack: ShardedStack, entries: list[dict], sd_dir: Path) -> list[set[str]]:
    """The ranks' entries written where the shards discover them, each with a `__param_shard_salt` label,
    which the shards hash with the target's other labels to pick the shard that scrapes it; tried salt after
    salt until every shard scrapes some rank (with 4 ranks and 2 shards, 1 salt in 8 gives one shard all of
    them). What each shard scrapes, once every rank is scraped by exactly one.

    The salt is a URL parameter (`/metrics?shard_salt=1`, which the ranks ignore) and not a bare `__` label:
    vmagent keeps the scraper of a target whose scrape does not change, with the discovered labels of the
    salt it was found with, so a target that stays on its shard would never show the new salt."""
    expected = {target for entry in entries for target in entry["targets"]}
    for salt in range(8):
        salted = [{**entry, "labels": {**entry["labels"], SALT: str(salt)}} for entry in entries]
        scratch = sd_dir / "ranks.json.tmp"
        scratch.write_text(json.dumps(salted))
        scratch.replace(sd_dir / "ranks.json")
        settled = functools.partial(shared, stack, expected, str(salt))
        # vmagent reads the file every second; on a busy host (CI, every core loaded) it took over 30 s
        try:
            shares = wait_for(settled, 120, "the shards to discover the ranks")
        except TimeoutError:
            pytest.fail(
                f"salt {salt}: the shards never settled on {sorted(expected)}: {stack.scraped_by_shard()}"
            )
        if all(shares):
            return shares
    pytest.fail(f"no salt of 8 spread {len(expected)} ranks over {SHARDS} shards: {stack.scraped_by_shard()}")


def shared(stack: ShardedStack, expected: set[str], salt: str) -> list[set[str]] | None:
    """What each shard scrapes, once the shards scrape every target of `expected` once, as discovered with
    `salt`; None before."""
    targets = [agent.targets() or [] for agent in stack.agents]
    if any(target["discoveredLabels"].get(SALT) != salt for share in targets for target in share):
        return None
    shares = [{target["labels"]["instance"] for target in share} for share in targets]
    together = set().union(*shares)
    return shares if together == expected and sum(map(len, shares)) == len(expected) else None


def names_by_rank(job: ObservedJob) -> dict[str, set[str]]:
    """The flare metric names each rank serves now (rank -> names), scraped directly."""
    scraped = scrape.scrape_all(job.targets, timeout=5)
    served = {}
    for rank, target in enumerate(job.targets):
        samples = scraped[target]
        assert not isinstance(samples, scrape.ScrapeError), samples
        served[str(rank)] = {sample.name for sample in samples if sample.name.startswith("flare_")}
    return served


def missing_from_store(stack: ShardedStack, served: dict[str, set[str]]) -> dict[str, set[str]]:
    """Of the names each rank served, those the store's index holds no series of for that rank (in flight
    series come and go: the index, not the current samples)."""
    missing = {}
    for rank, names in served.items():
        match = f'{{run="{RUN}", rank="{rank}"}}'
        held = promql.label_values(stack.store.url, "__name__", match, time.time() - 600, time.time())
        if names - set(held):
            missing[rank] = names - set(held)
    return missing


def culprit_pages(stack: ShardedStack) -> set[tuple[str, str]]:
    return {
        (alert["labels"]["alertname"], alert["labels"].get("rank", ""))
        for _, alert in stack.pages.alerts(run=RUN)
        if alert["labels"]["alertname"] in CULPRIT_ALERTS
    }


@pytest.mark.multirank
@pytest.mark.prometheus
@needs_binaries
def test_a_stuck_rank_is_paged_through_vmalert_and_diagnosed_from_the_store(tmp_path):
    sd_dir = tmp_path / "discovered"
    sd_dir.mkdir()
    stack = ShardedStack(str(tmp_path / "stack"), str(sd_dir), HANG_SECONDS, shards=SHARDS)
    try:
        stack.wait_ready()
        env = {"FLARE_STALL_SECONDS": "1", "FLARE_HANG_SECONDS": str(HANG_SECONDS)}
        env["FLARE_LINGER_SECONDS"] = "120"  # the survivors, dying of the lost peer, stay in sight
        args = ["--steps", "100000", "--step-seconds", str(STEP_SECONDS)]
        args += ["--fault", "stuck", "--fault-rank", str(STUCK), "--fault-step", str(FAULT_STEP)]
        (tmp_path / "job").mkdir()
        with ObservedJob(str(tmp_path / "job"), train_ddp.__file__, args, RANKS, RUN, env=env) as job:
            entries = wait_for(lambda: rank_targets(Path(job.file_sd_dir)), 120, "every rank's file_sd file")
            # (a) both shards scrape, each its own ranks
            shares = share_targets(stack, entries, sd_dir)
            assert all(shares) and set().union(*shares) == set(job.targets), shares

            # (b) the store holds every rank's series, whichever shard scraped it
            stack.await_every_rank(RUN, RANKS, timeout=60)
            served = names_by_rank(job)
            essential = {"flare_rank_info", "flare_collective_last_issued_seq", "flare_steps_total"}
            assert len(served) == RANKS and all(essential <= names for names in served.values()), served
            try:
                wait_for(
                    lambda: not missing_from_store(stack, served), 60, "every rank's series in the store"
                )
            except TimeoutError:
                pytest.fail(f"not in the store: {missing_from_store(stack, served)}")
            up = stack.store.query(f'up{{run="{RUN}"}} == 1')
            assert sorted(item["metric"]["rank"] for item in up) == [str(rank) for rank in range(RANKS)]

            # (c) the hang culprit page reaches the Alertmanager's receiver, naming rank 2 alone
            culprit = {"alertname": "FlareCollectiveHangCulprit", "run": RUN}
            try:
                pages = wait_for(lambda: stack.pages.alerts(**culprit), 120, "the hang culprit page")
            except TimeoutError:
                pytest.fail(f"no hang culprit page; vmalert: {json.dumps(stack.ruler.groups())[:4000]}")
            paged_at = pages[0][0]
            assert {alert["labels"]["rank"] for _, alert in pages} == {str(STUCK)}
            assert culprit_pages(stack) == {("FlareCollectiveHangCulprit", str(STUCK))}

            # (d) the engine, from the store, as a user asks it: the run and its threshold found there
            started = time.monotonic()
            code, report = flare_json("diagnose", "--prometheus", stack.store.url)
            took = time.monotonic() - started
            assert code == cli.EXIT_ANOMALY, report
            (verdict,) = report["verdicts"]
            assert (verdict["kind"], verdict["ranks"], verdict["group"]) == ("hang", [STUCK], "world"), report
            assert "stuck_in_compute" in verdict["evidence"]["culprits"][str(STUCK)]["frames"]
            assert (report["run"], report["hang_seconds"], report["hang_seconds_from"]) == (
                RUN,
                HANG_SECONDS,
                "run",
            )

            hung_at = report["timestamp_seconds"] - verdict["evidence"]["oldest_in_flight_seconds"]
            errors = [
                (rule["name"], rule["lastError"])
                for group in stack.ruler.groups()
                for rule in group["rules"]
                if rule["lastError"] or rule["health"] != "ok"
            ]
            assert errors == []  # every rule of `flare rules` evaluates in vmalert
            print(
                f"page {paged_at - hung_at:.1f} s after the hang began (threshold {HANG_SECONDS} s);"
                f" flare diagnose {took:.2f} s; shards {[sorted(share) for share in shares]}"
            )

            # (e) a killed rank: the rank-down page names it alone, and so does the engine
            killed_at = time.time()
            job.processes[KILLED].kill()
            down = {"alertname": "FlareRankDown", "run": RUN}
            pages = wait_for(lambda: stack.pages.alerts(**down), 120, "the rank-down page")
            assert {alert["labels"]["rank"] for _, alert in pages} == {str(KILLED)}
            code, report = flare_json("diagnose", "--prometheus", stack.store.url, "--run", RUN)
            verdicts = [(verdict["kind"], verdict["ranks"]) for verdict in report["verdicts"]]
            assert code == cli.EXIT_ANOMALY and ("rank_down", [KILLED]) in verdicts, report
            assert {rank for name, rank in culprit_pages(stack) if name == "FlareRankDown"} == {str(KILLED)}
            print(f"rank-down page {pages[0][0] - killed_at:.1f} s after the kill")
    finally:
        stack.stop()
