"""A run that died explains itself: the exception's cause, the termination signal, the last word reaching
the scraper before the rank exits, and the incident file (version 2)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from conftest import one_rank_env
from prometheus_client import generate_latest
from torch.utils.data import DataLoader, Dataset

from flare_exporter.config import Config
from flare_exporter.engine.scrape import parse
from flare_exporter.local.jobs import free_port
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing.fake_nvml import FakeNvml, make_device
from flare_exporter.rank import incident
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exposition import serve
from flare_exporter.rank.gpu_health import RECENT_READINGS, GpuHealthMonitor
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.incident import IncidentWriter
from flare_exporter.rank.last_word import (
    RaisedException,
    ScrapeTimes,
    last_word_bound,
    signal_sender,
    wait_for_last_word,
)
from flare_exporter.rank.state import FlareState


def make_state(tmp_path, **config) -> FlareState:
    identity = RankIdentity(
        rank=2, local_rank=2, world_size=4, run="died", host="node-b", pid=1, switch="leaf-3", rack="r9"
    )
    return FlareState.create(Config(incident_dir=str(tmp_path), **config), identity)


def exposed(state: FlareState, name: str) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(build_registry(state)).decode()
    return [(sample.labels, sample.value) for sample in parse(text) if sample.name == name]


def died_of(state: FlareState, exception: BaseException, monkeypatch) -> dict:
    """Run the rank's excepthook on `exception`, as Python does when it leaves the script; its incident."""
    monkeypatch.setattr(sys, "excepthook", lambda *args: None)  # what it chains to: print the traceback
    writer = IncidentWriter(state)
    writer._excepthook(type(exception), exception, exception.__traceback__)
    assert writer.written is not None
    with open(writer.written) as handle:
        return json.load(handle)


def raised(exception: BaseException) -> BaseException:
    try:
        raise exception
    except BaseException as caught:
        return caught


# ---------------------------------------------------------------------------------------------------------
# the cause, a bounded label


def test_an_out_of_memory_error_is_exported_with_its_cause(tmp_path, monkeypatch):
    state = make_state(tmp_path)
    error = raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    document = died_of(state, error, monkeypatch)
    info = exposed(state, "flare_rank_exception_info")
    assert info == [({"rank": "2", "run": "died", "type": "OutOfMemoryError", "cause": "out_of_memory"}, 1.0)]
    assert exposed(state, "flare_rank_exception_timestamp_seconds")[0][1] == state.exception.timestamp_seconds
    assert (document["reason"], document["detail"]) == ("exception", "exception OutOfMemoryError")
    assert document["exception"]["cause"] == "out_of_memory"
    assert document["exception"]["root_cause"]["type"] == "OutOfMemoryError"
    assert document["terminated"] is None


class StaleShard(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        raise OSError(errno.ESTALE, "Stale file handle", "/nfs/data/shard-0")


def test_a_data_loader_workers_stale_file_handle_is_a_storage_cause(tmp_path, monkeypatch):
    state = make_state(tmp_path)
    with pytest.raises(OSError) as caught:  # the worker's exception, re-raised in the training process
        for _ in DataLoader(StaleShard(), num_workers=1):
            pass
    document = died_of(state, caught.value, monkeypatch)
    [(labels, _)] = exposed(state, "flare_rank_exception_info")
    assert (labels["type"], labels["cause"]) == ("OSError", "storage")
    described = document["exception"]
    assert described["type"] == "OSError" and described["cause"] == "storage"
    assert described["root_cause"]["type"] == "OSError" and described["root_cause"]["errno"] == errno.ESTALE
    assert "Stale file handle" in described["root_cause"]["message"]
    assert (
        described["chain"][0]["type"] == "OSError" and "DataLoader worker" in described["chain"][0]["message"]
    )
    assert len(described["message"]) <= 2000 and described["traceback"]


def test_an_exception_type_label_is_bounded_and_a_broken_message_is_no_cause():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    long_name = type("E" * 100, (Exception,), {})
    assert len(RaisedException.of(long_name(), 1.0).type) == 64
    assert RaisedException.of(Unprintable(), 1.0).cause == "software_exception"
    assert incident.exception_document(Unprintable())["message"] == ""


# ---------------------------------------------------------------------------------------------------------
# termination


def test_the_sender_is_the_launcher_under_torchrun_or_srun():
    assert signal_sender({}) == "unknown"
    assert signal_sender({"TORCHELASTIC_RESTART_COUNT": "0"}) == "launcher"
    assert signal_sender({"TORCHELASTIC_RUN_ID": "abc"}) == "launcher"
    assert signal_sender({"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"}) == "launcher"
    assert signal_sender({"SLURM_JOB_ID": "7"}) == "unknown"  # sbatch's batch script, not srun's task


def test_a_termination_is_exported_and_written(tmp_path):
    state = make_state(tmp_path)
    writer = IncidentWriter(state, environ={"TORCHELASTIC_RESTART_COUNT": "0"})
    before = time.time()
    writer._terminated(signal.SIGTERM)  # what the handler does before the default action
    [(labels, value)] = exposed(state, "flare_rank_terminated_timestamp_seconds")
    assert (labels["signal"], labels["sender"]) == ("SIGTERM", "launcher") and before <= value <= time.time()
    assert exposed(state, "flare_rank_exception_info") == []
    with open(writer.written) as handle:
        document = json.load(handle)
    assert (document["reason"], document["detail"]) == ("signal", "signal SIGTERM")
    assert document["terminated"] == {
        "signal": "SIGTERM",
        "sender": "launcher",
        "timestamp_seconds": pytest.approx(value, abs=1e-5),
    }
    assert document["exception"] is None


def test_install_hooks_default_handlers_only_and_sigint_ends_as_keyboard_interrupt(tmp_path, monkeypatch):
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    saved = {number: signal.getsignal(number) for number in numbers}
    monkeypatch.setattr(sys, "excepthook", lambda *args: None)
    try:

        def users_own(number, frame):
            return None

        signal.signal(signal.SIGTERM, users_own)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        state = make_state(tmp_path)
        writer = IncidentWriter(state, environ={})
        writer.install()
        assert signal.getsignal(signal.SIGTERM) is users_own  # never replaced
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # it would not end the rank
        assert signal.getsignal(signal.SIGINT) == writer._on_signal
        with pytest.raises(KeyboardInterrupt) as interrupted:
            writer._on_signal(signal.SIGINT, None)  # Ctrl-C: KeyboardInterrupt, as without flare
        waits: list[float] = []
        monkeypatch.setattr(writer, "last_word", waits.append)
        writer._excepthook(KeyboardInterrupt, interrupted.value, None)
        assert waits == [] and writer.last_word_seen is None  # no last-word wait: Ctrl-C ends it now
        assert state.terminated is not None and (state.terminated.signal, state.terminated.sender) == (
            "SIGINT",
            "unknown",
        )
        with open(writer.written) as handle:
            document = json.load(handle)
        assert document["reason"] == "signal" and document["exception"]["type"] == "KeyboardInterrupt"
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


# ---------------------------------------------------------------------------------------------------------
# the last word


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_the_last_word_wait_ends_when_a_scrape_started_after_the_event_completes(tmp_path):
    state = make_state(tmp_path)
    server = serve(build_registry(state), "127.0.0.1", 0, rank=2, scrapes=state.scrapes)
    assert server is not None
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        get(url)  # scraped once before: someone listens
        # the endpoint notes a scrape complete once its send returned, which may be after the client read it
        wait_for(lambda: state.scrapes.last_completed_timestamp_seconds is not None, 10, "the scrape noted")
        assert state.scrapes.seen()
        state.exception = RaisedException.of(torch.OutOfMemoryError("CUDA out of memory"), time.time())
        event = time.monotonic()
        assert not state.scrapes.completed_after(event)
        bodies: list[bytes] = []
        stop = threading.Event()

        def scraper() -> None:
            while not stop.is_set():
                bodies.append(get(url))
                stop.wait(0.05)

        thread = threading.Thread(target=scraper)
        thread.start()
        try:
            # the margin is generous for a loaded machine; the wait ends long before it
            assert wait_for_last_word(state.scrapes, event, limit_seconds=30.0, margin=10.0) is True
            waited = time.monotonic() - event
        finally:
            stop.set()
            thread.join()
        assert waited < 10.0 and state.scrapes.completed_after(event)
        assert any(b'cause="out_of_memory"' in body for body in bodies)
    finally:
        server.close()


def test_a_rank_never_scraped_does_not_wait():
    started = time.monotonic()
    assert wait_for_last_word(ScrapeTimes(), started, limit_seconds=30.0) is False
    assert wait_for_last_word(None, started, limit_seconds=30.0) is False
    assert time.monotonic() - started < 1.0
    assert last_word_bound(ScrapeTimes(), 30.0) == 0.0


def test_the_wait_is_capped_by_twice_the_scrape_interval_and_by_last_word_seconds():
    now = time.monotonic()
    scrapes = ScrapeTimes()
    scrapes.started(now - 1.0)
    assert last_word_bound(scrapes, 7.0) == 7.0  # one scrape: no interval known yet
    scrapes.started(now - 0.9)  # scraped every 0.1 s
    assert scrapes.interval() == pytest.approx(0.1)
    assert last_word_bound(scrapes, 30.0, margin=0.1) == pytest.approx(0.3)
    assert last_word_bound(scrapes, 0.05, margin=0.1) == 0.05
    assert last_word_bound(scrapes, 0.0) == 0.0  # last_word_seconds 0: disabled
    scrapes.sent(rendered_at=now - 0.5)  # a scrape rendered before the event does not count
    event = time.monotonic()
    assert wait_for_last_word(scrapes, event, limit_seconds=30.0, margin=0.1) is False
    assert 0.3 <= time.monotonic() - event < 3.0


def test_the_wait_never_raises():
    class Broken(ScrapeTimes):
        def completed_after(self, event: float) -> bool:
            raise RuntimeError("broken")

    broken = Broken()
    broken.started(time.monotonic())
    assert wait_for_last_word(broken, time.monotonic(), limit_seconds=30.0) is False


# ---------------------------------------------------------------------------------------------------------
# the document


def test_the_version_2_document(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    state = make_state(tmp_path)
    state.gpu = GpuHealthMonitor(FakeNvml([make_device(0)]), 0, state.health)
    state.gpu.open()
    for _ in range(RECENT_READINGS + 3):
        state.gpu.poll()
    state.scrapes.started(time.monotonic())
    state.scrapes.sent(time.monotonic())
    writer = IncidentWriter(state)
    writer.exit_code = 0
    writer.on_exit()
    with open(writer.written) as handle:
        document = json.load(handle)
    assert document["version"] == 2 and document["reason"] in incident.REASONS
    assert (document["reason"], document["detail"], document["exit_code"]) == ("exit", "exit code 0", 0)
    assert document["exception"] is None and document["terminated"] is None
    assert document["identity"]["switch"] == "leaf-3" and document["identity"]["rack"] == "r9"
    readings = document["gpu_readings"]
    assert len(readings) == RECENT_READINGS  # a bounded ring: the last ones
    assert readings[-1]["timestamp_seconds"] >= readings[0]["timestamp_seconds"] > 0
    assert readings[-1]["uuid"] == state.gpu.uuid and readings[-1]["sm_clock_hertz"] > 0
    assert document["last_scrape_timestamp_seconds"] == pytest.approx(time.time(), abs=60)
    assert document["flight_recorder"] is None  # off in this process
    for key in ("steps", "groups", "threads", "training_thread", "heartbeat_timestamp_seconds"):
        assert key in document
    # an exception or a signal ended it: no exit incident over the word it left
    state.terminated = incident.Termination("SIGTERM", "unknown", 1.0)
    os.remove(writer.written)
    writer.on_exit()
    assert not os.path.exists(writer.written)


def test_without_nvml_or_a_scrape_the_document_says_so(tmp_path):
    writer = IncidentWriter(make_state(tmp_path))
    path = writer.write("hang", detail="no progress for 300 s")
    assert path is not None
    with open(path) as handle:
        document = json.load(handle)
    assert document["gpu_readings"] == [] and document["last_scrape_timestamp_seconds"] is None
    assert (document["reason"], document["detail"]) == ("hang", "no progress for 300 s")


def test_version_1_reasons_become_details(tmp_path):
    writer = IncidentWriter(make_state(tmp_path))
    with open(writer.write("exception RuntimeError", raised(RuntimeError("x")))) as handle:
        document = json.load(handle)
    assert (document["reason"], document["detail"]) == ("exception", "exception RuntimeError")


def test_the_incident_directory_is_resolved_once_for_the_writer(tmp_path):
    state = make_state(tmp_path)
    state.config = Config(file_sd_dir=str(tmp_path / "targets"))
    assert IncidentWriter(state).directory == str(tmp_path / "targets" / "incidents")
    state.config = Config(file_sd_dir=str(tmp_path / "targets"), incident_dir="off")
    assert IncidentWriter(state).write("hang") is None


FLIGHT_RECORDER_JOB = """
import json, os, sys
import torch, torch.distributed as dist
from flare_exporter.rank import incident
dist.init_process_group("gloo", rank=0, world_size=1)
tensor = torch.ones(2)
for _ in range(70):
    dist.all_reduce(tensor)
document = incident.flight_recorder_document(os.environ)
print(json.dumps(None if document is None else {k: v for k, v in document.items() if k != "entries"}
                 | {"entries": len(document["entries"]), "first": document["entries"][0]}))
print(json.dumps(incident.flight_recorder_document({})))
dist.destroy_process_group()
"""


@pytest.mark.process
def test_the_flight_recorder_keeps_its_last_entries(tmp_path):
    env = one_rank_env(0, MASTER_PORT=str(free_port()), TORCH_FR_BUFFER_SIZE="100")
    result = subprocess.run(
        [sys.executable, "-c", FLIGHT_RECORDER_JOB], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    recorded, off = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert off is None
    assert recorded["entries"] == incident.FLIGHT_RECORDER_ENTRIES and recorded["entries_total"] == 70
    assert recorded["first"]["collective_seq_id"] == 70 - incident.FLIGHT_RECORDER_ENTRIES + 1
    assert recorded["version"] and "0" in recorded["pg_status"]


# ---------------------------------------------------------------------------------------------------------
# a real rank under the launcher

RANK_JOB = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
tensor = torch.ones(2)
for _ in range(3):
    dist.all_reduce(tensor)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:  # until it has been scraped
    time.sleep(0.02)
if sys.argv[2] == "oom":
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
if sys.argv[2] == "wait":
    time.sleep(120)
"""


class Scraper:
    """Polls a rank's /metrics every 0.1 s until it stops answering, keeping what it read."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.pages: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.pages.append(get(self.url).decode())
            except OSError:
                if self.pages:
                    return  # the rank is gone
            self.stop.wait(0.1)

    def seen(self, text: str) -> bool:
        return any(text in page for page in self.pages)


def run_rank(tmp_path, mode: str, **extra: str):
    """RANK_JOB as rank 0 under the launcher, scraped from the start: its process, scraper, file_sd dir."""
    port = free_port()
    script = tmp_path / "job.py"
    script.write_text(RANK_JOB)
    go = tmp_path / "scraped"
    targets = tmp_path / "targets"
    env = one_rank_env(
        port, MASTER_PORT=str(free_port()), FLARE_FILE_SD_DIR=str(targets), FLARE_RUN=mode, **extra
    )
    command = [sys.executable, "-m", "flare_exporter.launch", str(script), str(go), mode]
    log = open(tmp_path / "log", "wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    scraper = Scraper(port)
    deadline = time.monotonic() + 120
    while not scraper.pages and process.poll() is None and time.monotonic() < deadline:
        scraper.stop.wait(0.05)
    go.touch()
    return process, scraper, targets, log


def finish(process, scraper, log, tmp_path) -> tuple[int, str]:
    try:
        code = process.wait(timeout=120)
    finally:
        scraper.stop.set()
        scraper.thread.join()
        log.close()
    return code, (tmp_path / "log").read_text()


@pytest.mark.process
def test_a_rank_dying_of_out_of_memory_is_scraped_before_it_exits_and_leaves_its_incident(tmp_path):
    process, scraper, targets, log = run_rank(tmp_path, "oom", TORCH_FR_BUFFER_SIZE="100")
    code, output = finish(process, scraper, log, tmp_path)
    assert code == 1 and "OutOfMemoryError" in output, output
    assert scraper.seen('flare_rank_exception_info{cause="out_of_memory"'), "no scrape saw the last word"
    path = targets / "incidents" / "oom-rank0.json"
    document = json.loads(path.read_text())
    assert (document["version"], document["reason"]) == (2, "exception")
    assert document["exception"]["cause"] == "out_of_memory" and document["terminated"] is None
    assert document["last_scrape_timestamp_seconds"] is not None
    recorded = document["flight_recorder"]  # PyTorch's, on in this job: the rank's three all-reduces
    assert [entry["profiling_name"] for entry in recorded["entries"]] == ["gloo:all_reduce"] * 3
    assert [name for name in os.listdir(targets) if name.endswith(".json")]  # the target is kept: up == 0


@pytest.mark.process
def test_a_rank_stopped_by_its_launcher_says_so_before_it_ends(tmp_path):
    process, scraper, targets, log = run_rank(tmp_path, "wait", TORCHELASTIC_RESTART_COUNT="0")
    deadline = time.monotonic() + 120
    while not scraper.seen("flare_steps_total") and not scraper.seen("flare_rank_info"):
        assert time.monotonic() < deadline and process.poll() is None
        scraper.stop.wait(0.05)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process, scraper, log, tmp_path)
    assert code == -signal.SIGTERM, output
    assert scraper.seen('flare_rank_terminated_timestamp_seconds{rank="0",run="wait",sender="launcher"')
    document = json.loads((targets / "incidents" / "wait-rank0.json").read_text())
    assert document["reason"] == "signal" and document["terminated"]["signal"] == "SIGTERM"
    assert document["terminated"]["sender"] == "launcher" and document["exception"] is None


@pytest.mark.process
def test_a_rank_that_ends_normally_says_so(tmp_path):
    process, scraper, targets, log = run_rank(tmp_path, "exit")
    code, output = finish(process, scraper, log, tmp_path)
    assert code == 0, output
    document = json.loads((targets / "incidents" / "exit-rank0.json").read_text())
    assert (document["reason"], document["exit_code"]) == ("exit", 0)
    assert document["exception"] is None and document["terminated"] is None


def test_sends_and_receives_in_flight_are_written_per_peer_and_read_back_as_the_engine_judges_them(tmp_path):
    """A pipeline stage's last words hold its oldest send or receive per direction and peer, not only the
    oldest of the group: a receive it waits in behind an older unfinished send is an edge of its own."""
    from flare_exporter.engine import incident_source
    from flare_exporter.rank.groups import GroupTracker
    from flare_exporter.rank.timing import CollectiveRecord, FutureTiming

    state = make_state(tmp_path)
    world = GroupTracker("world", 4, "gloo", FutureTiming(state.manager), state.health)
    state.groups["world"] = world
    state.manager.add_group(world)
    now = time.perf_counter()
    for op, age, peer in (("send", 9.0, 1), ("recv", 5.0, 3), ("recv", 1.0, 3)):
        world.p2p_pending.append(CollectiveRecord(world, op, 64, 0, now - age, peer))
    state.manager.drain()
    path = IncidentWriter(state).write("signal", detail="signal SIGTERM")
    with open(path) as handle:
        written = json.load(handle)["groups"]["world"]["p2p"]
    assert [(flight["direction"], flight["peer"]) for flight in written["in_flight"]] == [
        ("send", 1),
        ("recv", 3),
    ]
    p2p = incident_source._groups({"world": {"p2p": written}})["world"].p2p
    assert [(direction, peer) for direction, peer, _ in p2p.in_flight] == [("send", 1), ("recv", 3)]
    assert p2p.issued == {("send", 1): 1, ("recv", 3): 2} and p2p.completed == {}
    older = {"direction": "recv", "peer": 3, "issued_timestamp_seconds": 5.0}  # one flight: an older flare
    assert incident_source._p2p({**written, "in_flight": older}).in_flight == (("recv", 3, 5.0),)
