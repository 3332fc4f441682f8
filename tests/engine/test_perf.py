"""Where the step time goes: the exposed-collective arithmetic (and its split by group role), the badput
ledger, the bottleneck classes, MFU, and real 4-rank gloo jobs built to be input-, communication- (with
tensor-parallel pair groups) and compute-bound, and one with a straggler that sleeps a known time in every
step.

Each job is the unmodified DDP workload under the launcher; `flare perf --targets` and `flare stragglers
--targets` read the ranks' endpoints once every rank has accounted its steps. One job per class, shared
by the assertions about it; they start lazily, so that running one test starts one job.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import flare_json

from flare_exporter import label_values
from flare_exporter.config import Config
from flare_exporter.engine import perf, scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.mixin import perf_rules, rule_model
from flare_exporter.policies import BottleneckPolicy
from flare_exporter.rank.perf import PerfMonitor, peak_flops_of
from flare_exporter.rank.straggler_windows import exposed_by_role, exposed_seconds

RANKS = 4
POLICY = BottleneckPolicy()

# ---------------------------------------------------------------------------------------------------------
# the arithmetic


def test_exposed_time_counts_each_busy_period_from_its_last_issue():
    # DDP: three buckets issued while computing (0, 1, 2), all done at 5: the thread was blocked 2 .. 5
    assert exposed_seconds([(0.0, 5.0), (1.0, 4.0), (2.0, 1.0)], 0.0, 10.0) == pytest.approx(3.0)
    # two synchronous collectives, each waited for before the next: both count whole
    assert exposed_seconds([(0.0, 1.0), (3.0, 2.0)], 0.0, 10.0) == pytest.approx(3.0)
    # clipped to the step
    assert exposed_seconds([(9.0, 3.0)], 0.0, 10.0) == pytest.approx(1.0)
    assert exposed_seconds([], 0.0, 10.0) == 0.0


def test_each_busy_period_s_exposed_time_goes_to_the_role_of_its_last_issued_collective():
    waits = [
        (0.0, 5.0, "dp"),  # a DDP bucket reducing while the thread computes; at 2 it issues a tp collective
        (2.0, 1.0, "tp"),  # ... and then waits 2 .. 5: the thread was blocked after its tp issue, tp's
        (6.0, 1.0, "dp"),  # alone: 6 .. 7, dp's
        (8.0, 1.0, "tp"),  # overlapped by the dp issued at 8.5 ...
        (8.5, 2.0, "dp"),  # ... whose wait, 8.5 .. 10 within the step, is dp's
    ]
    by_role = exposed_by_role(waits, 0.0, 10.0)
    assert by_role == pytest.approx({"tp": 3.0, "dp": 2.5})
    assert sum(by_role.values()) == pytest.approx(exposed_seconds(waits, 0.0, 10.0))
    assert exposed_by_role([(1.0, 1.0)], 0.0, 10.0) == {"other": 1.0}  # a wait that names no role
    assert exposed_by_role([], 0.0, 10.0) == {}


def test_the_collective_phase_by_role_adds_up_to_the_phase_also_where_the_step_cut_it():
    monitor = PerfMonitor(None, Config())
    monitor.on_step(2, 0.5, 0.2, {"world": 0.15, "tp": 0.05})
    monitor.on_step(3, 0.1, 0.2, {"world": 0.1, "tp": 0.1})  # 0.2 s exposed in a 0.1 s step: halved
    monitor.on_step(4, 0.5, 0.0)  # a step handed over without roles, and no collective time
    assert monitor.collective_by_role == pytest.approx({"world": 0.2, "tp": 0.1})
    assert sum(monitor.collective_by_role.values()) == pytest.approx(monitor.phase_seconds["collective"])


def test_flare_perf_shows_each_ranks_collective_time_per_step_by_role_and_the_jobs_shares():
    series = {
        perf.PHASES: [
            ({"rank": str(rank), "phase": phase}, seconds)
            for rank in (0, 1)
            for phase, seconds in (("collective", 4.0), ("compute", 6.0))
        ],
        perf.STEPS: [({"rank": str(rank)}, 100.0) for rank in (0, 1)],
        perf.ROLES: [
            ({"rank": "0", "role": "dp"}, 3.0),
            ({"rank": "0", "role": "tp"}, 1.0),
            ({"rank": "1", "role": "dp"}, 1.0),
            ({"rank": "1", "role": "tp"}, 3.0),
            ({"rank": "1", "role": "nonsense"}, 9.0),  # not a role: left out
        ],
    }
    records = perf.records_from_series(series)
    result, lines = perf.perf_view(records)
    rows = {row["rank"]: row for row in result["ranks"]}
    assert rows[0]["collective_by_role"] == {"dp": 0.03, "tp": 0.01}
    assert rows[1]["collective_by_role"] == {"tp": 0.03, "dp": 0.01}
    assert result["collective_share_by_role"] == {"dp": 0.2, "tp": 0.2}
    assert lines[2].endswith("dp 30.00ms tp 10.00ms") and lines[3].endswith("tp 30.00ms dp 10.00ms")
    assert "collective by group role, of the job's step time: dp 20.0%, tp 20.0%" in lines


def rank_record(rank: int, wait_per_step: float, steps: int = 100, host: str = "h0", **phases: float):
    per_step = {"data": 0.0, "optimizer": 0.001, "collective": wait_per_step, "compute": 0.05, **phases}
    return perf.PerfRank(rank, host, steps, {phase: seconds * steps for phase, seconds in per_step.items()})


def test_the_rank_that_waits_least_is_charged_the_others_excess():
    records = {
        rank: rank_record(rank, 0.07 if rank != 2 else 0.01, host=f"h{rank // 2}") for rank in range(4)
    }
    lost = perf.seconds_lost(records)
    assert lost[2] == pytest.approx(3 * 0.06 * 100) and lost[0] == lost[1] == lost[3] == 0.0
    assert perf.seconds_lost_by_host(records, lost) == pytest.approx({"h0": 0.0, "h1": 18.0})


def test_equal_ranks_cost_nothing_and_one_rank_cannot_be_charged():
    assert set(perf.seconds_lost({r: rank_record(r, 0.02) for r in range(4)}).values()) == {0.0}
    assert perf.seconds_lost({0: rank_record(0, 0.02)}) == {0: 0.0}


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        ({"data": 0.3, "compute": 0.7}, "input_bound"),
        ({"data": 0.29, "collective": 0.5, "compute": 0.21}, "communication_bound"),
        ({"collective": 0.49, "bubble": 0.5, "compute": 0.01}, "bubble_bound"),
        ({"transfer": 0.3, "compute": 0.7}, "transfer_bound"),
        ({"host": 0.3, "compute": 0.7}, "launch_bound"),
        ({"data": 0.2, "collective": 0.49, "host": 0.1, "compute": 0.21}, "compute_bound"),
    ],
)
def test_classes_at_their_thresholds(phases, expected):
    assert POLICY.classify(phases) == expected


def test_a_rank_computing_slower_than_its_peers_is_named():
    records = {
        rank: perf.PerfRank(rank, "", 10, {"compute": 1.0 if rank != 3 else 1.5}, flops_per_step=1e9)
        for rank in range(4)
    }
    slow = perf.slow_ranks(records, POLICY)
    assert [row["rank"] for row in slow] == [3] and slow[0]["ratio"] == pytest.approx(1 / 1.5)


def pipeline_series(stage_compute: dict[int, float], groups: dict[int, tuple[str, int]]) -> dict:
    """Series of ranks that are pipeline stages: each computes `stage_compute[rank]` s a step (1e9 FLOPs)
    and waits the rest of 1 s in sends and receives, in the group and position `groups[rank]`."""
    ranks = list(stage_compute)
    phases = [
        ({"rank": str(r), "phase": phase}, seconds * 10)
        for r in ranks
        for phase, seconds in (("compute", stage_compute[r]), ("bubble", 1.0 - stage_compute[r]))
    ]
    return {
        perf.PHASES: phases,
        perf.STEPS: [({"rank": str(r)}, 10.0) for r in ranks],
        "flare_model_flops_per_step": [({"rank": str(r)}, 1e9) for r in ranks],
        perf.GROUP_INFO: [
            ({"rank": str(r), "group": groups[r][0], "group_rank": str(groups[r][1])}, 1) for r in ranks
        ],
        perf.P2P_DONE: [
            ({"rank": str(r), "group": groups[r][0], "peer": "x", "direction": "send"}, 40.0) for r in ranks
        ],
    }


def test_pipeline_stages_are_weighed_only_against_the_same_stage_of_other_pipelines():
    # one pipeline of 4 stages over the world: the last computes twice as long, by design
    series = pipeline_series({0: 0.3, 1: 0.3, 2: 0.3, 3: 0.6}, {r: ("world", r) for r in range(4)})
    result, lines = perf.perf_view(perf.records_from_series(series))
    assert result["slow_ranks"] == [] and not any("slower device" in line for line in lines)
    assert [row["stage"] for row in result["ranks"]] == [f"world stage {r}" for r in range(4)]
    assert [row["bottleneck"] for row in result["ranks"]] == ["bubble_bound"] * 3 + ["compute_bound"]
    # two pipelines of 3 stages (mesh_pp groups): stage 1 of pipeline b is slower than stage 1 of a and c
    groups = {r: (f"mesh_pp-{'abc'[r // 3]}", r % 3) for r in range(9)}
    compute = {r: 0.2 * (1 + r % 3) for r in range(9)} | {4: 0.8}
    records = perf.records_from_series(pipeline_series(compute, groups))
    assert records[4].stage == records[1].stage == "mesh_pp stage 1" != records[2].stage
    result, _ = perf.perf_view(records)
    assert [row["rank"] for row in result["slow_ranks"]] == [4]  # not stage 2, which computes 0.6 s by design


def test_mfu_is_achieved_over_peak_and_the_peak_comes_from_the_gpu_name():
    monitor = PerfMonitor(None, Config(model_flops_per_step=2e12, peak_flops=1e15, perf_window_steps=4))
    for step in range(2, 8):
        monitor.on_step(step, 0.5 if step != 12 else 9.0, 0.1)
    assert monitor.achieved_flops == pytest.approx(4e12) and monitor.mfu == pytest.approx(0.004)
    assert monitor.phase_seconds["collective"] == pytest.approx(0.6) and monitor.steps == 6
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12 and peak_flops_of("Tesla T4") == 65e12
    assert peak_flops_of("cpu") is None


def analytic_flops(width: int, batch: int) -> float:
    """Training FLOPs of train_ddp's model per step: 2 per multiply-add, forward (1x), backward (2x: the
    gradients of inputs and of weights), less the first layer's input gradient, which nothing needs."""
    layers = [(width, width), (width, width), (width, 10)]
    multiply_adds = sum(inputs * outputs for inputs, outputs in layers)
    return 2 * batch * (3 * multiply_adds - width * width)


# ---------------------------------------------------------------------------------------------------------
# real jobs

JOBS = {
    # every batch takes 60 ms to read, one worker per rank: the ranks wait for their input
    "input": ["--data-workers", "1", "--slow-data-seconds", "0.06", "--steps", "30"],
    # 4.7 M parameters all-reduced (19 MB) over a batch of 1: the ranks wait for the all-reduce; and in
    # tensor-parallel pairs (ranks 0-1, 2-3: role tp) a small all-reduce before every forward pass
    "communication": ["--width", "1536", "--batch", "1", "--steps", "25", "--pair-groups"],
    # a batch of 2048 through the 256-wide model, 0.5 MB all-reduced
    "compute": ["--batch", "2048", "--steps", "30"],
    # rank 1 sleeps 40 ms in every step; paced at 100 ms so that the machine stays quiet
    "straggler": [
        *("--steps", "50", "--step-seconds", "0.1", "--batch", "64"),
        *("--slow-rank", "1", "--slowdown", "40", "--slow-by", "sleep", "--slow-from-step", "0"),
    ],
}
STRAGGLER_DELAY = 40 * train_ddp.NOMINAL_COMPUTE_SECONDS
PEAK = 1e11  # FLOP/s configured for the CPU ranks


class Jobs:
    """Each job run once, when a test first asks for it: `flare perf` and `flare stragglers` on it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.done: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self.done:
            self.done[name] = self._run(name)
        return self.done[name]

    def _run(self, name: str) -> dict:
        args = JOBS[name]
        steps = int(args[args.index("--steps") + 1])
        (self.work / name).mkdir()
        env = {"FLARE_PEAK_FLOPS": str(PEAK), "FLARE_TIMING_INTERVAL_SECONDS": "0.2"}
        with ObservedJob(str(self.work / name), train_ddp.__file__, args, RANKS, name, env=env) as job:
            targets = job.file_sd_dir

            def accounted() -> bool:
                found = scrape.scrape_all(job.targets, timeout=5, wanted={"flare_step_phase_steps_total"})
                values = [
                    scrape.value(s, "flare_step_phase_steps_total") if isinstance(s, list) else None
                    for s in found.values()
                ]
                return all(value is not None and value >= steps - 2 for value in values)

            try:
                wait_for(accounted, 150, f"every rank of job {name} to account its steps")
            except TimeoutError:
                pytest.fail(f"job {name}: {job.log_tail(0)}")
            code, shown = flare_json("perf", "--targets", targets)
            assert code == 0, shown
            _, stragglers = flare_json("stragglers", "--targets", targets, "--timeout", "5")
            job.release()
            assert job.wait(60) == [0] * RANKS
        for row in shown["ranks"]:  # shown with -s: the numbers the report quotes
            print(
                name,
                row["rank"],
                row["bottleneck"],
                row["step_seconds"],
                row["phases_share"],
                row["seconds_lost"],
            )
        return {"perf": shown, "stragglers": stragglers, "steps": steps}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return Jobs(tmp_path_factory.mktemp("perf"))


@pytest.mark.multirank
@pytest.mark.process
@pytest.mark.parametrize(
    ("job", "expected"),
    [("input", "input_bound"), ("communication", "communication_bound"), ("compute", "compute_bound")],
)
def test_each_rank_of_a_job_is_in_its_class(jobs, job, expected):
    shown = jobs(job)["perf"]
    classes = {row["rank"]: (row["bottleneck"], row["phases_share"]) for row in shown["ranks"]}
    assert len(classes) == RANKS
    assert all(bottleneck == expected for bottleneck, _ in classes.values()), classes
    assert shown["bottleneck"] == expected


@pytest.mark.multirank
@pytest.mark.process
def test_the_collective_phase_splits_into_the_world_and_the_tensor_parallel_pairs(jobs):
    """DDP's gradient all-reduce is the world group's, the pair all-reduce the tp groups': every rank waits
    in both, and the roles add up to its collective phase (per step, as `flare perf` rounds them)."""
    for row in jobs("communication")["perf"]["ranks"]:
        by_role = row["collective_by_role"]
        print("communication by role", row["rank"], by_role, row["phases"]["collective"])
        assert set(by_role) == {"world", "tp"} and min(by_role.values()) > 0, row
        assert sum(by_role.values()) == pytest.approx(row["phases"]["collective"], abs=1e-5, rel=1e-4)
        assert by_role["world"] > by_role["tp"], row  # 19 MB against 16 bytes


@pytest.mark.multirank
@pytest.mark.prometheus
def test_flare_perf_reads_the_collective_time_by_role_from_prometheus(ddp_job):
    """The same numbers through Prometheus (their increase over --window): the shared DDP job has the world
    group alone. Each rank exports its groups' roles at 0 from the start, as it does its phases, so that
    increase() spans the same samples for both (a series born at its first nonzero value would be
    extrapolated back to zero on its own, and part of the phase would seem missing from its roles)."""
    if ddp_job.prometheus is None:
        pytest.skip("prometheus is not installed")
    shown: dict = {}

    def every_rank_has_roles() -> bool:
        _, found = flare_json("perf", "--prometheus", ddp_job.prometheus.url, "--run", "test-ddp")
        shown.update(found)
        rows = found.get("ranks", [])
        return len(rows) == RANKS and all("world" in row["collective_by_role"] for row in rows)

    wait_for(every_rank_has_roles, 60, "every rank's collective time by role in Prometheus")
    for row in shown["ranks"]:
        assert set(row["collective_by_role"]) == {"world"}, row
        if row["steps"]:
            collective = row["phases"]["collective"]
            print("prometheus", row["rank"], row["collective_by_role"], collective)
            assert row["collective_by_role"]["world"] == pytest.approx(collective, rel=0.02, abs=1e-5), row


@pytest.mark.multirank
@pytest.mark.process
def test_model_flops_match_the_analytic_count_and_mfu_is_achieved_over_peak(jobs):
    found = jobs("compute")["perf"]
    for row in found["ranks"]:
        assert row["flops_per_step"] == pytest.approx(analytic_flops(train_ddp.WIDTH, 2048), rel=0.05)
        assert row["mfu"] == pytest.approx(row["achieved_flops"] / PEAK, rel=1e-6)
        # the mean step of the last steps, against the whole run's mean step: within the step-time noise
        assert row["achieved_flops"] == pytest.approx(row["flops_per_step"] / row["step_seconds"], rel=0.3)


@pytest.mark.multirank
@pytest.mark.process
def test_a_straggler_is_charged_its_delay_for_each_other_rank_and_the_healthy_ranks_nothing(jobs):
    found = jobs("straggler")
    rows = {row["rank"]: row for row in found["perf"]["ranks"]}
    expected_per_step = STRAGGLER_DELAY * (RANKS - 1)
    assert rows[1]["seconds_lost"] / rows[1]["steps"] == pytest.approx(expected_per_step, rel=0.10)
    assert all(rows[rank]["seconds_lost"] == 0.0 for rank in (0, 2, 3))
    scores = found["stragglers"]["scores"]
    assert scores[0]["rank"] == 1 and scores[0]["seconds_lost"] == pytest.approx(
        rows[1]["seconds_lost"], rel=0.1
    )


def test_phase_label_values_are_the_specs():
    assert set(label_values.STEP_PHASES) >= {"data", "optimizer", "collective", "compute"}
    assert math.isclose(analytic_flops(256, 64), 42_926_080)


BOTTLENECK = perf_rules.BOTTLENECK
PROMTOOL_TEST = """
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{series}
    promql_expr_test:
      - expr: round(run_rank:flare_badput_seconds:rate5m, 0.000001)
        eval_time: 10m
        exp_samples:
          - labels: '{{rank="1", run="r"}}'
            value: {lost}
      - expr: run_rank:flare_step_bottleneck:info
        eval_time: 10m
        exp_samples:
{classes}
      - expr: round(run_role:flare_step_collective_seconds:share, 0.000001)
        eval_time: 10m
        exp_samples:
          - labels: '{{role="tp", run="r"}}'
            value: {tp_share}
          - labels: '{{role="world", run="r"}}'
            value: {world_share}
"""


@pytest.mark.skipif(not shutil.which("promtool"), reason="needs promtool")
def test_the_recording_rules_charge_the_last_arriver_and_classify_like_the_engine(tmp_path):
    """Rank 1 waits 10 ms a step, the others 50 ms; 2 steps a second; rank 3 also waits 0.4 s for data.
    Rank 4 waits 0.35 s in collectives and 0.1 s for data: by its own step (the wait lowered to rank 1's) it
    is input-bound, but the wait for the last arriver is most of its step, so it takes rank 1's class.
    Each rank waits a fifth of its collective time in its tp group, the rest in the world's: per run and
    role, the share of the run's step time."""
    waits = {0: 0.05, 1: 0.01, 2: 0.05, 3: 0.05, 4: 0.35}
    series = []
    for rank, wait in waits.items():
        data = {3: 0.4, 4: 0.1}.get(rank, 0.0)
        for phase, per_step in (("collective", wait), ("compute", 0.4 - wait), ("data", data)):
            series.append(
                (f'flare_step_phase_seconds_total{{phase="{phase}",rank="{rank}",run="r"}}', 120 * per_step)
            )
        for role, part in (("world", 0.8), ("tp", 0.2)):
            series.append(
                (
                    f'flare_step_collective_seconds_total{{role="{role}",rank="{rank}",run="r"}}',
                    120 * wait * part,
                )
            )
        series.append((f'flare_step_phase_steps_total{{rank="{rank}",run="r"}}', 120))
        series.append((f'flare_rank_info{{rank="{rank}",run="r",host="h{rank}"}}', 0))
    lines = [f"      - series: '{name}'\n        values: '0+{step:g}x20'" for name, step in series]
    expected = {0: "compute_bound", 1: "compute_bound", 2: "compute_bound", 3: "input_bound"}
    expected[4] = "compute_bound"  # rank 1's
    classes = [
        f'          - labels: \'{BOTTLENECK}{{bottleneck="{c}", rank="{r}", run="r"}}\'\n            value: 1'
        for r, c in expected.items()
    ]
    rules_doc = {
        "groups": [
            {
                "name": "flare.perf",
                "rules": [
                    {"record": r.record, "expr": r.expr}
                    for r in perf_rules.perf_recording_rules(rule_model.Thresholds())
                ],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules_doc, sort_keys=False))
    lost = (3 * (0.05 - 0.01) + (0.35 - 0.01)) * 2  # seconds per step the others waited, 2 steps a second
    step_seconds = 0.4 * len(waits) + 0.4 + 0.1  # summed over the ranks
    shares = {
        role: round(part * sum(waits.values()) / step_seconds, 6)
        for role, part in (("world", 0.8), ("tp", 0.2))
    }
    test = PROMTOOL_TEST.format(
        series="\n".join(lines),
        lost=f"{lost:g}",
        classes="\n".join(classes),
        tp_share=f"{shares['tp']:g}",
        world_share=f"{shares['world']:g}",
    )
    (tmp_path / "test.yml").write_text(test)
    done = subprocess.run(
        ["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ranks_that_wait_for_a_peer_share_its_bottleneck():
    """Every rank waits for its input, but only the slowest reader waits in the loader: the others wait for it
    in the all-reduce. Judged without that wait, every rank is input-bound; a rank's own wait is not lost."""
    slowest = rank_record(0, 0.01, data=0.05, compute=0.004)
    early = rank_record(1, 0.05, data=0.01, compute=0.004)
    records = {0: slowest, 1: early}
    least = perf.least_wait(records)
    assert least == pytest.approx(0.01)
    assert perf.classify(early, POLICY) == "communication_bound"
    assert perf.classify(early, POLICY, least) == perf.classify(slowest, POLICY, least) == "input_bound"
    assert perf.perf_view(records)[0]["bottleneck"] == "input_bound"


def test_a_rank_that_mostly_waits_for_the_last_arriver_takes_its_class_in_flare_perf():
    """As the recording rules do: rank 1 waits 0.35 s of its 0.5 s step for rank 0 (compute-bound, the last
    to arrive); by its own step, the wait lowered to rank 0's, it would be input-bound."""
    pacer = rank_record(0, 0.01, compute=0.4)
    waiting = rank_record(1, 0.35, data=0.1, compute=0.05)
    least = perf.least_wait({0: pacer, 1: waiting})
    assert perf.classify(waiting, POLICY, least) == "input_bound"
    assert perf.waits_for_pacer(waiting, POLICY, least) and not perf.waits_for_pacer(pacer, POLICY, least)
    rows = {row["rank"]: row for row in perf.perf_view({0: pacer, 1: waiting})[0]["ranks"]}
    assert [rows[r]["bottleneck"] for r in (0, 1)] == ["compute_bound", "compute_bound"]
    assert rows[1]["waits_for_last_arriver"] and not rows[0]["waits_for_last_arriver"]
