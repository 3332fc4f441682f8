"""A Prometheus behind on its scrapes of some ranks holds their numbers from before a hang: neither the alerts
nor `flare diagnose` judge a rank behind on them.

At thousands of ranks a Prometheus falls behind: `benchmarks/scale.py` at 6,144 ranks saw a target's scrape
interval reach 81 s at p99 against 15 s configured, and with a hang threshold of 20 s every rank whose last
scrape came before the hang was paged as a culprit. Here a virtual cluster (flare's own collectors render each
rank's page) of 8 ranks is scraped every second by a real Prometheus running `flare rules` with a 3 s hang
threshold, which pages a real Alertmanager. Four healthy ranks serve their pages stamped with one time before
the hang: what Prometheus holds of a rank last scraped then. With the culprit they are most of the group, so
judged on those numbers the three ranks at the front would be a mismatch, and no culprit would be named.
"""

from __future__ import annotations

import shutil
import time

import pytest
from conftest import await_page, flare_json, queries_sent

from flare_exporter.local import alertmanager
from flare_exporter.local.alertmanager import AlertingStack
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.mixin.rules import CULPRIT_ALERTS

RUN = "late-scrapes"
RANKS = 8
HUNG = 5
LATE = (0, 1, 2, 3)
HANG_SECONDS = 3
LATER_STEPS = 40  # render_phases' second page: the job 40 steps on


def stamped(page: bytes, unix_time: float) -> bytes:
    """`page` with every sample stamped `unix_time`: what Prometheus holds of a rank last scraped then."""
    stamp = f" {round(unix_time * 1000)}".encode()
    return b"\n".join(
        line + stamp if line and not line.startswith(b"#") else line for line in page.split(b"\n")
    )


def count(stack: AlertingStack, expr: str) -> int:
    answer = stack.prometheus.query(f"count({expr})")
    return int(float(answer[0]["value"][1])) if answer else 0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_ranks_scraped_before_a_hang_are_not_judged_on_it_by_the_alerts_nor_the_engine(tmp_path, monkeypatch):
    if not alertmanager.can_alert():
        pytest.skip("alertmanager is not installed")
    healthy, later, hung_pages = vc.render_phases(RANKS, RUN, None, HUNG, LATER_STEPS)
    # the late ranks' samples carry their time from the first scrape on: a series whose samples stop
    # carrying one is marked stale by Prometheus, and absent from its answers
    rendered_at = time.time()
    healthy = [stamped(page, rendered_at) if rank in LATE else page for rank, page in enumerate(healthy)]
    targets = str(tmp_path / "targets")
    stack = AlertingStack(str(tmp_path / "alerting"), targets, HANG_SECONDS)
    try:
        with vc.ClusterServer(healthy) as server:
            vc.write_file_sd(targets, RUN, server.targets(), RANKS)
            stack.wait_ready()
            wait_for(lambda: count(stack, f'flare_rank_info{{run="{RUN}"}}') == RANKS, 60, "every rank")

            # the job moves on; Prometheus's last scrape of the late ranks is at `last_scraped`
            last_scraped = time.time()
            late = {rank: stamped(later[rank], last_scraped) for rank in LATE}
            server.set_pages([late.get(rank, page) for rank, page in enumerate(later)])
            steps = f'flare_steps_total{{run="{RUN}"}} == {vc.STEPS + LATER_STEPS}'
            wait_for(lambda: count(stack, steps) == RANKS, 60, "every rank's later steps")

            # the world hangs after that: every rank but HUNG issues the next all-reduce and waits in it
            hung_at = time.time() + 0.5
            hung = vc.hung_at(hung_pages, hung_at)
            server.set_pages([late.get(rank, page) for rank, page in enumerate(hung)])
            await_page(stack, "FlareCollectiveHangCulprit", 60, run=RUN, rank=str(HUNG))
            seq = f'flare_collective_last_issued_seq{{run="{RUN}", group="world"}}'
            assert count(stack, f"timestamp({seq}) < {hung_at}") == len(LATE)  # still from before the hang
            firing = stack.prometheus.query(f'ALERTS{{run="{RUN}"}}')
            named = {
                (alert["metric"]["alertname"], alert["metric"].get("rank"))
                for alert in firing
                if alert["metric"]["alertname"] in CULPRIT_ALERTS
            }
            assert named == {("FlareCollectiveHangCulprit", str(HUNG))}
            paged = {
                (alert["labels"]["alertname"], alert["labels"].get("rank"))
                for _, alert in stack.pages.alerts(run=RUN)
                if alert["labels"]["alertname"] in CULPRIT_ALERTS
            }
            assert paged == {("FlareCollectiveHangCulprit", str(HUNG))}

            # the engine, from the same Prometheus: the same culprit, and which ranks it did not judge
            code, report = flare_json(
                "diagnose", "--prometheus", stack.prometheus.url, "--run", RUN,
                "--hang-seconds", str(HANG_SECONDS),
            )  # fmt: skip
            (verdict,) = report["verdicts"]
            assert (verdict["kind"], verdict["ranks"], verdict["group"]) == ("hang", [HUNG], "world")
            assert verdict["evidence"]["seen_before_stall"] == list(LATE)

            # without --run: the only run Prometheus's index names is the one, asked of no query
            with queries_sent(monkeypatch) as sent:
                found_code, found = flare_json(
                    "diagnose", "--prometheus", stack.prometheus.url, "--hang-seconds", str(HANG_SECONDS)
                )
            assert (found_code, found["run"], found["verdicts"][0]["ranks"]) == (code, RUN, [HUNG])
            assert sent and not [expr for expr in sent if "count by (run)" in expr]
    finally:
        stack.stop()
