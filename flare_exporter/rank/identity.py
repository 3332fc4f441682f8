"""Rank identity: who this process is in the job, read from whatever launcher started it."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, parse_topology

# Each launcher names the same facts differently; the first variable present wins.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# The run id, after the config key run (FLARE_RUN): the first of these that names one wins.
RUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid")
TORCHRUN_NO_RUN_ID = "none"  # what torchrun sets TORCHELASTIC_RUN_ID to when no --rdzv-id is given
DEFAULT_RUN = "default"
# Slurm's step ids from 0xFFFFFFF0 up name its own steps (batch, extern, interactive, pending), not an srun
SLURM_SPECIAL_STEPS = 0xFFFFFFF0


@dataclass(frozen=True)
class RankIdentity:
    """The facts flare_rank_info carries; `rank` and `run` also label every series."""

    rank: int
    local_rank: int
    world_size: int
    run: str
    host: str
    pid: int
    backend: str = ""
    gpu_uuid: str = ""
    pci_bus_id: str = ""
    switch: str = ""  # where the host sits (config key topology); labels of flare_rank_info
    rack: str = ""

    def info_labels(self) -> dict[str, str]:
        """Labels of flare_rank_info beyond rank and run."""
        return {
            "host": self.host,
            "local_rank": str(self.local_rank),
            "world_size": str(self.world_size),
            "backend": self.backend,
            "gpu_uuid": self.gpu_uuid,
            "pci_bus_id": self.pci_bus_id,
            "pid": str(self.pid),
            "switch": self.switch,
            "rack": self.rack,
        }


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        text = environ.get(name, "").strip()
        if text:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"environment variable {name}={text!r} is not an integer") from None
    return default


def from_environment(
    environ: Mapping[str, str], run: str = "", host: str = "", topology: str = ""
) -> RankIdentity:
    """The identity a launcher's environment gives; `run` and `host` override what it says; `topology`
    (the config key's `switch=...,rack=...`) says where the host sits."""
    return RankIdentity(
        rank=_first_int(environ, RANK_VARIABLES, 0),
        local_rank=_first_int(environ, LOCAL_RANK_VARIABLES, 0),
        world_size=_first_int(environ, WORLD_SIZE_VARIABLES, 1),
        run=run_id(environ, run),
        host=host or socket.gethostname(),
        pid=os.getpid(),
        **_topology(topology),
    )


def run_id(environ: Mapping[str, str], run: str = "") -> str:
    """The run id: `run` (the config key run, FLARE_RUN) if given; else torchrun's --rdzv-id (not its
    placeholder `none`); else Slurm's job id, `<job>.<step>` inside an srun step, so that every job and step
    has a run of its own; else Open MPI's job id; else DEFAULT_RUN."""
    if run:
        return run
    for name in RUN_VARIABLES:
        value = environ.get(name, "").strip()
        if not value or (name == "TORCHELASTIC_RUN_ID" and value == TORCHRUN_NO_RUN_ID):
            continue
        if name == "SLURM_JOB_ID":
            step = environ.get("SLURM_STEP_ID", "").strip()
            if step.isdecimal() and int(step) < SLURM_SPECIAL_STEPS:
                return f"{value}.{step}"
        return value
    return DEFAULT_RUN


def default_run_warning(rank_identity: RankIdentity, shared_directory: str) -> str:
    """The one line to log when the run id fell back to DEFAULT_RUN while the rank writes files into
    `shared_directory` (file_sd_dir or the incident directory, which other jobs share): '' if not."""
    if rank_identity.run != DEFAULT_RUN or not shared_directory:
        return ""
    return (
        f"flare-exporter: no run id (FLARE_RUN, torchrun --rdzv-id, SLURM_JOB_ID), so run is {DEFAULT_RUN!r} "
        f"and this job's files in {shared_directory} take the names of any other such job's; set FLARE_RUN "
        "(config key run) to an id unique to this job"
    )


def _topology(text: str) -> dict[str, str]:
    try:
        return parse_topology(text)
    except ValueError as error:
        raise ConfigError(f"key 'topology': {error}") from None


def gpu_identity(cuda: Any) -> tuple[str, str]:
    """(UUID, PCI bus id) of the current CUDA device, as NVML and dcgm-exporter write them; ('', '') if none.

    `cuda` is `torch.cuda` (a fake in tests). Call it on the training thread: the current device is
    per thread.
    """
    try:
        if not cuda.is_available():
            return "", ""
        properties = cuda.get_device_properties(cuda.current_device())
    except Exception:  # no driver, or a broken one: identity without a GPU is still identity
        return "", ""
    uuid = str(getattr(properties, "uuid", "") or "")
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    pci = [getattr(properties, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    pci_bus_id = "" if None in pci else f"{pci[0]:08X}:{pci[1]:02X}:{pci[2]:02X}.0"
    return uuid, pci_bus_id
