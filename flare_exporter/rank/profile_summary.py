"""A profiler capture reduced on the node to a few kilobytes, and the bottleneck class it shows.

Pure functions over the Chrome/Kineto trace that torch.profiler's `export_chrome_trace` writes
({"traceEvents": [...]}: complete events "ph": "X" with "cat", "name", "ts" and "dur" in microseconds,
"pid", "tid", "args"; instant events "ph": "i"), run off the training thread:

- summarize(trace, steps): where the captured steps' time went (summary keys below).
- classify(summary, policy, peers): the perf monitor's bottleneck class and the measurements that decided it.
- compare(a, b): the top ops or kernels whose time per step differs most between two ranks' captures.

What the time is measured on (the "device"):

- GPU captures (any `kernel`, `gpu_memcpy` or `gpu_memset` event): the union of those intervals over the
  rank's device streams is busy; the span runs from the first one's start to the last one's end (Holistic
  Trace Analysis' temporal breakdown measures the same). NCCL kernels (name contains "nccl") are
  communication, memcpys HtoD and DtoH are copies, other kernels compute; memsets and device-to-device
  copies are `other`. Launch gaps: a kernel's start after the start of the runtime call that launched it
  (cudaLaunchKernel and kin, matched by args "correlation").
- CPU captures (gloo): the training threads (those that carry the ProfilerStep#N annotations, else the
  thread with the most op time) and communication wherever it runs. gloo runs a collective on a worker
  thread of its own (a `gloo:*` annotation there) while the training thread waits outside any op, so
  communication is the union of the communication-named events (COMMUNICATION_PREFIXES / _WORDS; never
  aten:: ops, e.g. aten::broadcast_tensors) on every thread, and compute the training threads' op time
  outside them: a nested op is counted once, in the union of its thread's intervals. The span is the
  ProfilerStep annotations' (what falls outside them is left out), else the busy time's. Launch gaps: the
  training threads' gaps between top-level ops.

The split adds up: compute + exposed communication + exposed copies + other = busy, busy + idle = span.
Exposed communication is communication under no compute; exposed copies are copies under neither; the
overlap is communication under compute. The host gap is the idle time outside the data loader
(annotations named "DataLoader": torch's `enumerate(DataLoader)#..._next__`).

A malformed trace raises TraceError (a ValueError) and nothing else; events that are not well-formed are
skipped and counted. Time and memory are linear in the events but for a sort per kind.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import label_values
from ..policies import ProfilePolicy

FORMAT = 1
MAX_EVENTS = 10_000_000  # a capture of a few steps of a large model is ~10^6 events
MAX_SUMMARY_BYTES = 16 * 1024
TOP = 10  # ops or kernels listed
NAME_CHARS = 120
MEMORY_DEVICES = 16
SHORT_SECONDS = 1e-5  # a kernel (or top-level op) shorter than this costs less than its launch

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
NOT_HOST = DEVICE_CATEGORIES | {"gpu_user_annotation"}
COMMUNICATION_PREFIXES = ("gloo:", "c10d::", "nccl:", "record_param_comms")
COMMUNICATION_WORDS = (
    "allreduce", "all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "send", "recv",
)  # fmt: skip
STEP_PREFIX = "ProfilerStep#"
DATA_LOADER = "DataLoader"
MAX_TS_US = 1e17  # a clock far past any epoch's microseconds
MAX_DUR_US = 1e13  # about 116 days

Interval = tuple[float, float]
Thread = tuple[Any, Any]  # (pid, tid): each an int or a str


class TraceError(ValueError):
    """A trace that cannot be summarized, or a summary that cannot be classified."""


def is_communication(name: str) -> bool:
    """Whether a host-side op or annotation (CPU captures) is communication."""
    if name.startswith("aten::"):
        return False
    if name.startswith(COMMUNICATION_PREFIXES):
        return True
    lowered = name.lower()
    return any(word in lowered for word in COMMUNICATION_WORDS)


# ---------------------------------------------------------------------------------------------------------
# intervals: lists of (start, end), merged ones sorted and disjoint


def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(merged: Iterable[Interval]) -> float:
    return sum(end - start for start, end in merged)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of merged `a` inside merged `b`."""
    found: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            found.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return found


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of merged `a` outside merged `b`."""
    found: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        cursor, k = start, j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                found.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            found.append((cursor, end))
    return found


def gaps(merged: Sequence[Interval]) -> list[float]:
    return [merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)]


# ---------------------------------------------------------------------------------------------------------
# reading the events


@dataclass
class _Ops:
    """Per name: count, total and self microseconds."""

    by_name: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, total: float, own: float) -> None:
        entry = self.by_name.setdefault(name[:NAME_CHARS], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += total
        entry[2] += own


@dataclass
class _Events:
    """A trace's events sorted by what they say, in microseconds."""

    read: int = 0
    skipped: int = 0
    device: dict[str, list[Interval]] = field(
        default_factory=lambda: {"compute": [], "communication": [], "copy": [], "other": []}
    )
    kernels: list[tuple[float, float, str, Any]] = field(default_factory=list)  # ts, dur, name, correlation
    launches: dict[Any, float] = field(default_factory=dict)  # correlation -> the runtime call's start
    host: dict[Thread, list[tuple[float, float, str, bool]]] = field(default_factory=dict)  # communication?
    cpu_op_time: dict[Thread, float] = field(default_factory=dict)
    steps: list[tuple[float, float, Thread]] = field(default_factory=list)
    data: list[Interval] = field(default_factory=list)
    memory: dict[tuple[int, int], int] = field(default_factory=dict)  # (device type, id) -> peak bytes


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and abs(value) > 2**63:
        return None  # JSON's ints are unbounded; no clock or size of ours is that large
    number = float(value)
    return number if math.isfinite(number) else None


def _key(value: Any) -> Any:
    """A pid or tid as a key (an int or a str), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return value[:NAME_CHARS]
    return None


def _read(trace: Mapping[str, Any]) -> _Events:
    if not isinstance(trace, Mapping):
        raise TraceError(f"a trace is a JSON object with traceEvents, not a {type(trace).__name__}")
    raw = trace.get("traceEvents")
    if not isinstance(raw, list | tuple):
        raise TraceError(f"the trace's traceEvents is not a list but a {type(raw).__name__}")
    if len(raw) > MAX_EVENTS:
        raise TraceError(f"the trace has {len(raw)} events, more than the {MAX_EVENTS} summarized")
    events = _Events(read=len(raw))
    for event in raw:
        if not isinstance(event, Mapping):
            events.skipped += 1
            continue
        phase = event.get("ph")
        if phase == "X":
            if not _complete(events, event):
                events.skipped += 1
        elif phase == "i" and event.get("name") == "[memory]":
            _memory(events, event.get("args"))
    return events


def _complete(events: _Events, event: Mapping[str, Any]) -> bool:
    """Files a complete event; False if it is not a well-formed one."""
    name, category, args = event.get("name"), event.get("cat", ""), event.get("args")
    ts, dur = _number(event.get("ts")), _number(event.get("dur"))
    thread = (_key(event.get("pid", 0)), _key(event.get("tid", 0)))
    if not isinstance(name, str) or not isinstance(category, str) or ts is None or dur is None:
        return False
    if abs(ts) > MAX_TS_US or not 0 <= dur <= MAX_DUR_US or None in thread:
        return False
    args = args if isinstance(args, Mapping) else {}
    end = ts + dur
    if category in DEVICE_CATEGORIES:
        _device(events, category, name, ts, dur, args.get("correlation"))
    elif category in RUNTIME_CATEGORIES:
        correlation = _key(args.get("correlation"))
        if "Launch" in name and correlation is not None:
            events.launches[correlation] = ts
    elif category not in NOT_HOST:
        if name.startswith(STEP_PREFIX):
            events.steps.append((ts, end, thread))
        elif DATA_LOADER in name:
            events.data.append((ts, end))
        elif category == "cpu_op" or (category == "user_annotation" and is_communication(name)):
            events.host.setdefault(thread, []).append((ts, end, name, is_communication(name)))
            if category == "cpu_op":
                events.cpu_op_time[thread] = events.cpu_op_time.get(thread, 0.0) + dur
    return True


def _device(events: _Events, category: str, name: str, ts: float, dur: float, correlation: Any) -> None:
    if category == "kernel":
        kind = "communication" if "nccl" in name.lower() else "compute"
        events.kernels.append((ts, dur, name, _key(correlation)))
    elif category == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
        kind = "copy"
    else:
        kind = "other"
    events.device[kind].append((ts, ts + dur))


def _memory(events: _Events, args: Any) -> None:
    if not isinstance(args, Mapping):
        return
    allocated, device = _number(args.get("Total Allocated")), _number(args.get("Device Id"))
    kind = _number(args.get("Device Type", 0 if device == -1 else 1))
    if allocated is None or device is None or kind is None or abs(device) > 1e6 or abs(kind) > 1e6:
        return
    key = (int(kind), int(device))
    if key in events.memory or len(events.memory) < MEMORY_DEVICES:
        events.memory[key] = max(events.memory.get(key, 0), int(min(max(allocated, 0.0), 2.0**62)))


# ---------------------------------------------------------------------------------------------------------
# the breakdown


@dataclass
class _Breakdown:
    """The split of a span (merged intervals, microseconds) and the details beside it."""

    span: Interval
    compute: list[Interval]
    communication: list[Interval]
    copy: list[Interval]
    busy: list[Interval]
    top_of: str
    top: _Ops
    short_of: str
    durations: list[float]  # of the kernels, or of the training threads' top-level ops
    launch: dict[str, Any]


def _gpu(events: _Events) -> _Breakdown:
    device = {kind: union(intervals) for kind, intervals in events.device.items()}
    busy = union(interval for intervals in device.values() for interval in intervals)
    kernels = _Ops()
    delays: list[float] = []
    for ts, dur, name, correlation in events.kernels:
        kernels.add(name, dur, dur)
        launched = events.launches.get(correlation) if correlation is not None else None
        if launched is not None and ts >= launched:
            delays.append(ts - launched)
    return _Breakdown(
        span=(busy[0][0], busy[-1][1]),
        compute=device["compute"],
        communication=device["communication"],
        copy=device["copy"],
        busy=busy,
        top_of="kernels",
        top=kernels,
        short_of="kernels",
        durations=[dur for _, dur, _, _ in events.kernels],
        launch={"of": "launch_delay", **_distribution(delays)},
    )


def _training_threads(events: _Events) -> list[Thread]:
    annotated = sorted({thread for _, _, thread in events.steps if thread in events.host}, key=repr)
    if annotated:
        return annotated
    if not events.cpu_op_time:
        return []
    return [max(sorted(events.cpu_op_time, key=repr), key=lambda thread: events.cpu_op_time[thread])]


def _cpu(events: _Events) -> _Breakdown:
    training = set(_training_threads(events))
    communication = union((start, end) for ops in events.host.values() for start, end, _, comm in ops if comm)
    compute: list[Interval] = []
    top = _Ops()
    durations: list[float] = []
    gap_list: list[float] = []
    for thread, ops in events.host.items():
        top_level = _self_times(ops, top)
        if thread in training:
            durations += [end - start for start, end in top_level]
            mine = union(top_level)
            gap_list += gaps(mine)
            own_communication = union((start, end) for start, end, _, comm in ops if comm)
            compute += subtract(mine, own_communication)
    compute = union(compute)
    busy = union(compute + communication)
    if events.steps:
        span = (min(start for start, _, _ in events.steps), max(end for _, end, _ in events.steps))
    elif busy:
        span = (busy[0][0], busy[-1][1])
    else:
        raise TraceError("the trace has no device events, no ops and no ProfilerStep annotations")
    window = [span]
    return _Breakdown(
        span=span,
        compute=intersect(compute, window),
        communication=intersect(communication, window),
        copy=[],
        busy=intersect(busy, window),
        top_of="ops",
        top=top,
        short_of="ops",
        durations=durations,
        launch={"of": "thread_gaps", **_distribution(gap_list), "total_seconds": _seconds(sum(gap_list))},
    )


def _self_times(ops: list[tuple[float, float, str, bool]], top: _Ops) -> list[Interval]:
    """Adds one thread's ops to `top` with their self time (their time outside the ops nested in them);
    returns the top-level ones' intervals."""
    ordered = sorted(ops, key=lambda op: (op[0], -op[1]))
    own = [end - start for start, end, _, _ in ordered]
    stack: list[int] = []
    top_level: list[Interval] = []
    for index, (start, end, _, _) in enumerate(ordered):
        while stack and ordered[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            parent = stack[-1]
            own[parent] -= min(end, ordered[parent][1]) - start
        else:
            top_level.append((start, end))
        stack.append(index)
    for (start, end, name, _), seconds in zip(ordered, own, strict=True):
        top.add(name, end - start, max(seconds, 0.0))
    return top_level


# ---------------------------------------------------------------------------------------------------------
# the summary


def summarize(
    trace: Mapping[str, Any], steps: int, *, short_seconds: float = SHORT_SECONDS
) -> dict[str, Any]:
    """The capture of `steps` steps in `trace` reduced to a JSON-able dict of at most MAX_SUMMARY_BYTES:

    - format, kind ("gpu" | "cpu"), steps (as asked), step_seconds (the mean step);
    - shares: of the span, by label_values.PROFILE_PARTS (compute, communication, exposed_communication, copy,
      idle, data);
    - step: source ("ProfilerStep" | "span"), count, mean_seconds, max_seconds, total_seconds;
    - time: `<name>_seconds` for span, busy, idle, host_gap, compute, communication, copy,
      exposed_communication, exposed_copy, other, overlap; overlap_share (of the communication);
    - data_loader: count, seconds;
    - top: of ("kernels" | "ops"), entries (name, count, seconds (self time), total_seconds);
    - short: of, threshold_seconds, count, total, share (of the count), seconds, seconds_share (of the
      time);
    - launch: of ("launch_delay" | "thread_gaps"), count, median_seconds, p90_seconds[, total_seconds];
    - memory: [{device_type, device, peak_bytes}]; events: read, skipped.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TraceError(f"steps is a positive int, not {repr(steps)[:80]}")
    if not 0 < (_number(short_seconds) or 0.0) < 1:
        raise TraceError(f"short_seconds is a number of seconds in (0, 1), not {repr(short_seconds)[:80]}")
    try:
        events = _read(trace)
        breakdown = _gpu(events) if any(events.device.values()) else _cpu(events)
        return _summary(events, breakdown, steps, short_seconds)
    except TraceError:
        raise
    except Exception as error:  # a summary never raises anything else into its caller
        raise TraceError(f"unreadable trace: {type(error).__name__}: {str(error)[:200]}") from error


def _summary(events: _Events, breakdown: _Breakdown, steps: int, short_seconds: float) -> dict[str, Any]:
    entries = _top(breakdown.top)
    step = _step(events, breakdown.span, steps)
    time_ = _time(breakdown, union(events.data))
    data_loader = {"count": len(events.data), "seconds": _seconds(length(union(events.data)))}
    summary: dict[str, Any] = {
        "format": FORMAT,
        "kind": "gpu" if breakdown.top_of == "kernels" else "cpu",
        "steps": steps,
        "step_seconds": step["mean_seconds"],
        "shares": _shares(time_, data_loader["seconds"]),
        "step": step,
        "time": time_,
        "data_loader": data_loader,
        "top": {"of": breakdown.top_of, "entries": entries},
        "short": _short(breakdown, short_seconds),
        "launch": breakdown.launch,
        "memory": [
            {"device_type": kind, "device": device, "peak_bytes": peak}
            for (kind, device), peak in sorted(events.memory.items())
        ],
        "events": {"read": events.read, "skipped": events.skipped},
    }
    while entries and len(json.dumps(summary)) > MAX_SUMMARY_BYTES:
        entries.pop()  # only names of many escaped characters come near the bound
    return summary


def _time(breakdown: _Breakdown, data: list[Interval]) -> dict[str, Any]:
    span_us = breakdown.span[1] - breakdown.span[0]
    busy = length(breakdown.busy)
    compute = length(breakdown.compute)
    communication = length(breakdown.communication)
    overlap = length(intersect(breakdown.communication, breakdown.compute))
    hidden = union(breakdown.compute + breakdown.communication)
    exposed_copy = length(subtract(breakdown.copy, hidden))
    idle = subtract([breakdown.span], breakdown.busy)
    return {
        "span_seconds": _seconds(span_us),
        "busy_seconds": _seconds(busy),
        "idle_seconds": _seconds(max(span_us - busy, 0.0)),
        "host_gap_seconds": _seconds(length(subtract(idle, data))),
        "compute_seconds": _seconds(compute),
        "communication_seconds": _seconds(communication),
        "copy_seconds": _seconds(length(breakdown.copy)),
        "exposed_communication_seconds": _seconds(communication - overlap),
        "exposed_copy_seconds": _seconds(exposed_copy),
        "other_seconds": _seconds(max(busy - compute - (communication - overlap) - exposed_copy, 0.0)),
        "overlap_seconds": _seconds(overlap),
        "overlap_share": round(overlap / communication, 6) if communication > 0 else 0.0,
    }


def _shares(time_: Mapping[str, float], data_seconds: float) -> dict[str, float]:
    """The parts of the span the flare_profile_share_ratio metric exports (label_values.PROFILE_PARTS)."""
    span = time_["span_seconds"]
    seconds = {
        **{part: time_.get(f"{part}_seconds", 0.0) for part in label_values.PROFILE_PARTS},
        "data": data_seconds,
    }
    return {part: round(seconds[part] / span, 6) if span > 0 else 0.0 for part in label_values.PROFILE_PARTS}


def _step(events: _Events, span: Interval, steps: int) -> dict[str, Any]:
    durations = [end - start for start, end, _ in events.steps]
    if not durations:
        seconds = (span[1] - span[0]) / steps
        return {
            "source": "span",
            "count": steps,
            "mean_seconds": _seconds(seconds),
            "max_seconds": _seconds(seconds),
            "total_seconds": _seconds(span[1] - span[0]),
        }
    return {
        "source": "ProfilerStep",
        "count": len(durations),
        "mean_seconds": _seconds(sum(durations) / len(durations)),
        "max_seconds": _seconds(max(durations)),
        "total_seconds": _seconds(sum(durations)),
    }


def _top(ops: _Ops) -> list[dict[str, Any]]:
    ranked = sorted(ops.by_name.items(), key=lambda item: (-item[1][2], item[0]))[:TOP]
    return [
        {"name": _name(name), "count": int(count), "seconds": _seconds(own), "total_seconds": _seconds(total)}
        for name, (count, total, own) in ranked
    ]


def _short(breakdown: _Breakdown, short_seconds: float) -> dict[str, Any]:
    threshold = short_seconds * 1e6
    short = [dur for dur in breakdown.durations if dur < threshold]
    total_time = sum(breakdown.durations)
    return {
        "of": breakdown.short_of,
        "threshold_seconds": short_seconds,
        "count": len(short),
        "total": len(breakdown.durations),
        "share": round(len(short) / len(breakdown.durations), 6) if breakdown.durations else 0.0,
        "seconds": _seconds(sum(short)),
        "seconds_share": round(sum(short) / total_time, 6) if total_time > 0 else 0.0,
    }


def _distribution(values_us: list[float]) -> dict[str, Any]:
    if not values_us:
        return {"count": 0, "median_seconds": 0.0, "p90_seconds": 0.0}
    ordered = sorted(values_us)
    p90 = ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]  # nearest rank
    return {
        "count": len(ordered),
        "median_seconds": _seconds(statistics.median(ordered)),
        "p90_seconds": _seconds(p90),
    }


def _seconds(microseconds: float) -> float:
    return round(microseconds / 1e6, 9)


def _name(name: str) -> str:
    return "".join(char if char.isprintable() else "?" for char in name[:NAME_CHARS])


# ---------------------------------------------------------------------------------------------------------
# the verdict


def classify(
    summary: Mapping[str, Any], policy: ProfilePolicy, peers: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, dict[str, Any]]:
    """The perf monitor's bottleneck class of a capture's summary, and the evidence that decided it.

    `peers`: other ranks' summaries of the same steps. A synchronous collective ends for every rank when
    the last one arrives, so a rank whose exposed communication per step exceeds the least of its peers'
    spent the excess waiting for a slower one: as engine/perf.py's judged() does, it is judged on the
    least one's, and on its span without the excess (whose own bottleneck is then the one it shows).
    """
    if not isinstance(summary, Mapping):
        raise TraceError(f"a summary is a JSON object, not a {type(summary).__name__}")
    span = _field(summary, "time", "span_seconds")
    steps = _step_count(summary)
    own = _field(summary, "time", "exposed_communication_seconds") / steps
    peer_values = [
        _field(peer, "time", "exposed_communication_seconds") / _step_count(peer)
        for peer in peers
        if isinstance(peer, Mapping)
    ]
    least = min(peer_values) if peer_values else None
    judged = min(own, least) if least is not None else own
    waited = (own - judged) * steps
    judged_span = span - waited
    seconds = {
        "data": _field(summary, "data_loader", "seconds"),
        "communication": judged * steps,
        "transfer": _field(summary, "time", "exposed_copy_seconds"),
        "host_gap": _field(summary, "time", "host_gap_seconds"),
    }
    shares = {
        name: round(value / judged_span, 6) if judged_span > 0 else 0.0 for name, value in seconds.items()
    }
    is_gpu = summary.get("kind") == "gpu"
    shares["short_kernels"] = _field(summary, "short", "seconds_share") if is_gpu else 0.0
    decided = next(((cls, name) for cls, name, share in policy.thresholds() if shares[name] >= share), None)
    evidence = {
        "policy_version": policy.version,
        "decided_by": decided[1] if decided else None,
        "shares": shares,
        "thresholds": {name: share for _, name, share in policy.thresholds()},
        "span_seconds": _seconds(span * 1e6),
        "judged_span_seconds": _seconds(judged_span * 1e6),
        "exposed_communication_per_step_seconds": _seconds(own * 1e6),
        "least_peer_exposed_communication_per_step_seconds": _seconds(least * 1e6)
        if least is not None
        else None,
        "waiting_for_peers_seconds": _seconds(waited * 1e6),
        "peers": len(peer_values),
    }
    return (decided[0] if decided else "compute_bound"), evidence


def _field(summary: Mapping[str, Any], section: str, name: str) -> float:
    """A non-negative number from a summary (a peer's may come from anywhere): 0 where it is not one."""
    part = summary.get(section)
    value = _number(part.get(name)) if isinstance(part, Mapping) else None
    return value if value is not None and value > 0 else 0.0


def _step_count(summary: Mapping[str, Any]) -> float:
    counted = _field(summary, "step", "count")
    asked = _number(summary.get("steps"))
    return counted if counted >= 1 else (asked if asked is not None and asked >= 1 else 1.0)


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The top ops or kernels of two captures whose seconds per step differ most (at most TOP, largest
    difference first): name, a_seconds, b_seconds (per step; None where the name is not in that capture's
    top list, its time there at most that list's least), difference_seconds (b - a, the absent as 0)."""
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        raise TraceError("compare takes two summaries (JSON objects)")
    per_step = [_top_per_step(summary) for summary in (a, b)]
    rows: list[dict[str, Any]] = []
    for name in sorted(set(per_step[0]) | set(per_step[1])):
        first, second = per_step[0].get(name), per_step[1].get(name)
        difference = (second or 0.0) - (first or 0.0)
        rows.append(
            {
                "name": name,
                "a_seconds": _seconds(first * 1e6) if first is not None else None,
                "b_seconds": _seconds(second * 1e6) if second is not None else None,
                "difference_seconds": _seconds(difference * 1e6),
            }
        )
    rows.sort(key=lambda row: (-abs(row["difference_seconds"]), row["name"]))
    return rows[:TOP]


def _top_per_step(summary: Mapping[str, Any]) -> dict[str, float]:
    top = summary.get("top")
    entries = top.get("entries") if isinstance(top, Mapping) else None
    steps = _step_count(summary)
    found: dict[str, float] = {}
    for entry in entries[: TOP * 2] if isinstance(entries, list) else []:
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            name = _name(entry["name"])
            found[name] = found.get(name, 0.0) + _field({"e": entry}, "e", "seconds") / steps
    return found
