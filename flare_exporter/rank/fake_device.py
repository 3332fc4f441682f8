"""A fake device for CPU: streams that run queued kernels on their own thread and timestamp events.

It stands in for a GPU so that the timing manager, the kernel issue latency (ILD) and their tests run the
same code on CPU as on CUDA. A FakeStream is a thread that takes queued items in launch order:

- a kernel: a duration in seconds, or a callable that it runs;
- an event: it is timestamped when the stream reaches it (all earlier work done);
- a synchronisation marker, which wakes the host thread waiting in `synchronize()`.

Times are on the host's `perf_counter` clock and follow the stream's own schedule: an item starts when it
was launched or when the work before it ended, whichever is later, and a duration kernel ends exactly
`duration` later. The thread sleeps until then, so the queue drains in real time, but a late wake-up (a busy
machine) does not distort the timestamps. Issue latency = when the stream reached a kernel minus when the
host launched it: a host that runs ahead builds a queue and sees long latencies; a stalling host lets the
queue drain and sees them collapse toward zero, as on a GPU.

A launch hook (`set_launch_hook`) sees every launch before the kernel is queued; it may record an event on
the stream, which then marks the kernel's start. `sample_launches` makes it the ILD's kernel sampler, as the
shim samples a GPU's launches: a FakeDevice does so itself in a process with an exporter attached (a script
run by flare-run knows nothing of the exporter), tests with the state they built. A real rank never loads
this module.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .device_events import EventBackend
from .exporter_health import ExporterHealth

if TYPE_CHECKING:
    from .ild import IldState

Kernel = float | Callable[[], Any]
LaunchHook = Callable[["FakeStream"], None]

_launch_hook: LaunchHook | None = None


def set_launch_hook(hook: LaunchHook | None) -> None:
    """Call `hook(stream)` on the launching thread before every kernel launch (None: no hook)."""
    global _launch_hook
    _launch_hook = hook


class FakeEvent:
    """An event on a fake stream; `device_time` is set when the stream reaches it."""

    __slots__ = ("device_time", "done")

    def __init__(self) -> None:
        self.device_time = 0.0
        self.done = False


_KERNEL, _EVENT, _SYNC, _STOP = range(4)


class FakeStream:
    """One in-order queue of device work, executed by its own daemon thread."""

    def __init__(self, name: str = "fake-stream") -> None:
        self.name = name
        self.busy_until = 0.0  # the stream's clock: when its last item ended (stream thread only)
        self.kernels_run = 0
        self._queue: queue.SimpleQueue[tuple[int, Any, float]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, kernel: Kernel) -> None:
        """Queue `kernel` (seconds, or a callable); returns at once, like a kernel launch."""
        hook = _launch_hook
        if hook is not None:
            hook(self)
        self._queue.put((_KERNEL, kernel, time.perf_counter()))

    def record_event(self, event: FakeEvent) -> None:
        """Queue `event`; the stream timestamps it once everything launched before it has run."""
        event.done = False
        self._queue.put((_EVENT, event, time.perf_counter()))

    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has run (the host thread blocks, as with a device sync)."""
        reached = threading.Event()
        self._queue.put((_SYNC, reached, time.perf_counter()))
        return reached.wait(timeout)

    def close(self) -> None:
        self._queue.put((_STOP, None, 0.0))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            kind, item, launched_at = self._queue.get()
            start = max(launched_at, self.busy_until)
            if kind == _STOP:
                return
            if kind == _EVENT:
                item.device_time = start
                item.done = True
            elif kind == _SYNC:
                item.set()
            elif callable(item):
                began = time.perf_counter()
                try:
                    item()
                except Exception:  # a failing kernel must not stop the stream
                    pass
                self.busy_until = start + (time.perf_counter() - began)
                self.kernels_run += 1
            else:
                self.busy_until = start + float(item)
                delay = self.busy_until - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                self.kernels_run += 1


class FakeDevice:
    """A device with one default stream (what `current_stream()` gives on a GPU); its launches are sampled
    by the exporter attached to this process, if any."""

    def __init__(self, name: str = "fake0") -> None:
        self.stream = FakeStream(name)
        self.sampled = _sample_into_the_attached_exporter()

    def launch(self, kernel: Kernel) -> None:
        self.stream.launch(kernel)

    def synchronize(self, timeout: float | None = None) -> bool:
        return self.stream.synchronize(timeout)

    def close(self) -> None:
        if self.sampled:
            set_launch_hook(None)
        self.stream.close()


def _sample_into_the_attached_exporter() -> bool:
    """Sample launches into this process's exporter's ILD, unless none is attached or a hook is set."""
    attach = sys.modules.get(f"{__package__}.attach")  # not loaded: no exporter attached
    attachment = attach.attached() if attach is not None else None
    if attachment is None or attachment.state.ild is None or _launch_hook is not None:
        return False
    sample_launches(attachment.state.ild, attachment.state.config.ild_events)
    return True


def sample_launches(ild: IldState, pool_size: int) -> FakeDeviceEvents:
    """Sample every fake-device launch into `ild`'s kernel sampler, on events of a pool of `pool_size`;
    set_launch_hook(None) stops it."""
    events = FakeDeviceEvents(ild.health, pool_size)
    set_launch_hook(lambda stream: ild.kernels.on_launch(events, stream))
    return events


class FakeDeviceEvents(EventBackend):
    """The event backend of fake streams: the same interface, pool and manager path as CUDA events."""

    name = "fake"

    def __init__(self, health: ExporterHealth, pool_size: int, default_stream: FakeStream | None = None):
        super().__init__(health, pool_size)
        self.default_stream = default_stream

    def _new_event(self) -> FakeEvent:
        return FakeEvent()

    def _record(self, event: Any, stream: Any) -> None:
        target = stream if stream is not None else self.default_stream
        if target is None:
            raise ValueError("no fake stream to record the event on")
        target.record_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.done)

    def timestamp(self, event: Any) -> float:
        return float(event.device_time)
