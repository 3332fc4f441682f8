"""A rank of a lagging shard is not paged as a hang's culprit (issue: pages that stay right when the store
falls behind).

A virtual cluster of 4 ranks started with hang_seconds 4, scraped by a real Prometheus evaluating `flare
rules`: ranks 0-2 every second, rank 3 by a second job every 15 s (a shard behind). Prometheus's first
scrape of rank 3 finds it behind (it has not issued the next world all-reduce yet); right after it, ranks 0
and 1 report that they issued it half a second before that scrape, rank 3 that it issued it just after,
and rank 2 is stuck in compute. Until rank 3's next scrape, 15 s later, Prometheus holds rank 3's number
from after its group's newest visible issue but from before the group was hung (3.5 s after that scrape):
the rules must not judge it, and page rank 2 alone; `flare diagnose` names rank 2 and lists rank 3 as not
judged. Rules that judged every number scraped after the newest issue paged rank 3 too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import flare_json

from flare_exporter.config import Config
from flare_exporter.local.prometheus import PrometheusProcess, scrape_config, wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.mixin import rule_model, rules_render

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed"),
]

RUN = "lagging-shard"
WORLD, STUCK, LAGGING = 4, 2, 3
HANG_SECONDS = 4.0
LAGGING_INTERVAL = "15s"


def culprits_ever(prometheus: PrometheusProcess) -> set[str]:
    """The ranks FlareCollectiveHangCulprit has named for the run in the last two minutes."""
    named = f'ALERTS{{alertname="FlareCollectiveHangCulprit", alertstate="firing", run="{RUN}"}}'
    return {
        item["metric"]["rank"] for item in prometheus.query(f"max by (rank) (max_over_time({named}[2m]))")
    }


def scraped_at(prometheus: PrometheusProcess, rank: int) -> float:
    """When Prometheus last scraped the rank's issued numbers (0 before it has)."""
    answer = prometheus.query(
        f'max(timestamp(flare_collective_last_issued_seq{{run="{RUN}", rank="{rank}"}}))'
    )
    return float(answer[0]["value"][1]) if answer else 0.0


def test_a_rank_whose_scrapes_lag_is_not_paged_as_the_culprit(tmp_path: Path) -> None:
    _, before, hung = vc.render_phases(WORLD, RUN, None, STUCK, config=Config(hang_seconds=HANG_SECONDS))
    rule_file = tmp_path / "flare.rules.yml"
    thresholds = rule_model.Thresholds(scrape_interval_seconds=1.0, slow_interval="").with_for("0s")
    rule_file.write_text(rules_render.render(thresholds))  # told no threshold: the run's own 4 s
    fast, lagging = str(tmp_path / "fast"), str(tmp_path / "lagging")
    lagging_job = {**scrape_config(lagging, LAGGING_INTERVAL), "job_name": "flare-lagging"}
    with vc.ClusterServer(before) as cluster:
        targets = cluster.targets()
        vc.write_file_sd(fast, RUN, [target for rank, target in enumerate(targets) if rank != LAGGING], WORLD)
        vc.write_file_sd(lagging, RUN, [targets[LAGGING]], WORLD)
        with PrometheusProcess(
            str(tmp_path / "prometheus"), fast, rule_files=[str(rule_file)], extra_jobs=[lagging_job]
        ) as prometheus:
            first = wait_for(
                lambda: scraped_at(prometheus, LAGGING), 60, "the first scrape of the lagging rank"
            )
            pages = vc.hung_at(hung, first - 0.5)  # ranks 0 and 1 issued half a second before it
            pages[LAGGING] = vc.hung_at(hung, first + 0.1)[LAGGING]  # rank 3 right after it
            cluster.set_pages(pages)

            wait_for(lambda: STUCK_NAME in culprits_ever(prometheus), 30, "the culprit page")
            assert scraped_at(prometheus, LAGGING) == first, "rank 3 scraped again too soon to tell"
            code, report = flare_json("diagnose", "--prometheus", prometheus.url, "--run", RUN)
            (hang,) = [verdict for verdict in report["verdicts"] if verdict["group"] == "world"]
            assert (code, hang["kind"], hang["ranks"]) == (1, "hang", [STUCK]), report
            assert hang["evidence"]["seen_before_stall"] == [LAGGING], hang

            wait_for(lambda: scraped_at(prometheus, LAGGING) > first, 30, "the lagging rank's next scrape")
            assert culprits_ever(prometheus) == {STUCK_NAME}


STUCK_NAME = str(STUCK)
