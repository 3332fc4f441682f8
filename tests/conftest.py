"""Shared fixtures: a real 4-rank gloo DDP job under the launcher, scraped by a real Prometheus; certificates
made with the openssl command and a basic-auth password, for a secured rank and a secured Prometheus."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from flare_exporter.config import Config
from flare_exporter.engine import cli, promql, scrape
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.state import FlareState

RANKS = 4
STEPS = 40  # past step 32, where the default host-dispatch window (one step in 32) opens


@dataclass
class RunningJob:
    job: ObservedJob
    targets: list[str]
    samples: dict[str, list[scrape.Sample]]  # per target, once training finished and all completed
    prometheus: PrometheusProcess | None
    file_sd_dir: str


@contextlib.contextmanager
def queries_sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every PromQL expression sent to Prometheus (promql.query) while the block runs, in order."""
    sent: list[str] = []
    query = promql.query

    def recorded(base_url: str, expr: str, *args: Any) -> list:
        sent.append(expr)
        return query(base_url, expr, *args)

    monkeypatch.setattr(promql, "query", recorded)
    try:
        yield sent
    finally:
        monkeypatch.setattr(promql, "query", query)


def flare_json(*args: str) -> tuple[int, dict]:
    """`flare ARGS --json`, in this process: its exit code and its JSON ({} if it printed none)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main([*args, "--json"])
    return code, json.loads(out.getvalue()) if out.getvalue() else {}


# Four ranks share this machine's two cores, and one starved of CPU really is a straggler: the healthy-run
# tests of the other verdicts leave straggler verdicts and alerts out. That a light, paced healthy job gets
# none is shown in tests/rank/test_stragglers.py.
STRAGGLER_ALERTS = ("FlareRankStraggler", "FlareJobSlowdown")


def without_stragglers(verdicts: list[dict]) -> list[dict]:
    return [verdict for verdict in verdicts if verdict["kind"] != "straggler"]


def pages_without_stragglers(pages: list[tuple[float, dict]]) -> list[dict]:
    return [alert for _, alert in pages if alert["labels"]["alertname"] not in STRAGGLER_ALERTS]


def await_page(stack: Any, alertname: str, timeout: float = 90, **labels: str) -> list[tuple[float, dict]]:
    """The pages of `alertname` with `labels` that `stack` (an AlertingStack) delivers within `timeout`; on
    a miss, the test fails with what Prometheus holds of the alert: never pending, or pending and reset
    before its `for:` (a signal at its threshold) are different stories."""
    try:
        return wait_for(lambda: stack.pages.alerts(alertname=alertname, **labels), timeout, f"{alertname}")
    except TimeoutError:
        selector = ", ".join([f'alertname="{alertname}"', *(f'{k}="{v}"' for k, v in labels.items())])
        exprs = [f"ALERTS{{{selector}}}", f"count_over_time(ALERTS{{{selector}}}[3m])"]
        view = {expr: stack.prometheus.query(expr) for expr in exprs}
        pytest.fail(f"no {alertname} page in {timeout:.0f} s; Prometheus: {json.dumps(view)[:3000]}")


def training_done(targets: list[str], steps: int) -> dict[str, list[scrape.Sample]] | None:
    """Every rank's samples once it has taken `steps` steps and completed every collective it issued, the
    same number on every rank: after its last step a rank issues the script's closing barrier, and a rank
    scraped just before it would otherwise be one behind a rank scraped once the barrier had completed."""
    results = scrape.scrape_all(targets, timeout=2)
    done, last_issued = {}, set()
    for target, samples in results.items():
        if isinstance(samples, scrape.ScrapeError):
            return None
        issued = scrape.value(samples, "flare_collective_last_issued_seq", group="world")
        completed = scrape.value(samples, "flare_collective_last_completed_seq", group="world")
        if scrape.value(samples, "flare_steps_total") != steps or issued is None or issued != completed:
            return None
        done[target] = samples
        last_issued.add(issued)
    return done if len(last_issued) == 1 else None


@pytest.fixture(scope="session")
def ddp_job(tmp_path_factory: pytest.TempPathFactory):
    """4 ranks of the unmodified DDP script under the launcher; Prometheus (if installed) scrapes them."""
    work = tmp_path_factory.mktemp("ddp_job")
    torch_extension()  # built, so that its gloo groups are recorded in C++ as by default after `make`
    # two ranks per pretend host, named through FLARE_HOST (on a cluster the hostname says it)
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    # paced as real jobs are (every rank starts each step together): flat out, four ranks sharing two cores
    # take turns unevenly, and the one that gets least CPU is a straggler for real. At 20 ms a step one rank
    # that the scheduler kept ~0.7 ms late for three 5-step windows was named (a 3.4 % gap; the rule asks
    # for 3 %): 40 ms leaves a late rank half that share of its step
    args = ["--steps", str(STEPS), "--step-seconds", "0.04"]
    job = ObservedJob(str(work), train_ddp.__file__, args, RANKS, "test-ddp", rank_env=hosts)
    prometheus = None
    if shutil.which("prometheus"):
        prometheus = PrometheusProcess(str(work / "prometheus"), job.file_sd_dir)
    try:
        with job:
            try:
                samples = wait_for(
                    lambda: training_done(job.targets, STEPS), 180, "the ranks to finish training"
                )
                if prometheus is not None:
                    prometheus.wait_ready()
                yield RunningJob(job, job.targets, samples, prometheus, job.file_sd_dir)
            finally:
                job.release()
            codes = job.wait(timeout=60)
            assert codes == [0] * RANKS, "\n".join(job.log_tail(rank) for rank in range(RANKS))
    finally:
        if prometheus is not None:
            prometheus.stop()


def one_rank_env(port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "FLARE_ADDR": "127.0.0.1",
            "FLARE_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    env.update(extra)
    return env


def ild_state(run: str, **overrides: Any) -> FlareState:
    """The state of rank 0 of a one-rank run `run`, with ILD's phases short (warm-up 2 steps, baseline 10,
    windows of 3, 20 samples), a host-dispatch window every step and no GPU health; `overrides`: Config keys.
    Nothing installed (its steps, ILD hooks) yet."""
    settings: dict[str, Any] = dict(
        ild_dispatch_every_steps=1,
        ild_warmup_steps=2,
        ild_baseline_steps=10,
        ild_window_steps=3,
        ild_min_samples=20,
        gpu_health=False,
    )
    settings.update(overrides)
    identity = RankIdentity(rank=0, local_rank=0, world_size=1, run=run, host="h", pid=1)
    return FlareState.create(Config(**settings), identity)


def torch_extension() -> Any:
    """flare's torch extension (cpp_recorder.py), built here if it is not yet, and loaded."""
    from flare_exporter.rank import cpp_recorder

    cpp_recorder.build()
    extension = cpp_recorder.load()
    assert extension is not None, cpp_recorder.load_error
    return extension


@pytest.fixture(params=["stamps", "callback"])
def completion_extension(request: pytest.FixtureRequest) -> Any:
    """Both ways FutureTiming learns of a completion: flare's torch extension, whose C++ callback stamps it
    without the GIL, and (None) a Python callback on the future."""
    return torch_extension() if request.param == "stamps" else None


@pytest.fixture(params=["native", "python"])
def dispatch_timer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both host-dispatch timers: the native RecordFunction observer (built here) and the dispatch mode."""
    from flare_exporter.rank import cpp_recorder

    if request.param == "native":
        torch_extension()
    else:
        monkeypatch.setattr(cpp_recorder, "load", lambda: None)
    return request.param


@pytest.fixture(params=["native", "python"])
def text_format(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both writers of the text format: the extension's (csrc/text_format.cpp, built here) and Python's."""
    from flare_exporter.rank import exposition

    native = torch_extension().render_text if request.param == "native" else None
    monkeypatch.setattr(exposition, "_native_text_format", lambda: native)
    return request.param


# Fixtures that start a real multi-rank job or a real Prometheus: a test that uses one is marked so, and
# `make test-fast` (-m "not multirank and not prometheus") leaves it out.
SLOW_FIXTURES = {"ddp_job": "multirank", "clusters": "prometheus"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in SLOW_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        for skip in item.iter_markers("skipif"):
            if "prometheus" in str(skip.kwargs.get("reason", "")):
                item.add_marker("prometheus")


PASSWORD = "s3cret-scrape"
PASSWORD_HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()  # cheap for tests


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def signed(cwd: Path, name: str, usage: str, san: str) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    (cwd / f"{name}.ext").write_text(
        f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else "")
    )
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cwd = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=flare-test-ca",
            "-days", "2", cwd=cwd)  # fmt: skip
    signed(cwd, "server", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    signed(cwd, "client", "clientAuth", "")
    return cwd
