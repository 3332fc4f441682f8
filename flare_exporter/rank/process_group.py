"""See every collective of every process group by wrapping the process-group backend.

`install()` registers the backends `flare_gloo` and `flare_nccl` with `dist.Backend.register_backend`.
Each creates the real ProcessGroupGloo / ProcessGroupNCCL and wraps it:

- gloo, with flare's torch extension built (cpp_recorder.py): in its recording backend (csrc/collectives.cpp),
  a c10d Backend that records each collective in C++ and delegates it; torch registers it as the group's
  CPU backend, so the training thread runs no Python for a collective (timing.NativeTiming);
- otherwise (NCCL, gloo without the extension or with `native_collectives` off): in a FlareProcessGroup,
  a `dist.ProcessGroup` subclass whose Python methods record each collective, then delegate it.

Either way the wrapper is what the group calls, so collectives issued from C++ (DDP's bucket all-reduce,
FSDP, functional collectives, Megatron) go through it as well as Python calls.

So that unmodified scripts use it, `install()` wraps torch's group factory
(`distributed_c10d._new_process_group_helper`): a request for `gloo` or `nccl` builds `flare_gloo` /
`flare_nccl` instead, and the group is then recorded under its real backend name so that
`dist.get_backend()` still answers `gloo` or `nccl` and later `new_group()` calls are wrapped too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import cpp_recorder
from .exporter_health import ExporterHealth
from .groups import GroupTracker, group_name
from .timing import CudaEventTiming, FutureTiming, NativeTiming, TimingBackend, TimingManager

log = logging.getLogger("flare_exporter")

# ProcessGroup method -> index of the argument holding the tensors it sends (None: no payload).
# scatter and the receives count what they receive. One method per op of label_values.COLLECTIVE_OPS, in
# its order, the op its name less a leading _ (tests/rank/test_recording_backend.py checks them, and the C++
# recorder's).
WRAPPED_METHODS: dict[str, int | None] = {
    "allreduce": 0,
    "allreduce_coalesced": 0,
    "broadcast": 0,
    "reduce": 0,
    "allgather": 1,
    "_allgather_base": 1,
    "allgather_coalesced": 1,
    "allgather_into_tensor_coalesced": 1,
    "gather": 1,
    "scatter": 0,
    "reduce_scatter": 1,
    "_reduce_scatter_base": 1,
    "reduce_scatter_tensor_coalesced": 1,
    "alltoall": 1,
    "alltoall_base": 1,
    "send": 0,
    "recv": 0,
    "recv_anysource": 0,
    "barrier": None,
}
# torch 2.13 names ProcessGroup's tensor collectives as torchcomms does, the names above kept as deprecated
# aliases: c10d's all_gather_into_tensor and reduce_scatter_tensor (FSDP2's all-gathers and reduce-scatters),
# all_to_all_single and their coalesced forms call these, whose base implementation goes to the registered
# backend, past the Python method of the old name. Each is recorded as the method it renames (the op label
# the C++ recorder, a c10d Backend with only the old names, gives it) and delegated to it.
# tests/rank/test_entry_points.py checks that each communication entry point torch offers is wrapped here or
# deliberately left alone.
RENAMED_METHODS: dict[str, str] = {
    "all_gather_single": "_allgather_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all_single": "alltoall_base",
}
WRAPPED_BACKENDS = ("gloo", "nccl")
PEER_OPS = frozenset({"send", "recv"})  # point-to-point ops whose second argument is the peer's group rank


class FlareProcessGroup(dist.ProcessGroup):
    """A process group that records each collective, then delegates it to the real backend."""

    def __init__(self, inner: Any, rank: int, size: int, tracker: GroupTracker) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload stubs omit
        self._inner = inner
        self._tracker = tracker
        self._rank, self._size = rank, size
        # method -> the real backend's, bound once; a method its Python binding lacks (gloo's
        # allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced) goes through a plain
        # ProcessGroup of the real backend (_through_process_group)
        self._delegates = {
            method: getattr(inner, method) for method in WRAPPED_METHODS if hasattr(inner, method)
        }

    def getBackendName(self) -> str:
        return self._tracker.backend_name

    def _collective(self, method: str, op: str, payload_index: int | None, args: tuple, kwargs: dict) -> Any:
        tracker = self._tracker
        payload = args[payload_index] if payload_index is not None and len(args) > payload_index else None
        peer = (
            args[1] if op in PEER_OPS and len(args) > 1 else -1
        )  # send(tensors, dst, tag), recv(.., src, ..)
        record = tracker.issue(op, payload, peer)
        delegate = self._delegates.get(method) or self._through_process_group(method)
        work = delegate(*args, **kwargs)  # the user's collective: its errors are theirs
        return tracker.track(record, work)

    def _through_process_group(self, method: str) -> Callable[..., Any]:
        """`method` of a plain (C++) ProcessGroup whose backend is the real one: it reaches the backend's
        C++ method through torch's dispatcher where the backend's Python binding has none."""
        backend = self._tracker.backend_name
        plain = dist.ProcessGroup(self._rank, self._size)  # type: ignore[call-arg]
        plain._register_backend(
            torch.device("cuda" if backend == "nccl" else "cpu"), _backend_type(backend), self._inner
        )
        plain._set_default_backend(_backend_type(backend))
        delegate = self._delegates[method] = getattr(plain, method)
        return delegate


class WaitedWork(dist.Work):
    """A work whose completion only its wait() shows: gloo's reduce_scatter has no future, and its
    is_completed() stays False after the collective completed. Its first wait() that returns calls
    `on_waited(failed)` (as csrc/collectives.cpp's WaitedWork stamps its record); the rest is the real work's.
    """

    def __init__(self, inner: Any, on_waited: Callable[[bool], None]) -> None:
        super().__init__()
        self._inner = inner
        self._on_waited: Callable[[bool], None] | None = on_waited

    def wait(self, timeout: Any = None) -> bool:
        try:
            done = bool(self._inner.wait() if timeout is None else self._inner.wait(timeout))
        except BaseException:
            self._waited(failed=True)
            raise
        if done:
            self._waited(failed=False)
        return done

    def _waited(self, failed: bool) -> None:
        on_waited, self._on_waited = self._on_waited, None
        if on_waited is not None:
            on_waited(failed)

    def is_completed(self) -> bool:
        return self._on_waited is None or bool(self._inner.is_completed())

    def get_future(self) -> Any:
        return self._inner.get_future()

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()


def _make_method(method: str, payload_index: int | None, name: str = "") -> Callable[..., Any]:
    """The FlareProcessGroup method `name` (default: `method`), which records and delegates `method`."""
    op = method.lstrip("_")  # the op label: _allgather_base -> allgather_base

    def collective(self: FlareProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._collective(method, op, payload_index, args, kwargs)

    collective.__name__ = name or method
    collective.__doc__ = f"Record, then delegate {method} to the real backend."
    return collective


for _method, _payload_index in WRAPPED_METHODS.items():
    setattr(FlareProcessGroup, _method, _make_method(_method, _payload_index))
for _name, _method in RENAMED_METHODS.items():
    setattr(FlareProcessGroup, _name, _make_method(_method, WRAPPED_METHODS[_method], _name))


class Wrapping:
    """What install() needs to build groups: the shared state, and the group being created now."""

    def __init__(
        self,
        groups: dict[str, GroupTracker],
        manager: TimingManager,
        health: ExporterHealth,
        max_groups: int,
        on_group: Callable[[str, int, int, str], None],
        native_collectives: bool = True,
    ) -> None:
        self.groups = groups
        self.native_collectives = native_collectives
        self.on_group = on_group
        self.manager = manager
        self.health = health
        self.max_groups = max_groups
        self.creating_description = ""
        self.unwrapped_backends: set[str] = set()
        self.unobserved = False  # set while the canary creates its own groups (unobserved() below)
        self.original_helper: Callable[..., Any] | None = None

    def create(self, backend_name: str, options: Any, backend_options: Any) -> Any:
        """The backend creator registered with torch (extended API)."""
        inner = _create_inner(backend_name, options, backend_options)
        try:
            name = group_name(self.creating_description, list(options.global_ranks_in_group))
            if name in self.groups:  # the same ranks grouped again: members create groups in one order
                name += f"-{sum(1 for known in self.groups if known.startswith(name))}"
            if len(self.groups) >= self.max_groups:
                self.health.drop("process_groups")
                return inner  # unwrapped: still correct, just not observed
            timing = self._timing(backend_name)
            tracker = GroupTracker(
                name,
                options.group_size,
                backend_name,
                timing,
                self.health,
                self.manager.queue_size,
                global_ranks=list(options.global_ranks_in_group),
                group_rank=options.group_rank,
            )
            if isinstance(timing, NativeTiming):
                wrapper = timing.wrap(inner)  # a c10d Backend: torch registers it for the CPU
            else:
                wrapper = FlareProcessGroup(inner, options.group_rank, options.group_size, tracker)
                wrapper._register_backend(
                    torch.device("cuda" if backend_name == "nccl" else "cpu"),
                    _backend_type(backend_name),
                    inner,
                )
        except Exception as error:
            self.health.error("process_group_wrap", error)
            return inner
        self.groups[name] = tracker
        self.manager.add_group(tracker)
        if isinstance(timing, NativeTiming):
            self.manager.add_log(timing, tracker)
        self.on_group(name, options.group_rank, options.group_size, backend_name)
        return wrapper

    def _timing(self, backend_name: str) -> TimingBackend:
        """NCCL: its CUDA events. gloo: the extension's recording backend, with no Python on the training
        thread (unless `native_collectives` is off); without the extension, Python hooks and a callback."""
        if backend_name == "nccl":
            return CudaEventTiming(self.manager)
        extension = cpp_recorder.load()
        if self.native_collectives and hasattr(extension, "wrap_backend"):
            return NativeTiming(self.manager, extension)
        return FutureTiming(self.manager, extension, WaitedWork)

    def helper(
        self,
        group_size: int,
        group_rank: int,
        global_ranks: list[int],
        backend: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Replacement for torch's _new_process_group_helper that swaps in the flare backends."""
        assert self.original_helper is not None
        real = _wrappable(backend)
        if self.unobserved:
            return self.original_helper(group_size, group_rank, global_ranks, backend, *args, **kwargs)
        if real is None:
            if str(backend) not in self.unwrapped_backends:
                self.unwrapped_backends.add(str(backend))
                log.warning(
                    "flare-exporter: process groups with backend %r are not observed "
                    "(flare wraps plain 'gloo' and 'nccl')",
                    str(backend),
                )
            return self.original_helper(group_size, group_rank, global_ranks, backend, *args, **kwargs)
        self.creating_description = str(kwargs.get("group_desc") or "")
        pg, prefix_store = self.original_helper(
            group_size, group_rank, global_ranks, "flare_" + real, *args, **kwargs
        )
        if pg in c10d._world.pg_map:  # answer get_backend() with the real name
            c10d._world.pg_map[pg] = (real, c10d._world.pg_map[pg][1])
        return pg, prefix_store


def _wrappable(backend: Any) -> str | None:
    """The real backend ('gloo'/'nccl') a group request resolves to, if flare can wrap it."""
    name = str(backend or "undefined").lower()
    if name == "undefined":
        name = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return name if name in WRAPPED_BACKENDS else None


def _backend_type(backend_name: str) -> Any:
    return getattr(dist.ProcessGroup.BackendType, backend_name.upper())


def _create_inner(backend_name: str, options: Any, backend_options: Any) -> Any:
    if backend_name == "gloo":
        from torch.distributed import ProcessGroupGloo

        if backend_options is not None:
            gloo = ProcessGroupGloo(options.store, options.group_rank, options.group_size, backend_options)
        else:
            gloo = ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)
        gloo._set_sequence_number_for_group()  # as torch does for the groups it creates itself
        return gloo
    from torch.distributed import ProcessGroupNCCL

    nccl_options = backend_options or ProcessGroupNCCL.Options()
    nccl_options._timeout = options.timeout
    return ProcessGroupNCCL(options.store, options.group_rank, options.group_size, nccl_options)


_installed: Wrapping | None = None


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Process groups created inside the block are neither wrapped nor tracked: the canary's own, whose
    benchmark collectives are no part of the training's signals."""
    wrapping = _installed
    if wrapping is None:
        yield
        return
    wrapping.unobserved = True
    try:
        yield
    finally:
        wrapping.unobserved = False


def install(wrapping: Wrapping) -> None:
    """Make every gloo/NCCL group created from now on a FlareProcessGroup. Idempotent per process."""
    global _installed
    if _installed is not None:
        return
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    # NCCL records start/end CUDA events on its stream only when asked, before groups are created.
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    for real in WRAPPED_BACKENDS:
        devices = ["cuda"] if real == "nccl" else ["cpu"]
        dist.Backend.register_backend(
            "flare_" + real,
            lambda options, backend_options, real=real: wrapping.create(real, options, backend_options),
            extended_api=True,
            devices=devices,
        )
    wrapping.original_helper = c10d._new_process_group_helper
    c10d._new_process_group_helper = wrapping.helper  # type: ignore[assignment]
    _installed = wrapping
