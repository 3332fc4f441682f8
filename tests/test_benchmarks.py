"""The benchmarks' own checks, on runs too small to measure anything: they must keep working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("recorder", ["cpp", "python"])
def test_collective_path_compares_a_wrapped_group_with_a_plain_one(tmp_path, recorder):
    out = tmp_path / "results.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "collective_path.py"),
        *("--ranks", "2", "--blocks", "2", "--block-steps", "5", "--warmup", "3", "--json", str(out)),
        *("--recorder", recorder),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    # every step of the wrapped model issued DDP's all-reduce through flare: 3 + 2 * 5 steps per rank, and
    # the collectives DDP issues when it wraps the model; the plain group's were not seen (or the check fails)
    assert results["recorder"] == recorder and len(results["recorded_collectives"]) == 2
    assert all(recorded >= 13 for recorded in results["recorded_collectives"])
    for measure in ("wall", "cpu"):
        assert results[measure]["median_plain"] > 0 and results[measure]["median_wrapped"] > 0
    assert "training thread's CPU per step" in done.stdout


def test_collective_path_rejects_bad_arguments():
    command = [sys.executable, str(REPO / "benchmarks" / "collective_path.py"), "--blocks", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and "--blocks must be at least 1" in done.stderr


def test_instructions_rejects_bad_arguments():
    command = [sys.executable, str(REPO / "benchmarks" / "instructions.py"), "--short", "50", "--long", "50"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and "--short (50) must be positive and below --long (50)" in done.stderr
