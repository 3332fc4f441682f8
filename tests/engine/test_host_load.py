"""The host's load, as a rank reads it (rank/host_load.py) and as the engine weighs it with a slowdown
(engine/host_load.py): a slowdown every rank of a busy host shares is the host's, a warning that names no
rank; a straggler alone on a busy host stays one; a host-side issue-latency shift stays host side."""

from __future__ import annotations

import argparse
import threading

import pytest
from test_diagnosis import diag, drifted, only, windowed

from flare_exporter.config import DEFAULT, HangThreshold
from flare_exporter.engine import cli, host_load
from flare_exporter.engine.host_load import HostLoadState
from flare_exporter.local.prometheus import wait_for
from flare_exporter.policies import HostLoadPolicy, IldPolicy
from flare_exporter.rank import host_load as rank_host_load
from flare_exporter.rank.host_load import ThreadCpuShare, cpu_pressure, runnable_tasks

PSI = (
    "some avg10=63.50 avg60=40.10 avg300=12.00 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)

# ---------------------------------------------------------------------------------------------------------
# what a rank reads


def test_cpu_pressure_is_psis_some_avg10_as_a_share(tmp_path):
    path = tmp_path / "cpu"
    path.write_text(PSI)
    assert cpu_pressure(str(path)) == pytest.approx(0.635)


@pytest.mark.parametrize("text", ["", "some avg60=1.0\n", "some avg10=many\n", "full avg10=3.0\n"])
def test_cpu_pressure_that_cannot_be_read_is_none(tmp_path, text):
    path = tmp_path / "cpu"
    path.write_text(text)
    assert cpu_pressure(str(path)) is None
    assert cpu_pressure(str(tmp_path / "absent")) is None  # a kernel without PSI


def test_runnable_tasks_is_proc_stats_procs_running(tmp_path):
    path = tmp_path / "stat"
    path.write_text("cpu  1 2 3 4\nprocs_running 7\nprocs_blocked 0\n")
    assert runnable_tasks(str(path)) == 7
    path.write_text("cpu  1 2 3 4\n")
    assert runnable_tasks(str(path)) is None


def test_a_threads_cpu_share_is_its_cpu_time_over_wall_time(monkeypatch):
    """A spinning thread runs for much of its wall time, a sleeping one for next to none; the share needs
    two readings at least MIN_INTERVAL_SECONDS apart (shortened here). This thread polls, yielding the GIL:
    on a loaded machine the spinner still gets a good share of a core."""
    monkeypatch.setattr(rank_host_load, "MIN_INTERVAL_SECONDS", 0.3)
    done = threading.Event()
    spinning = threading.Thread(target=lambda: [None for _ in iter(done.is_set, True)], daemon=True)
    sleeping = threading.Thread(target=done.wait, daemon=True)
    spinning.start()
    sleeping.start()
    try:
        busy, idle = (ThreadCpuShare(thread.ident) for thread in (spinning, sleeping))
        assert (busy.read(), idle.read()) == (None, None)  # one reading: no interval yet
        busy_share = wait_for(busy.read, 30, "a second reading of the spinning thread")
        idle_share = idle.read()
    finally:
        done.set()
    assert idle_share is not None and idle_share < 0.02, idle_share
    assert busy_share > 0.05 and busy_share > 5 * idle_share, (busy_share, idle_share)


def test_a_thread_that_ended_has_no_share():
    thread = threading.Thread(target=lambda: None)
    thread.start()
    share = ThreadCpuShare(thread.ident)
    thread.join()
    assert share.read() is None


def test_the_pressure_floor_is_the_lowest_read_at_a_drain_that_closed_windows(monkeypatch):
    """The floor is read once a drain, where a window closed, and only ever goes down."""
    from test_stragglers import FakeSteps

    from flare_exporter.rank import straggler_windows
    from flare_exporter.rank.exporter_health import ExporterHealth

    readings = iter([0.6, 0.4, 0.9, 0.2])
    monkeypatch.setattr(straggler_windows, "cpu_pressure", lambda: next(readings))
    steps = FakeSteps()
    windows = straggler_windows.StepWindows(
        steps, {}, ExporterHealth(), steps_per_window=1, kept=4, finished=[]
    )
    found = []
    for step in range(1, 5):
        steps.boundaries.append((step, float(step)))
        windows.forget_finished()  # step 1 closes no window: no reading; then one a drain
        found.append(windows.host_pressure_floor)
    assert found == [None, 0.6, 0.4, 0.4]
    windows.forget_finished()  # no new window: no reading (the iterator's 0.2 is left)
    assert next(readings) == 0.2


# ---------------------------------------------------------------------------------------------------------
# what the engine makes of it

BUSY = HostLoadState(
    cpu_pressure=0.9, cpu_pressure_floor=0.05, runnable_tasks=7, cpus=2, thread_cpu_ratio=0.3
)
QUIET = HostLoadState(
    cpu_pressure=0.03, cpu_pressure_floor=0.02, runnable_tasks=2, cpus=2, thread_cpu_ratio=0.9
)
SLOW = [1.7, 1.8, 1.7]  # every window 1.7x the rank's best


def test_a_job_wide_slowdown_on_a_busy_host_is_the_hosts_warning_not_a_page():
    records = [windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host="node-a", host_load=BUSY) for r in range(4)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("straggler", (), "host")
    assert (verdict.severity, verdict.cause) == (host_load.WARNING, "host_contention")
    assert verdict.evidence["host_load"]["node-a"]["cpu_pressure"] == 0.9
    assert verdict.evidence["slowed_ranks"] == [0, 1, 2, 3]
    assert "host node-a busy" in verdict.summary and "no rank's fault" in verdict.summary
    assert cli.format_verdicts([verdict])[0].startswith("WARNING STRAGGLER (host: no single rank)")


def test_a_job_wide_slowdown_over_busy_hosts_is_the_jobs_warning():
    records = [
        windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host=f"node-{r // 2}", host_load=BUSY) for r in range(4)
    ]
    verdict = only(diag(*records))
    assert (verdict.domain, verdict.severity) == ("job", host_load.WARNING)
    assert sorted(verdict.evidence["host_load"]) == ["node-0", "node-1"]


@pytest.mark.parametrize(
    "load",
    [
        QUIET,
        # as busy as at its floor: a job that crowds its own cores did so all along
        HostLoadState(cpu_pressure=0.9, cpu_pressure_floor=0.85, runnable_tasks=7, cpus=2),
        # no PSI, and no more runnable tasks than CPUs
        HostLoadState(runnable_tasks=2, cpus=2),
        # busy now, but no floor read yet (no window closed): no rise to tell
        HostLoadState(cpu_pressure=0.9, runnable_tasks=7, cpus=2),
    ],
)
def test_a_job_wide_slowdown_on_a_host_that_did_not_get_busier_still_pages(load):
    records = [windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host="node-a", host_load=load) for r in range(4)]
    verdict = only(diag(*records))
    assert (verdict.domain, verdict.severity, verdict.cause) == ("job", "page", "straggler")
    assert "job-wide" in verdict.summary and "host_load" not in verdict.evidence


def test_without_psi_a_run_queue_longer_than_the_cpus_is_busy():
    load = HostLoadState(runnable_tasks=7, cpus=2)
    records = [windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host="node-a", host_load=load) for r in range(4)]
    verdict = only(diag(*records))
    assert verdict.severity == host_load.WARNING and "7 runnable tasks on 2 CPUs" in verdict.summary


def test_the_stragglers_that_are_every_rank_of_a_busy_host_are_that_hosts_warning():
    """Ranks 0 and 1 share node-0, busy; ranks 2-5 run on quiet hosts: 0 and 1 wait least, alike."""
    records = [windowed(r, [0.20, 0.21, 0.20], host="node-0", host_load=BUSY) for r in (0, 1)]
    records += [windowed(r, [0.40, 0.41, 0.40], host=f"node-{r // 2}", host_load=QUIET) for r in (2, 3, 4, 5)]
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain, verdict.severity) == (
        "straggler",
        (),
        "host",
        host_load.WARNING,
    )
    assert verdict.evidence["slowed_ranks"] == [0, 1] and list(verdict.evidence["host_load"]) == ["node-0"]


def test_a_straggler_whose_hosts_other_ranks_were_not_read_stays_a_straggler():
    """At thousands of ranks the Prometheus source reads the host's load of the few ranks it could name: the
    straggler's host mates, unread, still count as its host's ranks."""
    records = [windowed(r, [0.40, 0.41, 0.39], host="node-a") for r in (0, 1, 3)]
    records.append(windowed(2, [0.30, 0.31, 0.29], host="node-a", host_load=BUSY))
    verdict = only(diag(*records))
    assert (verdict.ranks, verdict.severity) == ((2,), "page") and "host_load" in verdict.evidence


def test_a_straggler_alone_on_a_busy_host_stays_a_straggler_with_its_hosts_load():
    records = [windowed(r, [0.40, 0.41, 0.39], host="node-a", host_load=BUSY) for r in (0, 1, 3)]
    records.append(windowed(2, [0.30, 0.31, 0.29], host="node-a", host_load=BUSY))
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.severity, verdict.cause) == (
        "straggler",
        (2,),
        "page",
        "straggler",
    )
    assert verdict.evidence["host_load"]["node-a"]["busy"] and "host node-a busy" in verdict.summary


def test_the_policy_thresholds_decide():
    records = [windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host="node-a", host_load=BUSY) for r in range(4)]
    strict = HostLoadPolicy(cpu_pressure=0.95)
    assert only(diag(*records, host_load=strict)).severity == "page"


def test_a_host_side_shift_on_the_slowest_rank_stays_host_side():
    """Rank 1's issue latency shifted (its interpreter contended) and it waits least: one verdict, the
    regression's, which says it is also the slowest."""
    records = [
        windowed(
            r, [0.40, 0.41, 0.39], ild_ks={"host_dispatch": 0.02}, ild_wasserstein={"host_dispatch": 1e-6}
        )
        for r in (0, 2, 3)
    ]
    records.append(
        windowed(
            1, [0.30, 0.31, 0.29], ild_ks={"host_dispatch": 0.6}, ild_wasserstein={"host_dispatch": 1e-3}
        )
    )
    verdict = only(diag(*records))
    assert (verdict.kind, verdict.ranks, verdict.domain) == ("ild_regression", (1,), "rank")
    assert verdict.evidence["also_slowest"]["1"]["gap"] == pytest.approx(0.10, abs=0.01)
    assert "also the slowest" in verdict.summary


def test_a_slowest_rank_whose_gpu_explains_it_stays_a_straggler_beside_its_shift():
    from flare_exporter.engine.rule_types import GpuState

    records = [windowed(r, [0.40, 0.41, 0.39]) for r in (0, 2, 3)]
    records = [
        drifted(r, 0.02, 1e-6, step_windows=w.step_windows, best_step_seconds=1.0, step_count=100)
        for r, w in zip((0, 2, 3), records, strict=True)
    ]
    throttled = GpuState(up=True, clock_events=("hw_thermal_slowdown",))
    slow = windowed(
        1,
        [0.30, 0.31, 0.29],
        gpu=throttled,
        ild_ks={"host_dispatch": 0.6},
        ild_wasserstein={"host_dispatch": 1e-3},
    )
    kinds = [(verdict.kind, verdict.ranks) for verdict in diag(*records, slow)]
    assert kinds == [("straggler", (1,)), ("ild_regression", (1,))]


@pytest.mark.parametrize("load, code", [(BUSY, cli.EXIT_OK), (QUIET, cli.EXIT_ANOMALY)])
def test_flare_diagnose_exits_0_on_a_busy_hosts_warning_and_1_on_a_page(load, code):
    from test_diagnosis import snapshot

    records = [windowed(r, [0.40, 0.41, 0.40], steps=SLOW, host="node-a", host_load=load) for r in range(4)]
    args = argparse.Namespace(command="diagnose")
    answer = cli._snapshot_answer(args, snapshot(*records), "test", HangThreshold(30.0, DEFAULT), IldPolicy())
    assert answer.code == code and len(answer.result["verdicts"]) == 1, answer.text
    assert answer.result["verdicts"][0]["severity"] == ("warning" if load is BUSY else "page")
