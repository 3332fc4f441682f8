"""`flare targets prune` (engine/prune.py): the target and incident files of runs that ended go, those of live
runs stay."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flare_exporter.engine import prune
from flare_exporter.rank import file_sd
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.incident import incident_path

HOUR_AGO = time.time() - 3600


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prune.add_arguments(parser)
    return parser.parse_args(list(argv))


def run_prune(directory: Path, *argv: str) -> int:
    return prune.main(parse("--dir", str(directory), "--timeout", "2", *argv))


class Endpoint:
    """A tiny /metrics endpoint on 127.0.0.1: `status` and `body` say what it answers."""

    def __init__(self, body: str = "", status: int = 200) -> None:
        self.body, self.status = body, status
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = endpoint.body.encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints() -> Iterator[list[Endpoint]]:
    started: list[Endpoint] = []
    yield started
    for endpoint in started:
        endpoint.close()


def serving(endpoints: list[Endpoint], run: str = "", status: int = 200) -> int:
    """The port of a new endpoint answering as a rank of `run` (or with `status`)."""
    body = f'flare_rank_info{{rank="0",run="{run}",host="node-a"}} 1\n' if run else "nope\n"
    endpoints.append(Endpoint(body, status))
    return endpoints[-1].port


def closed_port() -> int:
    """A port nobody listens on: bound, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def identity(run: str, rank: int) -> RankIdentity:
    return RankIdentity(rank=rank, local_rank=rank, world_size=2, run=run, host="node-a", pid=100 + rank)


def write_run(directory: Path, run: str, ports: list[int], written: float = HOUR_AGO) -> list[str]:
    """The run's target files (one per port) and one incident file, written at `written`."""
    paths = []
    for rank, port in enumerate(ports):
        path = file_sd.write_target(str(directory), identity(run, rank), "127.0.0.1", port)
        assert path is not None
        paths.append(path)
    incident = incident_path(str(directory / "incidents"), run, 0)
    os.makedirs(os.path.dirname(incident), exist_ok=True)
    Path(incident).write_text(json.dumps({"identity": {"rank": 0, "run": run}, "reason": "exit"}))
    paths.append(incident)
    for path in paths:
        os.utime(path, (written, written))
    return paths


def existing(paths: list[str]) -> list[str]:
    return [path for path in paths if os.path.exists(path)]


def test_files_of_a_run_whose_targets_do_not_answer_go_and_a_live_runs_stay(tmp_path, endpoints, capsys):
    dead = write_run(tmp_path, "dead", [closed_port(), closed_port()])
    live = write_run(tmp_path, "live", [serving(endpoints, "live"), closed_port()])  # one rank answers
    assert run_prune(tmp_path) == 0
    assert existing(dead) == []  # the incident file went with its run
    assert existing(live) == live
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == sorted(f"removed {path} (run dead)" for path in dead)


def test_a_live_flare_rank_answers_while_training(tmp_path, endpoints):
    """The real endpoint: flare's own MetricsServer, serving a rank's registry."""
    pytest.importorskip("torch")
    from flare_exporter.config import Config
    from flare_exporter.rank.attach import build_registry
    from flare_exporter.rank.exposition import serve
    from flare_exporter.rank.state import FlareState

    state = FlareState.create(Config(gpu_health=False), identity("training", 0))
    server = serve(build_registry(state), "127.0.0.1", 0, 0, "", state.health, state.scrapes)
    assert server is not None
    try:
        paths = write_run(tmp_path, "training", [server.port])
        assert run_prune(tmp_path) == 0
        assert existing(paths) == paths
    finally:
        server.close()


def test_a_run_whose_port_now_serves_another_run_has_ended(tmp_path, endpoints):
    port = serving(endpoints, "later")
    earlier = write_run(tmp_path, "earlier", [port])
    later = write_run(tmp_path, "later", [port])
    assert run_prune(tmp_path) == 0
    assert existing(earlier) == []
    assert existing(later) == later


def test_an_endpoint_that_cannot_be_verified_counts_as_answering(tmp_path, endpoints):
    """A rank secured by a web config file answers 401 without credentials: it may be live, keep it."""
    secured = write_run(tmp_path, "secured", [serving(endpoints, status=401)])
    assert run_prune(tmp_path) == 0
    assert existing(secured) == secured


def test_a_run_that_ended_recently_stays_until_older_than(tmp_path):
    recent = write_run(tmp_path, "recent", [closed_port()], written=time.time() - 60)
    assert run_prune(tmp_path) == 0
    assert existing(recent) == recent
    assert run_prune(tmp_path, "--older-than", "30s") == 0
    assert existing(recent) == []


def test_run_removes_only_that_runs_files_and_its_steps(tmp_path, endpoints):
    named = write_run(tmp_path, "123456", [serving(endpoints, "123456")], written=time.time())
    step = write_run(tmp_path, "123456.1", [closed_port()], written=time.time())
    other = write_run(tmp_path, "1234567", [closed_port()])
    dotted = write_run(tmp_path, "123456.x", [closed_port()], written=time.time())
    assert run_prune(tmp_path, "--run", "123456") == 0
    assert existing(named + step) == []  # live and new: named, so removed all the same
    assert existing(other) == other
    assert existing(dotted) == dotted


def test_dry_run_removes_nothing(tmp_path, capsys):
    dead = write_run(tmp_path, "dead", [closed_port()])
    assert run_prune(tmp_path, "--dry-run") == 0
    assert existing(dead) == dead
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(
        f"would remove {path} (run dead)" for path in dead
    )
    assert run_prune(tmp_path, "--dry-run", "--run", "dead") == 0
    assert existing(dead) == dead


def test_files_that_are_not_flares_are_left_alone(tmp_path):
    others = {
        "node.json": json.dumps([{"targets": [f"127.0.0.1:{closed_port()}"], "labels": {"run": "x"}}]),
        "flare-broken-rank0.json": "{not json",
        "flare-nolabel-rank0.json": json.dumps([{"targets": [f"127.0.0.1:{closed_port()}"]}]),
        "incidents/notes-rank0.json": json.dumps({"hello": "world"}),
    }
    for name, text in others.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
        os.utime(tmp_path / name, (HOUR_AGO, HOUR_AGO))
    assert run_prune(tmp_path) == 0
    assert run_prune(tmp_path, "--run", "x") == 0
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.json")) == sorted(others)


def test_an_empty_directory_is_nothing_to_prune(tmp_path, capsys):
    assert run_prune(tmp_path) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--older-than", "ten minutes"), "flag --older-than: 'ten minutes' is not a Prometheus duration"),
        (("--timeout", "0"), "flag --timeout: 0.0 is not a positive number of seconds"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert run_prune(tmp_path, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flare: {message}") and err.count("\n") == 1


def test_a_missing_directory_is_one_line_and_exit_2(tmp_path, capsys):
    assert prune.main(parse("--dir", str(tmp_path / "absent"))) == 2
    assert capsys.readouterr().err == f"flare: targets directory {tmp_path / 'absent'}: no such directory\n"


def test_flare_targets_prune_is_a_subcommand_of_flare(tmp_path, capsys):
    from flare_exporter.engine import cli

    assert cli.main(["targets", "prune", "--dir", str(tmp_path), "--dry-run"]) == 0
    assert cli.main(["targets", "prune", "--dir", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith("flare: ")
