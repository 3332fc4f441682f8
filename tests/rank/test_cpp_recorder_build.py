"""A launch that finds no C++ recorder (a plain `pip install`) builds it in the background, once per host and
torch version, and says in one line which recorder runs (cpp_recorder.build_later, startup_line)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flare_exporter.rank import cpp_recorder


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_CPP_RECORDER_DIR", str(tmp_path))
    return cpp_recorder.build_directory()


def sleeper(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def test_one_build_at_a_time_per_build_directory(empty_cache):
    assert cpp_recorder.build_later(sleeper(0)) == "started"
    lock = empty_cache / cpp_recorder.LOCK_NAME
    assert lock.read_text() == str(os.getpid())  # the launch that started it holds it until the build ends
    assert cpp_recorder.build_later(sleeper(0)) == "building"  # another rank of the host, the next launch
    old = time.time() - cpp_recorder.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))  # a build that died without removing its lock
    assert cpp_recorder.build_later(sleeper(0)) == "started"


def test_a_failed_build_is_not_tried_again_and_says_why(empty_cache, tmp_path):
    lock = empty_cache / cpp_recorder.LOCK_NAME
    empty_cache.mkdir(parents=True)
    lock.write_text("1")
    environment = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "FLARE_CPP_RECORDER_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "flare_exporter.rank.cpp_recorder", "--background", str(lock)],
        env=environment,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 1 and not lock.exists()
    why = cpp_recorder.build_later(sleeper(0))
    assert why.startswith("failed before: no C++ compiler") and "no-such-compiler" in why
    assert not lock.exists()  # nothing started


def test_the_start_up_line_says_which_recorder_runs_and_why(empty_cache, monkeypatch):
    monkeypatch.setattr(cpp_recorder, "load_error", "not built (x.so); build it with: python -m ...")
    line = cpp_recorder.startup_line(False, "started")
    assert line.startswith(
        "flare-exporter: collectives recorded by Python hooks: the C++ recorder is not built"
    )
    assert line.endswith("building it in the background for the next launch") and "\n" not in line
    assert "its build: failed before: boom" in cpp_recorder.startup_line(False, "failed before: boom")
    assert cpp_recorder.startup_line(True).startswith("flare-exporter: collectives recorded in C++")
