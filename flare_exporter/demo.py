"""The demo: a 4-rank gloo DDP job with flare-exporter on every rank, scraped by a real Prometheus.

    python -m flare_exporter.demo [--ranks 4] [--steps 600] [--no-prometheus]

Prints, per rank, the step rate and the all-reduce latency that Prometheus (or, without one, a direct
scrape of the ranks) reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from . import promql, scrape
from .local_job import ObservedJob
from .prometheus_process import PrometheusProcess, find_binary, wait_for
from .workloads import train_ddp

# PromQL the summary is made of, over the whole run (the job is short); each gives one series per rank.
STEPS = 'flare_steps_total{run="demo"}'
STEP_RATE = 'flare_step_duration_seconds_count{run="demo"} / flare_step_duration_seconds_sum{run="demo"}'
ALLREDUCE_QUANTILE = (
    "histogram_quantile({q}, sum by (rank, le) "
    '(flare_collective_duration_seconds_bucket{{run="demo", op="allreduce"}}))'
)
ALLREDUCE_MEAN = (
    'sum by (rank) (flare_collective_duration_seconds_sum{run="demo", op="allreduce"})'
    ' / sum by (rank) (flare_collective_duration_seconds_count{run="demo", op="allreduce"})'
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flare-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--no-prometheus", action="store_true", help="scrape the ranks directly instead")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 20:
        parser.error("--ranks must be ≥ 1 and --steps ≥ 20")

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
            (scrape.value(samples, "flare_steps_total") or 0) >= steps  # type: ignore[arg-type]
            for samples in results.values()
        )
        return results if done else None

    results = wait_for(finished, 300, "every rank to finish training")
    lines = [
        "\nread back from the ranks' /metrics:",
        f"{'rank':>4}  {'steps':>6}  {'steps/s':>8}  {'allreduce mean':>14}",
    ]
    for samples in results.values():
        step_count = scrape.value(samples, "flare_step_duration_seconds_count") or 0
        step_sum = scrape.value(samples, "flare_step_duration_seconds_sum") or 0
        count = scrape.value(samples, "flare_collective_duration_seconds_count", op="allreduce") or 0
        total = scrape.value(samples, "flare_collective_duration_seconds_sum", op="allreduce") or 0
        rank_label = scrape.labels_of(samples, "flare_rank_info").get("rank", "?")
        rate = step_count / step_sum if step_sum else 0.0
        lines.append(
            f"{rank_label:>4}  {scrape.value(samples, 'flare_steps_total') or 0:6.0f}  {rate:8.1f}  "
            f"{_ms(total / count if count else None):>14}"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:  # absent, or NaN from an empty window
        return "-"
    return f"{seconds * 1000:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
