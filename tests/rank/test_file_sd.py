"""Prometheus file_sd target files, one per rank."""

from __future__ import annotations

import json
import logging
import os

from flare_exporter.rank import file_sd
from flare_exporter.rank.identity import RankIdentity


def make_identity(rank: int = 3, run: str = "run-1") -> RankIdentity:
    return RankIdentity(rank=rank, local_rank=rank % 8, world_size=16, run=run, host="node-0", pid=1234)


def test_write_target_writes_file_sd_json(tmp_path):
    path = file_sd.write_target(str(tmp_path), make_identity(), "127.0.0.1", 9403)
    assert path is not None
    assert os.path.dirname(path) == str(tmp_path)
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    labels = {"rank": "3", "run": "run-1", "__meta_flare_host": "node-0"}
    assert document == [{"targets": ["127.0.0.1:9403"], "labels": labels}]
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left behind


def test_each_rank_gets_its_own_file(tmp_path):
    paths = {
        file_sd.write_target(str(tmp_path), make_identity(rank), "127.0.0.1", 9400 + rank)
        for rank in range(3)
    }
    assert len(paths) == 3
    assert len(os.listdir(tmp_path)) == 3


def test_write_target_creates_the_directory(tmp_path):
    directory = tmp_path / "targets" / "flare"
    path = file_sd.write_target(str(directory), make_identity(), "127.0.0.1", 9400)
    assert path is not None and os.path.exists(path)


def test_rewrite_replaces_the_file(tmp_path):
    file_sd.write_target(str(tmp_path), make_identity(), "127.0.0.1", 9400)
    path = file_sd.write_target(str(tmp_path), make_identity(), "127.0.0.1", 9500)
    with open(path, encoding="utf-8") as handle:
        assert json.load(handle)[0]["targets"] == ["127.0.0.1:9500"]


def test_unsafe_run_id_makes_a_safe_file_name(tmp_path):
    path = file_sd.target_path(str(tmp_path), make_identity(run="../a b/c"))
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path) == "flare-.._a_b_c-rank3.json"


def test_any_address_advertises_the_hostname():
    document = file_sd.target_document(make_identity(), "0.0.0.0", 9400)
    host = document[0]["targets"][0].rsplit(":", 1)[0]
    assert host not in ("", "0.0.0.0")


def test_ipv6_address_is_bracketed():
    assert file_sd.target_document(make_identity(), "::1", 9400)[0]["targets"] == ["[::1]:9400"]


def test_unwritable_directory_warns_and_returns_none(tmp_path, caplog):
    regular_file = tmp_path / "not-a-directory"
    regular_file.write_text("x")
    directory = str(regular_file / "targets")
    with caplog.at_level(logging.WARNING, logger="flare_exporter"):
        assert file_sd.write_target(directory, make_identity(), "127.0.0.1", 9400) is None
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert directory in messages[0]
    assert "rank 3" in messages[0]


def test_remove_target(tmp_path):
    path = file_sd.write_target(str(tmp_path), make_identity(), "127.0.0.1", 9400)
    file_sd.remove_target(path)
    assert not os.path.exists(path)
    file_sd.remove_target(path)  # already gone: no error
