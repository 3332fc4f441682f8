"""Time from fault to page: a real gloo job, a real Prometheus evaluating `flare rules`, a real Alertmanager.

    python benchmarks/alert_latency.py [--repeats 3] [--scrape-interval 1] [--hang-seconds 5] [--for 0s]
                                       [--ranks 4] [--json OUT]

Per repeat, two 4-rank runs of the unmodified DDP workload under the launcher (2 ranks per pretend host):

- stuck: rank 1 loops in its own Python code before a collective, from step 15. The fault's time is the
  stuck rank's last heartbeat (flare_heartbeat_timestamp_seconds, read from its endpoint once it stopped
  moving). The page: FlareCollectiveHangCulprit naming rank 1. The hang threshold is part of the delay by
  design, so the delay beyond it is reported too.
- kill: rank 2 is SIGKILLed once every rank has taken 20 steps; the fault's time is the kill. The page:
  FlareRankDown naming rank 2. The ranks linger 60 s after an exception (FLARE_LINGER_SECONDS), as they
  should in production: the survivors that raise then show their exception, and the rank that vanished
  without one is the culprit.

Prometheus scrapes every `--scrape-interval` seconds and evaluates the rules at the same interval; the
rules are `flare rules --for FOR --hang-seconds H --scrape-interval I`; Alertmanager runs
alerts/alertmanager/alertmanager.yml with group_wait and group_interval of one scrape interval and a
webhook receiver in this process (alertmanager_process.AlertingStack). The page's time is its arrival at
the webhook.

Exit status: 0 when every page named the right rank, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from flare_exporter.engine import scrape
from flare_exporter.local.alertmanager import AlertingStack, WebhookReceiver
from flare_exporter.local.jobs import ObservedJob
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp

STUCK_RANK, KILLED_RANK, FAULT_STEP = 1, 2, 15


def start_job(work: str, targets: str, run: str, ranks: int, hang_seconds: float, *args: str) -> ObservedJob:
    env = {
        "FLARE_FILE_SD_DIR": targets,
        "FLARE_HANG_SECONDS": str(hang_seconds),
        "FLARE_STALL_SECONDS": "1",
        # survivors of the killed rank raise; lingering, they show their exception, so that the rank that
        # vanished without one is the culprit (without it every rank looks killed)
        "FLARE_LINGER_SECONDS": "60",
    }
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(ranks)}
    os.makedirs(os.path.join(work, run))
    script_args = ["--steps", "100000", "--step-seconds", "0.02", *args]
    return ObservedJob(
        os.path.join(work, run), train_ddp.__file__, script_args, ranks, run, env=env, rank_env=hosts
    )


def steps_taken(job: ObservedJob) -> list[float]:
    results = scrape.scrape_all(job.targets, timeout=2)
    return [
        (scrape.value(samples, "flare_steps_total") or 0) if isinstance(samples, list) else -1
        for samples in results.values()
    ]


def frozen_heartbeat(target: str) -> float | None:
    """The rank's heartbeat once it stopped moving for a second (the rank is stuck), else None."""
    try:
        first = scrape.value(scrape.scrape(target, timeout=2), "flare_heartbeat_timestamp_seconds")
    except scrape.ScrapeError:  # not serving yet
        return None
    if first is None or time.time() - first < 1.0:
        return None
    return first


def await_page(pages: WebhookReceiver, run: str, alertname: str, rank: int, timeout: float) -> float:
    found = wait_for(
        lambda: pages.alerts(run=run, alertname=alertname, rank=str(rank)), timeout, f"{alertname} of {run}"
    )
    return min(arrived for arrived, _ in found)


def stuck_run(work: str, targets: str, run: str, args: argparse.Namespace, pages: WebhookReceiver) -> dict:
    fault = ["--fault", "stuck", "--fault-rank", str(STUCK_RANK), "--fault-step", str(FAULT_STEP)]
    with start_job(work, targets, run, args.ranks, args.hang_seconds, *fault) as job:
        fault_at = wait_for(lambda: frozen_heartbeat(job.targets[STUCK_RANK]), 120, "the stuck rank")
        paged_at = await_page(pages, run, "FlareCollectiveHangCulprit", STUCK_RANK, 120 + args.hang_seconds)
    return {
        "fault": "stuck",
        "seconds": paged_at - fault_at,
        "beyond_threshold": paged_at - fault_at - args.hang_seconds,
    }


def kill_run(work: str, targets: str, run: str, args: argparse.Namespace, pages: WebhookReceiver) -> dict:
    with start_job(work, targets, run, args.ranks, args.hang_seconds) as job:
        wait_for(lambda: min(steps_taken(job)) >= 20, 120, "every rank to take 20 steps")
        fault_at = time.time()
        os.kill(job.processes[KILLED_RANK].pid, signal.SIGKILL)
        paged_at = await_page(pages, run, "FlareRankDown", KILLED_RANK, 120)
    return {"fault": "kill", "seconds": paged_at - fault_at, "beyond_threshold": paged_at - fault_at}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--scrape-interval", type=int, default=1, help="seconds (also the rule evaluation)")
    parser.add_argument("--hang-seconds", type=float, default=5.0)
    parser.add_argument("--for", dest="for_", default="0s")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.ranks < 4 or args.scrape_interval < 1:
        parser.error("--repeats ≥ 1, --ranks ≥ 4 and --scrape-interval ≥ 1 please")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    interval = f"{args.scrape_interval}s"
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flare-alert-latency-") as work:
        targets = os.path.join(work, "targets")
        os.makedirs(targets)
        stack = AlertingStack(
            os.path.join(work, "alerting"), targets, args.hang_seconds, args.scrape_interval, args.for_
        )
        pages = stack.pages
        try:
            stack.wait_ready()
            for repeat in range(args.repeats):
                for run_fault in (stuck_run, kill_run):
                    result = run_fault(work, targets, f"{run_fault.__name__}-{repeat}", args, pages)
                    print(
                        f"{result['fault']:>5} #{repeat}: page after {result['seconds']:.2f} s "
                        f"({result['beyond_threshold']:.2f} s beyond the threshold)",
                        flush=True,
                    )
                    results.append(result)
        except TimeoutError as error:
            print(f"alert_latency: {error}", file=sys.stderr)
            return 1
        finally:
            stack.stop()
    print(
        f"\nscrape and rule evaluation every {interval}, for: {args.for_}, "
        f"hang threshold {args.hang_seconds:g} s, Alertmanager group_wait {interval}, "
        f"{args.ranks} ranks, {args.repeats} repeats"
    )
    summary = {}
    for fault in ("stuck", "kill"):
        delays = [r["seconds"] for r in results if r["fault"] == fault]
        beyond = [r["beyond_threshold"] for r in results if r["fault"] == fault]
        summary[fault] = {
            "median_seconds": statistics.median(delays),
            "median_beyond_threshold": statistics.median(beyond),
            "max_seconds": max(delays),
        }
        print(
            f"{fault:>5}: median {statistics.median(delays):.2f} s from fault to page "
            f"({statistics.median(beyond):.2f} s beyond the threshold), worst {max(delays):.2f} s"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results, "summary": summary}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
