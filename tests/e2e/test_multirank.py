"""A real 4-rank gloo DDP job under the launcher, unmodified script: what its ranks' /metrics say."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Collection, Iterator

import pytest
from conftest import RANKS, STEPS

from flare_exporter.engine import rank_client, records, scrape, scrape_source
from flare_exporter.engine.targets import read_targets
from flare_exporter.label_values import COLLECTIVE_DURATION_BUCKETS
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp

pytestmark = pytest.mark.multirank


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in train_ddp.make_model().parameters())


def test_every_rank_identifies_itself(ddp_job):
    for rank, target in enumerate(ddp_job.targets):
        info = [s for s in ddp_job.samples[target] if s.name == "flare_rank_info"]
        assert len(info) == 1
        labels = info[0].labels
        assert (labels["rank"], labels["run"], labels["world_size"], labels["local_rank"]) == (
            str(rank),
            "test-ddp",
            str(RANKS),
            str(rank),
        )
        assert labels["backend"] == "gloo"
        assert labels["host"] == f"node-{rank // 2}"  # FLARE_HOST overrides the machine's hostname
        # every flare series carries rank and run
        assert all(
            s.labels.get("rank") == str(rank) and s.labels.get("run") == "test-ddp"
            for s in ddp_job.samples[target]
        )


def test_ddp_allreduces_are_counted_with_consistent_sequence_numbers(ddp_job):
    counts, issued, completed = set(), set(), set()
    for target in ddp_job.targets:
        samples = ddp_job.samples[target]
        counts.add(
            scrape.value(samples, "flare_collective_duration_seconds_count", group="world", op="allreduce")
        )
        issued.add(scrape.value(samples, "flare_collective_last_issued_seq", group="world"))
        completed.add(scrape.value(samples, "flare_collective_last_completed_seq", group="world"))
        assert scrape.value(samples, "flare_steps_total") == STEPS
    # DDP's reducer issues one bucket all-reduce per step from C++; every rank saw each of them.
    assert counts == {STEPS}
    assert len(issued) == 1 and issued == completed
    # DDP also broadcast the parameters and verified shapes: more collectives than all-reduces.
    assert issued.pop() > STEPS


def test_the_ranks_record_their_collectives_in_cpp(ddp_job):
    for target in ddp_job.targets:
        info = [s.labels for s in ddp_job.samples[target] if s.name == "flare_process_group_info"]
        assert [(labels["group"], labels["recorder"]) for labels in info] == [("world", "cpp")]


def test_bytes_and_durations_are_plausible(ddp_job):
    expected_bytes = STEPS * param_bytes()
    for target in ddp_job.targets:
        samples = ddp_job.samples[target]
        assert scrape.value(samples, "flare_collective_bytes_total", op="allreduce") == expected_bytes
        total = scrape.value(samples, "flare_collective_duration_seconds_sum", op="allreduce")
        assert 0 < total < STEPS * 10
        under_10s = scrape.value(
            samples, "flare_collective_duration_seconds_bucket", op="allreduce", le="10.0"
        )
        assert under_10s == STEPS
        assert 10.0 in COLLECTIVE_DURATION_BUCKETS
        assert scrape.value(samples, "flare_step_duration_seconds_count") == STEPS - 1
        assert scrape.value(samples, "flare_heartbeat_timestamp_seconds") > 1.7e9


def test_exporter_reports_no_errors_and_healthy_collectors(ddp_job):
    for target in ddp_job.targets:
        samples = ddp_job.samples[target]
        assert not [
            s
            for s in samples
            if s.name in ("flare_exporter_errors_total", "flare_exporter_dropped_events_total")
        ]
        health = {
            s.labels["collector"]: s.value for s in samples if s.name == "flare_exporter_collector_success"
        }
        expected = {"identity", "collectives", "in_flight", "ild", "progress", "exporter"}
        assert expected <= set(health) and set(health.values()) == {1}, health


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_every_ranks_exposition(ddp_job):
    for target in ddp_job.targets:
        text = scrape.fetch(target)
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


STABLE_ONCE_TRAINED = {
    "flare_rank_info",
    "flare_collective_last_issued_seq",
    "flare_collective_last_completed_seq",
    "flare_steps_total",
    "flare_step_duration_seconds_count",
    "flare_collective_duration_seconds_sum",
}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_a_rank_serves_only_the_samples_asked_for_and_a_direct_scrape_asks_for_what_it_reads(
    ddp_job, monkeypatch
):
    for target in ddp_job.targets:
        everything = scrape.fetch(target)
        asked = scrape.parse(scrape.fetch(target, names=STABLE_ONCE_TRAINED))
        assert asked == [s for s in scrape.parse(everything) if s.name in STABLE_ONCE_TRAINED]
        text = scrape.fetch(target, names=records.SNAPSHOT_METRICS)
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert {s.name for s in scrape.parse(text)} <= records.SNAPSHOT_METRICS
        assert len(text) * 3 < len(everything)  # no histogram buckets, no series the rules never read
    exchanged = rank_client.exchange_all
    asked_for = []

    def recorded(
        targets: list[str], timeout: float, workers: int, via: scrape.Client, names: Collection[str]
    ) -> Iterator[tuple[str, str | scrape.ScrapeError]]:
        asked_for.append((len(targets), names))
        return exchanged(targets, timeout, workers, via, names)

    monkeypatch.setattr(rank_client, "exchange_all", recorded)
    snapshot = scrape_source.from_targets(read_targets(ddp_job.file_sd_dir), "test-ddp")
    assert asked_for == [(RANKS, records.SNAPSHOT_METRICS)] and snapshot.ranks_seen == RANKS


@pytest.mark.prometheus
def test_prometheus_discovers_every_rank_through_file_sd(ddp_job):
    if ddp_job.prometheus is None:
        pytest.skip("prometheus not installed")
    query = 'flare_collective_duration_seconds_count{op="allreduce",group="world",run="test-ddp"}'

    def every_rank_scraped():
        result = ddp_job.prometheus.query(query)
        final = [item for item in result if float(item["value"][1]) == STEPS]
        return result if len(final) == RANKS else None

    result = wait_for(every_rank_scraped, 60, "Prometheus to scrape every rank")
    assert sorted(int(item["metric"]["rank"]) for item in result) == list(range(RANKS))
    up = ddp_job.prometheus.query('up{job="flare"}')
    assert sorted(item["metric"]["rank"] for item in up) == [str(rank) for rank in range(RANKS)]
