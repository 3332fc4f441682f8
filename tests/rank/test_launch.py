"""The launcher: under torchrun, with subgroups, with a taken port and with bad configuration."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import one_rank_env, torch_extension

import flare_exporter
from flare_exporter.engine import scrape
from flare_exporter.local.jobs import ObservedJob, free_port, free_port_block
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp

JOBS = os.path.join(os.path.dirname(__file__), "jobs")


def samples_when(targets, condition, what):
    def ready():
        results = scrape.scrape_all(targets, timeout=2)
        if any(isinstance(r, scrape.ScrapeError) for r in results.values()):
            return None
        return results if all(condition(s) for s in results.values()) else None

    return wait_for(ready, 120, what)


@pytest.mark.multirank
def test_under_torchrun(tmp_path):
    base_port = free_port_block(2)
    done = tmp_path / "done"
    env = dict(os.environ, FLARE_PORT=str(base_port), FLARE_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "flare_exporter.launch",
        train_ddp.__file__,
        "--steps",
        "5",
        "--wait-for",
        str(done),
    ]
    with open(tmp_path / "log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        targets = [f"127.0.0.1:{base_port}", f"127.0.0.1:{base_port + 1}"]
        results = samples_when(targets, lambda s: scrape.value(s, "flare_steps_total") == 5, "torchrun ranks")
        infos = [next(s for s in samples if s.name == "flare_rank_info") for samples in results.values()]
        assert sorted(info.labels["rank"] for info in infos) == ["0", "1"]
        runs = {info.labels["run"] for info in infos}
        assert len(runs) == 1 and runs != {"default"}  # torchrun's run id, the same on both ranks
    finally:
        done.touch()
        assert process.wait(timeout=60) == 0, (tmp_path / "log").read_text()


@pytest.mark.multirank
@pytest.mark.parametrize("recorder", ["cpp", "python"])
def test_subgroups_get_stable_names_shared_by_their_members(tmp_path, recorder):
    """Whichever records the collectives (flare's C++ backend or the Python hooks): same groups, counts."""
    if recorder == "cpp":
        torch_extension()  # built, so that the ranks load it
    env = {"FLARE_NATIVE_COLLECTIVES": "true" if recorder == "cpp" else "false"}
    job = ObservedJob(str(tmp_path), os.path.join(JOBS, "groups_job.py"), [], 4, "test-groups", env=env)
    with job:
        try:
            results = samples_when(
                job.targets,
                lambda s: scrape.value(s, "flare_collective_last_completed_seq", group="world") == 2,
                "the ranks to finish",
            )
        finally:
            job.release()
        assert job.wait(timeout=60) == [0] * 4, job.log_tail(0)
    targets = job.targets
    groups = []
    for target in targets:
        info = [s.labels for s in results[target] if s.name == "flare_process_group_info"]
        assert {labels["recorder"] for labels in info} == {recorder}
        sub = [labels for labels in info if labels["group"] != "world"]
        assert len(sub) == 1 and sub[0]["role"] == "dp" and sub[0]["size"] == "2"
        groups.append(sub[0]["group"])
        for op, count, nbytes in (("allreduce", 3, 3 * 4000), ("broadcast", 1, 40)):
            group = sub[0]["group"] if op == "allreduce" else "world"
            samples = results[target]
            assert count == scrape.value(
                samples, "flare_collective_duration_seconds_count", group=group, op=op
            )
            assert scrape.value(samples, "flare_collective_bytes_total", group=group, op=op) == nbytes
        assert scrape.value(results[target], "flare_collective_last_issued_seq", group=sub[0]["group"]) == 3
    assert groups[0] == groups[1] != groups[2] == groups[3]
    assert groups[0].startswith("data_parallel-")


@pytest.mark.process
def test_taken_port_warns_and_training_goes_on(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = one_rank_env(port, MASTER_PORT=str(free_port()))
        result = subprocess.run(
            [sys.executable, "-m", "flare_exporter.launch", train_ddp.__file__, "--steps", "3"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert f"port {port} on 127.0.0.1 is already in use; rank 0 serves no metrics, training continues" in (
        result.stderr
    )


@pytest.mark.parametrize(
    "yaml_text, env, expected",
    [
        ("prot: 9400\n", {}, "unknown key 'prot' in config file {path}"),
        (
            "port: 70000\n",
            {},
            "key 'port' in config file {path}: 70000 is out of range (between 0 and 65535)",
        ),
        ("port: fast\n", {}, "key 'port' in config file {path}: expected int, got str 'fast'"),
        (
            "",
            {"FLARE_PORT": "abc"},
            "key 'port' in environment variable FLARE_PORT: 'abc' is not a valid int",
        ),
        ("", {"RANK": "abc"}, "environment variable RANK='abc' is not an integer"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_key_and_source(tmp_path, yaml_text, env, expected):
    path = tmp_path / "flare.yml"
    path.write_text(yaml_text)
    result = subprocess.run(
        [sys.executable, "-m", "flare_exporter.launch", "--config", str(path), train_ddp.__file__],
        env=dict(one_rank_env(0), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flare-run: " + expected.format(path=path)), lines


@pytest.mark.process
def test_attach_from_code_and_a_failing_hook_never_breaks_training():
    # FLARE_PORT 0: no endpoint needed here; the Python hooks, whose failure the job injects
    env = one_rank_env(0, MASTER_PORT=str(free_port()), FLARE_NATIVE_COLLECTIVES="false")
    result = subprocess.run(
        [sys.executable, os.path.join(JOBS, "attach_in_code_job.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["sums"] == [4.0, 4.0, 4.0]  # world size 1: all-reduce of ones is ones
    assert report["hook_errors"] == 3
    assert report["allreduce_count"] == 2  # the two collectives observed before the fault
    assert "collective_hook failed" in result.stderr  # said once, then counted
    assert result.stderr.count("collective_hook failed") == 1


@pytest.mark.parametrize("module", ["flare_exporter.launch", "flare_exporter.cli"])
def test_every_entry_point_prints_its_help(module):
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_flare_says_its_version():
    done = subprocess.run(
        [sys.executable, "-m", "flare_exporter.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == f"flare {flare_exporter.__version__}"
