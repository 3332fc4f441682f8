"""attach(): start observing this process as one rank of a distributed job."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed
from prometheus_client import CollectorRegistry

from .. import config as config_module
from . import cpp_recorder, file_sd, gpu_health, identity, process_group, profile_trigger, trackers
from .canary import Canary
from .collectors import Collector
from .collectors.canary import CanaryCollector
from .collectors.collectives import CollectivesCollector
from .collectors.exporter import ExporterCollector
from .collectors.gpu_health import GpuHealthCollector
from .collectors.host_load import HostLoadCollector
from .collectors.identity import IdentityCollector
from .collectors.ild import IldCollector
from .collectors.in_flight import InFlightCollector
from .collectors.perf import PerfCollector
from .collectors.profile import ProfileCollector
from .collectors.progress import ProgressCollector
from .collectors.shim import ShimCollector
from .collectors.stragglers import StragglersCollector
from .exposition import FlareCollector, MetricsServer, serve
from .groups import WORLD
from .incident import IncidentWriter
from .perf import PerfMonitor, PhaseClock
from .profiler import Profiler
from .stall import StallWatcher
from .state import FlareState

log = logging.getLogger("flare_exporter")


@dataclass
class Attachment:
    """A rank's running exporter: its state, registry, endpoint (None if not served) and target file."""

    state: FlareState
    registry: CollectorRegistry
    server: MetricsServer | None
    target_file: str | None
    incidents: IncidentWriter
    watcher: StallWatcher

    def close(self) -> None:
        """Stop the timing manager and the endpoint; withdraw the target file unless the rank is dying of an
        exception (then Prometheus keeps the target, sees it down, and `up` names the rank)."""
        self.watcher.stop()
        self.state.steps.remove()
        if self.state.canary is not None:
            self.state.canary.remove()
        if self.state.ild is not None:
            self.state.ild.remove()
        if self.state.perf is not None and self.state.perf.clock is not None:
            self.state.perf.clock.remove()
        self.state.manager.stop()
        if self.state.gpu is not None:
            self.state.gpu.stop()
        if self.target_file and self.state.exception is None:  # first: Prometheus drops it before it fails
            file_sd.remove_target(self.target_file)
        if self.server is not None:
            self.server.close()


_attachment: Attachment | None = None


def attached() -> Attachment | None:
    """This process's running exporter, if attach() started one."""
    return _attachment


@lru_cache(maxsize=1)  # the same str objects at every scrape, as the text format's kept labels want
def rank_labels(rank: int, run: str) -> tuple[str, str]:
    """The values of the labels every flare series carries: rank and run."""
    return str(rank), run


def build_registry(state: FlareState) -> CollectorRegistry:
    """A registry exposing every collector over `state`, with the rank's rank/run labels."""
    registry = CollectorRegistry()
    collectors: list[Collector] = [
        IdentityCollector(state),
        CollectivesCollector(state),
        InFlightCollector(state),
        IldCollector(state),
        ProgressCollector(state),
        StragglersCollector(state),
        PerfCollector(state),
        GpuHealthCollector(state),
        HostLoadCollector(state),
        ExporterCollector(state),
    ]
    if state.canary is not None:  # the canary on: its series, and its collector's meta-metrics
        collectors.insert(-1, CanaryCollector(state))
    if state.config.profile:  # the profiler on: its captures (off, a scrape collects nothing of it)
        collectors.insert(-1, ProfileCollector(state))
    if state.shim_feed is not None:  # the shim loaded: the NCCL calls it sampled
        collectors.insert(-1, ShimCollector(state))
    # Each scrape first drains the timing manager, once: collectives completed up to the scrape are counted
    # and leave the in-flight state, resolved device events and closed ILD windows count, straggler windows
    # close. The collectors read what the drain left. Before it, the scrape waits for the rank's next
    # collective (up to scrape_wait_seconds), so that it renders while training waits for that collective.
    wait_seconds = state.config.scrape_wait_seconds
    registry.register(
        FlareCollector(
            collectors,
            lambda: rank_labels(state.identity.rank, state.identity.run),
            state.health,
            prepare=lambda: state.manager.scrape_drain(wait_seconds),
            prepare_component="timing_manager",
        )
    )
    return registry


def start_gpu_health(state: FlareState) -> None:
    """Watch the rank's own GPU through NVML if enabled and available; its UUID and PCI bus id go into
    flare_rank_info so that dcgm-exporter's series join to the rank."""
    config = state.config
    if not config.gpu_health:
        return
    nvml = gpu_health.load_nvml(config.nvml_module)
    selector = gpu_health.device_selector(state.identity.local_rank, os.environ)
    monitor = gpu_health.GpuHealthMonitor(nvml, selector, state.health, config.gpu_health_interval_seconds)
    state.gpu = monitor
    if monitor.open():
        state.identity = dataclasses.replace(
            state.identity, gpu_uuid=monitor.uuid, pci_bus_id=monitor.pci_bus_id
        )
        monitor.start()


def make_canary(state: FlareState) -> Canary | None:
    """The hardware canary (rank/canary.py), unless `canary` is off; install() hooks it in."""
    if state.config.canary == "off":
        return None
    return Canary(
        state.config,
        lambda: state.identity,
        state.health,
        lambda: state.steps.steps,
        lambda: state.gpu if state.gpu is not None and state.gpu.up else None,
    )


def start_perf(state: FlareState) -> None:
    """The step breakdown and MFU (rank/perf.py), unless `perf` is off: its hooks after the step counter's."""
    config = state.config
    if not config.perf:
        return
    sampler = state.ild.dispatch if state.ild is not None else None  # host gaps: timed in its windows
    host_gaps, every = (sampler.host_gaps, sampler.every) if sampler is not None else (None, 0)
    clock = PhaseClock(state.steps, state.health, config.perf_flops_step, host_gaps, every)
    clock.install()

    def device_name() -> str:
        gpu = state.gpu
        return gpu.device_name() if gpu is not None and gpu.up else ""

    state.perf = PerfMonitor(clock, config, device_name)
    state.windows.step_listeners.append(state.perf.on_step)


def make_profiler(state: FlareState) -> Profiler | None:
    """The profiler, its step hook installed, where the rank was started with `profile: on`; else None."""
    config = state.config
    if not config.profile:
        return None
    profiler = Profiler(
        state.health,
        config.profile_max_steps,
        config.profile_cooldown_seconds,
        config.incident_directory,
        state.identity.run,
        state.identity.rank,
        config.profile_keep,
        config.profile_max_trace_bytes,
    )
    profiler.install()
    return profiler


def say_which_recorder(state: FlareState, config: config_module.Config) -> None:
    """One line on local rank 0: the C++ recorder or the Python hooks record the collectives, and why; where
    the recorder is not built (a plain `pip install`), its build started in the background for the next
    launch (config `cpp_recorder_build`)."""
    if state.identity.local_rank != 0:
        return
    built = cpp_recorder.load() is not None
    started = ""
    if not built and config.cpp_recorder_build:
        started = cpp_recorder.build_later()
    print(
        cpp_recorder.startup_line(built and config.native_collectives, started), file=sys.stderr, flush=True
    )


def start_server(state: FlareState, registry: CollectorRegistry) -> tuple[MetricsServer | None, str | None]:
    """Serve /metrics on the configured port (plus the local rank) and write the rank's file_sd target:
    (the server, the target file); None for what is not configured or failed."""
    config = state.config
    if not config.port:
        return None, None
    server = serve(
        registry,
        config.addr,
        config.port + state.identity.local_rank,
        state.identity.rank,
        config.web_config_file,
        state.health,
        state.scrapes,
        state.profiler,
    )
    if server is None or not config.file_sd_dir:
        return server, None
    return server, file_sd.write_target(config.file_sd_dir, state.identity, config.addr, server.port)


def peer_address(config: config_module.Config, server: MetricsServer | None) -> str:
    """Where the rank's peers ask it for a capture (host:port): '' without a server, or behind a secured
    one (a rank holds no password to ask its peers with)."""
    if server is None or config.web_config_file:
        return ""
    return file_sd.reachable_address(config.addr, server.port)


def attach(config: config_module.Config | None = None) -> Attachment:
    """Observe this process: wrap process groups, hook optimizer steps, serve /metrics. Once per process.

    Call it before `torch.distributed.init_process_group` so that every group is seen. Without `config`,
    the configuration comes from FLARE_CONFIG and the FLARE_* environment.
    """
    global _attachment
    if _attachment is not None:
        return _attachment
    config = config or config_module.load()
    rank_identity = identity.from_environment(os.environ, config.run, config.host, config.topology)
    shared_directory = config.file_sd_dir or config.incident_directory  # other jobs write there too
    if warning := identity.default_run_warning(rank_identity, shared_directory):
        log.warning("%s", warning)
    state = FlareState.create(config, rank_identity)
    start_gpu_health(state)
    state.canary = make_canary(state)
    registry = build_registry(state)

    def on_group(tracker_name: str, rank: int, size: int, backend: str) -> None:
        if tracker_name != WORLD:
            return
        # The launcher may not have said who we are; the world group does. Created on the training
        # thread, after torch.cuda.set_device() in a well-behaved script: the rank's GPU is current.
        gpu_uuid, pci_bus_id = identity.gpu_identity(torch.cuda) if backend == "nccl" else ("", "")
        if state.gpu is not None and gpu_uuid:
            state.gpu.preferred_uuid = gpu_uuid  # torch's current device wins over the LOCAL_RANK guess
        elif state.gpu is not None and state.gpu.uuid:
            gpu_uuid, pci_bus_id = state.gpu.uuid, state.gpu.pci_bus_id
        state.identity = dataclasses.replace(
            state.identity,
            rank=rank,
            world_size=size,
            backend=backend,
            gpu_uuid=gpu_uuid,
            pci_bus_id=pci_bus_id,
        )

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        log.warning(
            "flare-exporter: attach() after init_process_group: groups created so far are not observed"
        )
    process_group.install(
        process_group.Wrapping(
            state.groups, state.manager, state.health, config.max_groups, on_group, config.native_collectives
        )
    )
    say_which_recorder(state, config)
    state.steps.install()
    if state.ild is not None:
        state.ild.install()
    start_perf(state)
    if state.canary is not None:  # its step hook after the step counter's: it reads the step just counted
        state.canary.install()
    state.profiler = make_profiler(state)
    trackers.make_trackers(state)
    state.manager.start()
    incidents = IncidentWriter(state)
    incidents.install()
    watcher = StallWatcher(state, threading.get_ident(), incidents.on_hang)  # this thread trains
    watcher.start()

    server, target_file = start_server(state, registry)
    profile_trigger.make_trigger(state, peer_address(config, server))
    _attachment = Attachment(state, registry, server, target_file, incidents, watcher)
    atexit.register(_attachment.close)
    atexit.register(incidents.on_exit)  # before close (atexit runs the last registered first)
    return _attachment
