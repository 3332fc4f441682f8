"""Run a real Prometheus on loopback, discovering ranks through file_sd (for the demo and the tests)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import yaml

from ..engine import promql
from .jobs import free_port


def find_binary(name: str = "prometheus") -> str | None:
    return shutil.which(name)


def scrape_config(
    file_sd_dir: str, scrape_interval: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The scrape job for flare ranks; honor_labels keeps each series' own rank/run labels.

    `options` are added to the job: for ranks with a web config file, e.g. `scheme: https`, `tls_config`
    (`ca_file`, `cert_file`, `key_file`) and `basic_auth` (`username`, `password`).
    """
    return {
        "job_name": "flare",
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
        "honor_labels": True,
        "file_sd_configs": [{"files": [os.path.join(file_sd_dir, "*.json")], "refresh_interval": "1s"}],
        **(options or {}),
    }


_Server = TypeVar("_Server", bound="ServerProcess")


class ServerProcess:
    """A server binary (Prometheus, Alertmanager) on a free loopback port, its YAML config and its log in
    `work_dir`; `address` is host:port, `url` its HTTP root. Use as a context manager."""

    name = "server"
    connection: promql.Connection | None = None  # how to ask it, where a web config file secures it
    config_flag = "--config.file"  # the flags that name its config file and its address: Prometheus's
    listen_flag = "--web.listen-address"

    def __init__(
        self, work_dir: str, binary: str, config: dict[str, Any] | None, flags: Sequence[str]
    ) -> None:
        """`config` is written to `work_dir` and named by `config_flag` (none for a server without one)."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        os.makedirs(work_dir, exist_ok=True)
        command = [binary, f"{self.listen_flag}={self.address}", *flags]
        if config is not None:
            config_path = os.path.join(work_dir, f"{self.name}.yml")
            with open(config_path, "w") as out:
                yaml.safe_dump(config, out)
            command.insert(1, f"{self.config_flag}={config_path}")
        self.log_path = os.path.join(work_dir, f"{self.name}.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the server is ready (`answers`)."""
        wait_for(self._ready, timeout, f"{self.name} at {self.url} to become ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
        return self.answers()

    def answers(self) -> bool:
        """Whether it is ready: Prometheus and Alertmanager say so at /-/ready."""
        try:
            with promql.urlopen(self.connection or self.url, "/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        with open(self.log_path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self: _Server) -> _Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusProcess(ServerProcess):
    """A Prometheus server in `work_dir` scraping the ranks in `file_sd_dir`; `url` is its HTTP API."""

    name = "prometheus"

    def __init__(
        self,
        work_dir: str,
        file_sd_dir: str,
        scrape_interval: str = "1s",
        binary: str | None = None,
        scrape_options: dict[str, Any] | None = None,
        rule_files: Sequence[str] = (),
        alertmanager: str | None = None,
        web_config_file: str = "",
        access: promql.Connection | None = None,
        extra_jobs: Sequence[dict[str, Any]] = (),
    ) -> None:
        """`rule_files` are evaluated every scrape interval; alerts go to `alertmanager` (host:port);
        `extra_jobs` are scrape jobs besides the flare job of `file_sd_dir` (e.g. a shard scraping late).

        `web_config_file` secures Prometheus's own endpoints (`--web.config.file`: TLS, basic auth); `access`
        is how to ask it then (promql.connect: the scheme of its URL, whose host and port are replaced by
        Prometheus's; the TLS context and headers)."""
        binary = binary or find_binary()
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [scrape_config(file_sd_dir, scrape_interval, scrape_options), *extra_jobs],
        }
        if rule_files:
            config["rule_files"] = [os.path.abspath(path) for path in rule_files]
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        flags = [f"--storage.tsdb.path={os.path.join(work_dir, 'data')}", "--web.enable-lifecycle"]
        if web_config_file:
            flags.append(f"--web.config.file={os.path.abspath(web_config_file)}")
        super().__init__(work_dir, binary, config, flags)
        if access is not None:
            self.url = f"{urllib.parse.urlsplit(access.url).scheme}://{self.address}"
            self.connection = dataclasses.replace(access, url=self.url)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return promql.query(self.connection or self.url, expr, at=at)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it returns something truthy; TimeoutError names `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
