"""Previews of the dashboards from real data, and the job that feeds them (`docs/dashboards/`).

    python -m flare_exporter.local.dashboard_preview [--out docs/dashboards/]

Runs a short 4-rank gloo job under the launcher with every signal a dashboard shows: a fake GPU per rank
(fake NVML; rank 1's held at its power cap), kernel launches on the fake device, a short ILD baseline, the
step breakdown with a peak FLOP/s for the MFU, the hardware canary (canary=warn: a preflight, which rank 1's
capped GPU fails, and in-flight checks every CANARY_INTERVAL_STEPS steps), a straggler (rank 1 computes
twice as long from step 20) and, at the end, a hang (rank 2 loops in its own code before a collective),
with a real Prometheus evaluating the rules (hang threshold HANG_SECONDS). Once every panel's query returns
data, each dashboard's panels are queried over the run (query_range, the dashboard's variables filled in as
Grafana would) and drawn in their grid layout with matplotlib into <out>/<uid>.png. The tests use the same
job to run every panel's query (tests/mixin/test_dashboards.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import promql
from ..mixin import dashboards, rule_model, rules_render
from .jobs import ObservedJob
from .prometheus import PrometheusProcess, wait_for
from .workloads import train_ddp

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "dashboards"
RANKS = 4
RUN = "flare-preview"
HANG_SECONDS = 4.0
STRAGGLER_RANK, STUCK_RANK = 1, 2
DETAIL_RANK = STRAGGLER_RANK  # the rank dashboard's rank: slow, then waiting in the hung collective
FAULT_STEP = 120
CANARY_INTERVAL_STEPS = 25  # in flight after steps 25, 50, 75 and 100: before the hang, never at it
JOB_ENV = {
    "FLARE_NVML_MODULE": "flare_exporter.local.testing.fake_nvml",  # a fake GPU per rank
    "FLARE_GPU_HEALTH_INTERVAL_SECONDS": "0.5",
    "FLARE_PERF": "1",
    "FLARE_PEAK_FLOPS": "1e11",  # a CPU core's order of magnitude: an MFU to show
    "FLARE_CANARY": "warn",
    "FLARE_CANARY_RELATIVE_FLOOR": "0.5",  # four ranks on two shared cores: healthy ones are within 0.8
    "FLARE_CANARY_COMPUTE_SECONDS": "0.2",
    "FLARE_CANARY_INTERVAL_STEPS": str(CANARY_INTERVAL_STEPS),
    "FLARE_TIMING_INTERVAL_SECONDS": "0.2",
    "FLARE_ILD_LAUNCH_SAMPLE_EVERY": "1",
    "FLARE_ILD_DISPATCH_EVERY_STEPS": "2",
    "FLARE_ILD_WARMUP_STEPS": "3",
    "FLARE_ILD_BASELINE_STEPS": "30",
    "FLARE_ILD_WINDOW_STEPS": "5",
    "FLARE_STALL_SECONDS": "2",
    "FLARE_HANG_SECONDS": f"{HANG_SECONDS:g}",
}
JOB_ARGS = [
    "--steps",
    "100000",
    "--step-seconds",
    "0.1",
    "--slow-rank",
    str(STRAGGLER_RANK),
    "--slowdown",
    "1.0",
    "--slow-from-step",
    "20",
    "--fault",
    "stuck",
    "--fault-rank",
    str(STUCK_RANK),
    "--fault-step",
    str(FAULT_STEP),
    "--fake-kernels",
    "16",
    "--fake-kernel-seconds",
    "0.001",
]


@dataclass
class FaultyJob:
    job: ObservedJob
    prometheus: PrometheusProcess
    run: str
    started: float


@contextmanager
def faulty_job(work_dir: str, run: str = RUN) -> Iterator[FaultyJob]:
    """The job described above and a Prometheus (1 s scrapes) evaluating the rules for it."""
    thresholds = rule_model.Thresholds(
        hang_seconds=HANG_SECONDS,
        scrape_interval_seconds=1,
        slow_interval="",  # the slow rules at once too
    ).with_for("0s")
    rules_file = os.path.join(work_dir, "flare.rules.yml")
    with open(rules_file, "w") as out:
        out.write(rules_render.render(thresholds))
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    # sw_power_cap on the straggler's GPU: a throttle reason shows, and its canary fails gpu_clock_ok
    hosts[STRAGGLER_RANK]["FLARE_FAKE_NVML_CLOCK_EVENTS"] = "0x4"
    started = time.time()
    os.makedirs(os.path.join(work_dir, "job"), exist_ok=True)
    job = ObservedJob(
        os.path.join(work_dir, "job"), train_ddp.__file__, JOB_ARGS, RANKS, run, env=JOB_ENV, rank_env=hosts
    )
    with (
        job,
        PrometheusProcess(
            os.path.join(work_dir, "prometheus"), job.file_sd_dir, rule_files=[rules_file]
        ) as prometheus,
    ):
        yield FaultyJob(job, prometheus, run, started)


# ---------------------------------------------------------------------------------------------------------
# a panel's query as Grafana runs it


@dataclass(frozen=True)
class Window:
    """The time range of a query, and Grafana's interval variables for it."""

    start: float
    end: float

    @property
    def step(self) -> float:
        return float(max(1, math.ceil((self.end - self.start) / 600)))

    def variables(self, run: str, rank: str, group: str = ".*", **view: str) -> dict[str, str]:
        """Grafana's values of the variables (`view`: $selector and $k, else as Grafana starts them)."""
        scrape = 1  # the test Prometheus scrapes every second
        return {
            **dashboards.VIEW_DEFAULTS,
            **view,
            "run": run,
            "rank": rank,
            "group": group,
            "datasource": "prometheus",
            "__rate_interval": f"{int(max(4 * scrape, self.step + scrape))}s",
            "__interval": f"{int(self.step)}s",
            "__range": f"{max(1, int(self.end - self.start))}s",  # Grafana's is never 0
        }


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]

    def finite(self) -> bool:
        return any(math.isfinite(value) for _, value in self.points)


def evaluate(url: str, expr: str, instant: bool, window: Window) -> list[Series]:
    """The series a panel's query returns over `window` (an instant query: at its end)."""
    if instant:
        return [
            Series(item["metric"], [(float(item["value"][0]), float(item["value"][1]))])
            for item in promql.query(url, expr, at=window.end)
        ]
    return [
        Series(item["metric"], [(float(t), float(v)) for t, v in item["values"]])
        for item in promql.query_range(url, expr, window.start, window.end, window.step)
    ]


def empty_queries(
    url: str,
    queries: Sequence[dashboards.PanelQuery],
    window: Window,
    values: Mapping[str, str],
    finite: bool = True,
) -> list[str]:
    """The queries that return no series (`finite`: no finite value) over `window`, as 'dashboard / panel /
    refId: expr'."""
    empty = []
    for query in queries:
        expr = dashboards.substitute(query.expr, values)
        found = evaluate(url, expr, query.instant, window)
        if not any(series.finite() or not finite for series in found):
            empty.append(f"{query.dashboard} / {query.panel} / {query.ref_id}: {expr}")
    return empty


def await_every_panel(job: FaultyJob, timeout: float = 240.0) -> Window:
    """Wait until every panel's query returns data for the job's run (rank detail: DETAIL_RANK)."""
    empty: list[str] = []

    def all_answer() -> Window | None:
        nonlocal empty
        window = Window(job.started, time.time())
        empty = []
        for uid, queries in _by_dashboard(dashboards.panel_queries()).items():
            rank = str(DETAIL_RANK) if uid == dashboards.RANK_UID else ".*"
            empty += empty_queries(job.prometheus.url, queries, window, window.variables(job.run, rank))
        return window if not empty else None

    try:
        return wait_for(all_answer, timeout, "every panel's query to return data")  # type: ignore[no-any-return]
    except TimeoutError as error:
        raise TimeoutError(f"{error}; still empty:\n" + "\n".join(empty)) from None


def _by_dashboard(queries: Sequence[dashboards.PanelQuery]) -> dict[str, list[dashboards.PanelQuery]]:
    grouped: dict[str, list[dashboards.PanelQuery]] = {}
    for query in queries:
        grouped.setdefault(query.dashboard, []).append(query)
    return grouped


# ---------------------------------------------------------------------------------------------------------
# drawing

ROW_INCHES = 0.42  # one grid row (Grafana: 30 px)
COLUMN_INCHES = 0.75


def draw(model: Mapping[str, Any], url: str, window: Window, values: Mapping[str, str], path: str) -> None:
    """Draw the dashboard's panels in their grid layout into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = model["panels"]
    rows = max(panel["gridPos"]["y"] + panel["gridPos"]["h"] for panel in panels)
    figure = plt.figure(figsize=(24 * COLUMN_INCHES, rows * ROW_INCHES + 0.6), facecolor="#181b1f")
    figure.suptitle(f"{model['title']}  (run {values['run']})", color="white", fontsize=14, x=0.01, ha="left")
    top = 1 - 0.6 / (rows * ROW_INCHES + 0.6)
    for panel in panels:
        grid = panel["gridPos"]
        left, width = grid["x"] / 24, grid["w"] / 24
        height = grid["h"] / rows * top
        bottom = top - (grid["y"] + grid["h"]) / rows * top
        repeat = panel.get("repeat")
        ranks = _ranks(url, values, window) if repeat == "rank" else [values.get("rank", "")]
        for index, rank in enumerate(ranks):
            box = [left + index * width / len(ranks), bottom, width / len(ranks), height]
            axes = figure.add_axes(
                (box[0] + 0.012, box[1] + 0.03 * 8 / rows, box[2] - 0.02, box[3] - 0.07 * 8 / rows)
            )
            local = {**values, "rank": rank} if repeat else dict(values)
            title = dashboards.substitute(panel["title"], local)
            _draw_panel(axes, panel, url, window, local, title)
    figure.savefig(path, dpi=60, facecolor=figure.get_facecolor())
    plt.close(figure)


def _ranks(url: str, values: Mapping[str, str], window: Window) -> list[str]:
    found = promql.query(url, f'group by (rank) (up{{run="{values["run"]}", rank!=""}})', at=window.end)
    return sorted((item["metric"]["rank"] for item in found), key=int)


def _style(axes: Any, title: str) -> None:
    axes.set_facecolor("#111217")
    axes.set_title(title, color="white", fontsize=10, loc="left")
    axes.tick_params(colors="#ccccdc", labelsize=7)
    for spine in axes.spines.values():
        spine.set_color("#2c3235")


def _draw_panel(
    axes: Any, panel: Mapping[str, Any], url: str, window: Window, values: Mapping[str, str], title: str
) -> None:
    """Draw what the panel's queries return over `window` into `axes`, as the panel's kind shows it."""
    _style(axes, title)
    results = _results(panel, url, window, values)
    kind = panel["type"]
    if not results:
        _no_data(axes)
    elif kind == "timeseries":
        _draw_timeseries(axes, panel, results, window)
    elif kind == "heatmap":
        _heatmap(axes, results, window)
    elif kind == "state-timeline":
        _draw_state_timeline(axes, panel, results, window)
    elif kind in ("stat", "gauge", "bargauge"):
        _draw_last_values(axes, panel, results)
    elif kind == "table":
        _draw_table(axes, panel, results)


def _results(
    panel: Mapping[str, Any], url: str, window: Window, values: Mapping[str, str]
) -> list[tuple[str, Series]]:
    """Every series the panel's queries return, each with its legend."""
    results: list[tuple[str, Series]] = []
    for target in panel["targets"]:
        expr = dashboards.substitute(target["expr"], values)
        for series in evaluate(url, expr, bool(target.get("instant")), window):
            results.append((_legend(target.get("legendFormat", ""), series.labels), series))
    return results


def _unit(panel: Mapping[str, Any]) -> str:
    return str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))


def _hide_ticks(axes: Any) -> None:
    axes.set_xticks([])
    axes.set_yticks([])


def _no_data(axes: Any) -> None:
    axes.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center", transform=axes.transAxes)
    _hide_ticks(axes)


def _draw_timeseries(
    axes: Any, panel: Mapping[str, Any], results: list[tuple[str, Series]], window: Window
) -> None:
    """One line per series, over the seconds into the run."""
    for label, series in results:
        times = [t - window.start for t, _ in series.points]
        axes.plot(times, [v for _, v in series.points], label=label, linewidth=1.2)
    axes.set_xlabel("seconds into the run", color="#ccccdc", fontsize=7)
    if _unit(panel):
        axes.set_ylabel(_unit(panel), color="#ccccdc", fontsize=7)
    axes.legend(fontsize=6, loc="upper left", ncols=2, framealpha=0.3)


def _draw_state_timeline(
    axes: Any, panel: Mapping[str, Any], results: list[tuple[str, Series]], window: Window
) -> None:
    """One band per series, each step colored by the panel's thresholds."""
    for row, (_, series) in enumerate(results):
        for t, v in series.points:
            axes.barh(row, window.step, left=t - window.start, color=_color(panel, v), height=0.8)
    axes.set_yticks(range(len(results)), [label for label, _ in results], fontsize=7)
    axes.set_xlabel("seconds into the run", color="#ccccdc", fontsize=7)


def _draw_last_values(axes: Any, panel: Mapping[str, Any], results: list[tuple[str, Series]]) -> None:
    """Each series' last value: a stat's one value as a big number, else as colored bars."""
    unit = _unit(panel)
    numbers = [series.points[-1][1] for _, series in results]
    if panel["type"] == "stat" and len(results) == 1:
        axes.text(
            0.5,
            0.45,
            _number(numbers[0], unit),
            color="#73bf69",
            fontsize=26,
            ha="center",
            va="center",
            transform=axes.transAxes,
        )
        _hide_ticks(axes)
        return
    axes.barh(range(len(numbers)), numbers, color=[_color(panel, n) for n in numbers])
    axes.set_yticks(range(len(numbers)), [label or "value" for label, _ in results], fontsize=7)
    axes.invert_yaxis()
    for row, number in enumerate(numbers):
        axes.text(number, row, " " + _number(number, unit), color="white", fontsize=7, va="center")


def _draw_table(axes: Any, panel: Mapping[str, Any], results: list[tuple[str, Series]]) -> None:
    """One row per series: its labels and last value, but the columns the panel hides."""
    columns, rows = _table_cells(panel, results)
    _hide_ticks(axes)
    table = axes.table(
        cellText=[[cell[:60] for cell in row] for row in rows],
        colLabels=columns,
        loc="upper left",
        cellLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    for cell in table.get_celld().values():
        cell.set_facecolor("#181b1f")
        cell.set_edgecolor("#2c3235")
        cell.get_text().set_color("white")


def _table_cells(
    panel: Mapping[str, Any], results: list[tuple[str, Series]]
) -> tuple[list[str], list[list[str]]]:
    """The table's columns (labels, then Value) and its rows, without the hidden columns."""
    hidden: set[str] = set()
    for transformation in panel.get("transformations", []):
        hidden |= set(transformation.get("options", {}).get("excludeByName", {}))
    renamed: dict[str, str] = {}
    for transformation in panel.get("transformations", []):
        renamed |= transformation.get("options", {}).get("renameByName", {})
    columns = sorted({key for _, series in results for key in series.labels} - hidden)
    if "Value" not in hidden:
        columns.append("Value")
    unit = _unit(panel)
    rows = [
        [
            series.labels.get(column, "") if column != "Value" else _number(series.points[-1][1], unit)
            for column in columns
        ]
        for _, series in results
    ]
    return [renamed.get(column, column) for column in columns], rows


def _heatmap(axes: Any, results: list[tuple[str, Series]], window: Window) -> None:
    import numpy

    bounds = sorted({float(series.labels.get("le", "inf")) for _, series in results})
    times = sorted({t for _, series in results for t, _ in series.points})
    cumulative = numpy.zeros((len(bounds), len(times)))
    for _, series in results:
        row = bounds.index(float(series.labels.get("le", "inf")))
        for t, v in series.points:
            cumulative[row, times.index(t)] = v if math.isfinite(v) else 0
    counts = numpy.diff(cumulative, axis=0, prepend=0)
    finite = [bound for bound in bounds if math.isfinite(bound)]
    edges = [finite[0] / 3.16, *finite, finite[-1] * 3.16][: len(bounds) + 1]
    x = [t - window.start for t in times] + [times[-1] - window.start + window.step]
    axes.pcolormesh(x, edges, numpy.where(counts > 0, counts, numpy.nan), cmap="Oranges", shading="flat")
    axes.set_yscale("log")
    axes.set_ylabel("seconds", color="#ccccdc", fontsize=7)
    axes.set_xlabel("seconds into the run", color="#ccccdc", fontsize=7)


def _legend(template: str, labels: Mapping[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    while "{{" in text:
        start = text.index("{{")
        text = text[:start] + text[text.index("}}", start) + 2 :]
    return text.strip()


SI_UNITS = {"s": "s", "Bps": "B/s", "hertz": "Hz", "watt": "W"}
COLORS = {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "transparent": "#22252b"}


def _number(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "-"
    if unit not in SI_UNITS or value == 0:
        return f"{value:.3g}" + (" °C" if unit == "celsius" else "")
    prefixes = ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))
    factor, prefix = next((pair for pair in prefixes if abs(value) >= pair[0]), prefixes[-1])
    return f"{value / factor:.3g} {prefix}{SI_UNITS[unit]}"


def _color(panel: Mapping[str, Any], value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    color = "#5794f2"
    for step in steps:
        if step.get("value") is None or value >= step["value"]:
            color = COLORS.get(step.get("color", ""), "#5794f2")
    return color


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flare_exporter.local.dashboard_preview", description=__doc__
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory of the PNG files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    models = dashboards.all_json()
    with tempfile.TemporaryDirectory() as work, faulty_job(work) as job:
        window = await_every_panel(job)
        for name, model in models.items():
            rank = str(DETAIL_RANK) if model["uid"] == dashboards.RANK_UID else ".*"
            path = os.path.join(args.out, name.removesuffix(".json") + ".png")
            draw(model, job.prometheus.url, window, window.variables(job.run, rank), path)
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
