"""Alert rules of a GPU's health (rank/gpu_health.py): one that runs slower than it could (throttled, clocks
below their maximum, a degraded PCIe link), and one that reported errors (XID events, uncorrectable memory
errors). Wired into the rules file by RULE_GROUPS (rules.py): the errors as the group flare.gpu_errors, the
slowdowns in flare.slow_signals.
"""

from __future__ import annotations

from .. import label_values, spec
from ..durations import duration_seconds
from .rule_model import Alert, Recording, Thresholds, link, selector
from .rule_model import with_host as _with_host

GPU_CLOCK_EVENT_ACTIVE = spec.series("flare_gpu_clock_event_active")
GPU_ECC_ERRORS_TOTAL = spec.series("flare_gpu_ecc_errors_total")
GPU_LAST_XID = spec.series("flare_gpu_last_xid")
GPU_PCIE_LINK_GENERATION = spec.series("flare_gpu_pcie_link_generation")
GPU_PCIE_LINK_GENERATION_MAX = spec.series("flare_gpu_pcie_link_generation_max")
GPU_PCIE_LINK_WIDTH = spec.series("flare_gpu_pcie_link_width")
GPU_PCIE_LINK_WIDTH_MAX = spec.series("flare_gpu_pcie_link_width_max")
GPU_ROW_REMAP_FAILED = spec.series("flare_gpu_row_remap_failed")
GPU_SM_CLOCK_HERTZ = spec.series("flare_gpu_sm_clock_hertz")
GPU_SM_CLOCK_MAX_HERTZ = spec.series("flare_gpu_sm_clock_max_hertz")
GPU_XID_EVENTS_TOTAL = spec.series("flare_gpu_xid_events_total")

# The clock event reasons that slow a GPU down (FlareRankStraggler's description names its GPU's).
GPU_SLOWDOWN = "|".join(sorted(label_values.GPU_SLOWDOWN_REASONS))


def gpu_slowdown_alerts(t: Thresholds) -> list[Alert]:
    """A GPU that runs slower than it could: clocks held down, a PCIe link below its maximum."""
    s = selector(t)
    idle = selector(t, 'reason="gpu_idle"')
    busy = f"unless on (run, rank) ({GPU_CLOCK_EVENT_ACTIVE}{idle} == 1)"
    slowing = selector(t, f'reason=~"{GPU_SLOWDOWN}"')
    return [
        Alert(
            "FlareGPUThrottled",
            _with_host(f"max by (run, rank, reason) ({GPU_CLOCK_EVENT_ACTIVE}{slowing} == 1)"),
            t.gpu_for,
            "warning",
            "The GPU of rank {{ $labels.rank }} is throttled ({{ $labels.reason }})",
            "NVML reports {{ $labels.reason }} on the GPU of rank {{ $labels.rank }} (host "
            "{{ $labels.host }}) of run {{ $labels.run }}: its clocks are held down, and a synchronous job "
            "runs at its pace.",
            "flaregputhrottled",
            link("rank", "rank"),
        ),
        Alert(
            "FlareGPUClockBelowMax",
            _with_host(
                f"max by (run, rank) ({GPU_SM_CLOCK_HERTZ}{s} / {GPU_SM_CLOCK_MAX_HERTZ}{s} "
                f"< {t.stragglers.clock_below_max:g})\n{busy}"
            ),
            t.gpu_for,
            "warning",
            "The GPU of rank {{ $labels.rank }} runs below its maximum clock",
            "The SM clock of the busy GPU of rank {{ $labels.rank }} (host {{ $labels.host }}) of run "
            "{{ $labels.run }} is at {{ $value | humanizePercentage }} of its maximum.",
            "flaregpuclockbelowmax",
            link("rank", "rank"),
        ),
        Alert(
            "FlareGPUPCIeLinkDegraded",
            _with_host(
                f"max by (run, rank) ({GPU_PCIE_LINK_WIDTH}{s} < {GPU_PCIE_LINK_WIDTH_MAX}{s})\n"
                f"or on (run, rank)\n"
                f"(max by (run, rank) ({GPU_PCIE_LINK_GENERATION}{s}\n"
                f"  < {GPU_PCIE_LINK_GENERATION_MAX}{s})"
                f"\n{busy})"
            ),
            t.gpu_for,
            "warning",
            "The PCIe link of rank {{ $labels.rank }}'s GPU runs below its maximum",
            "The PCIe link of the GPU of rank {{ $labels.rank }} (host {{ $labels.host }}) of run "
            "{{ $labels.run }} trained below its maximum width or generation (at {{ $value }}): host-device "
            "copies and GPUDirect traffic are slower.",
            "flaregpupcielinkdegraded",
            link("rank", "rank"),
        ),
    ]


XID_RISE = "run_rank:flare_gpu_xid_events:rise_timestamp_seconds"
ECC_RISE = "run_rank:flare_gpu_ecc_errors_uncorrected:rise_timestamp_seconds"


def gpu_error_recordings(t: Thresholds) -> list[Recording]:
    """When each rank's GPU error counters last rose, while gpu_errors_window still holds the rise."""
    uncorrected = selector(t, 'type="uncorrected"')
    return [
        _rise_memory(XID_RISE, f"{GPU_XID_EVENTS_TOTAL}{selector(t)}", t),
        _rise_memory(ECC_RISE, f"{GPU_ECC_ERRORS_TOTAL}{uncorrected}", t),
    ]


def _rise_memory(name: str, counter: str, t: Thresholds) -> Recording:
    """`increase(counter[gpu_errors_window]) > 0` per rank, as the time of the last evaluation that saw the
    counter rise over a few scrapes, kept by this recording's own last value for the rest of the window:
    every evaluation reads a few samples a rank instead of every scrape of the window (40 at 15 s)."""
    window = duration_seconds(t.gpu_errors_window, "gpu_errors_window")
    recent = min(window, max(60.0, 4 * t.scrape_interval_seconds))
    rose = f"max by (run, rank) (increase({counter}[{recent:g}s]) > 0) * 0 + time()"
    if recent >= window:
        return Recording(name, rose)
    # a rise seen last at T was scraped at most `recent` before: the window holds it until T + window - recent
    return Recording(name, f"{rose}\nor ({name} > time() - {window - recent:g})")


def gpu_error_alerts(t: Thresholds) -> list[Alert]:
    """A GPU that reported errors (XID events, uncorrectable memory errors): pages now."""
    s = selector(t)
    return [
        Alert(
            "FlareGPUXidErrors",
            _with_host(f"max by (run, rank) ({XID_RISE})"),
            t.gpu_errors_for,
            "critical",
            "The GPU of rank {{ $labels.rank }} reported XID errors",
            "NVML delivered critical XID events for the GPU of rank {{ $labels.rank }} (host "
            "{{ $labels.host }}) of run {{ $labels.run }} in the last "
            f"{t.gpu_errors_window}"
            f'{{{{ with printf "{GPU_LAST_XID}{{run=%q, rank=%q}}" $labels.run $labels.rank | query }}}}'
            "{{ with first . }} (the last: XID {{ .Value }}){{ end }}{{ end }}.",
            "flaregpuxiderrors",
            link("rank", "rank"),
        ),
        Alert(
            "FlareGPUMemoryErrors",
            _with_host(
                f"max by (run, rank) ({ECC_RISE})\n"
                f"or on (run, rank) max by (run, rank) ({GPU_ROW_REMAP_FAILED}{s} == 1)"
            ),
            t.gpu_errors_for,
            "critical",
            "The GPU memory of rank {{ $labels.rank }} has uncorrectable errors",
            "The GPU of rank {{ $labels.rank }} (host {{ $labels.host }}) of run {{ $labels.run }} reported "
            "uncorrectable ECC errors or a failed row remapping: its memory cannot be trusted.",
            "flaregpumemoryerrors",
            link("rank", "rank"),
        ),
    ]
