"""The perf summary and each capture's verdict, in the experiment tracker a script already uses
(rank/trackers.py): a real job whose unmodified script logs to TensorBoard and to an offline W&B run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import flare_json

from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.trackers import Trackers, capture_numbers, perf_numbers

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "tracked_train.py"


def perf(recent: list[float], phases: dict[str, float], mfu: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(recent=recent, phase_seconds=phases, mfu=mfu)


def test_the_perf_numbers_are_the_monitors_with_the_ranks_own_class():
    numbers, bottleneck = perf_numbers(perf([0.1, 0.3], {"data": 0.6, "compute": 0.4}, 0.42))
    assert numbers == {
        "flare/step_seconds": 0.2,
        "flare/share/data": 0.6,
        "flare/share/compute": 0.4,
        "flare/mfu": 0.42,
    }
    assert bottleneck == "input_bound"
    assert perf_numbers(perf([], {"compute": 1.0})) == ({}, "")  # before a step: nothing
    capture = SimpleNamespace(summary={"step_seconds": 0.5, "shares": {"compute": 0.9, "idle": "x"}})
    assert capture_numbers(capture) == {"flare/profile/step_seconds": 0.5, "flare/profile/share/compute": 0.9}


class Failing:
    name = "broken"

    def active(self) -> bool:
        return True

    def log(self, numbers: dict, step: int, texts: dict) -> None:
        raise OSError("disk full")


def test_a_tracker_that_fails_is_dropped_and_counted_and_the_others_go_on():
    logged: list[tuple] = []
    working = SimpleNamespace(name="ok", active=lambda: True, log=lambda *args: logged.append(args))
    state = SimpleNamespace(perf=perf([0.1], {"compute": 1.0}), profiler=None, steps=SimpleNamespace(steps=7))
    health = ExporterHealth()
    trackers = Trackers(state, 0.0, [Failing(), working], health)
    for _ in range(2):
        trackers.after_drain()  # logs on a thread of its own
        wait_for(lambda: not trackers.lock.locked(), 10, "the logging thread")
    assert health.errors["tracker_broken"] == 1 and len(trackers.trackers) == 1
    assert [step for _, step, _ in logged] == [7, 7] and logged[0][2] == {"flare/bottleneck": "compute_bound"}


@pytest.mark.multirank
def test_a_scripts_tensorboard_and_wandb_run_get_the_perf_summary_and_the_captures_verdict(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    env = {
        "FLARE_PROFILE": "1",
        "FLARE_TRACKER_INTERVAL_SECONDS": "1",
        "FLARE_TIMING_INTERVAL_SECONDS": "0.5",
        "WANDB_SILENT": "true",
    }
    args = ["--log-dir", str(logs), "--wandb", "--step-seconds", "0.02"]
    with ObservedJob(str(tmp_path), str(PROGRAM), args, 2, "tracked", env=env) as job:
        wait_for(lambda: len(list(Path(job.file_sd_dir).glob("*.json"))) == 2, 60, "the targets")
        code, report = flare_json("profile", "--targets", job.file_sd_dir, "--ranks", "0", "--steps", "2")
        assert code == 0, report

        def tags_of(rank: int) -> tuple[EventAccumulator | None, dict]:
            runs = list(logs.glob(f"rank{rank}/flare-rank{rank}"))
            if not runs:
                return None, {"tensors": [], "scalars": []}
            events = EventAccumulator(str(runs[0]), size_guidance={"tensors": 0, "scalars": 0})
            events.Reload()
            return events, events.Tags()

        def verdict_written() -> EventAccumulator | None:
            # rank 1's perf summary too: its trackers log it to W&B just before TensorBoard
            events, tags = tags_of(0)
            both = (
                "flare/profile/verdict/text_summary" in tags["tensors"]
                and "flare/step_seconds" in tags["scalars"]
                and "flare/step_seconds" in tags_of(1)[1]["scalars"]
            )
            return events if both else None

        events = wait_for(verdict_written, 60, "the perf summary in both ranks' runs and rank 0's verdict")
        job.release()
        assert job.wait(120) == [0, 0]
    scalars = set(events.Tags()["scalars"])
    assert {"flare/step_seconds", "flare/share/compute", "flare/profile/step_seconds"} <= scalars
    assert events.Scalars("flare/step_seconds")[-1].value > 0.015  # paced at 20 ms
    assert (
        report["ranks"][0]["bottleneck"]
        in events.Tensors("flare/profile/verdict/text_summary")[-1].tensor_proto.string_val[0].decode()
    )
    rank1 = EventAccumulator(str(logs / "rank1" / "flare-rank1")).Reload().Tags()["scalars"]
    assert "flare/step_seconds" in rank1 and "flare/profile/step_seconds" not in rank1  # it captured nothing
    summaries = {rank: json.loads((logs / f"wandb-summary-rank{rank}.json").read_text()) for rank in (0, 1)}
    assert summaries[0]["flare/profile/verdict"].startswith(report["ranks"][0]["bottleneck"])
    assert summaries[1]["flare/step_seconds"] > 0 and "flare/profile/verdict" not in summaries[1]
