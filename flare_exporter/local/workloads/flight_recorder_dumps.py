"""Dumps a gloo rank's PyTorch flight recorder when a collective hangs, as NCCL's watchdog dumps its own.

Runs inside a training process (a workload's option: train_ddp.py --fr-dump-after). PyTorch 2.13 records
gloo's collectives (TORCH_FR_BUFFER_SIZE > 0) but dumps them only when asked: TORCH_FR_DUMP_TEMP_FILE is
written by NCCL's watchdog on a timeout alone. And a dump taken once gloo's timeout has failed the
collective shows nothing in flight: gloo retires the failed work and counts it completed. So, as NCCL's
watchdog does (TORCH_NCCL_DUMP_ON_TIMEOUT), a thread of each rank watches the recorder's active entries;
the first rank to see one in flight for `after_seconds` writes `_dump_fr_trace()` to
`<TORCH_FR_DUMP_TEMP_FILE><rank>` and tells every rank through the job's store, whose threads dump theirs
too: a rank stuck in its own code dumps what it last issued. A frozen rank dumps nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

SIGNAL_KEY = "flare_test_flight_recorder_dump"  # set in the job's store by the first rank that dumps
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"  # PyTorch's default for TORCH_NCCL_DEBUG_INFO_TEMP_FILE


def dump_prefix(environ: Any = os.environ) -> str:
    """Where PyTorch writes a rank's dump: TORCH_FR_DUMP_TEMP_FILE, else TORCH_NCCL_DEBUG_INFO_TEMP_FILE."""
    return (
        environ.get("TORCH_FR_DUMP_TEMP_FILE")
        or environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        or DEFAULT_PREFIX
    )


def write_dump(path: str) -> None:
    """This process's flight recorder, pickled as PyTorch dumps it, written atomically to `path`."""
    data = c10d._dump_fr_trace()  # type: ignore[attr-defined]  # not in torch 2.13's stubs
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    with open(partial, "wb") as out:
        out.write(data)
    os.replace(partial, path)


def oldest_active_age(now_ns: int) -> float:
    """Seconds the oldest collective still in flight on this rank has been, by its recorder; 0 if none."""
    dump = c10d._dump_fr_trace_json  # type: ignore[attr-defined]  # not in torch 2.13's stubs
    trace = json.loads(dump(includeCollectives=True, onlyActive=True))
    created = [entry["time_created_ns"] for entry in trace.get("entries", []) if not entry.get("retired")]
    return (now_ns - min(created)) / 1e9 if created else 0.0


class DumpOnHang:
    """The watchdog thread of one rank (start() once the default process group exists)."""

    def __init__(self, after_seconds: float, poll_seconds: float = 0.2) -> None:
        self.after_seconds = after_seconds
        self.poll_seconds = poll_seconds
        self.rank = dist.get_rank()
        self.path = f"{dump_prefix()}{self.rank}"
        self.store = dist.distributed_c10d._get_default_store()
        self.thread = threading.Thread(target=self._watch, name="flight-recorder-dump", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _watch(self) -> None:
        try:
            while True:
                if self.store.check([SIGNAL_KEY]):
                    write_dump(self.path)
                    return
                if oldest_active_age(time.time_ns()) >= self.after_seconds:
                    write_dump(self.path)
                    self.store.set(SIGNAL_KEY, str(self.rank))
                    return
                time.sleep(self.poll_seconds)
        except Exception:  # the store's host is gone (rank 0 ended): nothing left to coordinate
            return
