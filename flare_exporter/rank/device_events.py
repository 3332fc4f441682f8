"""Device events (kernel issue latency, ILD): one interface, EventBackend, for the timing manager.

Record an event on a stream (training thread, never waits), query it, read the host-clock time at which the
device reached it (manager thread). Implementations: TorchCudaEvents (`torch.cuda.Event`), CupyEvents
(`cupy.cuda.Event`, the `cupy` extra, imported lazily) and FakeDeviceEvents (fake_device.py: a CPU thread
standing in for the device), each drawing its events from a bounded EventPool. The timing manager
(timing.py) resolves them like collectives.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

from .exporter_health import ExporterHealth

EventSink = Callable[[int, float], None]  # (tag, seconds from host launch to the device reaching the event)

# A GPU reports only the time between two of its events, as a 32-bit float in milliseconds; events are
# placed on the host clock through an anchor event, renewed this often so that the float stays sub-µs.
ANCHOR_SECONDS = 5.0


class EventPool:
    """At most `size` reusable device events; empty -> None and a counted drop, never a wait.

    The training thread acquires, the manager releases; deque appends and pops are atomic, so no lock.
    """

    def __init__(self, create: Callable[[], Any], size: int, health: ExporterHealth) -> None:
        self.create = create
        self.size = size
        self.health = health
        self.free: deque[Any] = deque()
        self.created = 0

    def acquire(self) -> Any | None:
        try:
            return self.free.pop()
        except IndexError:
            pass
        if self.created >= self.size:
            self.health.drop("ild_events")
            return None
        self.created += 1
        return self.create()

    def release(self, event: Any) -> None:
        self.free.append(event)


class EventBackend(ABC):
    """Device events behind one interface, for the timing manager.

    record() runs on the training thread and never waits; query(), timestamp() and elapsed() run on the
    manager thread. timestamp() is the host `perf_counter` time at which the device reached the event.
    """

    name = "events"

    def __init__(self, health: ExporterHealth, pool_size: int) -> None:
        self.pool = EventPool(self._new_event, pool_size, health)

    def record(self, stream: Any = None) -> Any | None:
        """An event recorded on `stream` (None: the current stream), or None if the pool is empty."""
        event = self.pool.acquire()
        if event is not None:
            try:
                self._record(event, stream)
            except BaseException:
                self.pool.release(event)
                raise
        return event

    def release(self, event: Any) -> None:
        self.pool.release(event)

    @abstractmethod
    def query(self, event: Any) -> bool: ...

    @abstractmethod
    def timestamp(self, event: Any) -> float: ...

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from `start` to `end` on the device (both completed)."""
        return self.timestamp(end) - self.timestamp(start)

    @abstractmethod
    def _new_event(self) -> Any: ...

    @abstractmethod
    def _record(self, event: Any, stream: Any) -> None: ...


class AnchoredEvents(EventBackend):
    """GPU events, which only measure time between each other: an anchor event places them on the host clock.

    The manager records the anchor on a private, idle stream and waits for it (on its own thread); the device
    reaches it a launch latency after the host time read just before, so every timestamp carries that small
    constant bias. The anchor is renewed every ANCHOR_SECONDS.
    """

    def __init__(self, health: ExporterHealth, pool_size: int) -> None:
        super().__init__(health, pool_size)
        self._anchor: tuple[float, Any] | None = None  # (host time, anchor event); manager thread only
        self._anchored_at = 0.0

    def timestamp(self, event: Any) -> float:
        now = time.perf_counter()
        if self._anchor is None or now - self._anchored_at > ANCHOR_SECONDS:
            anchor = self._new_event()
            stream = self._private_stream()
            host_time = time.perf_counter()
            self._record(anchor, stream)
            self._synchronize(anchor)
            self._anchor = (host_time, anchor)
            self._anchored_at = now
        host_time, anchor = self._anchor
        return host_time + self._elapsed_ms(anchor, event) / 1000.0

    def elapsed(self, start: Any, end: Any) -> float:
        return self._elapsed_ms(start, end) / 1000.0

    @abstractmethod
    def _private_stream(self) -> Any: ...

    @abstractmethod
    def _synchronize(self, event: Any) -> None: ...

    @abstractmethod
    def _elapsed_ms(self, start: Any, end: Any) -> float: ...


class TorchCudaEvents(AnchoredEvents):
    """CUDA events through torch (`torch.cuda.Event`); `cuda` replaces torch.cuda in tests."""

    name = "torch_cuda"

    def __init__(self, health: ExporterHealth, pool_size: int, cuda: Any = None) -> None:
        if cuda is None:
            import torch.cuda as cuda  # only where CUDA events are used
        self.cuda = cuda
        self._stream: Any = None
        super().__init__(health, pool_size)

    def _new_event(self) -> Any:
        return self.cuda.Event(enable_timing=True)

    def _record(self, event: Any, stream: Any) -> None:
        event.record(stream if stream is not None else self.cuda.current_stream())

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def _private_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.cuda.Stream()
        return self._stream

    def _synchronize(self, event: Any) -> None:
        event.synchronize()

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))


class CupyEvents(AnchoredEvents):
    """CUDA events through cupy (`cupy.cuda.Event`, the `cupy` extra), imported when first used."""

    name = "cupy"

    def __init__(self, health: ExporterHealth, pool_size: int, cupy: Any = None) -> None:
        if cupy is None:
            import cupy as cupy_module  # type: ignore[import-not-found,unused-ignore]  # the `cupy` extra

            cupy = cupy_module
        self.cupy = cupy
        self._stream: Any = None
        super().__init__(health, pool_size)

    def _new_event(self) -> Any:
        return self.cupy.cuda.Event()

    def _record(self, event: Any, stream: Any) -> None:
        event.record(stream if stream is not None else self.cupy.cuda.get_current_stream())

    def query(self, event: Any) -> bool:
        return bool(event.done)

    def _private_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def _synchronize(self, event: Any) -> None:
        event.synchronize()

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self.cupy.cuda.get_elapsed_time(start, end))
