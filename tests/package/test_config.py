"""Configuration: defaults, precedence file < environment < flags, and errors that name key and source."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from flare_exporter import config
from flare_exporter.config import Config, ConfigError


@pytest.fixture
def write_yaml(tmp_path):
    """Write `text` to a YAML file under tmp_path and return its path."""

    def write(text: str, name: str = "flare.yaml") -> str:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write


def test_defaults():
    loaded = config.load(flags={}, environ={})
    assert loaded == Config()
    assert loaded.port == 21400
    assert loaded.addr == "0.0.0.0"
    assert loaded.run == ""
    assert loaded.file_sd_dir == ""
    assert loaded.queue_size == 65536
    assert loaded.timing_interval_seconds == 5.0
    assert loaded.max_groups == 64


def test_the_default_ports_are_nobody_elses():
    """A node's ranks serve on a block of ports from the default: it must not meet Prometheus's exporter
    allocations (9100-9999, dcgm-exporter's 9400 among them, and newer ones just above 10000), Ray's worker
    ports (10002-19999), torch's rendezvous and master ports (29400, 29500), the NodePort (30000-32767) and
    ephemeral (32768 up) ranges. Sixteen local ranks at most."""
    block = range(Config().port, Config().port + 16)
    assert block.start > 19999 and block.stop <= 29400
    assert "9400" in config.FIELDS["port"].metadata["help"]  # the help says why not 9400


def test_file_via_environment(write_yaml):
    path = write_yaml("port: 9500\nrun: from-file\ntiming_interval_seconds: 1\n")
    loaded = config.load(flags={}, environ={"FLARE_CONFIG": path})
    assert loaded.port == 9500
    assert loaded.run == "from-file"
    assert loaded.timing_interval_seconds == 1.0
    assert isinstance(loaded.timing_interval_seconds, float)
    assert loaded.config == path


def test_file_via_flag(write_yaml):
    path = write_yaml("port: 9600\n")
    assert config.load(flags={"config": path}, environ={}).port == 9600


def test_config_flag_wins_over_environment(write_yaml):
    env_file = write_yaml("port: 9500\n", "env.yaml")
    flag_file = write_yaml("port: 9600\n", "flag.yaml")
    assert config.load(flags={"config": flag_file}, environ={"FLARE_CONFIG": env_file}).port == 9600


def test_precedence_file_then_environment_then_flags(write_yaml):
    path = write_yaml("port: 9500\nrun: file\nhost: file-host\nmax_groups: 8\n")
    environ = {"FLARE_CONFIG": path, "FLARE_PORT": "9501", "FLARE_RUN": "env"}
    loaded = config.load(flags={"port": "9502", "file_sd_dir": None}, environ=environ)
    assert loaded.port == 9502  # flag beats environment and file
    assert loaded.run == "env"  # environment beats file
    assert loaded.host == "file-host"  # file beats default
    assert loaded.max_groups == 8
    assert loaded.file_sd_dir == ""  # a None flag overrides nothing


def test_environment_types():
    environ = {"FLARE_QUEUE_SIZE": " 128 ", "FLARE_TIMING_INTERVAL_SECONDS": "0.5", "FLARE_ADDR": "127.0.0.1"}
    loaded = config.load(flags={}, environ=environ)
    assert loaded.queue_size == 128
    assert loaded.timing_interval_seconds == 0.5
    assert loaded.addr == "127.0.0.1"


def test_unrelated_environment_is_ignored():
    assert config.load(flags={}, environ={"FLARE_NOT_A_KEY": "x", "PORT": "1"}) == Config()


def test_unknown_key_in_file_names_key_and_file(write_yaml):
    path = write_yaml("port: 9500\nprot: 9501\n")
    with pytest.raises(ConfigError) as raised:
        config.load(flags={"config": path}, environ={})
    assert "'prot'" in str(raised.value)
    assert path in str(raised.value)


def test_config_key_inside_file_is_rejected(write_yaml):
    path = write_yaml("config: other.yaml\n")
    with pytest.raises(ConfigError, match="'config'"):
        config.load(flags={"config": path}, environ={})


@pytest.mark.parametrize("value", ['"abc"', "true", "9400.5", "[1, 2]"])
def test_wrong_type_in_file_names_key_and_file(write_yaml, value):
    path = write_yaml(f"port: {value}\n")
    with pytest.raises(ConfigError) as raised:
        config.load(flags={"config": path}, environ={})
    assert "'port'" in str(raised.value)
    assert path in str(raised.value)
    assert "expected int" in str(raised.value)


@pytest.mark.parametrize(("text", "key"), [("port: 70000", "'port'"), ("queue_size: 1", "'queue_size'")])
def test_out_of_range_in_file_names_key_and_file(write_yaml, text, key):
    path = write_yaml(text + "\n")
    with pytest.raises(ConfigError, match="out of range") as raised:
        config.load(flags={"config": path}, environ={})
    assert key in str(raised.value)
    assert path in str(raised.value)


def test_garbage_environment_variable_names_it():
    with pytest.raises(ConfigError, match="FLARE_PORT") as raised:
        config.load(flags={}, environ={"FLARE_PORT": "abc"})
    assert "'abc'" in str(raised.value)


def test_out_of_range_environment_variable_names_it():
    with pytest.raises(ConfigError, match="FLARE_MAX_GROUPS"):
        config.load(flags={}, environ={"FLARE_MAX_GROUPS": "0"})


def test_bad_flag_value_names_flag():
    with pytest.raises(ConfigError, match="--port"):
        config.load(flags={"port": "nine"}, environ={})


def test_out_of_range_flag_names_flag():
    with pytest.raises(ConfigError, match="--timing-interval-seconds"):
        config.load(flags={"timing_interval_seconds": "60"}, environ={})


@pytest.mark.parametrize("text", ["- port\n- 9400\n", "just a string\n", "42\n"])
def test_non_mapping_file_names_file(write_yaml, text):
    path = write_yaml(text)
    with pytest.raises(ConfigError, match="mapping") as raised:
        config.load(flags={"config": path}, environ={})
    assert path in str(raised.value)


def test_invalid_yaml_names_file(write_yaml):
    path = write_yaml("port: [9400\n")
    with pytest.raises(ConfigError, match="not valid YAML") as raised:
        config.load(flags={"config": path}, environ={})
    assert path in str(raised.value)


def test_missing_file_names_file(tmp_path):
    path = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="cannot read") as raised:
        config.load(flags={}, environ={"FLARE_CONFIG": path})
    assert path in str(raised.value)


def test_empty_file_means_defaults(write_yaml):
    path = write_yaml("")
    assert config.load(flags={"config": path}, environ={}) == Config(config=path)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_config_is_frozen():
    loaded = config.load(flags={}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.port = 1  # type: ignore[misc]


def test_with_overrides_checks_values():
    assert Config().with_overrides({"port": 0}, "test").port == 0
    with pytest.raises(ConfigError, match="'run' in test"):
        Config().with_overrides({"run": "two\nlines"}, "test")


@pytest.mark.parametrize(
    "text",
    [
        "run: 2001-13-01\n",  # a date YAML recognises and cannot construct
        "run: !!timestamp nonsense\n",
        "port: !!float nonsense\n",
        "port: !!python/object:os.system ls\n",  # safe_load refuses arbitrary objects
        "[" * 3000 + "\n",  # nesting beyond the parser's recursion
    ],
)
def test_yaml_that_cannot_be_constructed_is_a_config_error(write_yaml, text):
    path = write_yaml(text)
    with pytest.raises(ConfigError, match="not valid YAML") as raised:
        config.load(flags={"config": path}, environ={})
    assert path in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("FLARE_TIMING_INTERVAL_SECONDS", "nan"),
        ("FLARE_STALL_SECONDS", "inf"),
        ("FLARE_HANG_SECONDS", "-1"),
        ("FLARE_PORT", "1" * 5000),  # beyond Python's int-from-text digit limit
        ("FLARE_PORT", "0x2000"),
        ("FLARE_QUEUE_SIZE", "1e6"),
        ("FLARE_RUN", "two\nlines"),
        ("FLARE_RUN", "x" * 129),
    ],
)
def test_garbage_environment_values_are_config_errors(variable, text):
    with pytest.raises(ConfigError, match=variable):
        config.load(flags={}, environ={variable: text})


def test_web_config_file_key():
    assert config.load(flags={}, environ={}).web_config_file == ""
    loaded = config.load(flags={"web_config_file": "/etc/flare/web.yml"}, environ={})
    assert loaded.web_config_file == "/etc/flare/web.yml"


def test_incident_directory_is_explicit_else_beside_the_file_sd_targets_else_none():
    assert Config().incident_directory == ""
    assert Config(file_sd_dir="/sd").incident_directory == "/sd/incidents"  # not read by file_sd's *.json
    assert Config(incident_dir="/inc", file_sd_dir="/sd").incident_directory == "/inc"
    assert Config(incident_dir="off", file_sd_dir="/sd").incident_directory == ""
    environ = {"FLARE_FILE_SD_DIR": "/sd", "FLARE_INCIDENT_DIR": "off"}
    assert config.load(flags={}, environ=environ).incident_directory == ""
    assert config.load(flags={"incident_dir": "/x"}, environ=environ).incident_directory == "/x"


def test_last_word_seconds():
    assert Config().last_word_seconds == 30.0
    assert config.load(flags={}, environ={"FLARE_LAST_WORD_SECONDS": "0"}).last_word_seconds == 0.0
    with pytest.raises(ConfigError, match="FLARE_LAST_WORD_SECONDS"):
        config.load(flags={}, environ={"FLARE_LAST_WORD_SECONDS": "-1"})


def test_topology_names_a_switch_and_a_rack():
    assert config.parse_topology("") == {}
    assert config.parse_topology("switch=leaf-07, rack=r12") == {"switch": "leaf-07", "rack": "r12"}
    assert config.parse_topology("rack=hall.2:row-3_r12") == {"rack": "hall.2:row-3_r12"}
    loaded = config.load(flags={"topology": "switch=s1"}, environ={})
    assert loaded.topology == "switch=s1"


@pytest.mark.parametrize(
    "text",
    [
        "pod=p1",  # an unknown key
        "switch",  # no value
        "switch=",  # an empty one
        "switch=a b",  # a character outside [A-Za-z0-9_.:-]
        'rack=r"1',
        "rack=" + "r" * 65,  # too long
        "switch=a,switch=b",  # twice
    ],
)
def test_a_bad_topology_is_a_config_error_naming_the_key(text):
    with pytest.raises(ValueError):
        config.parse_topology(text)
    with pytest.raises(ConfigError, match="'topology' in environment variable FLARE_TOPOLOGY") as raised:
        config.load(flags={}, environ={"FLARE_TOPOLOGY": text})
    assert "switch" in str(raised.value) and "rack" in str(raised.value)  # the rule says what is allowed


def test_engine_keys_are_config_keys():
    """The thresholds `flare diagnose` and `flare rules` take as flags are config keys, read through them."""
    assert set(config.ENGINE_KEYS) <= set(config.FIELDS)
    parser = argparse.ArgumentParser()
    config.add_engine_arguments(parser)
    args = parser.parse_args(["--hang-seconds", "12", "--ild-op-shift-seconds", "1e-6"])
    loaded = config.engine_config(args)
    assert (loaded.hang_seconds, loaded.ild_op_shift_seconds) == (12.0, 1e-6)
