"""The demo: a 4-rank gloo DDP job with flare-exporter on every rank, scraped by a real Prometheus.

    python -m flare_exporter.local.demo [--ranks 4] [--steps 600] [--no-prometheus]
    python -m flare_exporter.local.demo --fault stuck|mismatch|raise|kill|stop|host [--fault-rank 2]

Prints, per rank, the step rate and the all-reduce latency that Prometheus (or, without one, a direct
scrape of the ranks) reports. With --fault, one rank misbehaves once training is under way, and the demo
prints what `flare diagnose` and `flare ranks` say (two ranks per pretend host, named through FLARE_HOST):

    stuck     the rank loops in its own Python code before a collective
    mismatch  the rank calls broadcast where the others call all_reduce
    raise     the rank raises an exception and dies
    kill      the rank is SIGKILLed;  stop: it is SIGSTOPped (frozen)
    host      both ranks of the fault rank's host are SIGKILLed
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable

from .. import spec
from ..engine import cli, promql, scrape
from .alertmanager import AlertingStack, WebhookReceiver, can_alert
from .jobs import ObservedJob
from .prometheus import PrometheusProcess, find_binary, wait_for
from .workloads import train_ddp

COLLECTIVE_DURATION_SECONDS_BUCKET = spec.series("flare_collective_duration_seconds_bucket")
COLLECTIVE_DURATION_SECONDS_COUNT = spec.series("flare_collective_duration_seconds_count")
COLLECTIVE_DURATION_SECONDS_SUM = spec.series("flare_collective_duration_seconds_sum")
RANK_INFO = spec.series("flare_rank_info")
STEPS_TOTAL = spec.series("flare_steps_total")
STEP_DURATION_SECONDS_COUNT = spec.series("flare_step_duration_seconds_count")
STEP_DURATION_SECONDS_SUM = spec.series("flare_step_duration_seconds_sum")

# PromQL the summary is made of, over the whole run (the job is short); each gives one series per rank.
STEPS = f'{STEPS_TOTAL}{{run="demo"}}'
STEP_RATE = f'{STEP_DURATION_SECONDS_COUNT}{{run="demo"}} / {STEP_DURATION_SECONDS_SUM}{{run="demo"}}'
ALLREDUCE_QUANTILE = (
    "histogram_quantile({q}, sum by (rank, le) "
    f'({COLLECTIVE_DURATION_SECONDS_BUCKET}{{{{run="demo", op="allreduce"}}}}))'
)
ALLREDUCE_MEAN = (
    f'sum by (rank) ({COLLECTIVE_DURATION_SECONDS_SUM}{{run="demo", op="allreduce"}})'
    f' / sum by (rank) ({COLLECTIVE_DURATION_SECONDS_COUNT}{{run="demo", op="allreduce"}})'
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flare-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--no-prometheus", action="store_true", help="scrape the ranks directly instead")
    parser.add_argument("--fault", choices=FAULTS, default=None, help="inject a fault and diagnose it")
    parser.add_argument("--fault-rank", type=int, default=2, help="the rank that misbehaves (default 2)")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 20:
        parser.error("--ranks must be ≥ 1 and --steps ≥ 20")
    if args.fault and not (2 <= args.ranks and 0 <= args.fault_rank < args.ranks):
        parser.error("--fault needs --ranks ≥ 2 and 0 ≤ --fault-rank < --ranks")
    if args.fault:
        return fault_demo(args)

    use_prometheus = not args.no_prometheus and find_binary() is not None
    if not args.no_prometheus and not use_prometheus:
        print("prometheus is not installed: scraping the ranks directly instead")
    with tempfile.TemporaryDirectory(prefix="flare-demo-") as work_dir:
        job = ObservedJob(work_dir, train_ddp.__file__, ["--steps", str(args.steps)], args.ranks, "demo")
        print(f"started {args.ranks} ranks (gloo, DDP), metrics on {job.targets[0]} .. {job.targets[-1]}")
        with job:
            try:
                if use_prometheus:
                    prometheus_dir = os.path.join(work_dir, "prometheus")
                    with PrometheusProcess(prometheus_dir, job.file_sd_dir) as prometheus:
                        print(f"prometheus on {prometheus.url}, finding the ranks through file_sd")
                        summary = summary_from_prometheus(prometheus, args.ranks, args.steps)
                else:
                    summary = summary_from_scrape(job.targets, args.steps)
            except (TimeoutError, RuntimeError, promql.PrometheusError, scrape.ScrapeError) as error:
                print(f"flare-demo: {error}", file=sys.stderr)
                for rank in range(args.ranks):
                    print(f"--- rank {rank} log ---\n{job.log_tail(rank)}", file=sys.stderr)
                return 1
            finally:
                job.release()
            codes = job.wait(timeout=120)
        print(summary)
        if any(codes):
            print(f"flare-demo: ranks exited with codes {codes}", file=sys.stderr)
            return 1
    return 0


FAULTS = ("stuck", "mismatch", "raise", "kill", "stop", "host")
FAULT_ENV = {  # short thresholds, so that the demo shows a hang within seconds
    "FLARE_STALL_SECONDS": "1",
    "FLARE_HANG_SECONDS": "5",
    "FLARE_LINGER_SECONDS": "120",
}


def fault_demo(args: argparse.Namespace) -> int:
    """Run the job, make one rank misbehave after 20 steps, and print what `flare` says."""
    use_prometheus = not args.no_prometheus and find_binary() is not None
    script_fault = args.fault if args.fault in ("stuck", "mismatch", "raise") else "none"
    script_args = ["--steps", "100000", "--step-seconds", "0.02", "--fault", script_fault]
    script_args += ["--fault-rank", str(args.fault_rank), "--fault-step", "20"]
    with tempfile.TemporaryDirectory(prefix="flare-demo-") as work_dir:
        env = dict(FAULT_ENV, FLARE_INCIDENT_DIR=os.path.join(work_dir, "incidents"))
        hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(args.ranks)}
        job = ObservedJob(
            work_dir, train_ddp.__file__, script_args, args.ranks, "demo", env=env, rank_env=hosts
        )
        print(
            f"started {args.ranks} ranks (gloo, DDP, two per pretend host); fault: {args.fault} on rank "
            f"{args.fault_rank}; hang threshold {FAULT_ENV['FLARE_HANG_SECONDS']} s"
        )
        prometheus = stack = None
        try:
            with job:
                if use_prometheus and can_alert():
                    hang_seconds = float(FAULT_ENV["FLARE_HANG_SECONDS"])
                    stack = AlertingStack(os.path.join(work_dir, "alerting"), job.file_sd_dir, hang_seconds)
                    stack.wait_ready()
                    prometheus = stack.prometheus
                    source = ["--prometheus", prometheus.url]
                    print(f"prometheus on {prometheus.url} with `flare rules`, alerts to alertmanager")
                elif use_prometheus:
                    prometheus = PrometheusProcess(os.path.join(work_dir, "prometheus"), job.file_sd_dir)
                    prometheus.wait_ready()
                    source = ["--prometheus", prometheus.url]
                else:
                    source = ["--targets", job.file_sd_dir, "--timeout", "2"]
                wait_for(
                    lambda: _all_stepped(job.targets, 20, prometheus), 180, "every rank to take 20 steps"
                )
                _signal(job, args.fault, args.fault_rank)
                base = [*source, "--run", "demo", "--hang-seconds", FAULT_ENV["FLARE_HANG_SECONDS"]]
                wait_for(SettledVerdicts(base), 120, "flare diagnose to find the fault")
                print(f"\n$ flare ranks {' '.join(base)}")
                cli.main(["ranks", *base])
                print(f"\n$ flare diagnose {' '.join(base)}")
                cli.main(["diagnose", *base])
                if stack is not None:
                    _print_pages(stack.pages)
                incident_dir = env["FLARE_INCIDENT_DIR"]
                wait_for(
                    lambda: os.path.isdir(incident_dir) and os.listdir(incident_dir), 60, "incident files"
                )
                if args.fault == "stop":
                    os.kill(job.processes[args.fault_rank].pid, signal.SIGCONT)
        except (TimeoutError, RuntimeError, promql.PrometheusError) as error:
            print(f"flare-demo: {error}", file=sys.stderr)
            return 1
        finally:
            if stack is not None:
                stack.stop()
            elif prometheus is not None:
                prometheus.stop()
        incidents = (
            sorted(os.listdir(env["FLARE_INCIDENT_DIR"])) if os.path.isdir(env["FLARE_INCIDENT_DIR"]) else []
        )
        print(f"\nincident files left by the ranks after teardown: {', '.join(incidents) or 'none'}")
    return 0


def _print_pages(pages: WebhookReceiver) -> None:
    """The first page Alertmanager delivered for the run, as the engineer on call receives it."""
    delivered = wait_for(lambda: pages.alerts(run="demo"), 60, "Alertmanager to deliver a page")
    print("\npaged by Alertmanager (alerts/alertmanager/alertmanager.yml, rules from `flare rules`):")
    for _, alert in delivered:
        labels = alert["labels"]
        print(f"  [{labels['severity']}] {labels['alertname']}: {alert['annotations']['summary']}")
        print(f"      {alert['annotations']['description']}")


def _all_stepped(targets: list[str], steps: int, prometheus: PrometheusProcess | None) -> bool:
    results = scrape.scrape_all(targets, timeout=2)
    if not all(
        isinstance(samples, list) and (scrape.value(samples, STEPS_TOTAL) or 0) >= steps
        for samples in results.values()
    ):
        return False
    return prometheus is None or len(prometheus.query(f"{STEPS} >= {steps}")) == len(targets)


def _signal(job: ObservedJob, fault: str, rank: int) -> None:
    victims = {"kill": [rank], "stop": [rank], "host": [r for r in range(job.ranks) if r // 2 == rank // 2]}
    for victim in victims.get(fault, []):
        os.kill(job.processes[victim].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)


class SettledVerdicts:
    """A condition for wait_for: true once `flare diagnose <args>` has named the same verdicts (kind and
    ranks) for `seconds`. One scrape that times out on a loaded machine reads as a rank down until the next
    scrape; the demo prints the verdict that stays, not the first blip."""

    def __init__(self, args: list[str], seconds: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.args, self.seconds, self.clock = ["diagnose", *args, "--json"], seconds, clock
        self.verdicts: list[tuple[str, tuple[int, ...]]] = []
        self.since = 0.0

    def __call__(self) -> bool:
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(self.args)
        verdicts = _verdict_names(output.getvalue()) if code == cli.EXIT_ANOMALY else []
        now = self.clock()
        if verdicts != self.verdicts:
            self.verdicts, self.since = verdicts, now
        return bool(verdicts) and now - self.since >= self.seconds


def _verdict_names(answer: str) -> list[tuple[str, tuple[int, ...]]]:
    try:
        verdicts = json.loads(answer).get("verdicts", [])
        return [(verdict["kind"], tuple(verdict["ranks"])) for verdict in verdicts]
    except (ValueError, AttributeError, KeyError, TypeError):
        return []


def summary_from_prometheus(prometheus: PrometheusProcess, ranks: int, steps: int) -> str:
    """Wait until Prometheus has scraped every rank after its last step, then read the summary back."""

    def finished() -> bool:  # the ranks stay up after training until the demo lets them go
        seen = promql.values_by(prometheus.query(STEPS), "rank")
        return len(seen) == ranks and min(seen.values()) >= steps

    wait_for(finished, 300, f"Prometheus to see every rank reach step {steps}")
    step_rate = promql.values_by(prometheus.query(STEP_RATE), "rank")
    mean = promql.values_by(prometheus.query(ALLREDUCE_MEAN), "rank")
    p50 = promql.values_by(prometheus.query(ALLREDUCE_QUANTILE.format(q=0.5)), "rank")
    p99 = promql.values_by(prometheus.query(ALLREDUCE_QUANTILE.format(q=0.99)), "rank")
    lines = [
        f"\nread back from Prometheus ({prometheus.url}), over the whole run:",
        f"{'rank':>4}  {'steps/s':>8}  {'allreduce mean':>14}  {'p50':>9}  {'p99':>9}",
    ]
    for rank in sorted(step_rate, key=int):
        lines.append(
            f"{rank:>4}  {step_rate[rank]:8.1f}  {_ms(mean.get(rank)):>14}  {_ms(p50.get(rank)):>9}  "
            f"{_ms(p99.get(rank)):>9}"
        )
    return "\n".join(lines)


def summary_from_scrape(targets: list[str], steps: int) -> str:
    """Wait until every rank has finished its steps, then summarise their /metrics."""

    def finished() -> dict | None:
        results = scrape.scrape_all(targets, timeout=2)
        if any(isinstance(result, scrape.ScrapeError) for result in results.values()):
            return None
        done = all(
            (scrape.value(samples, STEPS_TOTAL) or 0) >= steps  # type: ignore[arg-type]
            for samples in results.values()
        )
        return results if done else None

    results = wait_for(finished, 300, "every rank to finish training")
    lines = [
        "\nread back from the ranks' /metrics:",
        f"{'rank':>4}  {'steps':>6}  {'steps/s':>8}  {'allreduce mean':>14}",
    ]
    for samples in results.values():
        step_count = scrape.value(samples, STEP_DURATION_SECONDS_COUNT) or 0
        step_sum = scrape.value(samples, STEP_DURATION_SECONDS_SUM) or 0
        count = scrape.value(samples, COLLECTIVE_DURATION_SECONDS_COUNT, op="allreduce") or 0
        total = scrape.value(samples, COLLECTIVE_DURATION_SECONDS_SUM, op="allreduce") or 0
        rank_label = scrape.labels_of(samples, RANK_INFO).get("rank", "?")
        rate = step_count / step_sum if step_sum else 0.0
        lines.append(
            f"{rank_label:>4}  {scrape.value(samples, STEPS_TOTAL) or 0:6.0f}  {rate:8.1f}  "
            f"{_ms(total / count if count else None):>14}"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:  # absent, or NaN from an empty window
        return "-"
    return f"{seconds * 1000:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
