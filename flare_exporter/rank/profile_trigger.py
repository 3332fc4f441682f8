"""Captures the rank's own signals ask for (inside the rank; `profile: on` with `profile_on_anomaly` only).

At every timing-manager drain (the manager's thread, or a scrape's: never the training thread) the trigger
looks at what the rank already measures, in this order:

- straggler: its last straggler windows (straggler_windows.py) all slower than its best window, with little
  of them spent in collectives (policies.ProfileTriggerPolicy): it is slow, not waiting for a slow peer;
- ild_shift: an issue-latency distribution shifted from its own baseline (ild.py's drift: KS and W1 at
  IldPolicy's full-shift thresholds; the partial and per-op shifts need the peers, which only the engine
  sees);
- canary_failed: the canary's last in-flight run failed a measurement.

The first that holds arms a capture of `profile_anomaly_steps` steps (profiler.py), at most once per
`profile_anomaly_cooldown_seconds`, and asks one peer for a capture beside it (PeerProfiles): a healthy
rank's steps to compare with (`flare profile --compare`).

PeerProfiles finds the peer's exporter through the job's c10d store, where every rank publishes its own
address once (`flare/<run>/exporter/<rank>`) at its first drain after init_process_group, and asks it
over HTTP (POST /profile?trigger=peer&of=RANK) on a thread of its own. An exporter behind TLS or basic
auth (web config) publishes nothing: a rank holds no password to ask its peers with, so no peer capture.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..policies import IldPolicy, ProfileTriggerPolicy
from .canary import IN_FLIGHT
from .exporter_health import ExporterHealth

STORE_SECONDS = 5.0  # the longest a store call or a peer's answer is waited for
Signal = tuple[str, dict[str, Any]]  # (trigger, its evidence)


def straggling(ring: Any, policy: ProfileTriggerPolicy) -> dict[str, Any] | None:
    """Evidence that the rank itself is slow: its last `slow_windows` windows (a WindowRing's) each at least
    `slowdown` times its best window's step time, with at most `max_wait_share` of it in collectives."""
    windows = ring.windows[-policy.slow_windows :]
    best = ring.best_step_seconds
    if len(windows) < policy.slow_windows or not best:
        return None
    for window in windows:
        if window.step_seconds < policy.slowdown * best:
            return None
        if window.wait_seconds > policy.max_wait_share * window.step_seconds:
            return None
    last = windows[-1]
    return {
        "window": last.number,
        "slowdown": round(last.step_seconds / best, 3),
        "wait_share": round(last.wait_seconds / last.step_seconds, 3),
        "policy_version": policy.version,
    }


def ild_shift(ild: Any, policy: IldPolicy) -> dict[str, Any] | None:
    """Evidence of an issue-latency distribution shifted from the rank's own baseline (an IldState's)."""
    for latency in ild.distributions if ild is not None else ():
        if latency.drift.current is None:
            continue
        ks, wasserstein = latency.drift.current
        if ks >= policy.ks and wasserstein >= policy.min_wasserstein_seconds:
            return {"distribution": latency.distribution, "ks": round(ks, 4), "wasserstein": wasserstein}
    return None


def canary_failed(canary: Any) -> dict[str, Any] | None:
    """Evidence of the canary's in-flight run failing a measurement (a Canary's snapshot)."""
    if canary is None:
        return None
    failed = sorted(entry for entry in canary.snapshot.failed if entry[2] == IN_FLIGHT)
    if not failed:
        return None
    measurement, scope, _ = failed[0]
    return {"measurement": measurement, "scope": scope}


class PeerProfiles:
    """Asks the next rank's exporter for a capture beside this rank's, through the job's c10d store."""

    def __init__(self, identity: Callable[[], Any], address: str, health: ExporterHealth) -> None:
        self.identity = identity  # the rank's identity now (its rank is known once the world group exists)
        self.address = address  # host:port of this rank's exporter; '' where it is secured (no peer asks)
        self.health = health
        self.published = False
        self.asked: list[dict[str, Any]] = []  # the answers of the peers asked (the newest last, bounded)

    def publish(self) -> None:
        """Put this rank's exporter address in the store, once the default process group exists, on a
        thread of its own: a store that does not answer must not hold the drain (and the scrapes) up."""
        if self.published or not self.address or not _initialized():
            return
        self.published = True
        me = self.identity()
        threading.Thread(
            target=self._publish, args=(_key(me.run, me.rank),), name="flare-profile-peer", daemon=True
        ).start()

    def _publish(self, key: str) -> None:
        try:
            _store().set(key, self.address)
        except Exception as error:  # no peer finds this rank: no capture beside another's
            self.health.error("profile_peer", error)

    def ask(self, steps: int) -> None:
        """Ask the peer for a capture of `steps` steps, on a thread of its own (never blocks)."""
        me = self.identity()
        if not self.address or me.world_size < 2:
            return
        peer = (me.rank + 1) % me.world_size
        threading.Thread(
            target=self._ask, args=(me.run, me.rank, peer, steps), name="flare-profile-peer", daemon=True
        ).start()

    def _ask(self, run: str, rank: int, peer: int, steps: int) -> None:
        try:
            store, key = _store(), _key(run, peer)
            store.wait([key], datetime.timedelta(seconds=STORE_SECONDS))
            address = store.get(key).decode()
            url = f"http://{address}/profile?steps={steps}&trigger=peer&of={rank}"
            request = urllib.request.Request(url, data=b"", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=STORE_SECONDS) as reply:
                    status, answer = reply.status, json.load(reply)
            except urllib.error.HTTPError as refused:
                status, answer = refused.code, json.load(refused)
            self.asked = [*self.asked[-7:], {"peer": peer, "status": status, "answer": answer}]
        except Exception as error:  # the peer gone, its store key never set: no capture beside ours
            self.health.error("profile_peer", error)


class AnomalyTrigger:
    """Arms a capture when the rank's own signals fire; `after_drain` runs at the end of every drain."""

    def __init__(
        self,
        profiler: Any,  # profiler.Profiler
        signals: Mapping[str, Callable[[], dict[str, Any] | None]],  # trigger -> its evidence, or None
        steps: int,
        cooldown_seconds: float,
        health: ExporterHealth,
        peers: PeerProfiles | None = None,
    ) -> None:
        self.profiler = profiler
        self.signals = signals
        self.steps = steps
        self.cooldown_seconds = cooldown_seconds
        self.health = health
        self.peers = peers
        self.quiet_until = 0.0
        self.fired: list[Signal] = []  # the signals that armed a capture, the newest last (bounded)

    def after_drain(self) -> None:
        try:
            if self.peers is not None:
                self.peers.publish()
            if time.time() >= self.quiet_until:
                self._check()
        except Exception as error:  # never into the drain: the next one looks again
            self.health.error("profile_trigger", error)
            self.quiet_until = time.time() + self.cooldown_seconds  # a broken signal: not at every drain

    def _check(self) -> None:
        for trigger, signal in self.signals.items():
            evidence = signal()
            if evidence is None:
                continue
            status, _ = self.profiler.request(self.steps, trigger, reason=evidence)
            if status != 202:
                return  # one runs (asked by a person, say) or its cooldown: look again at the next drain
            self.quiet_until = time.time() + self.cooldown_seconds
            self.fired = [*self.fired[-7:], (trigger, evidence)]
            if self.peers is not None:
                self.peers.ask(self.steps)
            return


def make_trigger(state: Any, address: str) -> AnomalyTrigger | None:
    """The trigger of a rank started with `profile: on` and `profile_on_anomaly`, added to the timing
    manager's drains; None otherwise. `address`: the rank's exporter (host:port, '' where secured)."""
    config = state.config
    if state.profiler is None or not config.profile_on_anomaly:
        return None
    policy = ProfileTriggerPolicy()
    signals = {
        "straggler": lambda: straggling(state.windows.ring, policy),
        "ild_shift": lambda: ild_shift(state.ild, IldPolicy()),
        "canary_failed": lambda: canary_failed(state.canary),
    }
    peers = PeerProfiles(lambda: state.identity, address, state.health)
    trigger = AnomalyTrigger(
        state.profiler,
        signals,
        config.profile_anomaly_steps,
        config.profile_anomaly_cooldown_seconds,
        state.health,
        peers,
    )
    state.manager.after_drain.append(trigger.after_drain)
    return trigger


def _key(run: str, rank: int) -> str:
    return f"flare/{run}/exporter/{rank}"


def _initialized() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
