"""Rank identity from the launcher's environment: torchrun, Slurm, OpenMPI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flare_exporter import __version__, spec
from flare_exporter.config import Config, ConfigError
from flare_exporter.rank import file_sd, identity
from flare_exporter.rank.identity import gpu_identity

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "job-42"}
SLURM = {"SLURM_PROCID": "17", "SLURM_LOCALID": "3", "SLURM_NTASKS": "32", "SLURM_JOB_ID": "123456"}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "16",
    "OMPI_MCA_ess_base_jobid": "2871",
}


def facts(rank_identity: identity.RankIdentity) -> tuple[int, int, int, str]:
    return (rank_identity.rank, rank_identity.local_rank, rank_identity.world_size, rank_identity.run)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (TORCHRUN, (5, 1, 8, "job-42")),
        (SLURM, (17, 3, 32, "123456")),
        (OPENMPI, (6, 2, 16, "2871")),
        ({}, (0, 0, 1, "default")),
    ],
    ids=["torchrun", "slurm", "openmpi", "none"],
)
def test_identity_from_launcher(environ, expected):
    rank_identity = identity.from_environment(environ)
    assert facts(rank_identity) == expected
    assert rank_identity.host == socket.gethostname()
    assert rank_identity.pid == os.getpid()


def test_torchrun_wins_over_slurm():
    # torchrun started inside a Slurm allocation: torchrun's per-process variables are the right ones
    assert facts(identity.from_environment({**SLURM, **TORCHRUN})) == (5, 1, 8, "job-42")


def test_torchrun_none_run_id_is_default():
    environ = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}
    assert identity.from_environment(environ).run == "default"


def test_empty_variables_are_skipped():
    environ = {"RANK": "", "SLURM_PROCID": "4", "TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": "99"}
    rank_identity = identity.from_environment(environ)
    assert rank_identity.rank == 4
    assert rank_identity.run == "99"


# torchrun started by srun on each node, without --rdzv-id: TORCHELASTIC_RUN_ID is torchrun's placeholder
SLURM_TORCHRUN = {**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}


def test_under_slurm_torchruns_placeholder_gives_way_to_the_job_id(tmp_path):
    first = identity.from_environment({**SLURM_TORCHRUN, "SLURM_JOB_ID": "1001"})
    second = identity.from_environment({**SLURM_TORCHRUN, "SLURM_JOB_ID": "1002"})
    assert (first.run, second.run) == ("1001", "1002")
    assert file_sd.target_path(str(tmp_path), first) != file_sd.target_path(str(tmp_path), second)
    file_sd.write_target(str(tmp_path), first, "127.0.0.1", 21400)
    file_sd.write_target(str(tmp_path), second, "127.0.0.1", 21400)
    assert len(list(tmp_path.iterdir())) == 2  # neither job's target overwrites the other's


def test_an_srun_step_is_a_run_of_its_own():
    assert identity.from_environment({**SLURM_TORCHRUN, "SLURM_STEP_ID": "2"}).run == "123456.2"
    assert identity.from_environment({**SLURM, "SLURM_STEP_ID": "0"}).run == "123456.0"
    # Slurm's own steps (batch script: 0xFFFFFFFB) and anything that is not a step number add nothing
    for step in ("4294967291", "batch", "", " "):
        assert identity.from_environment({**SLURM, "SLURM_STEP_ID": step}).run == "123456"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({**SLURM_TORCHRUN, "SLURM_STEP_ID": "1"}, "123456.1"),
        ({**SLURM_TORCHRUN, "TORCHELASTIC_RUN_ID": "job-42"}, "job-42"),
        ({**OPENMPI, "TORCHELASTIC_RUN_ID": "none"}, "2871"),
        ({**OPENMPI, **SLURM}, "123456"),
        ({"TORCHELASTIC_RUN_ID": "none"}, identity.DEFAULT_RUN),
    ],
)
def test_run_id_precedence(environ, expected):
    assert identity.from_environment(environ).run == expected
    assert identity.from_environment(environ, run="flare-run").run == "flare-run"  # FLARE_RUN wins


def test_a_default_run_in_a_shared_directory_is_warned_about():
    unnamed = identity.from_environment({"TORCHELASTIC_RUN_ID": "none"})
    warning = identity.default_run_warning(unnamed, "/shared/targets")
    assert "'default'" in warning and "/shared/targets" in warning and "FLARE_RUN" in warning
    assert "\n" not in warning
    assert identity.default_run_warning(unnamed, "") == ""  # no shared directory: nothing to collide in
    assert identity.default_run_warning(identity.from_environment(SLURM_TORCHRUN), "/shared") == ""


@pytest.mark.process
def test_attach_logs_the_default_run_warning_once(tmp_path):
    pytest.importorskip("torch")
    environ = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FLARE_", "TORCHELASTIC_", "SLURM_", "OMPI_"))
    }
    environ.update(FLARE_FILE_SD_DIR=str(tmp_path), FLARE_PORT="0", FLARE_GPU_HEALTH="0")
    code = "import flare_exporter; flare_exporter.attach()"
    result = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "FLARE_RUN" in line]
    assert len(lines) == 1 and str(tmp_path) in lines[0], result.stderr


def test_build_info_names_the_versions_and_the_recorder():
    pytest.importorskip("torch")
    import torch

    from flare_exporter.rank.collectors import Families
    from flare_exporter.rank.collectors.identity import IdentityCollector
    from flare_exporter.rank.state import FlareState

    state = FlareState.create(Config(gpu_health=False), identity.from_environment(TORCHRUN))
    families = {f.name: f for f in IdentityCollector(state).collect(Families(("5", "job-42")))}
    (sample,) = families["flare_exporter_build_info"].samples
    metric = spec.BY_NAME["flare_exporter_build_info"]
    assert tuple(sample.labels) == (*spec.COMMON_LABELS, *metric.labels)
    assert sample.labels["version"] == __version__
    assert sample.labels["torch"] == str(torch.__version__)
    assert sample.labels["python"] == ".".join(map(str, sys.version_info[:3]))
    assert sample.labels["cpp_recorder"] in ("cpp", "python")
    assert sample.value == 1


def test_explicit_run_and_host_override():
    rank_identity = identity.from_environment(TORCHRUN, run="my-run", host="node-7")
    assert rank_identity.run == "my-run"
    assert rank_identity.host == "node-7"
    assert rank_identity.rank == 5


@pytest.mark.parametrize("variable", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID"])
def test_non_integer_variable_names_it(variable):
    with pytest.raises(ValueError, match=variable):
        identity.from_environment({variable: "zero"})


def test_info_labels():
    rank_identity = identity.RankIdentity(
        rank=3, local_rank=1, world_size=4, run="r", host="h", pid=77, backend="gloo", gpu_uuid="GPU-x"
    )
    labels = rank_identity.info_labels()
    assert list(labels) == [
        "host",
        "local_rank",
        "world_size",
        "backend",
        "gpu_uuid",
        "pci_bus_id",
        "pid",
        "switch",
        "rack",
    ]
    assert labels == {
        "host": "h",
        "local_rank": "1",
        "world_size": "4",
        "backend": "gloo",
        "gpu_uuid": "GPU-x",
        "pci_bus_id": "",
        "pid": "77",
        "switch": "",
        "rack": "",
    }
    assert all(isinstance(value, str) for value in labels.values())


def test_topology_gives_switch_and_rack():
    placed = identity.from_environment(TORCHRUN, topology="switch=leaf-1,rack=r7")
    assert (placed.switch, placed.rack) == ("leaf-1", "r7")
    assert placed.info_labels()["switch"] == "leaf-1" and placed.info_labels()["rack"] == "r7"
    assert identity.from_environment(TORCHRUN, topology="rack=r7").switch == ""
    with pytest.raises(ConfigError, match="topology"):
        identity.from_environment(TORCHRUN, topology="row=3")


def test_info_labels_match_the_spec():
    rank_identity = identity.from_environment({})
    assert tuple(rank_identity.info_labels()) == spec.BY_NAME["flare_rank_info"].labels


class FakeProperties:
    uuid = "5d1f4c3e-0000-1111-2222-333344445555"
    pci_domain_id, pci_bus_id, pci_device_id = 0, 0x3B, 0


class FakeCuda:
    """torch.cuda as the identity code sees it on a GPU machine."""

    def __init__(self, available: bool = True, device: int = 0, properties: object = FakeProperties()):
        self.available, self.device, self.properties = available, device, properties
        self.asked_for: list[int] = []

    def is_available(self) -> bool:
        return self.available

    def current_device(self) -> int:
        return self.device

    def get_device_properties(self, index: int) -> object:
        self.asked_for.append(index)
        return self.properties


def test_gpu_identity_formats_uuid_and_pci_bus_id_as_nvml_does():
    cuda = FakeCuda(device=3)
    assert gpu_identity(cuda) == ("GPU-5d1f4c3e-0000-1111-2222-333344445555", "00000000:3B:00.0")
    assert cuda.asked_for == [3]  # the rank's own (current) device


def test_gpu_identity_without_gpu_or_pci_fields_is_empty_not_an_error():
    assert gpu_identity(FakeCuda(available=False)) == ("", "")

    class OnlyUuid:
        uuid = "GPU-abc"

    assert gpu_identity(FakeCuda(properties=OnlyUuid())) == ("GPU-abc", "")

    class Broken(FakeCuda):
        def get_device_properties(self, index: int) -> object:
            raise RuntimeError("CUDA driver version is insufficient")

    assert gpu_identity(Broken()) == ("", "")
