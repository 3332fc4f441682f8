"""The stall watcher, the incident file, and a snapshot built from a rank's exposition."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
from prometheus_client import generate_latest
from test_golden import fixed_state

from flare_exporter.config import Config
from flare_exporter.engine import records
from flare_exporter.engine.scrape import parse
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.incident import IncidentWriter, incident_path
from flare_exporter.rank.stall import StackSample, StallWatcher, innermost_frames, sample_thread
from flare_exporter.rank.state import FlareState


def make_state(tmp_path, **config) -> FlareState:
    identity = RankIdentity(rank=5, local_rank=1, world_size=8, run="unit", host="node-x", pid=1)
    return FlareState.create(Config(incident_dir=str(tmp_path), **config), identity)


def spin_until(event: threading.Event) -> None:
    while not event.is_set():  # a training thread busy in its own code
        time.sleep(0.001)


def test_stalled_thread_is_sampled_with_its_own_frames_and_released_on_progress(tmp_path):
    state = make_state(tmp_path, stall_seconds=1.0, hang_seconds=100.0)
    release = threading.Event()
    worker = threading.Thread(target=spin_until, args=(release,))
    worker.start()
    try:
        hangs: list[str] = []
        watcher = StallWatcher(state, worker.ident, hangs.append)
        state.steps.last_step_at = time.perf_counter()
        watcher.check(state.steps.last_step_at + 0.5)
        assert state.stack is None  # not stalled yet
        watcher.check(state.steps.last_step_at + 1.5)
        assert state.stack is not None and state.stack.activity == "compute"
        assert state.stack.frames[0].startswith("test_stall.py:") and "spin_until" in state.stack.frames[0]
        assert hangs == []
        state.steps.last_step_at = time.perf_counter()  # progress resumes
        watcher.check(state.steps.last_step_at + 0.1)
        assert state.stack is None
    finally:
        release.set()
        worker.join()


def test_frames_are_sampled_by_half_the_hang_threshold_whatever_stall_seconds_says(tmp_path):
    state = make_state(tmp_path, stall_seconds=30.0, hang_seconds=4.0)
    watcher = StallWatcher(state, threading.get_ident(), [].append)
    state.steps.last_step_at = time.perf_counter()
    watcher.check(state.steps.last_step_at + 1.9)
    assert state.stack is None
    watcher.check(state.steps.last_step_at + 2.1)  # the first hang verdict (at 4 s) has the frames
    assert state.stack is not None and state.stack.frames


def test_hang_is_reported_once_per_stall_and_not_during_start_up(tmp_path):
    state = make_state(tmp_path, stall_seconds=1.0, hang_seconds=2.0)
    hangs: list[str] = []
    watcher = StallWatcher(state, threading.get_ident(), hangs.append)
    watcher.check(watcher.started_at + 10)  # no progress yet: start-up, not a hang
    assert hangs == []
    state.steps.last_step_at = time.perf_counter()
    watcher.check(state.steps.last_step_at + 2.5)
    watcher.check(state.steps.last_step_at + 3.5)
    assert len(hangs) == 1 and hangs[0].startswith("no progress for 2 s")
    state.steps.last_step_at += 5  # progress, then a second stall
    watcher.check(state.steps.last_step_at + 2.5)
    assert len(hangs) == 2


def test_a_training_rank_is_checked_when_a_stall_could_begin_and_every_interval_while_stalled(tmp_path):
    state = make_state(tmp_path, stall_seconds=30.0, hang_seconds=300.0)
    watcher = StallWatcher(state, threading.get_ident(), [].append)
    assert watcher.interval == 1.0
    assert watcher.seconds_to_next_check(watcher.started_at + 5) == pytest.approx(25)  # start-up counts too
    state.steps.last_step_at = time.perf_counter()
    assert watcher.seconds_to_next_check(state.steps.last_step_at + 0.01) == pytest.approx(29.99)
    assert watcher.seconds_to_next_check(state.steps.last_step_at + 29.5) == 1.0  # never sooner than that
    assert watcher.seconds_to_next_check(state.steps.last_step_at + 31) == 1.0  # stalled: every interval
    early_hang = StallWatcher(make_state(tmp_path, stall_seconds=30.0, hang_seconds=10.0), 0, [].append)
    assert early_hang.seconds_to_next_check(early_hang.started_at + 4) == pytest.approx(1)  # frames at 5 s

    class TwoWaits:  # the watcher's stop event: records each wait, and stops it at the second
        def __init__(self) -> None:
            self.waits: list[float] = []

        def wait(self, timeout: float) -> bool:
            self.waits.append(timeout)
            return len(self.waits) > 1

    stop = watcher._stop = TwoWaits()  # type: ignore[assignment]
    state.steps.last_step_at = time.perf_counter()
    watcher._run()  # checks once after its first wait, then sleeps until a stall could begin
    assert stop.waits[0] == 1.0 and 28 < stop.waits[1] <= 30


def test_waiting_in_a_collective_and_in_the_data_loader_are_told_apart():
    frame = sys._getframe()
    sample = sample_thread(threading.get_ident(), waiting_on_collective=True)
    assert sample is not None and sample.activity == "collective"
    assert innermost_frames(frame, kept=1)[0] is frame
    assert sample_thread(-1, waiting_on_collective=False) is None  # a thread that is gone
    long = StackSample("data", ("x" * 200, "y" * 200))
    assert len(long.frames_label()) == 240 and long.frames_label().endswith("...")


def test_incident_file_holds_state_stacks_and_exception(tmp_path):
    state = fixed_state()
    state.config = Config(incident_dir=str(tmp_path))
    writer = IncidentWriter(state)
    try:
        raise ValueError("bad shard")
    except ValueError as error:
        path = writer.write("exception ValueError", error)
    assert path == incident_path(str(tmp_path), "golden", 3)
    incident = json.loads(open(path).read())
    assert incident["version"] == 2
    assert (incident["reason"], incident["detail"]) == ("exception", "exception ValueError")
    assert incident["identity"]["host"] == "node-a" and incident["steps"] == 3
    world = incident["groups"]["world"]
    assert (world["last_issued_seq"], world["last_completed_seq"]) == (4, 3)
    assert world["in_flight"]["op"] == "broadcast" and world["in_flight"]["seq"] == 4
    assert incident["training_thread"]["activity"] == "compute"
    assert any(
        "test_incident_file_holds_state" in line for stack in incident["threads"].values() for line in stack
    )
    assert incident["exception"]["type"] == "ValueError" and "bad shard" in incident["exception"]["message"]
    assert incident["exception"]["cause"] == "software_exception"
    assert incident["identity"]["switch"] == "leaf-07" and incident["identity"]["rack"] == "r12"


def test_no_incident_directory_writes_nothing_and_a_bad_one_is_counted(tmp_path):
    state = make_state(tmp_path)
    state.config = Config()
    assert IncidentWriter(state).write("hang", detail="no progress") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    state.config = Config(incident_dir=str(blocker / "sub"))
    assert IncidentWriter(state).write("hang", detail="no progress") is None
    assert state.health.errors["incident"] == 1


def test_excepthook_records_the_exception_and_chains(tmp_path, monkeypatch):
    state = make_state(tmp_path)
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[0]))
    writer = IncidentWriter(state)
    writer._excepthook(KeyError, KeyError("k"), None)
    assert seen == [KeyError] and state.exception is not None and state.exception.type == "KeyError"
    assert state.exception.cause == "software_exception"
    incident = json.loads(open(writer.written).read())
    assert incident["reason"] == "exception" and incident["exception"]["type"] == "KeyError"
    assert writer.last_word_seen is False  # never scraped: no wait


def test_snapshot_from_a_rank_exposition():
    state = fixed_state()
    samples = parse(generate_latest(build_registry(state)).decode())
    series: dict = {}
    for sample in samples:
        series.setdefault(sample.name, []).append((sample.labels, sample.value))
    snapshot = records.build_snapshot(series, {3: records.Liveness(True)}, now=1_700_000_010.0, run="golden")
    assert snapshot.world_size == 8 and sorted(snapshot.ranks) == list(range(8))
    record = snapshot.ranks[3]
    assert record.up and record.host == "node-a" and record.steps == 3
    world = record.groups["world"]
    assert (world.last_issued, world.last_completed) == (4, 3)
    assert world.in_flight is not None and (world.in_flight.op, world.in_flight.seq) == ("broadcast", 4)
    assert record.activity == "compute" and record.frames.startswith("train.py:42 forward")
    assert record.exception == "RuntimeError"
    assert [rank for rank, r in snapshot.ranks.items() if not r.up] == [0, 1, 2, 4, 5, 6, 7]
