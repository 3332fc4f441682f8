"""Faults around the exporter: each gets a clear message, and the rest keeps working.

Unwritable file_sd directory and unusable web config on a real rank; Prometheus unreachable or silent for
the CLI; ranks answering with malformed or truncated expositions; a rank restarted under the same rank id;
incident files and stack samples that must not carry environment variables or tensors. (A taken port is
tested in test_launch.py and test_exposition.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import one_rank_env

from flare_exporter.config import Config
from flare_exporter.engine import cli, diagnosis, records, rule_types, scrape
from flare_exporter.local.jobs import LocalJob, free_port, free_port_block
from flare_exporter.local.prometheus import PrometheusProcess, find_binary, wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank import incident, stall
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exposition import serve
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.state import FlareState

# ---------------------------------------------------------------------------------------------------------
# a real rank: unwritable file_sd directory, unusable web config


@pytest.mark.process
def test_unwritable_file_sd_directory_warns_and_the_rank_still_serves(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the directory should be\n")
    port = free_port()
    done = tmp_path / "done"
    env = one_rank_env(port, MASTER_PORT=str(free_port()), FLARE_FILE_SD_DIR=str(blocker / "targets"))
    log = tmp_path / "rank.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flare_exporter.launch", train_ddp.__file__, "--steps", "3"]
            + ["--wait-for", str(done)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        samples = wait_for(
            lambda: _scrape_steps(f"127.0.0.1:{port}", 3), 120, "the rank to train and be scraped"
        )
        assert scrape.value(samples, "flare_collective_last_issued_seq", group="world")
    finally:
        done.touch()
        assert process.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert f"cannot write file_sd target file in {blocker / 'targets'}" in text
    assert "Prometheus will not discover rank 0, training continues" in text


def _scrape_steps(target: str, steps: int) -> list[scrape.Sample] | None:
    try:
        samples = scrape.scrape(target, timeout=2)
    except scrape.ScrapeError:
        return None
    return samples if scrape.value(samples, "flare_steps_total") == steps else None


@pytest.mark.process
def test_unusable_web_config_warns_and_training_goes_on(tmp_path):
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: absent.crt\n  key_file: absent.key\n")
    env = one_rank_env(free_port(), MASTER_PORT=str(free_port()), FLARE_WEB_CONFIG_FILE=str(web))
    result = subprocess.run(
        [sys.executable, "-m", "flare_exporter.launch", train_ddp.__file__, "--steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "flare-exporter" in line]
    lines = [line for line in said if "collectives recorded" not in line]  # the start-up line aside
    assert len(lines) == 1 and len(said) == 2, result.stderr
    assert f"web config file {web}: key 'tls_server_config.cert_file/key_file'" in lines[0]
    assert lines[0].endswith("rank 0 serves no metrics, training continues")


# ---------------------------------------------------------------------------------------------------------
# Prometheus unreachable or slow, for the CLI


def test_cli_with_prometheus_unreachable(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    assert cli.main(["diagnose", "--prometheus", url, "--timeout", "2"]) == cli.EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"flare: cannot reach Prometheus at {url}") and "\n" not in error


def test_cli_with_prometheus_that_never_answers(capsys):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        assert cli.main(["hang", "--prometheus", url, "--timeout", "0.5", "--run", "r"]) == cli.EXIT_USAGE
        elapsed = time.monotonic() - started
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"flare: cannot reach Prometheus at {url}") and "timed out" in error
    assert elapsed < 60  # bounded by --timeout per query, not hung


@pytest.mark.parametrize(
    "body, says",
    [
        (b"<html>proxy error</html>", "answered with something that is not JSON"),
        (b"[1, 2]", "failed the values of run on flare_rank_info: not an API answer"),
        (
            b'{"status": "error", "error": "overloaded"}',
            "failed the values of run on flare_rank_info: overloaded",
        ),
        (
            b'{"status": "success", "data": {"run": "r"}}',
            "answered the values of run on flare_rank_info without a list",
        ),
        (b'{"status": "success", "data": ["a", "b"]}', "without a result list"),  # so the query is asked
    ],
)
def test_cli_with_prometheus_answering_nonsense(body, says, capsys):
    class Nonsense(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            answer = body if "/label/" in self.path else b'{"status": "success", "data": {"result": 7}}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Nonsense) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert cli.main(["diagnose", "--prometheus", url, "--timeout", "5"]) == cli.EXIT_USAGE
        server.shutdown()
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"flare: Prometheus at {url} ") and says in error and "\n" not in error


@pytest.mark.parametrize(
    "argv",
    [
        ["diagnose", "--targets", "x", "--timeout", "nan"],
        ["diagnose", "--targets", "x", "--timeout", "-1"],
        ["diagnose", "--targets", "x", "--timeout", "abc"],
        ["diagnose", "--targets", "x", "--hang-seconds", "soon"],
        ["diagnose", "--targets", "x", "--scheme", "ftp"],
        ["diagnose", "--prometheus", "u", "--targets", "x"],
        ["explode"],
        [],
    ],
)
def test_cli_bad_arguments_are_usage_errors(argv, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert capsys.readouterr().err.strip()


# ---------------------------------------------------------------------------------------------------------
# a rank answering with a malformed or truncated exposition


class FakeRank(BaseHTTPRequestHandler):
    """Serves `self.server.body` as /metrics; with `self.server.short`, promises more bytes than it sends."""

    def do_GET(self) -> None:
        body: bytes = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        extra = 1000 if self.server.short else 0  # type: ignore[attr-defined]
        self.send_header("Content-Length", str(len(body) + extra))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def good_rank():
    """Rank 0 of a 2-rank run `faulty`, served by the exporter's real registry."""
    identity = RankIdentity(rank=0, local_rank=0, world_size=2, run="faulty", host="node-0", pid=os.getpid())
    server = serve(build_registry(FlareState.create(Config(), identity)), "127.0.0.1", 0, rank=0)
    assert server is not None
    yield f"127.0.0.1:{server.port}"
    server.close()


GOOD = (
    '# TYPE flare_rank_info gauge\nflare_rank_info{rank="1",run="faulty",host="node-1",world_size="2"} 1\n'
    '# TYPE flare_steps_total counter\nflare_steps_total{rank="1",run="faulty"} 5\n'
)


@pytest.mark.parametrize(
    ("body", "short", "reason"),
    [
        (b"this is not an exposition {{{\n", False, "malformed exposition"),
        (GOOD.encode()[:-30], False, "malformed exposition"),  # cut mid-line
        (GOOD.encode(), True, "truncated response"),  # the connection closed before Content-Length
        (b"\xff\xfe garbage", False, "not UTF-8"),
        (GOOD.replace('rank="1"', 'rank="one"').encode(), False, "malformed exposition"),
        (GOOD.replace('world_size="2"', 'world_size="99999999999"').encode(), False, "malformed exposition"),
        (
            (
                GOOD + 'flare_collective_last_issued_seq{rank="1",run="faulty",group="world"} NaN\n'
                'flare_collective_in_flight_info{rank="1",run="faulty",group="world",op="x",state="a"} 1\n'
                'flare_collective_in_flight_seq{rank="1",run="faulty",group="world"} +Inf\n'
            ).encode(),
            False,
            "malformed exposition",
        ),  # fmt: skip
        (GOOD.replace("flare_steps_total{", "flare_steps_total{group=1,").encode(), False, "malformed"),
    ],
)
def test_malformed_or_truncated_rank_is_reported_and_the_rest_is_diagnosed(
    good_rank, tmp_path, capsys, body, short, reason
):
    fake = ThreadingHTTPServer(("127.0.0.1", 0), FakeRank)
    fake.body, fake.short = body, short  # type: ignore[attr-defined]
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        targets = tmp_path / "targets.json"
        groups = [
            {"targets": [good_rank], "labels": {"rank": "0", "run": "faulty"}},
            {"targets": [f"127.0.0.1:{fake.server_port}"], "labels": {"rank": "1", "run": "faulty"}},
        ]
        targets.write_text(json.dumps(groups))
        code = cli.main(["ranks", "--targets", str(targets), "--json", "--timeout", "5"])
    finally:
        fake.shutdown()
        fake.server_close()
    report = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_ANOMALY
    rows = {row["rank"]: row for row in report["ranks"]}
    assert rows[0]["up"] is True
    assert rows[1]["up"] is False and reason in rows[1]["down_reason"]
    assert report["verdicts"][0]["kind"] == "rank_down" and report["verdicts"][0]["ranks"] == [1]


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (b"HTTP/1.0 404 Not Found\r\n\r\nnope", "cannot scrape (HTTP 404 Not Found)"),
        (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + GOOD.encode(), 2),  # to the end
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "chunked"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP response"),
        (b"", "connection closed before a response"),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "exposition larger than"),
    ],
)
def test_a_rank_answering_other_than_an_exposition_is_one_scrape_error(answer, outcome):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def answer_once() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)  # the request
                connection.sendall(answer)

        threading.Thread(target=answer_once, daemon=True).start()
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        if isinstance(outcome, int):
            assert len(scrape.scrape(target, timeout=5)) == outcome
            return
        with pytest.raises(scrape.ScrapeError) as raised:
            scrape.scrape(target, timeout=5)
    message = str(raised.value)
    assert message.startswith(f"{target}: ") and outcome in message and "\n" not in message


def test_a_scrape_from_code_that_runs_an_event_loop_gets_its_answer(good_rank):
    async def notebook() -> tuple[dict, str]:  # a caller inside asyncio (a notebook) scrapes synchronously
        return scrape.scrape_all([good_rank, "127.0.0.1:1"], timeout=5), scrape.fetch(good_rank)

    results, text = asyncio.run(notebook())
    assert scrape.labels_of(results[good_rank], "flare_rank_info")["run"] == "faulty"  # type: ignore[arg-type]
    assert isinstance(results["127.0.0.1:1"], scrape.ScrapeError) and "flare_rank_info{" in text


# ---------------------------------------------------------------------------------------------------------
# a rank restarted under the same rank id: the snapshot


def _record(rank: int, **fields) -> rule_types.RankRecord:
    return rule_types.RankRecord(rank=rank, **fields)


def test_restarted_rank_with_lower_sequence_numbers_is_not_a_hang():
    now = 1000.0
    ranks = {
        0: _record(0, heartbeat=now - 1, groups={"world": rule_types.GroupState(5000, 5000)}),
        1: _record(1, heartbeat=now - 1, groups={"world": rule_types.GroupState(12, 12)}),  # restarted
    }
    assert diagnosis.diagnose(rule_types.Snapshot(ranks, now, "r", 2), hang_seconds=30) == []
    # the others wait on it, but for less than hang_seconds: not a hang yet either
    waiting = rule_types.InFlight("allreduce", 5001, 4, "issued", now - 5)
    ranks[0] = _record(0, heartbeat=now - 5, groups={"world": rule_types.GroupState(5001, 5000, waiting)})
    assert diagnosis.diagnose(rule_types.Snapshot(ranks, now, "r", 2), hang_seconds=30) == []


def test_previous_process_exception_does_not_make_a_restarted_rank_gone():
    now = 1000.0
    series = {
        "flare_rank_info": [({"rank": "0", "run": "r", "world_size": "1", "host": "h"}, 1.0)],
        "flare_rank_exception_info": [({"rank": "0", "run": "r", "type": "RuntimeError"}, 1.0)],
        "flare_rank_exception_timestamp_seconds": [({"rank": "0", "run": "r"}, now - 60)],
        "flare_heartbeat_timestamp_seconds": [({"rank": "0", "run": "r"}, now - 1)],  # progress since
    }
    restarted = records.build_snapshot(series, {0: records.Liveness(True)}, now, "r")
    assert not restarted.ranks[0].gone and diagnosis.diagnose(restarted, 30) == []
    # a rank that is dying of it (lingering, no progress since) is gone
    series["flare_heartbeat_timestamp_seconds"] = [({"rank": "0", "run": "r"}, now - 90)]
    dying = records.build_snapshot(series, {0: records.Liveness(True)}, now, "r")
    assert dying.ranks[0].gone and diagnosis.diagnose(dying, 30)[0].kind == "rank_down"


# ---------------------------------------------------------------------------------------------------------
# a rank restarted under the same rank id: real processes, a real Prometheus


@pytest.mark.multirank
def test_rank_restarted_under_the_same_rank_id(tmp_path):
    run = "restart"
    base_port = free_port_block(1)
    target = f"127.0.0.1:{base_port}"
    file_sd_dir = tmp_path / "targets"
    done = tmp_path / "done"
    env = {
        "FLARE_PORT": str(base_port),
        "FLARE_ADDR": "127.0.0.1",
        "FLARE_RUN": run,
        "FLARE_FILE_SD_DIR": str(file_sd_dir),
        "FLARE_LINGER_SECONDS": "300",  # the first process lingers until Prometheus has seen why it died
    }
    prometheus = PrometheusProcess(str(tmp_path / "prometheus"), str(file_sd_dir)) if find_binary() else None
    try:
        first_dir = tmp_path / "first"
        first_dir.mkdir()
        script = [train_ddp.__file__, "--steps", "100", "--fault", "raise", "--fault-rank", "0"]
        first = LocalJob(
            ["-m", "flare_exporter.launch", *script, "--fault-step", "20"], 1, env, None, str(first_dir)
        )
        with first:
            dying = wait_for(
                lambda: _with_exception(target), 120, "the first process to die of its exception"
            )
            first_pid = scrape.labels_of(dying, "flare_rank_info")["pid"]
            first_seq = scrape.value(dying, "flare_collective_last_issued_seq", group="world")
            if prometheus is not None:
                prometheus.wait_ready()
                wait_for(
                    lambda: prometheus.query(f'flare_rank_exception_info{{run="{run}"}}'),
                    60,
                    "Prometheus to scrape the exception",
                )
            first.kill()  # a supervisor restarts the rank
            first.wait(timeout=30)
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        script = [train_ddp.__file__, "--steps", "3", "--wait-for", str(done)]
        with LocalJob(["-m", "flare_exporter.launch", *script], 1, env, None, str(second_dir)) as second:
            samples = wait_for(lambda: _scrape_steps(target, 3), 120, "the restarted rank to train")
            # the new process's series are its own: one identity, sequence numbers started again
            infos = [s for s in samples if s.name == "flare_rank_info"]
            assert len(infos) == 1 and infos[0].labels["pid"] != first_pid
            seq = scrape.value(samples, "flare_collective_last_issued_seq", group="world")
            assert seq is not None and first_seq is not None and 0 < seq < first_seq
            assert seq == scrape.value(samples, "flare_collective_last_completed_seq", group="world")
            assert not any(s.name == "flare_rank_exception_info" for s in samples)
            code = cli.main(["diagnose", "--targets", str(file_sd_dir), "--run", run, "--hang-seconds", "5"])
            assert code == cli.EXIT_OK
            if prometheus is not None:
                steps = f'flare_steps_total{{run="{run}"}} == 3'
                wait_for(lambda: prometheus.query(steps), 60, "Prometheus to scrape the restarted rank")
                assert prometheus.query(f'max_over_time(flare_collective_last_issued_seq{{run="{run}"}}[5m])')
                code = cli.main(
                    [
                        "diagnose",
                        "--prometheus",
                        prometheus.url,
                        "--run",
                        run,
                        "--hang-seconds",
                        "5",
                        "--json",
                    ]
                )
                assert code == cli.EXIT_OK  # no false hang, and the old process's exception is history
            done.touch()
            assert second.wait(timeout=60) == [0], second.log_tail(0)
    finally:
        if prometheus is not None:
            prometheus.stop()


def _with_exception(target: str) -> list[scrape.Sample] | None:
    try:
        samples = scrape.scrape(target, timeout=2)
    except scrape.ScrapeError:
        return None
    return samples if any(s.name == "flare_rank_exception_info" for s in samples) else None


# ---------------------------------------------------------------------------------------------------------
# what incident files and stack samples never carry


def test_incident_files_and_stack_samples_carry_no_environment_or_tensors(tmp_path, monkeypatch):
    secret = "hunter2-do-not-leak-7f3a"
    monkeypatch.setenv("FLARE_TEST_SECRET_TOKEN", secret)
    marker = 123456.75
    tensor = torch.full((4,), marker)
    holding = threading.Event()
    release = threading.Event()

    def training_like(token: str, weights: torch.Tensor) -> None:  # locals hold the secret and a tensor
        holding.set()
        release.wait(30)

    worker = threading.Thread(target=training_like, args=(os.environ["FLARE_TEST_SECRET_TOKEN"], tensor))
    worker.start()
    try:
        holding.wait(30)
        identity = RankIdentity(rank=0, local_rank=0, world_size=1, run="r", host="h", pid=os.getpid())
        state = FlareState.create(Config(incident_dir=str(tmp_path)), identity)
        state.stack = stall.sample_thread(worker.ident or 0, waiting_on_collective=False)
        try:
            raise RuntimeError("step failed")
        except RuntimeError as error:
            path = incident.IncidentWriter(state).write("exception RuntimeError", error)
        assert path is not None
        with open(path) as written:
            text = written.read()
        assert "training_like" in text  # the stacks are there ...
        assert secret not in text and "FLARE_TEST_SECRET_TOKEN" not in text  # ... the environment is not
        assert str(marker) not in text and "tensor(" not in text
        assert state.stack is not None
        label = state.stack.frames_label()
        assert secret not in label and "tensor(" not in label
    finally:
        release.set()
        worker.join()
