"""The `flare` CLI and the targets it reads."""

from __future__ import annotations

import json

import pytest
from conftest import RANKS, STEPS

from flare_exporter import cli
from flare_exporter.local_job import free_port
from flare_exporter.targets import TargetsError, read_targets


def test_targets_from_lines_file_sd_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("# ranks\n10.0.0.1:9400\n\n10.0.0.1:9401  # rank 1\n")
    (tmp_path / "b.json").write_text(json.dumps([{"targets": ["10.0.0.2:9400"], "labels": {"rank": "2"}}]))
    assert read_targets(str(tmp_path / "a.txt")) == ["10.0.0.1:9400", "10.0.0.1:9401"]
    assert read_targets(str(tmp_path / "b.json")) == ["10.0.0.2:9400"]
    assert read_targets(str(tmp_path)) == ["10.0.0.1:9400", "10.0.0.1:9401", "10.0.0.2:9400"]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("t.txt", "just-a-host\n", "line 1: 'just-a-host' is not host:port"),
        ("t.json", "[{", "not valid JSON"),
        ("t.json", '{"targets": []}', "a file_sd file is a JSON list"),
        ("t.json", '[{"labels": {}}]', "each target group needs a 'targets' list"),
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
    assert report["ranks_seen"] == RANKS
    assert [row["rank"] for row in report["ranks"]] == list(range(RANKS))
    assert {row["steps"] for row in report["ranks"]} == {STEPS}
    assert len({row["last_issued_seq"] for row in report["ranks"]}) == 1
    assert cli.main(["ranks", "--targets", ddp_job.file_sd_dir]) == cli.EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["rank", "host", "steps"] and len(table) == RANKS + 1


def test_unreachable_rank_is_reported_and_exits_1(tmp_path, capsys):
    path = tmp_path / "targets.txt"
    path.write_text(f"127.0.0.1:{free_port()}\n")
    assert cli.main(["ranks", "--targets", str(path), "--timeout", "2"]) == cli.EXIT_ANOMALY
    assert "cannot scrape" in capsys.readouterr().out


def test_usage_errors_exit_2(tmp_path, capsys):
    assert cli.main(["ranks"]) == cli.EXIT_USAGE
    assert cli.main(["ranks", "--targets", str(tmp_path / "missing")]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.strip().endswith("no such file or directory")
