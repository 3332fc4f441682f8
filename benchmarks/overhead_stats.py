"""The overhead benchmark's statistics: medians and their intervals, slices and pairs, summaries, --pool.

Imported by overhead.py, which puts the checkout on sys.path first.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from bisect import bisect_left
from dataclasses import asdict
from pathlib import Path
from typing import Any

from overhead_scraper import ScrapeCounts, Span, scraper_cpu_text

GOAL_RATIO = 1.005
BURNER_THREAD = "burner"  # its thread's name (burner.py)


# ---------------------------------------------------------------------------------------------------------
# medians


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval for the median (order statistics); None if n is too small."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1.0 - confidence) / 2
    below = 0.0
    k = 0  # largest k with P(Binomial(n, 1/2) < k) <= tail
    for j in range(n + 1):
        below += math.comb(n, j) / 2**n
        if below > tail:
            break
        k = j + 1
    if k < 1:
        return None
    return ordered[k - 1], ordered[n - k]


# ---------------------------------------------------------------------------------------------------------
# what the ranks reported


def scrape_cost(step_ends: list[float], rounds: list[Span], warmup: int) -> float | None:
    """Seconds of training that one scrape round cost a rank, measured within one run (so untouched by the
    machine's drift from run to run, unlike the ratio): per round, how much longer than the median step its
    steps that overlapped the round took, minus the same for a placebo round (the round moved halfway to
    the next, where nothing was scraped). The placebo takes out the measure's own bias: a long step is more
    likely to overlap any span than a short one. The ranks step together, so what delays one rank (its
    render, or another's that it waits for in a collective) shows in every rank's steps. `rounds`: wall
    time spans, in order, one after another. None if there is nothing to compare."""
    steps = list(itertools.pairwise(step_ends[warmup:]))
    if not steps or len(rounds) < 2:
        return None
    placebo = [
        (began + (after - began) / 2, ended + (after - began) / 2)
        for (began, ended), (after, _) in itertools.pairwise(rounds)
    ]
    typical = statistics.median(ended - began for began, ended in steps)
    scraped, unscraped = excess(steps, rounds[:-1], typical), excess(steps, placebo, typical)
    return None if scraped is None or unscraped is None else scraped - unscraped


def excess(steps: list[Span], spans: list[Span], typical: float) -> float | None:
    """Per span of `spans` (in order, one after another) that falls within `steps` ((began, ended) each):
    how much longer than `typical` the steps that overlapped a span took, summed. None if none falls."""
    starts = [began for began, _ in spans]
    total = 0.0
    for began, ended in steps:
        last = bisect_left(starts, ended) - 1  # the last span that began before the step ended
        if last >= 0 and spans[last][1] > began:
            total += ended - began - typical
    within = sum(1 for began, ended in spans if steps[0][0] < ended and began < steps[-1][1])
    return total / within if within else None


def process_cpu_per_step(reports: list[dict], warmup: int) -> float:
    """Median over ranks of the whole process's mean CPU per step after the warm-up (every thread)."""
    return statistics.median(statistics.fmean(reported["process_cpu"][warmup:]) for reported in reports)


def threads_cpu_per_step(reports: list[dict]) -> dict[str, float]:
    """Median over ranks of each Python thread's CPU over the training steps, per step."""
    per_thread: dict[str, list[float]] = {}
    for reported in reports:
        for name, seconds in reported.get("threads_cpu", {}).items():
            per_thread.setdefault(name, []).append(seconds / len(reported["step_times"]))
    return {name: statistics.median(values) for name, values in per_thread.items()}


def thread_breakdown(threads_of_runs: list[dict[str, float]]) -> dict[str, float]:
    """Median over the runs with the exporter of each Python thread's CPU per step, busiest first."""
    per_thread: dict[str, list[float]] = {}
    for threads in threads_of_runs:
        for name, seconds in threads.items():
            per_thread.setdefault(name, []).append(seconds)
    medians = {name: statistics.median(values) for name, values in per_thread.items()}
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


# ---------------------------------------------------------------------------------------------------------
# interleaved: slices of both jobs, weighed in pairs


SETTLE_S = 0.2  # after a job resumes, its steps are left out for this long (caches, queued wake-ups)
MIN_SLICE_STEPS = 10  # a slice needs this many whole steps on every rank to count


def slice_steps(report: dict, span: Span, warmup: int) -> tuple[list[float], list[float]]:
    """The step times and training-thread CPU per step of the steps that a rank took wholly within `span`
    (wall time), SETTLE_S after its start excepted, and after its first `warmup` steps."""
    began, ended = span
    times, cpus = [], []
    for index in range(warmup, len(report["step_times"])):
        step_ended, seconds = report["step_ends"][index], report["step_times"][index]
        if began + SETTLE_S <= step_ended - seconds and step_ended <= ended:
            times.append(seconds)
            cpus.append(report["step_cpu"][index])
    return times, cpus


def slice_step_time(reports: list[dict], span: Span, warmup: int) -> tuple[float, float] | None:
    """(step time, training thread's CPU per step) of one job in one slice: the median over ranks of each
    rank's median; None if a rank took fewer than MIN_SLICE_STEPS steps in it."""
    times, cpus = [], []
    for report in reports:
        rank_times, rank_cpus = slice_steps(report, span, warmup)
        if len(rank_times) < MIN_SLICE_STEPS:
            return None
        times.append(statistics.median(rank_times))
        cpus.append(statistics.median(rank_cpus))
    return statistics.median(times), statistics.median(cpus)


def slice_pairs(
    slices: list[tuple[bool, Span]], without: list[dict], with_: list[dict], warmup: int
) -> list[dict]:
    """One pair per slice that lies between two slices of the other job: its step time against the mean of
    theirs (so that a drift of the machine across the three cancels), with the exporter over without, and
    the same for the training thread's CPU per step. Slices of both jobs are weighed so, so that neither job
    is always the one in the middle. `slices`: (with the exporter, wall time span), in order."""
    measured = [
        slice_step_time(with_ if with_exporter else without, span, warmup) for with_exporter, span in slices
    ]
    pairs = []
    for index in range(1, len(slices) - 1):
        before, this, after = measured[index - 1 : index + 2]
        with_exporter = slices[index][0]
        if slices[index - 1][0] == with_exporter or slices[index + 1][0] == with_exporter:
            continue
        if before is None or this is None or after is None:
            continue
        around = ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
        with_times, without_times = (this, around) if with_exporter else (around, this)
        pairs.append(
            {
                "slice": index,
                "step_time_without": without_times[0],
                "step_time_with": with_times[0],
                "ratio": with_times[0] / without_times[0],
                "thread_cpu_ratio": with_times[1] / without_times[1],
            }
        )
    return pairs


# ---------------------------------------------------------------------------------------------------------
# summaries


def sequential_summary(
    pairs: list[dict], scrapes: ScrapeCounts, retried: list[str], scrape_interval: float
) -> dict[str, object]:
    """Print the summary of pairs run one job after the other (no --interleave) and return it."""
    ratios = [p["ratio"] for p in pairs]
    without_times = [p["without"]["step_time"] for p in pairs]
    with_times = [p["with"]["step_time"] for p in pairs]
    median_ratio = statistics.median(ratios)
    ci = median_ci(ratios)
    print("summary:")
    for side, times in (("without exporter:", without_times), ("with exporter:   ", with_times)):
        print(f"  step time {side} median {statistics.median(times) * 1e3:.3f} ms over {len(times)} runs")
    ci_text = f", 95% CI of the median [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
    print(
        f"  ratio with/without: median {median_ratio:.4f} over {len(ratios)} pairs "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}{ci_text})"
    )
    print(
        f"  scrapes: {scrapes.done} done ({scrapes.during_training} while training), "
        f"{scrapes.failed} failed "
        f"(not counted: {scrapes.startup} refused before a rank's endpoint was up, "
        f"{scrapes.shutdown} after a rank's training ended); {scraper_cpu_text(scrapes)}"
    )
    cost = scrape_round_cost(pairs, scrape_interval)
    _print_process_cpu(pairs)
    cpu_ratios = cpu_per_step_ratios(pairs)
    threads = thread_breakdown([pair["with"]["threads_cpu"] for pair in pairs])
    print(
        "  CPU per step of each Python thread, with the exporter (median over runs; all steps): "
        + ", ".join(f"{name} {seconds * 1e6:.1f} us" for name, seconds in threads.items())
    )
    if scrapes.never_answered:
        print(f"  WARNING: {len(scrapes.never_answered)} rank-runs never answered a scrape")
    for failure in scrapes.failures:
        print(f"  scrape failure: {failure}")
    _print_retried(retried)
    print(f"  goal: median ratio <= {GOAL_RATIO}: {_verdict(median_ratio, ci)}")
    return {
        "median_step_time_without": statistics.median(without_times),
        "median_step_time_with": statistics.median(with_times),
        "median_ratio": median_ratio,
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_ratio_ci95": list(ci) if ci else None,
        "threads_cpu_with": threads,
        "scrape_cost_s": cost,
        "goal_ratio": GOAL_RATIO,
        "goal_met": median_ratio <= GOAL_RATIO,
        "scrapes": asdict(scrapes),
        "cpu_per_step": cpu_ratios,
        "retried": retried,
    }


def scrape_round_cost(pairs: list[dict], scrape_interval: float) -> float | None:
    """The median over the runs with the exporter of what one scrape round cost the training, printed with
    its share of a run at a round every `scrape_interval`; None without scrapes."""
    costs = [p["with"]["scrape_cost_s"] for p in pairs if p["with"]["scrape_cost_s"] is not None]
    if not costs:
        return None
    cost = statistics.median(costs)
    print(
        f"  training time one scrape round cost (steps overlapping a round, against a placebo round): "
        f"median {cost * 1e3:.2f} ms over {len(costs)} runs (min {min(costs) * 1e3:.2f}, max "
        f"{max(costs) * 1e3:.2f}); a round every {scrape_interval:g} s makes that "
        f"{cost / scrape_interval:.2%} of the run"
    )
    return cost


def _print_process_cpu(pairs: list[dict]) -> None:
    """Print each side's median CPU time per rank process, start-up and exit included."""
    cpu_without = statistics.median(p["without"]["cpu_s"] for p in pairs)
    cpu_with = statistics.median(p["with"]["cpu_s"] for p in pairs)
    print(
        f"  CPU time per rank process (user + system, start-up and exit included): median "
        f"{cpu_without:.2f} s without, {cpu_with:.2f} s with ({cpu_with - cpu_without:+.2f} s)"
    )


def cpu_per_step_ratios(pairs: list[dict]) -> dict[str, dict[str, Any]]:
    """The training thread's and the whole process's CPU per step, with / without: their medians and the
    median ratio with its interval, each printed."""
    cpu_ratios = {}
    for key, what in (
        ("thread_cpu", "training thread's CPU per step"),
        ("process_cpu", "whole process's CPU per step (every thread)"),
    ):
        values = [p[f"{key}_ratio"] for p in pairs]
        interval = median_ci(values)
        cpu_ratios[key] = found = {
            "median_without": statistics.median(p["without"][key] for p in pairs),
            "median_with": statistics.median(p["with"][key] for p in pairs),
            "median_ratio": statistics.median(values),
            "median_ratio_ci95": list(interval) if interval else None,
        }
        interval_text = f", 95% CI [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""
        print(
            f"  {what}: median {found['median_without'] * 1e6:.1f} us without, "
            f"{found['median_with'] * 1e6:.1f} us with; "
            f"ratio median {found['median_ratio']:.4f}{interval_text}"
        )
    return cpu_ratios


def _print_retried(retried: list[str]) -> None:
    """Print how many runs were retried after a rank crashed while exiting, by side."""
    if retried:
        without_count = sum("without exporter" in message for message in retried)
        print(
            f"  runs retried after a rank crashed while exiting: {len(retried)} "
            f"({without_count} without the exporter, {len(retried) - without_count} with it)"
        )


def interleaved_summary(pairs: list[dict], scrapes: ScrapeCounts, placebo: bool) -> dict[str, object]:
    """Print the summary of interleaved pairs (one run's, or several runs' pooled) and return it."""
    ratios = [pair["ratio"] for pair in pairs]
    cpu_ratios = [pair["thread_cpu_ratio"] for pair in pairs]
    median_ratio, ci, cpu_ci = statistics.median(ratios), median_ci(ratios), median_ci(cpu_ratios)
    ci_text = f", 95% CI of the median [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
    cpu_ci_text = f", 95% CI [{cpu_ci[0]:.4f}, {cpu_ci[1]:.4f}]" if cpu_ci else ""
    print("summary:")
    print(
        f"  ratio with/without: median {median_ratio:.4f} over {len(ratios)} pairs "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}{ci_text}); "
        f"{sum(len(pair['slices']) for pair in pairs)} slices with the exporter weighed in all"
    )
    print(
        f"  training thread's CPU per step, with/without: median {statistics.median(cpu_ratios):.4f}"
        f"{cpu_ci_text}"
    )
    if scrapes.attempts:
        print(f"  scrapes: {scrapes.done} done, {scrapes.failed} failed; {scraper_cpu_text(scrapes)}")
    for failure in scrapes.failures:
        print(f"  scrape failure: {failure}")
    accounting = exporter_cpu_accounting(pairs)
    if accounting is not None:
        print(f"  {accounting_text(accounting)}")
    print(f"  goal: median ratio <= {GOAL_RATIO}: {_verdict(median_ratio, ci)}")
    return {
        "median_ratio": median_ratio,
        "median_ratio_ci95": list(ci) if ci else None,
        "thread_cpu_median_ratio": statistics.median(cpu_ratios),
        "thread_cpu_ratio_ci95": list(cpu_ci) if cpu_ci else None,
        "scrapes": asdict(scrapes),
        "exporter_cpu": accounting,
        "goal_ratio": GOAL_RATIO,
        "goal_met": median_ratio <= GOAL_RATIO,
        "placebo": placebo,
    }


def exporter_threads(threads: dict[str, float]) -> dict[str, float]:
    """The exporter's own threads (flare-*) of a thread breakdown, or the burner that stands in for them in a
    placebo (--burn)."""
    return {name: s for name, s in threads.items() if name.startswith("flare-") or name == BURNER_THREAD}


def scrape_cpu(reports: list[dict], rounds: int) -> float | None:
    """Median over ranks of the endpoint thread's CPU per scrape (each round scrapes every rank once)."""
    if not rounds:
        return None
    return statistics.median(r.get("threads_cpu", {}).get("flare-http", 0.0) / rounds for r in reports)


def exporter_cpu_accounting(pairs: list[dict]) -> dict[str, Any] | None:
    """What the exporter's own threads cost per step, against a rank's CPU per step without the exporter:
    on a machine whose cores the ranks fill, about that share of the step time is theirs alone (the
    training thread's own extra CPU comes on top). None without the exporter (placebo)."""
    threads = thread_breakdown([pair["exporter_threads_cpu"] for pair in pairs])
    if not threads:
        return None
    total = sum(threads.values())
    process_without = statistics.median(pair["process_cpu_without"] for pair in pairs)
    scrapes = [pair["scrape_cpu"] for pair in pairs if pair.get("scrape_cpu") is not None]
    return {
        "threads_per_step": threads,
        "total_per_step": total,
        "process_cpu_without": process_without,
        "share": total / process_without,
        "scrape_cpu": statistics.median(scrapes) if scrapes else None,
    }


def accounting_text(accounting: dict[str, Any]) -> str:
    """exporter_cpu_accounting's summary line."""
    scrape = accounting["scrape_cpu"]
    per_scrape = f" ({scrape * 1e3:.2f} ms a scrape)" if scrape else ""
    parts = [
        f"{name} {seconds * 1e6:.1f} us" + (per_scrape if name == "flare-http" else "")
        for name, seconds in accounting["threads_per_step"].items()
    ]
    return (
        f"the exporter's own threads, CPU per step (median over pairs): {', '.join(parts)}: "
        f"{accounting['total_per_step'] * 1e6:.1f} us, {accounting['share']:.2%} of a rank process's CPU per "
        f"step without the exporter ({accounting['process_cpu_without'] * 1e3:.2f} ms); where the ranks fill "
        "the cores, that share of the step time is theirs, before the training thread's own"
    )


def _verdict(median_ratio: float, ci: tuple[float, float] | None) -> str:
    verdict = "met" if median_ratio <= GOAL_RATIO else "NOT met"
    if ci and ci[0] <= GOAL_RATIO < ci[1]:
        verdict += " (the goal lies inside the confidence interval: noise-limited, add --steps or --pairs)"
    return verdict


# ---------------------------------------------------------------------------------------------------------
# pooling runs


class PoolError(Exception):
    """A results file that cannot be pooled with the others."""


POOLED_KEYS = ("machine", "config", "flare_env", "code")  # what every pooled run must share


def pool(paths: list[Path], default_config: dict[str, object]) -> dict[str, object]:
    """The interleaved pairs of several runs (their --json files) as one sample: runs of the same job, the
    same code and the same machine, measured at different times, whose pairs together give the median a
    narrower interval than any one run's. Every run given counts: pool all the runs of the code, not the
    ones that came out well. `default_config`: a run's config with every setting at its default."""
    runs = [_pooled_run(path) for path in paths]
    first = {key: _pooled_value(runs[0], key, default_config) for key in POOLED_KEYS}
    for path, run in zip(paths[1:], runs[1:], strict=True):
        for key in POOLED_KEYS:
            ours = _pooled_value(run, key, default_config)
            if ours != first[key]:
                raise PoolError(
                    f"{path}: its {key} ({ours}) is not {paths[0]}'s ({first[key]}): only runs of the same "
                    "job, code and machine pool"
                )
    print(f"pooled: {len(runs)} runs of the same job (code {first['code'] or 'not recorded'})")
    pairs: list[dict] = []
    scrapes = ScrapeCounts()
    for path, run in zip(paths, runs, strict=True):
        summary = run["interleaved"]["summary"]
        print(
            f"  {path}: {run.get('date', '?')} (revision {run.get('revision') or '?'}), "
            f"{len(run['interleaved']['pairs'])} pairs, median {summary['median_ratio']:.4f}"
        )
        pairs += run["interleaved"]["pairs"]
        scrapes.add(ScrapeCounts(**summary["scrapes"]))
    return {
        "pooled": {
            "runs": [str(path) for path in paths],
            "summary": interleaved_summary(pairs, scrapes, first["config"]["placebo"]),
        }
    }


def _pooled_run(path: Path) -> dict[str, Any]:
    try:
        run = json.loads(path.read_text())
        pairs = run["interleaved"]["pairs"]
        if not pairs or not all(isinstance(pair["ratio"], float) for pair in pairs):
            raise PoolError(f"{path}: no interleaved pairs")
        return run
    except OSError as error:
        raise PoolError(f"{path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise PoolError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
    except (KeyError, TypeError):
        raise PoolError(
            f"{path}: not the results of an interleaved run (overhead.py --interleave S --json)"
        ) from None


def _pooled_value(run: dict[str, Any], key: str, default_config: dict[str, object]) -> Any:
    value = run.get(key)
    if key == "config":
        # how many pairs each run took does not matter; a setting a run did not record was the default
        value = {**default_config, **(value or {})}
        del value["pairs"]
    return value
