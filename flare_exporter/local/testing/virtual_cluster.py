"""A virtual cluster: many ranks' /metrics, rendered by flare's own collectors, served by one process.

Each virtual rank's exposition comes from `attach.build_registry` over a FlareState set up as the hooks, the
timing manager, the stall watcher and the GPU health reader would leave it after `STEPS` steps of a job with
every signal on at its defaults: rank N on host node-<N//8>, in three process groups (world, a data-parallel
group of the ranks with its local rank, a tensor-parallel group of its host's 8 ranks), with collective and
step histograms, sequence numbers, straggler windows, both issue-latency distributions and their drift, and
its GPU's health through the fake NVML. Sequence numbers agree across the members of each group.

Faults, each on one rank:

- hung: stuck in compute before the world group's next all-reduce, which every other rank issued at
  `hung_at` (perf_counter time) and waits in; their stacks say `collective`, the culprit's `compute`;
- straggler: its GPU throttles (hw_thermal_slowdown, SM clock at 70 %), so it computes longest and waits
  least in collectives in every straggler window; the others wait for it;
- dead: not rendered here; the server stops answering for it (see `ClusterServer.kill`).

`ClusterServer` serves every virtual rank on its own loopback port at /metrics (asyncio, HTTP/1.1 keep-alive,
one thread), as a real rank does, so that Prometheus's file_sd targets and `flare diagnose --targets` see
one endpoint per rank. Used by benchmarks/scale.py, benchmarks/post_mortem.py, benchmarks/direct_scrape.py,
benchmarks/rule_cost.py, benchmarks/footprint.py and tests/rank/test_footprint.py.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.utils import floatToGoString

from ...config import Config
from ...rank import file_sd, progress
from ...rank.atomic_files import write_json_atomically
from ...rank.attach import build_registry
from ...rank.exposition import only_samples, render_text, requested_names
from ...rank.gpu_health import GpuHealthMonitor
from ...rank.groups import WORLD, GroupTracker, group_name
from ...rank.identity import RankIdentity
from ...rank.stall import StackSample
from ...rank.state import FlareState
from ...rank.timing import CollectiveStats, CudaEventTiming
from .fake_nvml import FakeNvml, make_device, nvmlClocksEventReasonHwThermalSlowdown

RANKS_PER_HOST = 8  # also the tensor-parallel group size
STEPS = 1200  # steps every rank completed
STEP_SECONDS = 0.25
WAIT_SHARE = 0.2  # share of a healthy rank's step spent waiting in collectives
STRAGGLER_WAIT_SHARE = 0.02  # the straggler computes longest and waits least
CULPRIT_FRAMES = ("model.py:212 forward", "module.py:1736 _call_impl", "train.py:81 train_step")
WAITING_FRAMES = (
    "distributed_c10d.py:2806 all_reduce",
    "c10d_logger.py:81 wrapper",
    "train.py:88 train_step",
)


@dataclass(frozen=True)
class Faults:
    """Which virtual ranks misbehave (None: no such fault). `hung_at`: perf_counter time of the hang."""

    hung: int | None = None
    hung_at: float = 0.0
    straggler: int | None = None


def _fill(histogram: Any, count: int, typical: float) -> None:
    """`count` observations around `typical` (60 % in its bucket, 30 % in the next, 10 % in the one before),
    set at once rather than observed one by one: rendering thousands of ranks must stay cheap."""
    index = bisect_left(histogram.bounds, typical)
    above, below = count * 3 // 10, count // 10
    histogram.counts[index] += count - above - below
    histogram.counts[min(index + 1, len(histogram.counts) - 1)] += above
    histogram.counts[max(index - 1, 0)] += below
    histogram.sum += count * typical


def identity_of(rank: int, world: int, run: str) -> RankIdentity:
    host_index, local_rank = divmod(rank, RANKS_PER_HOST)
    return RankIdentity(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        run=run,
        host=f"node-{host_index}",
        pid=20000 + rank,
        backend="nccl",
        gpu_uuid=f"GPU-{rank:08x}-0000-4000-8000-{host_index:012x}",
        pci_bus_id=f"00000000:{0x18 + 0x10 * local_rank:02X}:00.0",
    )


def group_layout(
    rank: int, world: int
) -> list[tuple[str, int, int, tuple[tuple[str, int, int, float], ...]]]:
    """(name, size, collectives per step, ops: (op, one in this many of them, bytes each, typical seconds))
    of each group of `rank`: the world, its data-parallel group and its host's tensor-parallel group."""
    host_index, local_rank = divmod(rank, RANKS_PER_HOST)
    dp_members = list(range(local_rank, world, RANKS_PER_HOST))
    tp_members = list(range(host_index * RANKS_PER_HOST, min(world, (host_index + 1) * RANKS_PER_HOST)))
    return [
        (WORLD, world, 1, (("allreduce", 1, 8, 0.002), ("broadcast", 400, 4096, 0.001))),
        (group_name("data_parallel", dp_members), len(dp_members), 4, (("allreduce", 1, 25 << 20, 0.04),)),
        (
            group_name("tensor_parallel", tp_members),
            len(tp_members),
            48,
            (
                ("allgather_into_tensor_coalesced", 2, 8 << 20, 0.0006),
                ("reduce_scatter_base", 2, 8 << 20, 0.0007),
            ),
        ),
    ]


def wait_share_of(rank: int, faults: Faults) -> float:
    """Share of the rank's step spent waiting in collectives: the straggler's is the smallest."""
    if rank == faults.straggler:
        return STRAGGLER_WAIT_SHARE
    return WAIT_SHARE * (1 + 0.05 * ((rank * 7919) % 11 - 5) / 5)


def rank_state(
    rank: int, world: int, run: str, perf_now: float, faults: Faults = Faults(), config: Config | None = None
) -> FlareState:
    """The state rank `rank` of a `world`-rank job would hold at `perf_now`, every signal on; started with
    `config` (default: Config(), every key at its default)."""
    identity = identity_of(rank, world, run)
    config = Config() if config is None else config
    state = FlareState.create(config, identity)
    for name, size, _, ops in group_layout(rank, world):
        tracker = GroupTracker(name, size, "nccl", CudaEventTiming(state.manager), state.health)
        state.groups[name] = tracker
        state.manager.add_group(tracker)
        for op, _, _, _ in ops:
            state.manager.stats[(name, op)] = CollectiveStats()
    advance(state, rank, world, STEPS, perf_now, faults)
    straggler = rank == faults.straggler

    # issue latency: both distributions sampled since the start, a baseline and a current window
    assert state.ild is not None
    for latency, typical, per_step in (
        (state.ild.kernel_issue, 4e-4, 40),
        (state.ild.host_dispatch, 1.2e-5, 300),
    ):
        latency.active = True
        samples = STEPS * per_step // (config.ild_dispatch_every_steps if per_step == 300 else 1)
        _fill(latency.histogram, samples, typical)
        latency.drift.current = (0.04 + 0.001 * (rank % 7), typical * 0.03)
    state.ild.host_dispatch.drift.op_shift = 1e-9 * (rank % 11 - 5)  # a few ns either way: healthy
    state.ild.host_gap.drift.current = (0.05 + 0.001 * (rank % 5), 2e-6)  # its drift only, no histogram

    # the rank's GPU, through the fake NVML: throttling on the straggler
    device = make_device(identity.local_rank)
    if straggler:
        device.clock_events = nvmlClocksEventReasonHwThermalSlowdown
        device.sm_clock_mhz = device.sm_clock_max_mhz * 7 // 10
        device.temperature = 91
    state.gpu = GpuHealthMonitor(FakeNvml([device]), 0, state.health)
    state.gpu.open()
    state.gpu.poll()

    if faults.hung is not None:
        hang(state, rank == faults.hung, faults.hung_at)
    state.manager.drain()  # publishes each group's oldest unfinished collective, as a scrape would
    return state


def advance(state: FlareState, rank: int, world: int, steps: int, perf_now: float, faults: Faults) -> None:
    """The rank takes `steps` more steps, the last one ending at `perf_now`, as every rank of the job does:
    counters, histograms, sequence numbers and straggler windows move on consistently across ranks."""
    config = state.config
    before = state.steps.steps
    after = before + steps
    for name, _, per_step, ops in group_layout(rank, world):
        tracker = state.groups[name]
        tracker.last_issued_seq = tracker.last_completed_seq = after * per_step
        tracker._next_seq = itertools.count(after * per_step + 1)
        tracker.last_progress_at = perf_now - 0.06
        for op, one_in, nbytes, typical in ops:
            count = after * per_step // one_in - before * per_step // one_in
            collective = state.manager.stats[(name, op)]
            _fill(collective.durations, count, typical)
            collective.bytes_total += count * nbytes
    _fill(state.steps.durations, steps - (before == 0), STEP_SECONDS)  # step 1 has no duration
    state.steps.steps = after
    state.steps.last_step_at = perf_now - 0.05
    wait_share = wait_share_of(rank, faults)
    kept_steps = config.straggler_window_steps * (config.straggler_windows + 1)
    for step in range(max(2, before + 1, after - kept_steps), after + 1):
        state.windows.ring.add_step(step, STEP_SECONDS, STEP_SECONDS * wait_share)


def hang(state: FlareState, culprit: bool, hung_at: float) -> None:
    """The world group hangs at `hung_at` (perf_counter time), when every rank took its last step and the
    others issued the next world all-reduce; the culprit is stuck in compute and never issued it.

    Every timestamp the rank then exports is `hung_at`: rendered with progress.wall_time pinned (see
    HANG_SENTINEL), a hang's time can be set at once in thousands of rendered pages."""
    state.steps.last_step_at = hung_at
    for tracker in state.groups.values():
        tracker.last_progress_at = hung_at
    if culprit:  # stuck in compute since its last step: never issued the next world collective
        state.stack = StackSample("compute", CULPRIT_FRAMES)
        return
    world_tracker = state.groups[WORLD]
    record = world_tracker.issue("allreduce", None)
    assert record is not None
    record.issued_at = hung_at
    record.nbytes = 8
    world_tracker.pending.append(record)  # what track() does; no backend ever completes it
    state.stack = StackSample("collective", WAITING_FRAMES)
    state.manager.drain()


# A hang rendered at this time, with progress.wall_time the identity, carries it as its only timestamp,
# as these bytes; replacing them with another time's moves the hang there (ClusterServer.set_pages).
HANG_SENTINEL = 1111111111.5
HANG_SENTINEL_TEXT = b"1.1111111115e+09"


def render_phases(
    world: int,
    run: str,
    straggler: int | None,
    hung: int,
    later_steps: int = 40,
    config: Config | None = None,
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Every rank's page three times: healthy (the straggler aside); healthy `later_steps` steps later
    (Prometheus sees the job progress); hung at HANG_SENTINEL right after that (see `hang`). The ranks are
    started with `config` (rank_state's default where None).

    Each rank's state is built once and rendered three times."""
    pages = render_pages(world, run, straggler, hung, later_steps, config)
    return pages.healthy, pages.later, pages.hung


@dataclass(frozen=True)
class PhasePages:
    """Every rank's page (index = rank) in each phase of a job (render_pages)."""

    healthy: list[bytes]
    later: list[bytes]
    hung: list[bytes]
    resumed: list[bytes]  # empty unless asked for


def render_pages(
    world: int,
    run: str,
    straggler: int | None,
    hung: int,
    later_steps: int = 40,
    config: Config | None = None,
    resumed_steps: int = 0,
) -> PhasePages:
    """render_phases' pages, and with `resumed_steps`, a fourth: the hang over (the hung rank issued the
    collective and every rank completed it) and the job `resumed_steps` steps on, so that every sequence
    number moves on from the hung pages', as in a job (the `later` pages' are behind them)."""
    healthy, later, hung_pages, resumed = [], [], [], []
    perf_now = progress.time.perf_counter()
    faults = Faults(straggler=straggler)
    for rank in range(world):
        state = rank_state(rank, world, run, perf_now, faults, config)
        healthy.append(render(state))
        advance(state, rank, world, later_steps, perf_now + later_steps * STEP_SECONDS, faults)
        state.manager.drain()
        later.append(render(state))
        hang(state, rank == hung, HANG_SENTINEL)
        hung_pages.append(render_hung(state, rank))
        if resumed_steps:
            steps = later_steps + resumed_steps
            resume(state, rank, world, resumed_steps, perf_now + steps * STEP_SECONDS, faults)
            resumed.append(render(state))
    return PhasePages(healthy, later, hung_pages, resumed)


def render_hung(state: FlareState, rank: int) -> bytes:
    """The page of a rank after `hang`, every timestamp HANG_SENTINEL."""
    wall_time = progress.wall_time
    progress.wall_time = lambda perf_time: perf_time  # type: ignore[assignment]
    try:
        page = render(state)
    finally:
        progress.wall_time = wall_time  # type: ignore[assignment]
    if HANG_SENTINEL_TEXT not in page:
        raise RuntimeError(f"rank {rank}: the hang's time is not in its page")
    return page


def resume(state: FlareState, rank: int, world: int, steps: int, perf_now: float, faults: Faults) -> None:
    """The hang ends: every collective in flight completes (the hung rank issued its own), and the job
    takes `steps` more steps, the last one ending at `perf_now`."""
    for tracker in state.groups.values():
        for record in tracker.pending:
            record.duration = 0.0
    state.stack = None
    advance(state, rank, world, steps, perf_now, faults)
    state.manager.drain()  # the completed collectives leave the in-flight series


def hung_at(pages: list[bytes], unix_time: float) -> list[bytes]:
    """`pages` from render_phases with the hang moved to `unix_time`."""
    text = floatToGoString(unix_time).encode()
    return [page.replace(HANG_SENTINEL_TEXT, text) for page in pages]


def render(state: FlareState) -> bytes:
    """The rank's /metrics body, as its endpoint serves it."""
    return render_text(build_registry(state))


def render_cluster(
    world: int, run: str, faults: Faults = Faults(), perf_now: float | None = None
) -> list[bytes]:
    """Every rank's exposition (index = rank), real Unix timestamps (progress.wall_time at render time)."""
    now = progress.time.perf_counter() if perf_now is None else perf_now
    return [render(rank_state(rank, world, run, now, faults)) for rank in range(world)]


# ---------------------------------------------------------------------------------------------------------
# serving


class ClusterServer:
    """Serves page `pages[rank]` on a loopback port per rank at /metrics; one asyncio loop on one thread.

    `set_pages` swaps what every rank serves at once (between two requests); `kill(rank)` closes a rank's
    listener and its open connections, so that a scrape of it is refused, as with a rank that died.
    """

    def __init__(self, pages: list[bytes], host: str = "127.0.0.1") -> None:
        self.pages = pages
        self.host = host
        self.ports: list[int] = []
        self.served = itertools.count()
        self.errors = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer | None] = []
        self._connections: dict[int, set[asyncio.StreamWriter]] = {}
        self._filtered: dict[tuple[int, frozenset[str]], tuple[bytes, bytes]] = {}  # _only_samples
        self._thread = threading.Thread(target=self._loop.run_forever, name="virtual-cluster", daemon=True)

    def __enter__(self) -> ClusterServer:
        self._thread.start()
        self._call(self._listen_all())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def targets(self) -> list[str]:
        return [f"{self.host}:{port}" for port in self.ports]

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=600)

    async def _listen_all(self) -> None:
        for rank in range(len(self.pages)):
            server = await asyncio.start_server(
                functools.partial(self._serve, rank),
                self.host,
                0,
                backlog=64,
                reuse_address=True,
            )
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])

    async def _serve(self, rank: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections = self._connections.setdefault(rank, set())
        connections.add(writer)
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                line = request.split(b"\r\n", 1)[0].split()
                path, _, query = line[1].partition(b"?") if len(line) > 1 else (b"", b"", b"")
                if path != b"/metrics":
                    body, status = b"serves /metrics only\n", b"404 Not Found"
                    content_type = b"text/plain"
                else:
                    # as a rank's endpoint answers name[] (exposition.make_app): of its page, those samples
                    names = requested_names(query.decode("latin-1"))
                    page = self.pages[rank]
                    body, status, content_type = (
                        page if names is None else self._only_samples(rank, page, names),
                        b"200 OK",
                        CONTENT_TYPE_PLAIN_0_0_4.encode(),
                    )
                    next(self.served)
                writer.write(
                    b"HTTP/1.1 "
                    + status
                    + b"\r\nContent-Type: "
                    + content_type
                    + b"\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
                if b"connection: close" in request.lower():
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - a virtual rank must never take the others down
            next(self.errors)
        finally:
            connections.discard(writer)
            writer.close()

    def _only_samples(self, rank: int, page: bytes, names: frozenset[str]) -> bytes:
        """only_samples(page, names), kept for the rank's next request of the same page and names: a real
        rank filters its own page on its own host, not on the machine that scrapes thousands of them."""
        kept = self._filtered.get((rank, names))
        if kept is None or kept[0] is not page:
            kept = (page, only_samples(page, names))
            self._filtered[(rank, names)] = kept
        return kept[1]

    def set_pages(self, pages: list[bytes]) -> None:
        """Every rank serves its page of `pages` from the next request on."""

        async def swap() -> None:
            self.pages = pages

        self._call(swap())

    def kill(self, rank: int) -> None:
        """Rank `rank` dies: its listener closes (connections refused) and its open connections drop."""

        async def close() -> None:
            server = self._servers[rank]
            if server is not None:
                server.close()
                self._servers[rank] = None
            for writer in list(self._connections.get(rank, ())):
                writer.close()

        self._call(close())

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            for server in self._servers:
                if server is not None:
                    server.close()
            for writers in self._connections.values():
                for writer in list(writers):
                    writer.close()

        self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def write_file_sd(directory: str, run: str, targets: Iterable[str], world: int) -> str:
    """One file_sd file: a target group per rank, as each rank writes its own (`rank`, `run` labels)."""
    groups = []
    for rank, target in enumerate(targets):
        host, port = target.rsplit(":", 1)
        groups.extend(file_sd.target_document(identity_of(rank, world, run), host, int(port)))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"flare-{run}.json")
    write_json_atomically(path, groups)
    return path


def series_count(text: str) -> int:
    """Samples in an exposition (each is one series in Prometheus)."""
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def label_values(pages: Mapping[int, str] | list[str]) -> dict[str, set[str]]:
    """Every label name seen in the expositions, with the set of its values (to check they are bounded)."""
    from ...engine.scrape import parse

    found: dict[str, set[str]] = {}
    texts = pages.values() if isinstance(pages, Mapping) else pages
    for text in texts:
        for sample in parse(text):
            for name, value in sample.labels.items():
                found.setdefault(name, set()).add(value)
    return found
