"""Causes: the one word every verdict carries, and the classifier both sides apply to an exception.

A rank classifies the exception that ends it (`exception_cause`) and exports the cause as a bounded label;
the engine applies the same function to the exceptions in incident files, and maps its own verdicts to the
same vocabulary (engine/post_mortem.py, engine/diagnosis.py). The rules are text patterns over the
exception's type and message, versioned: a change to them changes CAUSE_RULES_VERSION.

- out_of_memory: the device or host ran out of memory (torch.OutOfMemoryError, CUDA/NCCL OOM, MemoryError).
- storage: a file system failed the rank (stale NFS handle, I/O error, no space, read-only file system).
- data_stall: the input pipeline failed or timed out (a DataLoader worker killed or timed out).
- communication: the collective backend failed (a peer's connection reset or closed, a collective timed
  out, NCCL/gloo errors): on a rank whose peer died, this is what it raises, so it is evidence, never the
  culprit by itself (secondary).
- software_exception: anything else raised out of the training script.
- collective_mismatch, deadlock, straggler, host_contention, node_failure, unknown: decided by the engine's
  rules, never from one exception (node_failure: a rank gone without a word: killed, frozen, its host lost;
  host_contention: a slowdown every rank of a busy host shares, engine/host_load.py).
"""

from __future__ import annotations

import errno
import re
from typing import Literal, NamedTuple, TypeGuard, get_args

CAUSE_RULES_VERSION = 1

Cause = Literal[
    "out_of_memory",
    "software_exception",
    "data_stall",
    "storage",
    "collective_mismatch",
    "deadlock",
    "straggler",
    "host_contention",
    "node_failure",
    "communication",
    "unknown",
]
CAUSES: tuple[Cause, ...] = get_args(Cause)
# The causes the classifier (exception_cause) names; the engine's rules decide the others.
EXCEPTION_CAUSES: tuple[Cause, ...] = (
    "out_of_memory",
    "storage",
    "data_stall",
    "communication",
    "software_exception",
)
SECONDARY_CAUSES: frozenset[Cause] = frozenset({"communication"})  # what survivors of a lost peer raise

MAX_MESSAGE_CHARS = 2000  # of a message the classifier reads, and an incident file keeps
STORAGE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ESTALE", "EIO", "ENOSPC", "EROFS", "EDQUOT", "ENOLINK", "EREMOTEIO")
    if hasattr(errno, name)
)

_OUT_OF_MEMORY = re.compile(
    r"OutOfMemoryError|MemoryError|out of memory|CUDA error: out of memory|NCCL.*(?:OOM|out of memory)"
    r"|DefaultCPUAllocator: can't allocate memory|std::bad_alloc",
    re.IGNORECASE,
)
_STORAGE = re.compile(
    r"Stale file handle|Input/output error|No space left on device|Read-only file system"
    r"|Disk quota exceeded|Remote I/O error|Errno (?:5|28|30|116|121|122)\b",
    re.IGNORECASE,
)
_DATA_STALL = re.compile(
    r"DataLoader worker \(pid\(?s?\)? ?[\d, ]*\)? (?:is killed|exited unexpectedly)|DataLoader timed out"
    r"|DataLoader worker .* (?:killed|exited)",
    re.IGNORECASE,
)
_COMMUNICATION = re.compile(
    r"Connection (?:reset|closed|refused) by peer|Connection reset|Broken pipe|ECONNRESET|EPIPE"
    r"|Timed out waiting|timed out|Timeout|DistBackendError|DistNetworkError|NCCL (?:error|communicator)"
    r"|ncclRemoteError|ncclSystemError|ncclInternalError|gloo|ProcessGroupNCCL|ProcessGroupGloo"
    r"|Socket Timeout|Connection closed",
    re.IGNORECASE,
)
# A DataLoader re-raises its worker's exception in the training process as the same type, with the worker's
# traceback in the message: the root cause is the last line of that traceback.
_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)|[A-Z]\w*): ?(.*)$")


class Raised(NamedTuple):
    """An exception as the classifier sees it: its type's name, its message, its errno if it has one."""

    type: str
    message: str
    errno: int | None = None


def is_cause(text: str, among: tuple[Cause, ...] = CAUSES) -> TypeGuard[Cause]:
    """Whether `text` (a label's value, an incident file's field) is one of `among` (CAUSES)."""
    return text in among


def exception_cause(raised: Raised) -> Cause:
    """The cause an exception names (one of EXCEPTION_CAUSES), by its type, message and errno."""
    text = f"{raised.type}: {raised.message[:MAX_MESSAGE_CHARS]}"
    if _OUT_OF_MEMORY.search(text):
        return "out_of_memory"
    if raised.errno in STORAGE_ERRNOS or _STORAGE.search(text):
        return "storage"
    if _DATA_STALL.search(text):
        return "data_stall"
    if _COMMUNICATION.search(text):
        return "communication"
    return "software_exception"


def is_secondary(cause: str) -> bool:
    """Whether an exception of this cause is what a rank raises when a peer failed first."""
    return cause in SECONDARY_CAUSES


def worker_root_cause(message: str) -> Raised | None:
    """The exception a DataLoader worker raised, from the message its re-raise carries; None if none."""
    if _WORKER_TRACEBACK not in message:
        return None
    lines = [line.strip() for line in message.split(_WORKER_TRACEBACK, 1)[1].splitlines() if line.strip()]
    for line in reversed(lines):
        found = _EXCEPTION_LINE.match(line)
        if found:
            name, text = found.group(1).rsplit(".", 1)[-1], found.group(2)
            code = re.match(r"\[Errno (\d+)\]", text)
            return Raised(name, text[:MAX_MESSAGE_CHARS], int(code.group(1)) if code else None)
    return None


def chain(exception: BaseException, limit: int = 8) -> list[Raised]:
    """The exception and those it was raised from or during (__cause__, __context__), outermost first."""
    found: list[Raised] = []
    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen and len(found) < limit:
        seen.add(id(current))
        code = getattr(current, "errno", None)
        message = _message(current)
        found.append(Raised(type(current).__name__, message, code if isinstance(code, int) else None))
        current = current.__cause__ or current.__context__
    return found


def _message(exception: BaseException) -> str:
    """The exception's text, bounded; its type's name where its __str__ fails (any object may raise)."""
    try:
        return str(exception)[:MAX_MESSAGE_CHARS]
    except Exception:
        return f"<{type(exception).__name__}: unprintable>"


def root_cause(raised_chain: list[Raised]) -> Raised:
    """What really failed: a DataLoader worker's exception where one was re-raised, else the innermost
    exception of the chain that names a cause more specific than software_exception, else the outermost."""
    for raised in raised_chain:
        worker = worker_root_cause(raised.message)
        if worker is not None:
            return worker
    for raised in reversed(raised_chain):
        if exception_cause(raised) != "software_exception":
            return raised
    return raised_chain[0]


class Classified(NamedTuple):
    """An exception classified: its cause, what really failed, and the chain it was found in."""

    cause: Cause
    root: Raised
    chain: list[Raised]


def classify(exception: BaseException) -> Classified:
    """The cause of an exception, from its root cause (a DataLoader worker's, or the chain's innermost)."""
    raised_chain = chain(exception)
    root = root_cause(raised_chain)
    return Classified(exception_cause(root), root, raised_chain)
