"""The benchmarks' own checks, on runs too small to measure anything: they must keep working."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks' helpers, tested below

pytestmark = pytest.mark.multirank


def run_benchmark(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "benchmarks" / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def run_to_json(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The benchmark run with `args` to completion, and the results it wrote with --json."""
    out = tmp_path / "results.json"
    done = run_benchmark(script, *args, "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(out.read_text())


@pytest.mark.parametrize("recorder", ["cpp", "python"])
def test_collective_path_compares_a_wrapped_group_with_a_plain_one(tmp_path, recorder):
    done, results = run_to_json(
        tmp_path,
        "collective_path.py",
        *("--ranks", "2", "--blocks", "2", "--block-steps", "5", "--warmup", "3", "--recorder", recorder),
    )
    # every step of the wrapped model issued DDP's all-reduce through flare: 3 + 2 * 5 steps per rank, and
    # the collectives DDP issues when it wraps the model; the plain group's were not seen (or the check fails)
    assert results["recorder"] == recorder and len(results["recorded_collectives"]) == 2
    assert all(recorded >= 13 for recorded in results["recorded_collectives"])
    for measure in ("wall", "cpu"):
        assert results[measure]["median_plain"] > 0 and results[measure]["median_wrapped"] > 0
    assert "training thread's CPU per step" in done.stdout


def test_collective_path_rejects_bad_arguments():
    done = run_benchmark("collective_path.py", "--blocks", "0")
    assert done.returncode == 2 and "--blocks must be at least 1" in done.stderr


PROBE = """
import json, sys, threading
import torch.distributed as dist
from torch.optim import optimizer
from flare_exporter.rank import cpp_recorder
print(json.dumps({
    "name": __name__,
    "argv": sys.argv,
    "extension": cpp_recorder._loaded is not None,
    "modules": [m for m in ("prometheus_client", "flare_exporter.rank.attach") if m in sys.modules],
    "threads": [t.name for t in threading.enumerate() if t.name.startswith("flare-")],
    "step_hooks": len(optimizer._global_optimizer_post_hooks),
    "backends": [b for b in dist.Backend.backend_list if b.startswith("flare")],
}))
"""


def test_the_loaded_control_runs_the_script_with_flares_code_loaded_and_nothing_attached(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = run_benchmark("loaded.py", str(script), "--steps", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"] == [str(script), "--steps", "3"]
    assert seen["extension"] and len(seen["modules"]) == 2  # loaded, as under the launcher ...
    assert seen["threads"] == [] and seen["step_hooks"] == 0 and seen["backends"] == []  # ... not attached


def test_instructions_rejects_bad_arguments():
    done = run_benchmark("instructions.py", "--short", "50", "--long", "50")
    assert done.returncode == 2 and "--short (50) must be positive and below --long (50)" in done.stderr


def test_an_instructions_variant_is_a_side_with_the_exporter_and_its_variables_set(capsys):
    from instructions import parse_args

    args = parse_args(
        ["--variant", "perf_off:FLARE_PERF=0", "--variant", "flops:FLARE_PERF_FLOPS_STEP=0,FLARE_X="]
    )
    assert args.variant == [
        ("perf_off", (("FLARE_PERF", "0"),)),
        ("flops", (("FLARE_PERF_FLOPS_STEP", "0"), ("FLARE_X", ""))),
    ]
    for bad in ("with:FLARE_PERF=0", "perf_off:PERF=0", "perf_off"):  # a side's name; not FLARE_*; no pair
        with pytest.raises(SystemExit) as exited:
            parse_args(["--variant", bad])
        assert exited.value.code == 2 and f"{bad!r} is not NAME:FLARE_KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("forbidden", [True, False])
def test_timed_commands_run_flare_byte_compiled_whether_or_not_this_environment_writes_bytecode(forbidden):
    # in a fresh interpreter: installed_env is computed once per process
    probe = (
        "import sys; sys.path.insert(0, 'benchmarks'); import cli_runs, pathlib; "
        "env = cli_runs.installed_env(); prefix = env.get('PYTHONPYCACHEPREFIX'); "
        "print(prefix is not None, 'PYTHONDONTWRITEBYTECODE' in env, "
        "bool(prefix) and any(pathlib.Path(prefix).rglob('cli.cpython-*.pyc')))"
    )
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    if forbidden:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    # where bytecode may not be written, it goes to a directory of the benchmark's, flare's CLI compiled in
    # it before any timed command; elsewhere the environment is left as it is
    assert done.stdout.split() == (["True", "False", "True"] if forbidden else ["False", "False", "False"])


def test_a_rank_scraping_itself_asks_its_own_endpoint_every_n_steps_as_prometheus_does(monkeypatch):
    from flare_exporter.local.jobs import free_port
    from flare_exporter.local.workloads import train_ddp

    seen = []
    status = [200]

    class Endpoint(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's)
            seen.append((self.path, self.headers.get("Accept-Encoding")))
            self.send_response(status[0])
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # the rank's port: FLARE_PORT + LOCAL_RANK, as the exporter binds it
    rank = {"FLARE_PORT": str(server.server_address[1] - 1), "LOCAL_RANK": "1"}
    try:
        env = dict(
            os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        command = [sys.executable, train_ddp.__file__, "--steps", "7", "--scrape-every", "2"]
        done = subprocess.run(command, env=env | rank, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert seen == [("/metrics", "gzip")] * 3  # after steps 2, 4 and 6
        status[0] = 503
        monkeypatch.setenv("FLARE_PORT", rank["FLARE_PORT"])
        monkeypatch.setenv("LOCAL_RANK", rank["LOCAL_RANK"])
        with pytest.raises(RuntimeError, match="HTTP 503"):
            train_ddp.scrape_own_endpoint()
    finally:
        server.shutdown()
        server.server_close()


def test_a_scrapes_instructions_are_the_exporters_threads_beyond_the_unscraped_side_per_scrape():
    from instructions import thread_growth_per_scrape

    # 100 steps between the short and long runs; per step, the training thread 8,000,000 and the exporter's
    # threads 50,000 (thread 2) unscraped; scraped, 1,000 more on the training thread (its GETs) and
    # 40,000 more on the exporter's (thread 3, the renders)
    unscraped = ({1: 0, 2: 0, 3: 0}, {1: 800_000_000, 2: 5_000_000, 3: 0})
    scraped = ({1: 0, 2: 0, 3: 0}, {1: 800_100_000, 2: 5_000_000, 3: 4_000_000})
    growth = thread_growth_per_scrape(unscraped, scraped, scrapes=5)
    scraper = growth.pop(1)
    assert (sum(growth.values()), scraper) == (pytest.approx(800_000), pytest.approx(20_000))


def test_each_threads_growth_per_scrape_is_beyond_the_unscraped_sides_between_short_and_long():
    from instructions import thread_growth_per_scrape

    # (short, long) runs: thread 1 trains, 2 wakes on the clock, 3 serves the scrapes
    unscraped = ({1: 100, 2: 1_000, 3: 10}, {1: 900, 2: 5_000, 3: 10})
    scraped = ({1: 150, 2: 1_200, 3: 4_000}, {1: 990, 2: 4_600, 3: 24_000})
    growth = thread_growth_per_scrape(unscraped, scraped, scrapes=5)
    assert growth == {
        1: pytest.approx((840 - 800) / 5),
        2: pytest.approx((3_400 - 4_000) / 5),
        3: pytest.approx(20_000 / 5),
    }


def test_callgrinds_per_thread_files_give_every_event_of_each_thread(tmp_path):
    from instructions import instructions_of, thread_events

    simulated = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim\n"
    (tmp_path / "cg.42-01").write_text(
        f"version: 1\ncreator: callgrind-3.19.0\n{simulated}fn=main\n0 1 2\n"
        "totals: 8000 2500 450 60 200 50 1 2 3 320 24 58 17\n"
    )
    (tmp_path / "cg.42-02").write_text(f"{simulated}totals: 900 1 2 3 4 5 6 7 8 9 10 11 12\n")
    (tmp_path / "cg.43-01").write_text("events: Ir\ntotals: 5\n")  # another process's
    events = thread_events(tmp_path, 42)
    assert sorted(events) == [1, 2]
    assert events[1] == {
        "Ir": 8000, "Dr": 2500, "Dw": 450, "I1mr": 60, "D1mr": 200, "D1mw": 50, "ILmr": 1, "DLmr": 2,
        "DLmw": 3, "Bc": 320, "Bcm": 24, "Bi": 58, "Bim": 17,
    }  # fmt: skip
    assert instructions_of(events) == {1: 8000, 2: 900}
    assert instructions_of(thread_events(tmp_path, 43)) == {1: 5}  # instructions alone, without --cache-sim


def test_the_training_thread_is_counted_up_to_the_interpreters_exit_and_the_others_whole(tmp_path):
    from instructions import instructions_of, thread_events

    (tmp_path / "cg.42.1-01").write_text("events: Ir\ntotals: 8000\n")  # dumped before Py_FinalizeEx
    (tmp_path / "cg.42-01").write_text("events: Ir\ntotals: 3000\n")  # the exit: its heap's collections
    (tmp_path / "cg.42.1-02").write_text("events: Ir\ntotals: 900\n")
    (tmp_path / "cg.42-02").write_text("events: Ir\ntotals: 100\n")
    (tmp_path / "cg.42-03").write_text("events: Ir\ntotals: 70\n")  # a thread that ended before the exit
    assert instructions_of(thread_events(tmp_path, 42)) == {1: 8000, 2: 1000, 3: 70}


@pytest.mark.skipif(shutil.which("callgrind_annotate") is None, reason="valgrind not installed")
def test_the_training_threads_collector_is_its_instructions_inside_gc_collect_main(tmp_path):
    from instructions import collector_instructions

    (tmp_path / "cg.42.1-01").write_text(
        "version: 1\ncreator: callgrind-3.19.0\npid: 42\nevents: Ir\nob=/lib/libpython3.11.so\n"
        "fl=/b/Modules/gcmodule.c\nfn=gc_collect_main\n0 700\ncfl=/b/Modules/gcmodule.c\n"
        "cfn=visit_reachable\ncalls=3 0\n0 300\nfn=visit_reachable\n0 300\n"
        "fl=/b/Python/ceval.c\nfn=_PyEval_EvalFrameDefault\n0 9000\ntotals: 10000\n"
    )
    assert collector_instructions(tmp_path, 42) == 1000  # its own 700 and the 300 of what it called
    assert collector_instructions(tmp_path, 43) is None  # no file of that process
    (tmp_path / "cg.44.1-01").write_text("not a callgrind file\n")
    assert collector_instructions(tmp_path, 44) is None  # unreadable: no number, not 0


def test_the_training_threads_simulated_events_per_step_weigh_l1_misses_and_mispredictions():
    from instructions import training_events_per_step

    def thread(ir, l1, last_level, mispredicted):  # the misses split over their kinds
        return {
            1: {"Ir": ir, "I1mr": l1 // 2, "D1mr": l1 // 4, "D1mw": l1 // 4, "ILmr": last_level, "DLmr": 0,
                "DLmw": 0, "Bcm": mispredicted // 2, "Bim": mispredicted // 2},
            2: {"Ir": 10**9, "I1mr": 1, "Bcm": 1},  # another thread: not the training thread's
        }  # fmt: skip

    # 10 steps between the runs: per step 8,000 instructions, 400 L1 misses, 2 last-level, 60 mispredicted
    per_step = training_events_per_step(thread(1_000, 40, 0, 0), thread(81_000, 4_040, 20, 600), 10)
    assert per_step["Ir"] == 8_000 and per_step["I1mr"] == 200 and per_step["Bim"] == 30
    assert per_step["CEst"] == 8_000 + 10 * (400 + 60)  # first touches of the last level left out
    # instructions alone (no --cache-sim): no estimate
    assert training_events_per_step({1: {"Ir": 10}}, {1: {"Ir": 70}}, 3) == {"Ir": 20}


def test_overhead_on_the_gpu_needs_a_gpu_for_each_rank():
    done = run_benchmark("overhead.py", "--device", "cuda", "--ranks", "64", "--pairs", "1")
    assert done.returncode == 2 and "\n" not in done.stderr.strip()
    assert "--device cuda with --ranks 64: NCCL takes one rank per GPU" in done.stderr


def test_overhead_runs_pairs_of_one_job_without_and_with_the_exporter_in_alternating_order(tmp_path):
    done, results = run_to_json(
        tmp_path,
        "overhead.py",
        *("--pairs", "2", "--ranks", "2", "--steps", "60", "--warmup", "10", "--scrape-interval", "0.2"),
    )
    pairs = results["pairs"]
    assert [pair["pair"] for pair in pairs] == [1, 2]
    for pair in pairs:
        assert pair["ratio"] == pytest.approx(pair["with"]["step"] / pair["without"]["step"])
        assert pair["without"]["exporter_threads"] == {}  # the plain job has no flare thread
        assert pair["with"]["exporter_threads"]["flare-http"] > 0  # the endpoint answered the scrapes
        assert pair["scrapes"]["done"] > 0 and pair["scrapes"]["failed"] == []
    summary = results["summary"]
    assert summary["ratio"]["median"] == pytest.approx(statistics.median(p["ratio"] for p in pairs))
    assert 0 < summary["exporter_share"] < 1 and summary["scrapes"]["failed"] == 0
    assert "step time with / without over 2 pairs" in done.stdout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_overhead_job_gets_the_launcher_device_and_width_only_where_asked(device):
    from overhead import job, parse_args

    args = parse_args(["--ranks", "2", "--device", device, "--width", "1024"])
    plain, plain_env, no_ports = job(args, with_exporter=False)
    flare, flare_env, ports = job(args, with_exporter=True)
    assert plain[1:] == flare[3:] and flare[1:3] == ["-m", "flare_exporter.launch"]  # the same script
    assert plain[plain.index("--width") + 1] == "1024"
    assert ("--device" in plain) == (device == "cuda")
    assert no_ports == [] and plain_env.get("FLARE_PORT") == os.environ.get("FLARE_PORT")  # nothing to scrape
    assert ports == [int(flare_env["FLARE_PORT"]) + rank for rank in range(2)]
    # on a GPU the exporter reads NVML itself; on CPU a fake one, so that GPU health runs as it would
    fake = flare_env.get("FLARE_NVML_MODULE") == "flare_exporter.local.testing.fake_nvml"
    assert fake == (device == "cpu") and "FLARE_NVML_MODULE" not in plain_env


def test_a_side_of_a_pair_takes_the_ranks_medians_after_the_warmup_and_the_exporters_threads_per_step():
    from overhead import side

    def report(step: float, threads: dict[str, float]) -> dict:
        return {
            "step_times": [1.0] * 2 + [step] * 8,  # two warm-up steps, slower
            "step_cpu": [1.0] * 2 + [step / 2] * 8,
            "process_cpu": [1.0] * 2 + [step] * 8,
            "threads_cpu": threads,
        }

    reports = [report(0.010, {"flare-http": 0.010, "MainThread": 5.0}), report(0.012, {"flare-http": 0.030})]
    figures = side(reports, warmup=2)
    assert figures["step"] == pytest.approx(0.011) and figures["thread_cpu"] == pytest.approx(0.0055)
    assert figures["exporter_threads"] == {"flare-http": pytest.approx(0.002)}  # over 10 steps, median of 2


def test_the_median_interval_needs_enough_pairs_and_holds_the_order_statistics_around_the_median():
    from cli_runs import median_ci

    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 5 values cannot hold a median at 95 %
    assert median_ci([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)  # the 2nd and 9th of 10


def test_overhead_rejects_bad_arguments():
    done = run_benchmark("overhead.py", "--steps", "10", "--warmup", "10")
    assert done.returncode == 2 and "--warmup must be at least 0 and smaller than --steps" in done.stderr


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_post_mortem_names_the_rank_that_raised_first_in_a_run_prometheus_saw_die(tmp_path):
    done, results = run_to_json(
        tmp_path,
        "post_mortem.py",
        *("--ranks", "16", "--repeats", "1", "--scrape-interval", "1", "--healthy-scrapes", "2"),
    )
    # rank 16 * 777 // 1024 raised OutOfMemoryError; the others followed or were stopped by their launcher
    assert results["verdict"]["ranks"] == [12] and results["verdict"]["cause"] == "out_of_memory"
    assert results["summary"]["command_wall"]["n"] == results["summary"]["in_process_wall"]["n"] == 1
    assert "goal: < 1 s of CLI time at 16 ranks: " in done.stdout


def test_direct_scrape_times_each_fault_and_checks_its_verdict(tmp_path):
    done, results = run_to_json(tmp_path, "direct_scrape.py", "--ranks", "16", "--repeats", "1")
    # straggler 16*3//8, hung 16*777//1024, dead 16*5//8, each named in its phase (else exit 1)
    assert results["faults"] == {"straggler": 6, "hang": 12, "dead": 10}
    assert [results["phases"][p]["verdicts"].split(" [")[0] for p in results["phases"]] == [
        "straggler",
        "hang",
        "rank_down",
    ]
    client = results["client_alone"]
    assert 0 < client["http_only"]["median"] < client["with_parse"]["median"]
    assert "goal < 3 s (set at 6,144 ranks) at 16 ranks: PASS" in done.stdout


def test_scale_rejects_bad_arguments():
    done = run_benchmark("scale.py", "--ranks", "8")
    assert done.returncode == 2 and "--ranks >= 16" in done.stderr
    done = run_benchmark("scale.py", "--store", "thanos")
    assert done.returncode == 2 and "invalid choice: 'thanos'" in done.stderr


def post_alerts(url: str, alerts: list[dict]) -> None:
    """An Alertmanager notification of `alerts` (each a dict of labels), POSTed as Alertmanager does."""
    body = json.dumps({"alerts": [{"status": "firing", "labels": labels} for labels in alerts]}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()


def test_scale_fails_on_a_page_naming_another_rank_and_lists_monitoring_pages_apart():
    from types import SimpleNamespace

    from scale import failures, pages_since

    from flare_exporter.local.alertmanager import WebhookReceiver

    receiver = WebhookReceiver()
    try:
        run_labels = {"run": "bench-scale", "severity": "critical"}
        post_alerts(
            receiver.url,
            [
                {**run_labels, "alertname": "FlareRankDown", "rank": "5"},
                {**run_labels, "alertname": "FlareCollectiveHangCulprit", "rank": "7", "group": "world"},
                {**run_labels, "alertname": "FlareCollectiveHangCulprit", "rank": "9", "group": "world"},
                {**run_labels, "alertname": "FlareRankScrapesLate", "rank": "3"},
                {**run_labels, "alertname": "FlareCollectiveHang", "group": "world"},
                {**run_labels, "run": "another", "alertname": "FlareRankDown", "rank": "1"},
            ],
        )
        # the dead phase of a run whose hung rank was 7: its culprit page may still come
        run = SimpleNamespace(
            store=SimpleNamespace(pages=receiver),
            right={("FlareCollectiveHangCulprit", "7"), ("FlareRankDown", "5")},
        )
        pages = pages_since(run, 0.0)
        assert pages["right"] == ["FlareCollectiveHangCulprit[7]", "FlareRankDown[5]"]
        assert list(pages["wrong"]) == ["FlareCollectiveHangCulprit[9]"]
        assert pages["wrong"]["FlareCollectiveHangCulprit[9]"]["labels"]["group"] == "world"
        assert pages["monitoring"] == ["FlareRankScrapesLate[3]"]
        assert pages["without_rank"] == ["FlareCollectiveHang"]
        assert pages_since(run, time.time() + 60)["wrong"] == {}  # delivered before the phase
    finally:
        receiver.stop()
    dead = {"rank": 5, "page_seconds": 9.5, "pages": pages}
    late = {"rank": 5, "page_seconds": None, "pages": {**pages, "wrong": {}}}
    assert failures({"stores": {"prometheus": {"phases": {"dead": dead}}}}) == [
        "prometheus, dead: pages naming another rank: FlareCollectiveHangCulprit[9]"
    ]
    assert failures({"stores": {"victoria-metrics": {"phases": {"dead": late}}}}) == [
        "victoria-metrics, dead: no FlareRankDown page naming rank 5"
    ]


def test_a_vmalert_recording_rules_own_time_is_its_difference_with_the_recording_rule_before_it():
    from scale_stores import slowest_rules

    groups = [
        {
            "rules": [
                {"name": "a", "type": "recording", "evaluationTime": 0.1},
                {"name": "b", "type": "recording", "evaluationTime": 0.5},
                {"name": "c", "type": "recording", "evaluationTime": 0.6},
                {"name": "A", "type": "alerting", "evaluationTime": 0.2},
            ]
        }
    ]
    assert slowest_rules(groups, 2, cumulative_recordings=True) == {"b": 0.4, "A": 0.2}
    assert slowest_rules(groups, 2, cumulative_recordings=False) == {"c": 0.6, "b": 0.5}


def test_after_a_hang_the_virtual_ranks_sequence_numbers_move_on_and_nothing_is_in_flight():
    """The scale benchmark's pages once the hang is over: a rank judged on them is never behind the
    numbers it or its peers served while hung (numbers that went back named hundreds of culprits)."""
    from flare_exporter.engine import scrape
    from flare_exporter.local.testing import virtual_cluster as vc

    pages = vc.render_pages(16, "resumed", 6, 12, resumed_steps=40)

    def issued(page: bytes) -> dict[str, float]:
        samples = scrape.parse(page.decode())
        return {s.labels["group"]: s.value for s in samples if s.name == "flare_collective_last_issued_seq"}

    for rank in range(16):
        hung, resumed = issued(pages.hung[rank]), issued(pages.resumed[rank])
        assert hung.keys() == resumed.keys() and all(resumed[g] > hung[g] for g in hung), (rank, resumed)
        assert b"flare_collective_in_flight_info{" not in pages.resumed[rank]
    assert b"flare_collective_in_flight_info{" in pages.hung[0]  # rank 0 waits in the hung all-reduce


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_rule_cost_measures_every_rule_of_every_group_on_a_quiet_prometheus(tmp_path):
    """rule_cost.py at 16 virtual ranks: each group's cost is the sum of its rules', every rule of flare's
    rules file is asked (the per-rank recordings the dashboards' heatmaps count among them), and some
    rules answer with series: the recorded series they read were there at the time asked."""
    import yaml

    from flare_exporter.mixin import rule_model, rules_render

    out = tmp_path / "cost.json"
    done = run_benchmark(
        "rule_cost.py", "--ranks", "16", "--scrape-interval", "1", "--repeats", "1", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    groups = json.loads(out.read_text())["groups"]
    document = yaml.safe_load(rules_render.render(rule_model.Thresholds()))
    assert set(groups) == {group["name"] for group in document["groups"]}
    for group in document["groups"]:
        measured = groups[group["name"]]
        names = [rule.get("record") or rule["alert"] for rule in group["rules"]]
        assert sorted(rule["rule"] for rule in measured["rules"]) == sorted(names)
        for cost in ("seconds", "cpu_seconds"):
            assert measured[cost] == pytest.approx(sum(rule[cost] for rule in measured["rules"]))
        assert measured["seconds"] > 0 and 0 <= measured["share_of_interval"] < 1
        assert measured["samples"] == sum(rule["samples"] for rule in measured["rules"])
    assert sum(group["cpu_seconds"] for group in groups.values()) > 0  # 10 ms ticks: a small group may read 0
    dashboards = {rule["rule"]: rule["series"] for rule in groups["flare.dashboards"]["rules"]}
    assert dashboards["run:flare_straggler_window_step_seconds_bucket:ranks"] > 0
    assert groups["flare.recording"]["samples"] > 0  # Prometheus's count of the samples the rules read
    assert "costliest rules (CPU, wall):" in done.stdout and "most samples read:" in done.stdout


def test_rule_cost_rejects_bad_arguments():
    done = run_benchmark("rule_cost.py", "--ranks", "4")
    assert done.returncode == 2 and "--ranks must be at least 8" in done.stderr
