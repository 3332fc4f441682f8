"""The profiler: its capture mechanics (rank/profiler.py), its endpoint, and `flare profile` on real ranks."""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import flare_json

from flare_exporter.engine import scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.exposition import make_app
from flare_exporter.rank.profiler import Profiler
from flare_exporter.rank.web_config import BasicAuth


class Recorded:
    """A reducer that keeps what it was given: the trace's step markers, and the steps asked for."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[tuple[list[str], int, str]] = []

    def __call__(self, trace: dict, steps: int) -> tuple[dict, str, dict]:
        names = [event.get("name", "") for event in trace.get("traceEvents", [])]
        marks = sorted({name for name in names if name.startswith("ProfilerStep#")})
        self.seen.append((marks, steps, threading.current_thread().name))
        if self.fail:
            raise ValueError("a trace it cannot read")
        return {"steps": steps, "step_seconds": 0.01, "shares": {"compute": 0.9}}, "compute_bound", {"why": 1}


def profiler(tmp_path, reducer: Any, cooldown: float = 0.0, keep: int = 1) -> Profiler:
    found = Profiler(ExporterHealth(), 5, cooldown, str(tmp_path), "run-1", 3, keep=keep, reducer=reducer)
    found.install()
    return found


def train(steps: int) -> None:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()


def ended(found: Profiler) -> dict:
    return wait_for(lambda: found.status()["last"], 30, "the capture to end")


def test_a_capture_runs_from_one_step_boundary_to_another_and_is_reduced_off_the_training_thread(tmp_path):
    reducer = Recorded()
    found = profiler(tmp_path, reducer)
    try:
        train(2)  # nothing armed: nothing captured
        assert reducer.seen == [] and found.status()["last"] is None
        assert found.request(3) == (202, {"capture": found.status()["running"]})
        train(5)
        last = ended(found)
    finally:
        found.uninstall()
    [(marks, steps, thread)] = reducer.seen
    assert steps == 3 and thread == "flare-profile" and thread != threading.current_thread().name
    assert marks == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]  # the boundaries of 3 steps
    assert (last["state"], last["bottleneck"], last["steps"]) == ("captured", "compute_bound", 3)
    summary = tmp_path / "profiles" / "run-1-rank3-capture1.summary.json"
    assert json.loads(summary.read_text())["step_seconds"] == 0.01
    assert last["trace_path"].endswith("run-1-rank3-capture1.trace.json")
    assert "ProfilerStep#1" in open(last["trace_path"]).read()  # the raw trace kept, whole
    assert found.outcomes == {"captured": 1, "failed": 0}


def test_one_capture_at_a_time_then_a_cooldown_and_bad_step_counts_are_refused(tmp_path):
    found = profiler(tmp_path, Recorded(), cooldown=60.0)
    try:
        assert found.request(0)[0] == 400 and found.request(6)[0] == 400  # 1 to profile_max_steps (5)
        assert found.request(1)[0] == 202
        status, answer = found.request(1)
        assert status == 409 and answer["error"] == "a capture is running"
        train(3)
        ended(found)
        status, answer = found.request(1)
        assert status == 429 and 0 < answer["retry_after"] <= 60
        assert found.refused == 2
    finally:
        found.uninstall()


def test_a_failed_reduction_ends_the_capture_as_failed_and_training_goes_on(tmp_path):
    found = profiler(tmp_path, Recorded(fail=True))
    try:
        found.request(2)
        train(4)
        last = ended(found)
        train(2)  # the hook stays quiet after a failure
    finally:
        found.uninstall()
    assert last["state"] == "failed" and "a trace it cannot read" in last["error"]
    assert found.outcomes == {"captured": 0, "failed": 1} and found.health.errors["profiler"] == 1


def test_only_the_newest_raw_traces_are_kept(tmp_path):
    found = profiler(tmp_path, Recorded(), keep=1)
    try:
        for capture in (1, 2):
            found.request(1)
            train(2)
            wait_for(
                lambda n=capture: (found.status()["last"] or {}).get("id") == n, 30, f"capture {capture}"
            )
    finally:
        found.uninstall()
    traces = sorted(path.name for path in (tmp_path / "profiles").glob("*.trace.json"))
    summaries = sorted(path.name for path in (tmp_path / "profiles").glob("*.summary.json"))
    assert traces == ["run-1-rank3-capture2.trace.json"] and len(summaries) == 2


def test_a_trace_is_exported_beside_the_kept_ones_and_a_killed_predecessors_scratch_is_removed(tmp_path):
    profiles = tmp_path / "profiles"
    stale, others = profiles / ".run-1-rank3-scratch-abc", profiles / ".run-1-rank4-scratch-abc"
    for directory in (stale, others):
        directory.mkdir(parents=True)
        (directory / "trace.json").write_text('{"traceEvents": [')  # half-exported when it was killed
    reducer = Recorded()
    found = profiler(tmp_path, reducer)  # the same run and rank starting again
    try:
        assert not stale.exists() and others.exists()  # rank 4's is rank 4's to remove
        found.request(1)
        train(2)
        ended(found)
    finally:
        found.uninstall()
    assert sorted(path.name for path in profiles.iterdir()) == [
        ".run-1-rank4-scratch-abc",
        "run-1-rank3-capture1.summary.json",
        "run-1-rank3-capture1.trace.json",
    ]


def call(app: Any, method: str, path: str, query: str = "", authorization: str = "") -> tuple[str, Any]:
    answer: dict[str, Any] = {}
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}
    if authorization:
        environ["HTTP_AUTHORIZATION"] = authorization
    body = b"".join(app(environ, lambda status, headers: answer.update(status=status)))
    try:
        return answer["status"], json.loads(body)
    except ValueError:
        return answer["status"], body


def test_the_endpoint_arms_and_reports_captures_only_where_profiling_is_on(tmp_path):
    from prometheus_client import CollectorRegistry

    found = profiler(tmp_path, Recorded())
    try:
        app = make_app(CollectorRegistry(), profiler=found)
        assert call(app, "POST", "/profile", "steps=x")[0].startswith("400")
        status, answer = call(app, "POST", "/profile", "steps=2")
        assert status == "202 Accepted" and answer["capture"]["state"] == "armed"
        status, answer = call(app, "GET", "/profile")
        assert status == "200 OK" and answer["running"]["steps"] == 2
        assert call(app, "DELETE", "/profile")[0].startswith("405")
    finally:
        found.uninstall()
    assert call(make_app(CollectorRegistry()), "POST", "/profile", "steps=2")[0].startswith("404")
    secured = make_app(CollectorRegistry(), BasicAuth({"u": b"$2b$04$" + b"x" * 53}), profiler=found)
    assert call(secured, "POST", "/profile", "steps=2")[0].startswith("401")


@pytest.mark.multirank
def test_flare_profile_captures_chosen_ranks_of_a_real_job_and_is_refused_where_profiling_is_off(tmp_path):
    args = ["--steps", "100000", "--step-seconds", "0.02"]
    env = {"FLARE_PROFILE": "1", "FLARE_PROFILE_COOLDOWN_SECONDS": "0"}
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    with ObservedJob(str(tmp_path / "on"), train_ddp.__file__, args, 4, "profiled", env=env) as job:
        wait_for(lambda: len(list((tmp_path / "on" / "targets").glob("*.json"))) == 4, 60, "the targets")
        targets = str(tmp_path / "on" / "targets")
        started = time.monotonic()
        code, report = flare_json("profile", "--targets", targets, "--ranks", "1,2", "--steps", "3")
        assert code == 0, report
        assert [row["rank"] for row in report["ranks"]] == [1, 2]
        for row in report["ranks"]:
            assert row["steps"] == 3 and row["bottleneck"] and row["evidence"]
            assert 0 < row["summary_bytes"] < 16 * 1024
        assert time.monotonic() - started < 60
        code, compared = flare_json(
            "profile", "--targets", targets, "--ranks", "0,3", "--steps", "2", "--compare"
        )
        assert code == 0 and 0 < len(compared["compare"]) <= 10
        assert {"name", "a_seconds", "b_seconds", "difference_seconds"} <= set(compared["compare"][0])
        code, again = flare_json("profile", "--targets", targets, "--ranks", "1", "--steps", "100")
        assert code == 2 and "steps" in again["ranks"][0]["error"]  # beyond profile_max_steps
    with ObservedJob(str(tmp_path / "off"), train_ddp.__file__, args, 2, "plain") as job:
        wait_for(lambda: len(list((tmp_path / "off" / "targets").glob("*.json"))) == 2, 60, "the targets")
        code, report = flare_json("profile", "--targets", str(tmp_path / "off" / "targets"), "--steps", "2")
        assert code == 2 and {row["state"] for row in report["ranks"]} == {"refused"}
        assert "profiling is off" in report["ranks"][0]["error"]
        job.release()


def _armed(samples: list, trigger: str) -> float:
    return scrape.value(samples, "flare_profile_armed_total", trigger=trigger) or 0.0


def _by_rank(job: ObservedJob) -> dict[int, list]:
    return {
        int(scrape.labels_of(samples, "flare_rank_info")["rank"]): samples
        for samples in scrape.scrape_all(job.targets, timeout=2).values()
        if isinstance(samples, list)
    }


def _profile_status(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/profile", timeout=5) as reply:
        return json.load(reply)


@pytest.mark.multirank
def test_a_straggler_captures_itself_once_per_cooldown_with_a_healthy_peer_beside_it(tmp_path):
    """profile_on_anomaly: from step 60 rank 2 sleeps 0.1 s before each step's compute. Its own straggler
    windows (5 steps) show it slower than its best without waiting in collectives: it captures 2 steps, and
    asks rank 3 (the next rank) for a capture beside it. The others slow down as much, waiting for it."""
    env = {
        "FLARE_PROFILE": "1",
        "FLARE_PROFILE_ON_ANOMALY": "1",
        "FLARE_PROFILE_ANOMALY_STEPS": "2",
        "FLARE_PROFILE_COOLDOWN_SECONDS": "0",
        "FLARE_STRAGGLER_WINDOW_STEPS": "5",
        "FLARE_TIMING_INTERVAL_SECONDS": "0.5",
    }
    args = ["--steps", "100000", "--step-seconds", "0.02", "--slow-rank", "2", "--slowdown", "100"]
    args += ["--slow-from-step", "60", "--slow-by", "sleep"]
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, 4, "anomaly", env=env) as job:

        def both_captured() -> dict[int, list] | None:
            ranks = _by_rank(job)
            captured = "flare_profile_captures_total"
            done = [scrape.value(ranks.get(rank, []), captured, outcome="captured") for rank in (2, 3)]
            return ranks if len(ranks) == 4 and all(done) else None

        ranks = wait_for(both_captured, 120, "rank 2's capture and its peer's")
        assert _armed(ranks[2], "straggler") == 1 and _armed(ranks[3], "peer") == 1
        steps = scrape.value(ranks[2], "flare_steps_total") or 0
        wait_for(
            lambda: (scrape.value(_by_rank(job).get(2, []), "flare_steps_total") or 0) >= steps + 30,
            120,
            "6 more windows of rank 2",
        )
        later = _by_rank(job)
        assert _armed(later[2], "straggler") == 1  # still slow, and in its cooldown (an hour): no other
        for samples in later.values():
            assert (
                sum(_armed(samples, trigger) for trigger in ("straggler", "ild_shift", "canary_failed")) <= 1
            )
        mine, peers = (_profile_status(job.targets[rank])["last"] for rank in (2, 3))
        paged = on_alert(job, str(tmp_path / "targets"))
        job.release()
    assert (mine["trigger"], mine["state"], mine["steps"]) == ("straggler", "captured", 2)
    assert mine["reason"]["slowdown"] >= 1.5 and mine["reason"]["wait_share"] <= 0.2
    assert (peers["trigger"], peers["peer_of"], peers["state"]) == ("peer", 2, "captured")
    # side by side: the peer spent its steps in the all-reduce that waited for rank 2, rank 2 did not
    assert peers["summary"]["shares"]["communication"] > mine["summary"]["shares"]["communication"]
    # the page's rank, and the next rank no alert names, beside it; the same page again asks nothing
    asked, lasts = paged
    assert [(row["rank"], row["trigger"], row["state"]) for row in asked] == [
        (0, "alert", "armed"),
        (1, "peer", "armed"),
    ]
    assert (lasts[0]["trigger"], lasts[1]["trigger"], lasts[1]["peer_of"]) == ("alert", "peer", 0)


def on_alert(job: ObservedJob, targets: str) -> tuple[list[dict], list[dict]]:
    """`flare profile --on-alert`'s receiver, served, sent a notification twice over HTTP: rank 0 a
    straggler (a dead rank's page and a resolved one ask nothing). The rows it printed, and the captures."""
    from flare_exporter.engine import cli, profile_on_alert

    argv = ["profile", "--targets", targets, "--steps", "2", "--on-alert", "x:1", "--json"]
    args = cli.build_parser().parse_args(argv)
    out = io.StringIO()
    server = profile_on_alert.serve(
        profile_on_alert.AlertCaptures(args, None, cli._client(args), out), "127.0.0.1:0"
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alerts = [
        ("FlareRankStraggler", "0", "firing"),
        ("FlareRankDown", "3", "firing"),
        ("FlareRankStraggler", "2", "resolved"),
    ]
    payload = {
        "version": "4",
        "alerts": [
            {"status": status, "labels": {"alertname": name, "run": "anomaly", "rank": rank}}
            for name, rank, status in alerts
        ],
    }
    try:
        for _ in range(2):
            url = f"http://127.0.0.1:{server.server_address[1]}/"
            request = urllib.request.Request(url, json.dumps(payload).encode(), method="POST")
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200
    finally:
        server.shutdown()
        server.server_close()

    def ended(rank: int) -> dict | None:
        last = _profile_status(job.targets[rank])["last"] or {}
        return last if last.get("trigger") in ("alert", "peer") and last.get("state") == "captured" else None

    lasts = [wait_for(lambda r=rank: ended(r), 60, f"rank {rank}'s capture") for rank in (0, 1)]
    return [json.loads(line) for line in out.getvalue().splitlines()], lasts


# the jobs of tests/engine/test_perf.py, run until released: each rank's capture, judged beside the others',
# is in the class the perf monitor gives the job
CLASSED = {
    "input_bound": ["--data-workers", "1", "--slow-data-seconds", "0.06"],
    "communication_bound": ["--width", "1536", "--batch", "1", "--pair-groups", "--sync-mb", "32"],
    "compute_bound": ["--batch", "2048"],
}


@pytest.mark.multirank
@pytest.mark.parametrize("expected", sorted(CLASSED))
def test_captures_of_real_jobs_are_classed_as_the_job_is(tmp_path, expected):
    args = [*CLASSED[expected], "--steps", "100000"]
    env = {"FLARE_PROFILE": "1"}
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, 4, expected, env=env) as job:
        wait_for(lambda: len(list(Path(job.file_sd_dir).glob("*.json"))) == 4, 60, "the targets")
        wait_for(
            lambda: all((scrape.value(s, "flare_steps_total") or 0) >= 3 for s in _by_rank(job).values()),
            120,
            "3 steps on every rank",
        )
        code, report = flare_json("profile", "--targets", job.file_sd_dir, "--steps", "3", "--wait", "240")
        job.release()
    assert code == 0, report
    classes = {row["rank"]: (row["bottleneck"], row["evidence"]["shares"]) for row in report["ranks"]}
    print(expected, classes)
    assert len(classes) == 4 and {bottleneck for bottleneck, _ in classes.values()} == {expected}, classes
    assert all(row["evidence"]["peers"] == 3 for row in report["ranks"])  # judged beside the others


@pytest.mark.multirank
def test_a_rank_killed_mid_capture_leaves_nothing_half_written_and_flare_report_names_it(tmp_path):
    """Rank 1 capturing 500 steps is killed (SIGKILL): its peers (gloo) end on the lost connection, and the
    incident directory holds no half capture of it; `flare report` reads what the ranks left."""
    env = {"FLARE_PROFILE": "1", "FLARE_PROFILE_MAX_STEPS": "1000"}
    args = ["--steps", "100000", "--step-seconds", "0.02"]
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, 4, "killed", env=env) as job:
        wait_for(lambda: len(list(Path(job.file_sd_dir).glob("*.json"))) == 4, 60, "the targets")
        request = urllib.request.Request(f"http://{job.targets[1]}/profile?steps=500", b"", method="POST")
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 202
        wait_for(
            lambda: (_profile_status(job.targets[1])["running"] or {}).get("state") == "capturing",
            60,
            "rank 1 to capture",
        )
        job.processes[1].kill()
        codes = job.wait(120)
    assert codes[1] == -9 and all(code != 0 for code in codes)  # gloo: the peers end on the lost rank
    incidents = Path(job.file_sd_dir) / "incidents"
    assert [*incidents.glob("profiles/killed-rank1*"), *incidents.glob("profiles/.killed-rank1*")] == []
    code, report = flare_json("report", "--incidents", str(incidents), "--run", "killed")
    assert code == 1 and report["verdicts"][0]["ranks"] == [1], report["verdicts"][:1]
