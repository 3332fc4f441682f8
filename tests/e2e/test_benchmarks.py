"""The benchmarks' own checks, on runs too small to measure anything: they must keep working."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import socket
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


def test_overhead_rejects_a_placebo_without_turns():
    done = run_benchmark("overhead.py", "--placebo")
    assert done.returncode == 2 and "--placebo needs --interleave" in done.stderr


def interleaved_results(ratios: list[float], **config: object) -> dict:
    """What `overhead.py --interleave S --json OUT` writes, for pairs of these ratios."""
    pairs = [
        {
            "pair": number,
            "slices": [{"ratio": ratio}],
            "ratio": ratio,
            "thread_cpu_ratio": ratio,
            "process_cpu_without": 0.005,
            "exporter_threads_cpu": {"flare-http": 2e-5},
            "scrape_cpu": 0.0015,
        }
        for number, ratio in enumerate(ratios, 1)
    ]
    settings = {"pairs": len(ratios), "ranks": 4, "steps": 2000, "warmup": 50, "batch": 64, "interleave": 2.0}
    scrapes = {"done": 100, "attempts": 100}
    return {
        "date": "2026-12-04T00:00:00+00:00",
        "machine": {"cpus": 2, "torch": "2.13.0+cpu"},
        "config": {**settings, **config},
        "flare_env": {},
        "revision": "6dfc5a9",
        "code": "c0de",
        "interleaved": {"pairs": pairs, "summary": {"median_ratio": sorted(ratios)[1], "scrapes": scrapes}},
    }


def write_results(tmp_path: Path, name: str, results: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(results))
    return str(path)


def test_overhead_pools_the_pairs_of_runs_of_the_same_job_and_code(tmp_path, capsys):
    from overhead import main

    first = write_results(tmp_path, "first.json", interleaved_results([1.00, 1.01, 1.02]))
    second = write_results(tmp_path, "second.json", interleaved_results([0.99, 1.03, 1.04]))
    out = tmp_path / "pooled.json"
    assert main(["--pool", first, second, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["pooled"]["summary"]
    # the median of all six pairs, not of the runs' medians (1.01, 1.03) nor of either run
    assert summary["median_ratio"] == pytest.approx(1.015) and summary["scrapes"]["done"] == 200
    printed = capsys.readouterr().out
    assert "2 runs of the same job (code c0de)" in printed and "over 6 pairs" in printed


def test_overhead_pools_runs_of_the_same_code_from_different_commits(tmp_path, capsys):
    from overhead import main

    first = write_results(tmp_path, "first.json", interleaved_results([1.0] * 3))
    later = write_results(tmp_path, "later.json", {**interleaved_results([1.0] * 3), "revision": "0af132b"})
    assert main(["--pool", first, later]) == 0
    assert "(revision 0af132b)" in capsys.readouterr().out


def test_overhead_code_digest_follows_the_code_a_run_executes_and_nothing_else(tmp_path, monkeypatch):
    import overhead

    def git(*arguments: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *arguments], check=True, capture_output=True)

    for path in (
        "flare_exporter/rank/attach.py",
        "benchmarks/overhead.py",
        "benchmarks/overhead_stats.py",
        "benchmarks/other.py",
        "README.md",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"# {path}\n")
    script = tmp_path / "train.py"
    script.write_text("print('step')\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    monkeypatch.setattr(overhead, "REPO", tmp_path)
    digest = overhead.code_digest(script)
    assert digest is not None

    (tmp_path / "README.md").write_text("notes\n")  # not run: the same code
    (tmp_path / "benchmarks/other.py").write_text("# another benchmark\n")
    assert overhead.code_digest(script) == digest
    for changed in (
        "flare_exporter/rank/attach.py",
        "benchmarks/overhead.py",
        "benchmarks/overhead_stats.py",  # the benchmark's own modules run too
        "flare_exporter/new.py",
        "train.py",
    ):
        before = (tmp_path / changed).read_text() if (tmp_path / changed).exists() else None
        (tmp_path / changed).write_text("# changed, not committed\n")
        assert overhead.code_digest(script) != digest, changed
        if before is None:
            (tmp_path / changed).unlink()
        else:
            (tmp_path / changed).write_text(before)
    assert overhead.code_digest(script) == digest


@pytest.mark.parametrize(
    "second, differs",
    [
        (interleaved_results([1.0] * 3, steps=500), "config"),
        (interleaved_results([1.0] * 3, control="loaded"), "config"),  # the first recorded none: plain
        ({**interleaved_results([1.0] * 3), "code": "0ther"}, "code"),
        ({**interleaved_results([1.0] * 3), "flare_env": {"FLARE_GPU_HEALTH": "false"}}, "flare_env"),
    ],
)
def test_overhead_pools_only_runs_of_the_same_job_code_and_machine(tmp_path, capsys, second, differs):
    from overhead import main

    first = write_results(tmp_path, "first.json", interleaved_results([1.0] * 3))
    second_path = write_results(tmp_path, "second.json", second)
    assert main(["--pool", first, second_path]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith(f"overhead: error: {second_path}: its {differs} (")


def test_overhead_counts_a_setting_an_older_run_did_not_record_as_its_default(tmp_path):
    from overhead import main

    older = write_results(tmp_path, "older.json", interleaved_results([1.0] * 3))  # before --control
    plain = write_results(tmp_path, "plain.json", interleaved_results([1.0] * 3, control="plain"))
    assert main(["--pool", older, plain]) == 0


@pytest.mark.parametrize(
    "text, says",
    [("{", "not JSON"), ('{"pairs": []}', "not the results of an interleaved run"), (None, "cannot read it")],
)
def test_overhead_refuses_to_pool_what_is_not_an_interleaved_run(tmp_path, capsys, text, says):
    from overhead import main

    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    good = write_results(tmp_path, "good.json", interleaved_results([1.0] * 3))
    assert main(["--pool", good, str(path)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"overhead: error: {path}: {says}")


def test_overhead_rejects_a_placebo_with_a_control():
    done = run_benchmark("overhead.py", "--interleave", "1", "--placebo", "--control", "loaded")
    assert done.returncode == 2 and "--placebo runs both jobs as plain scripts" in done.stderr


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["--burn", "0.01"], "--burn needs --placebo"),
        (["--placebo", "--burn", "1.5"], "--burn must be a share of a rank's CPU"),
        (["--placebo", "--burn", "-0.1"], "--burn must be a share of a rank's CPU"),
        (["--placebo", "--burn-in", "interpreter"], "--burn-in says how --burn burns: give --burn too"),
    ],
)
def test_overhead_burns_only_a_share_and_only_in_a_placebo(arguments, says):
    done = run_benchmark("overhead.py", "--interleave", "1", *arguments)
    assert done.returncode == 2 and says in done.stderr


BURN_PROBE = """
import json, sys, threading, time
# the training thread's own work, in Python (it holds the GIL), until the process has used 2.6 s of CPU
while time.process_time() < 2.6:
    sum(range(1000))
burner = next(t for t in threading.enumerate() if t.name == "burner")
burned = time.clock_gettime(time.pthread_getcpuclockid(burner.ident))
print(json.dumps({"name": __name__, "argv": sys.argv, "orig_argv": sys.orig_argv, "burned": burned,
                  "process": time.process_time()}))
"""


@pytest.mark.parametrize("burn_in", ["cores", "interpreter"])
def test_a_burning_job_spends_its_share_of_each_ranks_cpu_beside_the_script(tmp_path, burn_in):
    # the side "with" of a placebo that burns: the script runs as __main__ beside the burner thread, which
    # has spent its share of the process's CPU at its bursts (every second: at 1 s and 2 s of 2.6), though
    # the script's thread holds the GIL whenever it can
    from overhead import parse_args
    from overhead_jobs import start_job

    script = tmp_path / "probe.py"
    script.write_text(BURN_PROBE)
    args = parse_args(["--ranks", "1", "--script", str(script), "--interleave", "1", "--placebo"])
    args.burn_in = burn_in
    job = start_job(args, False, tmp_path / "job", "probe", burn=0.05)
    try:
        assert job.procs[0].wait(timeout=120) == 0, (tmp_path / "job" / "stderr0.log").read_text()[-2000:]
    finally:
        job.kill()
    seen = json.loads((tmp_path / "job" / "stdout0.log").read_text().strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"][0] == str(script)
    assert ("--interpreter" in seen["orig_argv"]) == (burn_in == "interpreter")  # the burner got the mode
    assert 0.025 < seen["burned"] / seen["process"] <= 0.05 + 0.005  # its share, not more


def test_a_placebo_that_burns_reports_the_burners_cpu_as_the_exporters_would_be(tmp_path):
    done, results = run_to_json(
        tmp_path,
        "overhead.py",
        *("--pairs", "1", "--ranks", "2", "--steps", "400", "--warmup", "10"),
        *("--interleave", "0.5", "--placebo", "--burn", "0.01"),
    )
    assert results["config"]["burn"] == 0.01
    assert "the side 'with' burns 1.00% of each rank's CPU" in done.stdout
    accounting = results["interleaved"]["summary"]["exporter_cpu"]
    assert list(accounting["threads_per_step"]) == ["burner"] and 0 < accounting["share"] < 0.02
    from overhead import code_digest

    script = REPO / "flare_exporter/local/workloads/train_ddp.py"
    assert results["code"] == code_digest(script, REPO / "benchmarks/burner.py") != code_digest(script)


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


def test_overhead_weighs_each_scraped_run_against_its_scrape_rounds(tmp_path):
    done, results = run_to_json(
        tmp_path,
        "overhead.py",
        *("--pairs", "1", "--ranks", "2", "--steps", "150", "--warmup", "10", "--scrape-interval", "0.1"),
        *("--control", "loaded"),  # the side without runs benchmarks/loaded.py
    )
    assert results["config"]["control"] == "loaded" and "flare's code loaded, nothing attached" in done.stdout
    (pair,) = results["pairs"]
    # the ranks reported when each step ended and the scraper its rounds: a cost, whatever its sign
    assert isinstance(pair["with"]["scrape_cost_s"], float) and pair["without"]["scrape_cost_s"] is None
    assert results["summary"]["scrape_cost_s"] == pair["with"]["scrape_cost_s"]
    assert "training time one scrape round cost" in done.stdout
    # what a sampling window adds to a step: the ops it timed, on the script's model
    assert results["micro"]["ild_window_ops"] >= 20 and "ILD window" in done.stdout


def test_overhead_interleaved_runs_both_jobs_in_turns_and_scrapes_only_the_running_one(tmp_path):
    done, results = run_to_json(
        tmp_path,
        "overhead.py",
        *("--pairs", "2", "--ranks", "2", "--steps", "400", "--warmup", "10"),
        *("--interleave", "0.4", "--scrape-interval", "0.1", "--pin"),
    )
    # the job that starts and runs first alternates: without (A) in odd pairs, with (B) in even ones
    pairs = results["interleaved"]["pairs"]
    assert [pair["first"] for pair in pairs] == ["A", "B"]
    assert [pair["turns"][:2] for pair in pairs] == ["AB", "BA"]
    # each job's ranks start with an environment padded by a length of its own: a layout drawn per job
    from overhead_jobs import LAYOUT_PAD_BYTES

    pads = [pad for pair in pairs for pad in pair["layout_pads"].values()]
    assert all(0 <= pad < LAYOUT_PAD_BYTES for pad in pads) and len(set(pads)) > 1
    # --pin: rank r of both jobs on CPU r (modulo the CPUs there are), as the job line says
    cpus = sorted(os.sched_getaffinity(0))
    pinned = [[cpus[rank % len(cpus)]] for rank in range(2)]
    assert all(pair["rank_cpus"] == {"without": pinned, "with": pinned} for pair in pairs)
    assert results["machine"]["cpu_model"]  # part of the machine that --pool compares
    assert results["config"]["pin"] and f"ranks pinned to CPUs {pinned[0][0]},{pinned[1][0]}" in done.stdout
    # what --pool compares: every setting of the job, and the code measured
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True)
    assert results["revision"].startswith(head.stdout.decode().strip())
    from overhead import code_digest

    assert results["code"] == code_digest(REPO / "flare_exporter/local/workloads/train_ddp.py")
    assert results["config"]["interleave"] == 0.4 and results["config"]["scrape_interval"] == 0.1
    pair = pairs[0]
    assert pair["slices"] and all(
        s["step_time_with"] > 0 and s["step_time_without"] > 0 for s in pair["slices"]
    )
    scrapes = results["interleaved"]["summary"]["scrapes"]
    # the exporter's job answered while it ran, and no scrape waited on it while it was paused
    assert scrapes["done"] > 0 and scrapes["failed"] == 0, scrapes["failures"]
    assert "each pair's two jobs at once, taking turns of 0.4 s" in done.stdout
    # the benchmark's own scraper shares the job's cores: its CPU is reported, as Prometheus's part
    assert scrapes["scraper_cpu_s"] > 0 and "the benchmark's scraper used" in done.stdout
    # the exporter's own threads' CPU, from the ranks' reports: the endpoint's among them, per scrape too
    accounting = results["interleaved"]["summary"]["exporter_cpu"]
    threads = accounting["threads_per_step"]
    assert threads["flare-http"] > 0 and all(name.startswith("flare-") for name in threads)
    assert accounting["total_per_step"] == pytest.approx(sum(threads.values()))
    share = accounting["total_per_step"] / accounting["process_cpu_without"]
    assert 0 < accounting["share"] == pytest.approx(share)
    assert 0 < accounting["scrape_cpu"] < pair["exporter_threads_cpu"]["flare-http"] * 400
    assert "the exporter's own threads, CPU per step" in done.stdout


def steps_ending(durations: list[float], at: float = 100.0) -> list[float]:
    return list(itertools.accumulate(durations, initial=at))[1:]


def test_scrape_cost_is_the_excess_of_the_steps_a_round_overlapped_over_a_placebo():
    from overhead_stats import scrape_cost

    slowed = {10: 0.003, 40: 0.003, 70: 0.004}  # the steps that a round overlaps take longer
    ends = steps_ending([0.010 + slowed.get(step, 0.0) for step in range(100)])
    rounds = [(ends[step - 1] + 0.001, ends[step - 1] + 0.002) for step in slowed]
    # the last round has no placebo (halfway to the next): the first two are weighed against theirs
    assert scrape_cost(ends, rounds, warmup=0) == pytest.approx(0.003)
    assert scrape_cost(ends, rounds, warmup=20) == pytest.approx(0.003)  # the first round is warm-up
    assert scrape_cost(ends, rounds[:1], warmup=0) is None


def test_scrape_cost_of_rounds_that_slow_nothing_is_about_zero():
    """Steps of 5 and 15 ms: a span overlaps the long ones three times as often, which the placebo
    takes out."""
    from overhead_stats import excess, scrape_cost

    ends = steps_ending([0.005, 0.015] * 2000)
    rounds = [(100.0 + k * 0.1371, 100.0 + k * 0.1371 + 0.0005) for k in range(140)]
    steps = list(zip(ends, ends[1:], strict=False))
    assert excess(steps, rounds, typical=0.010) > 0.002  # biased: 0.0025 expected
    assert abs(scrape_cost(ends, rounds, warmup=0)) < 0.0005


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


def report_of(steps: list[tuple[float, float]], cpu: float = 0.001) -> dict:
    """A rank's report from (ended, seconds) per step."""
    return {
        "step_ends": [ended for ended, _ in steps],
        "step_times": [seconds for _, seconds in steps],
        "step_cpu": [cpu] * len(steps),
    }


def steps_in(span: tuple[float, float], seconds: float) -> list[tuple[float, float]]:
    """Steps of `seconds` back to back from the span's start, the last one running past its end."""
    began, ended = span
    count = int((ended - began) / seconds) + 1
    return [(began + (k + 1) * seconds, seconds) for k in range(count)]


def test_a_slice_counts_the_steps_wholly_within_it_once_the_job_has_settled():
    from overhead_stats import SETTLE_S, slice_steps

    assert SETTLE_S == pytest.approx(0.2)  # the numbers below assume it
    steps = [(100.0 + 0.05 * k, 0.05) for k in range(1, 41)]  # steps of 50 ms ending at 100.05 .. 102.0
    steps[25] = (steps[25][0], 0.07)  # began 20 ms before the one before it ended: still counted whole
    span = (100.31, 101.52)
    times, _ = slice_steps(report_of(steps), span, warmup=0)
    # from SETTLE_S in (100.51), the first whole step ends at 100.6 (list index 11), the last at 101.5 (29)
    assert times == [seconds for _, seconds in steps[11:30]] and 0.07 in times
    assert slice_steps(report_of(steps), span, warmup=15)[0] == times[4:]  # list indices 11..14: warm-up


def test_interleaved_pairs_weigh_each_slice_against_the_two_of_the_other_job_around_it():
    from overhead_stats import MIN_SLICE_STEPS, SETTLE_S, slice_pairs

    spans = [(100.0 + 2 * k, 102.0 + 2 * k) for k in range(5)]  # without, with, without, with, without
    slices = [(k % 2 == 1, span) for k, span in enumerate(spans)]
    seconds = {0: 0.010, 1: 0.0125, 2: 0.012, 3: 0.013, 4: 0.014}  # the machine slows down slice by slice
    without = [step for k in (0, 2, 4) for step in steps_in(spans[k], seconds[k])]
    with_ = [step for k in (1, 3) for step in steps_in(spans[k], seconds[k])]
    pairs = slice_pairs(slices, [report_of(without)], [report_of(with_, cpu=0.0011)], warmup=0)
    # the slices without the exporter in the middle count too, with over without all the same
    assert [pair["slice"] for pair in pairs] == [1, 2, 3]
    assert [pair["ratio"] for pair in pairs] == pytest.approx([0.0125 / 0.011, 0.01275 / 0.012, 1.0])
    assert pairs[0]["thread_cpu_ratio"] == pytest.approx(1.1)
    assert pairs[1]["thread_cpu_ratio"] == pytest.approx(1.1)
    # the job with the exporter first (even pairs): the same slices, the roles swapped
    swapped = [(not with_exporter, span) for with_exporter, span in slices]
    mirrored = slice_pairs(swapped, [report_of(with_, cpu=0.0011)], [report_of(without)], warmup=0)
    assert [pair["ratio"] for pair in mirrored] == pytest.approx([1 / pair["ratio"] for pair in pairs])
    # a slice with fewer than MIN_SLICE_STEPS whole steps on a rank counts for nothing
    short = (True, (spans[1][0], spans[1][0] + SETTLE_S + (MIN_SLICE_STEPS - 0.5) * seconds[1]))
    assert slice_pairs([slices[0], short, slices[2]], [report_of(without)], [report_of(with_)], 0) == []


def test_the_two_jobs_of_a_pair_start_with_arguments_of_one_length():
    # an A/A placebo's two jobs differ in nothing else: not even in how long their ranks' arguments are
    # (their --report and --start-after paths lie in these directories)
    from overhead_jobs import JOB_DIRS

    assert len(JOB_DIRS[False]) == len(JOB_DIRS[True]) and JOB_DIRS[False] != JOB_DIRS[True]


ARGV_PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "nvml": os.environ.get("FLARE_NVML_MODULE")}))
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_job_on_the_gpu_gets_the_device_and_width_and_reads_nvml_itself(tmp_path, device):
    # the script is a probe: what a rank was started with, under the launcher, is all that is checked here
    # (the job on a GPU runs in scripts/gpu_check.sh)
    from overhead import parse_args
    from overhead_jobs import start_job

    script = tmp_path / "probe.py"
    script.write_text(ARGV_PROBE)
    args = parse_args(["--ranks", "1", "--script", str(script), "--device", device, "--width", "1024"])
    job = start_job(args, True, tmp_path / "job", "probe")
    try:
        assert job.procs[0].wait(timeout=120) == 0, (tmp_path / "job" / "stderr0.log").read_text()[-2000:]
    finally:
        job.kill()
    seen = json.loads((tmp_path / "job" / "stdout0.log").read_text().strip().splitlines()[-1])
    assert seen["argv"][seen["argv"].index("--width") + 1] == "1024"
    if device == "cuda":
        assert seen["argv"][seen["argv"].index("--device") + 1] == "cuda" and seen["nvml"] is None
    else:  # the CPU job's script is started as before; its GPU health reads the fake NVML
        assert "--device" not in seen["argv"] and seen["nvml"] == "flare_exporter.local.testing.fake_nvml"


def test_overhead_on_the_gpu_needs_a_gpu_for_each_rank():
    done = run_benchmark("overhead.py", "--device", "cuda", "--ranks", "64", "--pairs", "1")
    assert done.returncode == 2 and "\n" not in done.stderr.strip()
    assert "--device cuda with --ranks 64: NCCL takes one rank per GPU" in done.stderr


def serve_answers(answers: list[bytes]) -> tuple[int, list[bytes]]:
    """A loopback server that answers each connection's first request with the next of `answers`, raw, then
    closes it; returns its port and the requests it read."""
    listener = socket.create_server(("127.0.0.1", 0))
    requests: list[bytes] = []

    def serve() -> None:
        with listener:
            for answer in answers:
                connection, _ = listener.accept()
                with connection:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += connection.recv(4096)
                    requests.append(request)
                    connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], requests


def test_the_scraper_asks_as_prometheus_does_and_reads_flares_answers_on_one_kept_connection():
    from overhead_scraper import Scraper
    from prometheus_client import CollectorRegistry, Counter

    from flare_exporter.rank.exposition import MetricsServer

    registry = CollectorRegistry()
    Counter("flare_test_scrapes", "a flare metric", registry=registry).inc()
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        scraper = Scraper(server.port, 1, interval=1.0)
        assert scraper._scrape(0) is None
        first = scraper.connections[0]
        assert [scraper._scrape(0) for _ in range(2)] == [None, None]
        assert first is not None and scraper.connections[0] is first  # kept alive, as Prometheus keeps it
        # an answer other than 200 is named by its status
        scraper.requests[0] = b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n"
        assert scraper._scrape(0) == "HTTP 404"
    finally:
        server.close()

    # the request's bytes, as a server reads them: Prometheus's headers, gzip accepted, and the body
    # decompressed before it is checked for flare_ metrics
    def gzipped(page: bytes) -> bytes:  # as a rank closing its connection after the answer sends it
        body = gzip.compress(page)
        head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Encoding: gzip\r\nContent-Length: %d"
        return head % len(body) + b"\r\n\r\n" + body

    port, requests = serve_answers([gzipped(b"flare_x 1\n"), gzipped(b"other_x 1\n")])
    scraper = Scraper(port, 1, interval=1.0)
    assert scraper._scrape(0) is None and scraper.connections[0] is None
    assert scraper._scrape(0) == "200 without flare_ metrics"
    head = requests[0].decode()
    assert head.startswith("GET /metrics HTTP/1.1\r\n") and "Accept-Encoding: gzip\r\n" in head
    assert "User-Agent: Prometheus/" in head and f"Host: 127.0.0.1:{port}\r\n" in head


@pytest.mark.parametrize(
    "answer, says",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\nflare_x 1\n", "truncated response: 30 bytes missing"),
        (b"HTTP/1.1 200 OK\r\n\r\nflare_x 1\n", "a response without Content-Length"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP response: 'SSH-2.0-OpenSSH'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "a body of 99999999999 bytes, over"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "does not decompress"),
        (b"", "connection closed before a response"),
    ],
)
def test_the_scraper_names_an_answer_that_is_not_a_whole_response(answer, says):
    from overhead_scraper import Scraper

    port, _ = serve_answers([answer])
    scraper = Scraper(port, 1, interval=1.0)
    failure = scraper._scrape(0)
    assert failure is not None and failure.startswith("ScrapeAnswerError: ") and says in failure
    assert scraper.connections[0] is None  # closed: the next attempt opens a new one


def test_an_http_1_0_answer_closes_the_scrapers_connection():
    from overhead_scraper import Scraper

    port, _ = serve_answers([b"HTTP/1.0 200 OK\r\nContent-Length: 10\r\n\r\nflare_x 1\n"])
    scraper = Scraper(port, 1, interval=1.0)
    assert scraper._scrape(0) is None and scraper.connections[0] is None


def test_a_run_whose_rank_crashed_only_while_exiting_is_retried_in_a_new_directory_and_counted(tmp_path):
    # sequential runs and interleaved pairs alike: gloo's teardown sometimes aborts after the last step
    from overhead_jobs import RunError, retrying

    tried: list[Path] = []

    def run(workdir: Path) -> str:
        tried.append(workdir)
        if len(tried) < 3:
            raise RunError(f"rank 0 exited with code -6 after its last step ({len(tried)})", at_exit=True)
        return "measured"

    retried: list[str] = []
    assert retrying(2, retried, run, tmp_path / "pair1") == "measured"
    assert [path.name for path in tried] == ["pair1-1", "pair1-2", "pair1-3"] and len(retried) == 2
    # one retry too many, or a failure before the last step: the benchmark ends
    tried.clear()
    with pytest.raises(RunError, match=r"\(2\)"):
        retrying(1, [], run, tmp_path / "pair2")

    def fails_early(workdir: Path) -> str:
        raise RunError("rank 1 exited with code 1 before its last step")

    with pytest.raises(RunError, match="before its last step"):
        retrying(2, retried, fails_early, tmp_path / "pair3")
    assert len(retried) == 2


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
