"""The README's first command: the demo trains, and prints what it read back, one line per rank."""

from __future__ import annotations

import json
import shutil

import pytest

from flare_exporter.engine import cli
from flare_exporter.local import demo

pytestmark = pytest.mark.multirank


def rank_lines(output: str) -> dict[int, list[str]]:
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if fields and fields[0].isdigit():
            rows[int(fields[0])] = fields
    return rows


def test_demo_by_direct_scrape(capsys):
    assert demo.main(["--ranks", "2", "--steps", "40", "--no-prometheus"]) == 0
    rows = rank_lines(capsys.readouterr().out)
    assert sorted(rows) == [0, 1]
    assert all(float(fields[1]) == 40 for fields in rows.values())  # steps, read from /metrics


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_demo_reads_step_rate_and_latency_back_from_prometheus(capsys):
    assert demo.main(["--ranks", "2", "--steps", "300"]) == 0
    output = capsys.readouterr().out
    assert "read back from Prometheus" in output
    rows = rank_lines(output)
    assert sorted(rows) == [0, 1]
    for fields in rows.values():
        assert float(fields[1]) > 0  # steps/s
        assert fields[2] != "-" and fields[3] == "ms"  # all-reduce mean latency present


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit) as exit:
        demo.main(["--ranks", "0"])
    assert exit.value.code == 2


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_make_demo_fault_names_the_stuck_rank_as_soon_as_the_hang_is_declared(capsys):
    # `make demo-fault FAULT=stuck`: flare asks Prometheus the moment the hang threshold has passed, when no
    # number Prometheus holds was scraped after the hang began; it must still name rank 2, not a group fault
    code = demo.main(["--fault", "stuck", "--fault-rank", "2"])
    out, err = capsys.readouterr()
    verdicts = [line for line in out.splitlines() if line.startswith("HANG")]
    assert code == 0 and verdicts, out + err
    assert all(line.startswith("HANG (rank: rank 2)") for line in verdicts), verdicts


def test_the_fault_demo_prints_the_verdict_that_stays_not_the_first_blip(monkeypatch):
    # one scrape that timed out reads as a rank down until the next; the demo waits for the same verdicts to
    # hold for two seconds before it prints them
    answers = iter(["down", "down", "-", "hang", "hang", "hang", "hang"])
    clock = iter(range(100))

    def diagnose(args):
        kind = next(answers)
        verdicts = [] if kind == "-" else [{"kind": kind, "ranks": [2]}]
        print(json.dumps({"verdicts": verdicts}))
        return cli.EXIT_ANOMALY if verdicts else cli.EXIT_OK

    monkeypatch.setattr(demo.cli, "main", diagnose)
    settled = demo.SettledVerdicts(["--prometheus", "http://p"], 2.0, lambda: float(next(clock)))
    held = [settled() for _ in range(6)]
    assert held == [False, False, False, False, False, True]
    assert settled.verdicts == [("hang", (2,))]
