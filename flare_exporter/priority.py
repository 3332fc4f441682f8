"""The exporter's threads give way to training: each lowers its own scheduling priority as it starts.

On Linux a thread has its own nice value (setpriority on its thread id). A thread at nice 19 runs on a core
the training threads leave idle and does not preempt them when it wakes; when it holds the GIL, a training
thread of its own process that waits for the GIL is woken at once it releases it, as at any priority.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 19


def lower_own_priority(nice: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value to `nice` (never lowers it; no-op where unsupported)."""
    try:
        thread = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
    except (AttributeError, OSError):  # not Linux-like, or not allowed: the thread runs at its priority
        pass
