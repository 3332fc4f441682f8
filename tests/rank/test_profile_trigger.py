"""Captures a rank's own signals ask for (rank/profile_trigger.py), and the healthy peer asked beside it."""

from __future__ import annotations

import datetime
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from flare_exporter.local.prometheus import wait_for
from flare_exporter.policies import IldPolicy, ProfileTriggerPolicy
from flare_exporter.rank import profile_trigger
from flare_exporter.rank.canary import IN_FLIGHT, PREFLIGHT
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.exposition import MetricsServer
from flare_exporter.rank.profile_trigger import (
    AnomalyTrigger,
    PeerProfiles,
    canary_failed,
    ild_shift,
    straggling,
)
from flare_exporter.rank.straggler_windows import WindowRing

POLICY = ProfileTriggerPolicy()


def ring_of(*windows: tuple[float, float]) -> WindowRing:
    """A ring fed windows of 2 steps, each (step seconds, wait seconds)."""
    ring = WindowRing(2, 4)
    step = 2
    for step_seconds, wait_seconds in windows:
        for _ in range(2):
            ring.add_step(step, step_seconds, wait_seconds)
            step += 1
    return ring


def test_a_rank_slower_than_its_best_without_waiting_is_a_straggler_one_that_waits_is_not():
    evidence = straggling(ring_of((0.1, 0.01), (0.1, 0.01), (0.2, 0.01), (0.21, 0.02)), POLICY)
    assert evidence == {"window": 3, "slowdown": 2.1, "wait_share": 0.095, "policy_version": 1}
    waits = ring_of((0.1, 0.01), (0.1, 0.01), (0.2, 0.15), (0.2, 0.15))  # it waits for a slower peer
    assert straggling(waits, POLICY) is None
    once = ring_of((0.1, 0.01), (0.1, 0.01), (0.1, 0.01), (0.2, 0.01))  # one slow window: noise
    assert straggling(once, POLICY) is None
    assert straggling(ring_of((0.2, 0.0)), POLICY) is None  # too few windows to judge


def drift(distribution: str, current: tuple[float, float] | None) -> Any:
    return SimpleNamespace(distribution=distribution, drift=SimpleNamespace(current=current))


def test_an_issue_latency_shift_from_the_ranks_own_baseline_and_a_failed_in_flight_canary_fire():
    ild = SimpleNamespace(distributions=(drift("kernel_issue", None), drift("host_dispatch", (0.5, 2e-6))))
    assert ild_shift(ild, IldPolicy()) == {"distribution": "host_dispatch", "ks": 0.5, "wasserstein": 2e-6}
    small = SimpleNamespace(
        distributions=(drift("host_dispatch", (0.2, 2e-6)), drift("host_gap", (0.9, 0.0)))
    )
    assert ild_shift(small, IldPolicy()) is None and ild_shift(None, IldPolicy()) is None
    preflight_only = SimpleNamespace(snapshot=SimpleNamespace(failed={("matmul", "device", PREFLIGHT)}))
    assert canary_failed(preflight_only) is None and canary_failed(None) is None
    failed = {("matmul", "device", PREFLIGHT), ("allreduce", "inter_host", IN_FLIGHT)}
    assert canary_failed(SimpleNamespace(snapshot=SimpleNamespace(failed=failed))) == {
        "measurement": "allreduce",
        "scope": "inter_host",
    }


class Armed:
    """A profiler that answers `statuses` in turn and keeps what it was asked."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.asked: list[tuple] = []

    def request(self, steps: int, trigger: str, reason: Any = None) -> tuple[int, dict]:
        self.asked.append((steps, trigger, reason))
        return self.statuses.pop(0), {}


class Peers:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def publish(self) -> None:
        pass

    def ask(self, steps: int) -> None:
        self.asked.append(steps)


def test_a_signal_arms_one_capture_per_cooldown_and_asks_a_peer_a_refusal_is_tried_again():
    fired = {"straggler": None, "ild_shift": {"ks": 0.5}}
    signals = {name: (lambda name=name: fired[name]) for name in fired}
    profiler, peers = Armed(409, 202, 202), Peers()
    trigger = AnomalyTrigger(profiler, signals, 2, 3600.0, ExporterHealth(), peers)  # type: ignore[arg-type]
    trigger.after_drain()  # a capture runs (asked by a person): refused, no cooldown starts
    assert profiler.asked == [(2, "ild_shift", {"ks": 0.5})] and peers.asked == [] and not trigger.fired
    trigger.after_drain()
    assert len(profiler.asked) == 2 and peers.asked == [2] and trigger.fired == [("ild_shift", {"ks": 0.5})]
    fired["straggler"] = {"slowdown": 2.0}
    for _ in range(3):
        trigger.after_drain()  # in the cooldown: nothing more is armed, whatever fires
    assert len(profiler.asked) == 2 and peers.asked == [2]
    trigger.quiet_until = time.time() - 1
    trigger.after_drain()  # the cooldown over: the first signal in order wins
    assert profiler.asked[-1] == (2, "straggler", {"slowdown": 2.0}) and peers.asked == [2, 2]


def test_a_failing_signal_never_reaches_the_drain_and_is_not_looked_at_every_drain():
    def broken() -> dict:
        raise ZeroDivisionError("a signal it cannot compute")

    health = ExporterHealth()
    profiler = Armed()
    trigger = AnomalyTrigger(profiler, {"straggler": broken}, 2, 60.0, health)
    trigger.after_drain()
    trigger.after_drain()
    assert health.errors["profile_trigger"] == 1 and profiler.asked == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Asked:
    """The peer's profiler: what its endpoint was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def request(self, steps: int, trigger: str = "asked", peer_of: int | None = None) -> tuple[int, dict]:
        self.asked.append((steps, trigger, peer_of))
        return 202, {"capture": {"id": 1}}

    def status(self) -> dict:
        return {}


@pytest.mark.process
def test_the_peer_is_found_through_the_jobs_store_and_asked_over_http():
    """Rank 3 of 4 asks rank 0 (the next rank, wrapping): its address from the c10d store, where rank 0
    published it, then POST /profile?trigger=peer&of=3 to its exporter."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    peer_profiler = Asked()
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, profiler=peer_profiler)
    try:
        health = ExporterHealth()
        identity = SimpleNamespace(run="r", rank=0, world_size=4)
        published = PeerProfiles(lambda: identity, f"127.0.0.1:{server.port}", health)
        published.publish()
        wait_for(lambda: profile_trigger._store().check(["flare/r/exporter/0"]), 15, "rank 0's address")
        asking = PeerProfiles(lambda: SimpleNamespace(run="r", rank=3, world_size=4), "127.0.0.1:1", health)
        asking.ask(2)
        wait_for(lambda: asking.asked, 15, "the peer's answer")
        assert peer_profiler.asked == [(2, "peer", 3)] and asking.asked[0]["status"] == 202
        secured = PeerProfiles(lambda: SimpleNamespace(run="r", rank=1, world_size=4), "", health)
        secured.publish()  # behind web config: nothing published, and it asks nobody
        assert not secured.published and not profile_trigger._store().check(["flare/r/exporter/1"])
        assert health.errors == {}
    finally:
        server.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# flare profile --on-alert: the webhook receiver


def notification(*alerts: tuple[str, str, str, str]) -> dict:
    """A webhook notification (version 4) of (alertname, run, rank, status) alerts."""
    return {
        "version": "4",
        "status": "firing",
        "alerts": [
            {"status": status, "labels": {"alertname": name, "run": run, "rank": rank}}
            for name, run, rank, status in alerts
        ],
    }


def test_a_notification_names_the_firing_slow_ranks_of_each_run_and_a_healthy_peer_is_the_next_unpaged():
    from flare_exporter.engine.profile_on_alert import alerts_wanted, healthy_peer, paged_ranks

    payload = notification(
        ("FlareRankStraggler", "a", "3", "firing"),
        ("FlareIssueLatencyShifted", "a", "1", "firing"),
        ("FlareCollectiveHangCulprit", "a", "2", "firing"),  # a hung rank steps no more: nothing to capture
        ("FlareRankStraggler", "b", "0", "resolved"),
        ("FlareRankStraggler", "b", "x", "firing"),
    )
    assert paged_ranks(payload, alerts_wanted("")) == {"a": [1, 3]}
    assert paged_ranks(payload, alerts_wanted("FlareCollectiveHangCulprit")) == {"a": [2]}
    assert (
        paged_ranks([1, 2], alerts_wanted("")) == {}
        and paged_ranks({"alerts": [None]}, alerts_wanted("")) == {}
    )
    assert healthy_peer(3, [0, 1, 2, 3], [1, 3]) == 0 and healthy_peer(1, [0, 1, 2, 3], [1, 2]) == 3
    assert healthy_peer(0, [0, 1], [0, 1]) is None


def test_flare_profile_on_alert_refuses_a_bad_address_in_one_line(capsys, tmp_path):
    from flare_exporter.engine import cli

    code = cli.main(["profile", "--targets", str(tmp_path), "--on-alert", "nowhere"])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "flare profile: flag --on-alert: 'nowhere' is not HOST:PORT (e.g. 0.0.0.0:9095)"
    ]
