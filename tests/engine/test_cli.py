"""The `flare` CLI and the targets it reads."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
from conftest import RANKS, STEPS

from flare_exporter.engine import cli, promql, rule_types, scrape_source
from flare_exporter.engine.targets import Target, TargetsError, read_targets
from flare_exporter.local.jobs import free_port
from flare_exporter.local.prometheus import wait_for


def test_targets_from_lines_file_sd_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("# ranks\n10.0.0.1:9400\n\n10.0.0.1:9401  # rank 1\n")
    (tmp_path / "b.json").write_text(json.dumps([{"targets": ["10.0.0.2:9400"], "labels": {"rank": "2"}}]))
    assert read_targets(str(tmp_path / "a.txt")) == [Target("10.0.0.1:9400", {}), Target("10.0.0.1:9401", {})]
    assert read_targets(str(tmp_path / "b.json")) == [Target("10.0.0.2:9400", {"rank": "2"})]
    addresses = [target.address for target in read_targets(str(tmp_path))]
    assert addresses == ["10.0.0.1:9400", "10.0.0.1:9401", "10.0.0.2:9400"]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("t.txt", "just-a-host\n", "line 1: 'just-a-host' is not host:port"),
        ("t.json", "[{", "not valid JSON"),
        ("t.json", '{"targets": []}', "a file_sd file is a JSON list"),
        ("t.json", '[{"labels": {}}]', "each target group needs a 'targets' list"),
        (
            "t.json",
            '[{"targets": ["h:1"], "labels": {"rank": 3}}]',
            "'labels' must map label names to strings",
        ),
    ],
)
def test_bad_targets_name_the_file_and_the_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TargetsError, match=str(path)) as error:
        read_targets(str(path))
    assert message in str(error.value)


def test_ranks_of_a_running_job_from_its_file_sd_directory(ddp_job, capsys):
    assert cli.main(["ranks", "--targets", ddp_job.file_sd_dir, "--json"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["ranks_seen"] == RANKS and report["world_size"] == RANKS and report["verdicts"] == []
    assert [row["rank"] for row in report["ranks"]] == list(range(RANKS))
    assert {row["steps"] for row in report["ranks"]} == {STEPS}
    assert {row["host"] for row in report["ranks"]} == {"node-0", "node-1"}
    assert all(row["up"] and row["in_flight"] is None for row in report["ranks"])
    assert cli.main(["ranks", "--targets", ddp_job.file_sd_dir]) == cli.EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith(f"run test-ddp: {RANKS} of {RANKS} ranks answered")
    assert table[1].split()[:3] == ["rank", "host", "steps"]
    assert [line.split()[0] for line in table[2 : 2 + RANKS]] == [str(rank) for rank in range(RANKS)]
    assert table[-1] == "no anomaly found"


def test_healthy_job_from_prometheus_has_no_verdict(ddp_job, capsys):
    if ddp_job.prometheus is None:
        pytest.skip("prometheus is not installed")
    url = ddp_job.prometheus.url
    wait_for(
        lambda: len(promql.query(url, f'flare_steps_total{{run="test-ddp"}} == {STEPS}')) == RANKS,
        60,
        "Prometheus to scrape the finished ranks",
    )
    assert cli.main(["diagnose", "--prometheus", url, "--json"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == "test-ddp" and report["ranks_seen"] == RANKS and report["verdicts"] == []
    assert cli.main(["hang", "--prometheus", url, "--json"]) == cli.EXIT_OK
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert [(g["group"], g["members"], g["hung"]) for g in groups] == [("world", RANKS, False)]


def test_a_rank_that_does_not_answer_is_down(ddp_job, tmp_path, capsys):
    path = tmp_path / "targets.txt"
    path.write_text("\n".join([*ddp_job.targets, f"127.0.0.1:{free_port()}"]) + "\n")
    (tmp_path / "gone.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"rank": "7", "run": "test-ddp"}}])
    )
    assert cli.main(["diagnose", "--targets", str(tmp_path), "--timeout", "2", "--json"]) == cli.EXIT_ANOMALY
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("rank_down", [7])]
    assert "cannot scrape" in verdicts[0]["summary"]


def test_no_rank_answering_cannot_decide(tmp_path, capsys):
    path = tmp_path / "targets.txt"
    path.write_text(f"127.0.0.1:{free_port()}\n")
    assert cli.main(["ranks", "--targets", str(path), "--timeout", "2"]) == cli.EXIT_UNDECIDED
    assert capsys.readouterr().err.startswith("flare: cannot decide: ")


def test_unreachable_prometheus_is_a_one_line_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["diagnose", "--prometheus", url]) == cli.EXIT_USAGE
    error = capsys.readouterr().err
    assert error.startswith(f"flare: cannot reach Prometheus at {url}") and error.count("\n") == 1


def test_usage_errors_exit_2(tmp_path, capsys):
    assert cli.main(["ranks"]) == cli.EXIT_USAGE
    assert cli.main(["diagnose", "--targets", "a", "--prometheus", "http://b"]) == cli.EXIT_USAGE
    capsys.readouterr()
    assert cli.main(["ranks", "--targets", str(tmp_path / "missing")]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.strip().endswith("no such file or directory")
    assert cli.main(["hang", "--targets", str(tmp_path), "--hang-seconds", "soon"]) == cli.EXIT_USAGE
    assert "'soon' is not a valid float" in capsys.readouterr().err


def test_start_up_imports_no_torch_yaml_or_prometheus_client():
    # `flare diagnose` at thousands of ranks must answer in about a second, start-up included
    names = ("torch", "yaml", "prometheus_client")
    code = f"import sys, flare_exporter.cli; print(sorted(set({names!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_garbage_collector_is_back_on_after_a_command(tmp_path):
    assert cli.main(["diagnose", "--targets", str(tmp_path / "missing")]) == cli.EXIT_USAGE
    assert gc.isenabled()


def test_the_ild_op_shift_threshold_is_a_flag_of_diagnose(tmp_path, monkeypatch, capsys):
    """A per-op shift of 100 ns on one rank of four: below the default threshold (400 ns, for ranks that
    share cores), a regression at --ild-op-shift-seconds 5e-8 (dedicated cores)."""
    records = [
        rule_types.RankRecord(
            rank,
            host=f"h{rank}",
            ild_ks={"host_dispatch": 0.02},
            ild_wasserstein={"host_dispatch": 1e-8},
            ild_op_shift={"host_dispatch": 1e-7 if rank == 2 else 1e-9},
        )
        for rank in range(4)
    ]
    snapshot = rule_types.Snapshot({record.rank: record for record in records}, 1e9, "r", 4)
    monkeypatch.setattr(scrape_source, "from_targets", lambda *args: snapshot)
    monkeypatch.delenv("FLARE_ILD_OP_SHIFT_SECONDS", raising=False)
    (tmp_path / "t.txt").write_text("127.0.0.1:1\n")
    command = ["diagnose", "--targets", str(tmp_path / "t.txt"), "--json"]
    assert cli.main(command) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["verdicts"] == []
    assert cli.main([*command, "--ild-op-shift-seconds", "5e-8"]) == cli.EXIT_ANOMALY
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("ild_regression", [2])]
    assert verdicts[0]["evidence"]["op_shift_threshold_seconds"] == 5e-8
    monkeypatch.setenv("FLARE_ILD_OP_SHIFT_SECONDS", "5e-8")  # or from the environment
    assert cli.main(command) == cli.EXIT_ANOMALY
    capsys.readouterr()
    assert cli.main([*command, "--ild-op-shift-seconds", "-1"]) == cli.EXIT_USAGE
    assert "flag --ild-op-shift-seconds" in capsys.readouterr().err
