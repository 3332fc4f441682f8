"""Configuration: one typed, frozen Config, from a YAML file, then `FLARE_*` environment, then flags.

Later sources override earlier ones. Every key has the same name in all three places: YAML `file_sd_dir`,
environment `FLARE_FILE_SD_DIR`, flag `--file-sd-dir`. Unknown keys and bad values raise ConfigError,
whose message names the key and where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "FLARE_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and its source."""


def _setting(default: Any, help: str, check: Callable[[Any], bool] = lambda _: True, rule: str = "") -> Any:
    return field(default=default, metadata={"help": help, "check": check, "rule": rule})


def _between(low: float, high: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: low <= value <= high), f"between {low} and {high}"


def _label_safe(value: str) -> bool:
    return len(value) <= 128 and "\n" not in value


TOPOLOGY_KEYS = ("switch", "rack")  # the shared fault domains above a host, labels of flare_rank_info
_TOPOLOGY_VALUE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
TOPOLOGY_RULE = (
    "comma-separated key=value pairs, keys switch and rack, each value 1 to 64 characters of "
    "[A-Za-z0-9_.:-], e.g. switch=leaf-07,rack=r12"
)


def parse_topology(text: str) -> dict[str, str]:
    """The topology a `switch=...,rack=...` value names; ValueError (saying what is wrong) if it is bad."""
    found: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or key not in TOPOLOGY_KEYS or key in found:
            raise ValueError(f"{item.strip()!r}: expected one of {', '.join(TOPOLOGY_KEYS)}=VALUE, once each")
        if not _TOPOLOGY_VALUE.fullmatch(value):
            raise ValueError(f"{key}={value!r}: expected 1 to 64 characters of [A-Za-z0-9_.:-]")
        found[key] = value
    return found


def _topology_ok(value: str) -> bool:
    try:
        parse_topology(value)
    except ValueError:
        return False
    return True


# 21400 + local_rank: see the key's help for why not 9400 (dcgm-exporter's, which GPU nodes run)
DEFAULT_PORT = 21400
INCIDENTS_SUBDIRECTORY = "incidents"  # under file_sd_dir, where Prometheus' *.json glob does not look
INCIDENTS_OFF = "off"
CANARY_MODES = ("off", "warn", "enforce")


@dataclass(frozen=True)
class Config:
    """Everything a rank's exporter can be told; see the README's configuration table."""

    config: str = _setting("", "YAML config file to read first (also FLARE_CONFIG).")
    port: int = _setting(
        DEFAULT_PORT,
        "Base port; a rank serves /metrics on port + local_rank. 0 serves nothing. The default is not 9400 "
        "(dcgm-exporter's): a rank per GPU needs a block of ports, which the exporter allocations on "
        "Prometheus's wiki (9100-9999, full, and newer ones just above 10000) cannot spare; 21400 and up is "
        "also clear of Ray's worker ports (10002-19999), torch's 29400 and 29500, and the NodePort and "
        "ephemeral ranges (30000 up).",
        *_between(0, 65535),
    )
    addr: str = _setting(
        "0.0.0.0",
        "Bind address of the metrics endpoint (0.0.0.0: every interface, so a remote Prometheus can scrape).",
        lambda v: bool(v),
        "non-empty",
    )
    run: str = _setting(
        "",
        "Run id, label run of every series, and the name of the rank's files (default: torchrun's --rdzv-id, "
        "else Slurm's job id, `<job>.<step>` in an srun step, else Open MPI's job id, else 'default'; set it "
        "when jobs without one share file_sd_dir).",
        _label_safe,
        "at most 128 characters on one line",
    )
    host: str = _setting(
        "",
        "Host identity in flare_rank_info (default: this machine's hostname).",
        _label_safe,
        "at most 128 characters on one line",
    )
    file_sd_dir: str = _setting("", "Directory in which each rank writes a Prometheus file_sd target file.")
    queue_size: int = _setting(
        65536,
        "Collective events buffered between the training thread and the timing manager; beyond it, dropped.",
        *_between(16, 10_000_000),
    )
    timing_interval_seconds: float = _setting(
        5.0,
        "Longest time between two resolutions of completed collectives: every scrape resolves them, so it is "
        "current, and the timing manager's thread does once this long passed without one.",
        *_between(0.001, 10),
    )
    scrape_wait_seconds: float = _setting(
        0.1,
        "Longest a scrape waits for the rank's next collective before it renders, so that the render runs "
        "while training waits for that collective instead of delaying it (gloo groups recorded in C++, on a "
        "rank that issued a collective in the last second); 0: render at once.",
        *_between(0, 10),
    )
    native_collectives: bool = _setting(
        True,
        "Record gloo groups' collectives in C++, in flare's torch extension (built by `python -m "
        "flare_exporter.rank.cpp_recorder`): the training thread runs no Python for a collective. false, "
        "or without "
        "the extension: Python hooks.",
    )
    cpp_recorder_build: bool = _setting(
        True,
        "Where flare's C++ recorder is not built for this torch, start building it in the background (local "
        "rank 0; one build per host and torch version; lowest CPU priority) for the next launch; this one "
        "runs the Python hooks. false: never build from a launch.",
    )
    max_groups: int = _setting(
        64,
        "Most process groups tracked per rank; collectives of further groups are counted as dropped.",
        *_between(1, 4096),
    )

    stall_seconds: float = _setting(
        30.0,
        "Seconds without progress (no step, no collective issued) after which the rank samples its training "
        "thread's stack into flare_rank_stack_info.",
        *_between(0.1, 86400),
    )
    hang_seconds: float = _setting(
        300.0,
        "Seconds a collective may stay unfinished before it counts as a hang; the rank then writes its "
        "incident file, and `flare diagnose` uses the same threshold.",
        *_between(0.5, 86400),
    )
    incident_dir: str = _setting(
        "",
        "Directory in which each rank writes its incident file (`<run>-rank<N>.json`: why it ended, the "
        "exception and its root cause, a termination signal, thread stacks, in-flight state, recent GPU "
        "readings) when it dies, hangs or exits. Empty: `<file_sd_dir>/incidents` when file_sd_dir is set, "
        "else none written; `off`: none written.",
    )
    last_word_seconds: float = _setting(
        30.0,
        "Longest a rank dying of an exception or a termination signal waits, still serving /metrics, for a "
        "scrape that starts after its death began to complete (at most twice the observed scrape interval "
        "plus a second; no wait if it was never scraped), so that Prometheus holds why it died; 0: no wait.",
        *_between(0, 3600),
    )
    linger_seconds: float = _setting(
        0.0,
        "Seconds a rank dying of an exception keeps serving /metrics (with flare_rank_exception_info) after "
        "its last word (last_word_seconds), whatever was scraped: a fixed extra wait.",
        *_between(0, 3600),
    )
    topology: str = _setting(
        "",
        "Where the rank's host sits, as `switch=NAME,rack=NAME` (either or both): labels switch and rack of "
        "flare_rank_info and the incident file's identity, so that ranks failing together name the shared "
        "switch or rack.",
        _topology_ok,
        TOPOLOGY_RULE,
    )

    straggler_window_steps: int = _setting(
        5,
        "Steps per straggler window: each rank exports its mean step time and collective wait per step over "
        "its last straggler_windows windows of this many steps.",
        *_between(1, 100_000),
    )
    straggler_windows: int = _setting(
        4,
        "Straggler windows each rank keeps and exports (label ago); the engine names a straggler when its "
        "score holds over the last 3 windows the ranks share.",
        *_between(3, 16),
    )
    gpu_health: bool = _setting(
        True,
        "Read the rank's own GPU health from NVML (pynvml, the `nvml` extra); without NVML or GPU "
        "flare_gpu_health_up is 0.",
    )
    gpu_health_interval_seconds: float = _setting(
        5.0,
        "How often GPU health is read from NVML, on a background thread (XID events arrive as they happen).",
        *_between(0.05, 3600),
    )
    nvml_module: str = _setting(
        "pynvml",
        "Python module providing the NVML API; flare_exporter.local.testing.fake_nvml runs the GPU health "
        "collector without a GPU (its readings come from FLARE_FAKE_NVML_* variables).",
        lambda v: bool(v),
        "non-empty",
    )
    web_config_file: str = _setting(
        "",
        "Prometheus web config file (exporter-toolkit's web-config.yml: TLS, client certificates, bcrypt "
        "basic auth) for the metrics endpoint; see docs/security.md. Empty: plain HTTP.",
    )

    perf: bool = _setting(
        True,
        "Break each step into phases (data loader, optimizer, exposed collectives, host gaps, compute) and "
        "count the model's FLOPs on one step (flare_step_phase_seconds_total, flare_mfu_ratio; "
        "`flare perf`).",
    )
    perf_flops_step: int = _setting(
        12,
        "The step whose model FLOPs torch.utils.flop_counter counts on the training thread (from the end "
        "of step N-1 to the end of step N; flare_model_flops_per_step); 0: never.",
        lambda v: v == 0 or 2 <= v <= 1_000_000_000,
        "0 or from 2 to 1000000000",
    )
    model_flops_per_step: float = _setting(
        0.0,
        "Model FLOPs of one training step, if known; 0: counted on the step perf_flops_step.",
        *_between(0.0, 1e30),
    )
    peak_flops: float = _setting(
        0.0,
        "Peak FLOP/s of the rank's device for flare_mfu_ratio; 0: the dense BF16 peak of the GPU model by "
        "its NVML name (rank/perf.py's table), none on CPU.",
        *_between(0.0, 1e30),
    )
    perf_window_steps: int = _setting(
        20,
        "Steps over which flare_achieved_flops averages the step time.",
        *_between(1, 100_000),
    )

    ild_dispatch_every_steps: int = _setting(
        32,
        "Host dispatch latency is sampled in one step out of this many (a dispatch mode times every op of "
        "that step; see docs/ild.md); 0: never.",
        *_between(0, 1_000_000),
    )
    ild_launch_sample_every: int = _setting(
        8,
        "One kernel launch in this many is timed for the kernel issue latency (a device event each).",
        *_between(1, 1_000_000),
    )
    ild_warmup_steps: int = _setting(
        5,
        "First steps left out of the ILD baseline (allocations, first-iteration set-up).",
        *_between(0, 1_000_000),
    )
    ild_baseline_steps: int = _setting(
        200,
        "Steps after the warm-up whose issue latencies form each rank's ILD baseline.",
        *_between(1, 1_000_000),
    )
    ild_window_steps: int = _setting(
        10,
        "The ILD drift compares the baseline with the last this many steps that have samples (for host "
        "dispatch: sampling windows).",
        *_between(1, 10_000),
    )
    ild_min_samples: int = _setting(
        50,
        "Samples the baseline and the current window each need before the ILD drift gauges are exported.",
        *_between(1, 10_000_000),
    )
    # Healthy 3- and 4-rank jobs sharing this machine's 2 cores reached 128-263 ns beyond their peers'
    # median; a per-op delay of 8 % of the benchmark's step moves it 515-601 ns.
    ild_op_shift_seconds: float = _setting(
        4e-7,
        "The per-op shift of host dispatch latency (docs/ild.md) beyond the ranks' median at or above which "
        "`flare diagnose` and `flare rules` count a rank's as shifted (their flag --ild-op-shift-seconds). "
        "400 ns suits ranks that share cores; on dedicated cores, 25 ns catches a delay of 1 % of a step.",
        *_between(1e-9, 1.0),
    )
    ild_events: int = _setting(
        1024,
        "Device events in the ILD event pool (kernel issue latency); a launch sampled while all are in use "
        "is counted as dropped.",
        *_between(1, 1_000_000),
    )

    canary: str = _setting(
        "off",
        "The hardware canary (docs/canary.md): `off`; `warn`: benchmark every rank's compute, collective bus "
        "bandwidth and storage once the process group is up, before the first step, export flare_canary_* "
        "and log a failure; `enforce`: also end every rank with exit status 75 when one fails, naming the "
        "rank, its host and the measurement in one line.",
        lambda v: v in CANARY_MODES,
        "one of " + ", ".join(CANARY_MODES),
    )
    canary_relative_floor: float = _setting(
        0.7,
        "A rank fails a canary measurement below this fraction of the job's median (same measurement and "
        "scope); 0: no relative floor.",
        *_between(0, 1),
    )
    canary_min_gemm_flops: float = _setting(
        0.0, "Absolute floor of the canary's GEMM, in FLOP/s (0: none).", *_between(0, 1e18)
    )
    canary_min_busbw_bytes_per_second: float = _setting(
        0.0,
        "Absolute floor of the canary's all-reduce and all-gather bus bandwidth, in bytes/s (0: none).",
        *_between(0, 1e15),
    )
    canary_min_storage_bytes_per_second: float = _setting(
        0.0,
        "Absolute floor of the canary's storage read throughput, in bytes/s (0: none).",
        *_between(0, 1e15),
    )
    canary_compute_seconds: float = _setting(
        0.5,
        "Seconds the preflight spends in back-to-back GEMMs (a tenth of it in flight).",
        *_between(0.01, 60),
    )
    canary_gemm_size: int = _setting(
        0,
        "Side of the canary's square GEMM; 0: sized to the device (256 on a CPU, 8192 in bfloat16 on a GPU).",
        *_between(0, 65536),
    )
    canary_collective_bytes: int = _setting(
        0,
        "Bytes per rank of the canary's all-reduce and all-gather; 0: sized to the device (4 MiB on gloo, "
        "256 MiB on NCCL; in flight a sixteenth).",
        *_between(0, 1 << 34),
    )
    canary_collective_iterations: int = _setting(
        5, "Timed iterations of each canary collective (after one untimed warm-up).", *_between(1, 1000)
    )
    canary_storage_paths: str = _setting(
        "",
        "Comma-separated files or directories (dataset, checkpoint mount) whose read throughput the "
        "preflight measures, at most 8; each read bounded by canary_storage_max_bytes and "
        "canary_storage_max_seconds.",
        lambda v: len([path for path in v.split(",") if path.strip()]) <= 8,
        "at most 8 comma-separated paths",
    )
    canary_storage_max_bytes: int = _setting(
        256 << 20, "Most bytes the canary reads from each storage path.", *_between(1, 1 << 40)
    )
    canary_storage_max_seconds: float = _setting(
        2.0, "Longest the canary reads from each storage path.", *_between(0.01, 600)
    )
    canary_confirm_runs: int = _setting(
        2,
        "Preflight runs repeated, at most, while a rank fails: the job is judged on each rank's best value "
        "of the runs, so a rank fails (and `enforce` stops the start) only where every run failed it.",
        *_between(0, 10),
    )
    canary_interval_steps: int = _setting(
        0,
        "Repeat a smaller canary (GEMM, intra-host all-reduce) after every this many optimizer steps, at "
        "the same step on every rank; 0: preflight only.",
        *_between(0, 100_000_000),
    )
    canary_in_flight_fraction: float = _setting(
        0.5,
        "In flight, a measurement fails below this fraction of the rank's own preflight value.",
        *_between(0, 1),
    )
    canary_ewma_alpha: float = _setting(
        0.3,
        "Weight of the newest in-flight measurement in its exponentially weighted moving average.",
        *_between(0.01, 1),
    )
    canary_drift_band: float = _setting(
        0.2,
        "flare_canary_drift flags a measurement whose moving average fell more than this fraction below "
        "its preflight value (sustained drift, long before canary_in_flight_fraction).",
        *_between(0.01, 1),
    )
    profile: bool = _setting(
        False,
        "Serve POST /profile?steps=N (`flare profile`): the rank captures N optimizer steps with "
        "torch.profiler, from one step boundary to another, and reduces the trace on the node to a summary "
        "and a bottleneck class. Off: no endpoint answers and no hook runs. Behind the web config's TLS and "
        "basic auth where the exporter has them.",
    )
    profile_max_steps: int = _setting(
        20, "The most optimizer steps one capture may ask for.", *_between(1, 1000)
    )
    profile_cooldown_seconds: float = _setting(
        300.0,
        "Seconds after a capture ends before the rank takes another; a request sooner is refused (429).",
        *_between(0, 86400),
    )
    profile_keep: int = _setting(
        4,
        "Raw traces kept per rank in `<incident directory>/profiles` (oldest removed first; each at most "
        "profile_max_trace_bytes, a larger one is not kept); the summaries are kept too.",
        *_between(0, 1000),
    )
    profile_max_trace_bytes: int = _setting(
        64 * 1024 * 1024, "The largest raw trace kept on disk.", *_between(0, 2**40)
    )
    experiment_trackers: str = _setting(
        "auto",
        "auto: the perf monitor's summary (step time, MFU, phase shares, bottleneck) and each capture's "
        "verdict also go to the experiment tracker the script made active (TensorBoard's SummaryWriter, "
        "a wandb run); off: to none.",
        lambda value: value in ("auto", "off"),
        "auto or off",
    )
    tracker_interval_seconds: float = _setting(
        60.0, "Seconds between two perf summaries sent to the experiment trackers.", *_between(1, 86400)
    )
    profile_on_anomaly: bool = _setting(
        False,
        "With profile on: a rank that its own signals show as a straggler (policies.ProfileTriggerPolicy), "
        "with an issue-latency shift from its own baseline, or with a failed in-flight canary captures "
        "profile_anomaly_steps steps, and asks one peer (the next rank) for a capture beside it; once per "
        "profile_anomaly_cooldown_seconds.",
    )
    profile_anomaly_steps: int = _setting(3, "Optimizer steps of an anomaly's capture.", *_between(1, 1000))
    profile_anomaly_cooldown_seconds: float = _setting(
        3600.0,
        "Seconds after an anomaly's capture before the rank's own signals may arm another.",
        *_between(0, 7 * 86400),
    )

    @property
    def incident_directory(self) -> str:
        """Where incident files are written ('' for nowhere): incident_dir if set (`off`: nowhere), else
        `<file_sd_dir>/incidents` when file_sd_dir is set, else nowhere."""
        explicit = self.incident_dir.strip()
        if explicit:
            return "" if explicit == INCIDENTS_OFF else self.incident_dir
        if self.file_sd_dir:
            return os.path.join(self.file_sd_dir, INCIDENTS_SUBDIRECTORY)
        return ""

    def with_overrides(self, overrides: Mapping[str, Any], source: str) -> Config:
        """This config with `overrides` (already typed) applied, each checked; errors name `source`."""
        checked = {name: _check(name, value, source) for name, value in overrides.items()}
        return dataclasses.replace(self, **checked)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _type_of(name: str) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool}[str(FIELDS[name].type)]


def _check(name: str, value: Any, source: str) -> Any:
    if name not in FIELDS:
        raise ConfigError(f"unknown key {name!r} in {source}; known keys: {', '.join(FIELDS)}")
    expected = _type_of(name)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"key {name!r} in {source}: expected {expected.__name__}, got {type(value).__name__} {value!r}"
        )
    metadata = FIELDS[name].metadata
    if not metadata["check"](value):
        problem = "is not valid" if isinstance(value, str) else "is out of range"
        raise ConfigError(f"key {name!r} in {source}: {value!r} {problem} ({metadata['rule']})")
    return value


def _parse_text(name: str, text: str, source: str) -> Any:
    """Turn an environment or flag string into the key's type."""
    expected = _type_of(name)
    try:
        if expected is bool:
            lowered = text.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            return lowered in ("1", "true", "yes", "on")
        return expected(text.strip()) if expected is not str else text
    except ValueError:
        raise ConfigError(f"key {name!r} in {source}: {text!r} is not a valid {expected.__name__}") from None


# What PyYAML's safe constructors raise, besides YAMLError, for values they cannot build
YAML_CONSTRUCTION_ERRORS = (ValueError, TypeError, AttributeError, OverflowError, RecursionError)


def read_yaml(path: str, what: str, error_type: type[ConfigError] = ConfigError) -> Any:
    """The YAML document in file `path`; `error_type` with one line naming `what` and the file otherwise."""
    import yaml  # here, not at the top: most commands read no YAML, and it is slow to import

    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except OSError as error:
        raise error_type(f"{what} {path}: cannot read it ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise error_type(f"{what} {path}: not UTF-8 text ({error.reason})") from None
    except yaml.YAMLError as error:
        first_line = str(error).splitlines()[0] if str(error) else "invalid YAML"
        raise error_type(f"{what} {path}: not valid YAML ({first_line})") from None
    except YAML_CONSTRUCTION_ERRORS as error:  # e.g. `a: 2024-13-01` or `!!timestamp x`; deep nesting
        raise error_type(f"{what} {path}: not valid YAML ({type(error).__name__}: {error})") from None


def read_file(path: str) -> dict[str, Any]:
    """The mapping in a YAML config file, unchecked; errors name the file."""
    data = read_yaml(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of keys to values, got {type(data).__name__}"
        )
    for key in data:
        if not isinstance(key, str) or key not in FIELDS or key == "config":
            raise ConfigError(f"unknown key {key!r} in config file {path}; known keys: {', '.join(FIELDS)}")
    return data


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Typed values of the FLARE_* variables that name config keys."""
    values = {}
    for name in FIELDS:
        variable = ENV_PREFIX + name.upper()
        if variable in environ:
            values[name] = _parse_text(name, environ[variable], _env_source(name))
    return values


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per config key; their defaults are None so unset flags override nothing."""
    for name, spec in FIELDS.items():
        help_text = spec.metadata["help"].replace("%", "%%")  # argparse formats help with %
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=help_text)


def load(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The config from file (flag --config, else FLARE_CONFIG), then the environment, then `flags`."""
    environ = os.environ if environ is None else environ
    env_values = from_environment(environ)
    flag_values = {
        name: _parse_text(name, str(text), _flag_source(name))
        for name, text in (flags or {}).items()
        if text is not None
    }
    config = Config()
    path = flag_values.get("config") or env_values.get("config") or ""
    if path:
        config = config.with_overrides(read_file(path), f"config file {path}")
    for name, value in env_values.items():
        config = config.with_overrides({name: value}, _env_source(name))
    for name, value in flag_values.items():
        config = config.with_overrides({name: value}, _flag_source(name))
    return config


# The keys of the thresholds that `flare diagnose` and `flare rules` take as flags (add_engine_arguments),
# with what each flag's help says it is.
HANG_KEY = "hang_seconds"
ILD_OP_SHIFT_KEY = "ild_op_shift_seconds"
ENGINE_KEYS = {HANG_KEY: "hang threshold", ILD_OP_SHIFT_KEY: "per-op shift that counts as an ILD regression"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the thresholds that `flare diagnose` and `flare rules` share (see engine_config)."""
    for name, what in ENGINE_KEYS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            help=f"{what} (default: {ENV_PREFIX}{name.upper()}, {FIELDS[name].default:g})",
        )


def engine_config(args: argparse.Namespace) -> Config:
    """The config, the engine's thresholds from add_engine_arguments' flags over FLARE_* over the file."""
    return load({name: getattr(args, name) for name in ENGINE_KEYS})


# Where a setting was told (told_by); a hang threshold may also be the run's own (the largest its ranks
# export, flare_hang_threshold_seconds) or the default: `flare diagnose`'s JSON key hang_seconds_from
FLAG, ENVIRONMENT, CONFIG_FILE = "flag", "environment", "config"
RUN, DEFAULT = "run", "default"


def told_by(name: str, flag_value: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """Where setting `name` was told: FLAG (its flag's value `flag_value` is not None), ENVIRONMENT (its
    FLARE_* variable is set, even to the default), CONFIG_FILE (the file FLARE_CONFIG names has the key);
    None where nothing told it and it holds its default."""
    environ = os.environ if environ is None else environ
    if flag_value is not None:
        return FLAG
    if ENV_PREFIX + name.upper() in environ:
        return ENVIRONMENT
    path = environ.get(ENV_PREFIX + "CONFIG", "")
    if path and name in read_file(path):
        return CONFIG_FILE
    return None


@dataclass(frozen=True)
class HangThreshold:
    """The hang threshold `flare diagnose` judges a run by, in seconds, and where it came from (FLAG,
    ENVIRONMENT, CONFIG_FILE, RUN or DEFAULT): the one the engine was told (told_by's order), else the
    run's own, else the config's default. From Prometheus the run's own is one query, asked before the
    snapshot (engine/prometheus_source.resolve_hang_threshold); from a direct scrape or flight-recorder
    dumps it comes with the snapshot (Snapshot.hang_seconds)."""

    seconds: float
    source: str


def hang_told_by(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """Where the engine was told its hang threshold: FLAG (--hang-seconds given), ENVIRONMENT
    (FLARE_HANG_SECONDS set, even to the default), CONFIG_FILE (the file FLARE_CONFIG names has
    hang_seconds); None where nothing told it."""
    return told_by(HANG_KEY, getattr(args, HANG_KEY, None), environ)


def configured_hang(seconds: float, told: str | None) -> HangThreshold:
    """The hang threshold of the engine's config (`seconds`): told by `told`, else its default."""
    return HangThreshold(seconds, told or DEFAULT)


def hang_of_run(found: float | None, fallback: HangThreshold) -> HangThreshold:
    """The run's own hang threshold (`found`, None where no rank exports one) where the engine was not told
    one; `fallback` otherwise."""
    if fallback.source != DEFAULT or found is None or not 0 < found < math.inf:
        return fallback
    return HangThreshold(found, RUN)


def _env_source(name: str) -> str:
    return f"environment variable {ENV_PREFIX}{name.upper()}"


def _flag_source(name: str) -> str:
    return "flag --" + name.replace("_", "-")
