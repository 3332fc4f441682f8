"""Run a real Prometheus on loopback, discovering ranks through file_sd (for the demo and the tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from . import promql
from .local_job import free_port


def find_binary(name: str = "prometheus") -> str | None:
    return shutil.which(name)


def scrape_config(file_sd_dir: str, scrape_interval: str) -> dict[str, Any]:
    """The scrape job for flare ranks; honor_labels keeps each series' own rank/run labels."""
    return {
        "job_name": "flare",
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
        "honor_labels": True,
        "file_sd_configs": [{"files": [os.path.join(file_sd_dir, "*.json")], "refresh_interval": "1s"}],
    }


class PrometheusProcess:
    """A Prometheus server in `work_dir`; `url` is its HTTP API. Use as a context manager."""

    def __init__(
        self,
        work_dir: str,
        file_sd_dir: str,
        scrape_interval: str = "1s",
        binary: str | None = None,
    ) -> None:
        binary = binary or find_binary()
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval},
            "scrape_configs": [scrape_config(file_sd_dir, scrape_interval)],
        }
        os.makedirs(work_dir, exist_ok=True)
        config_path = os.path.join(work_dir, "prometheus.yml")
        with open(config_path, "w") as out:
            yaml.safe_dump(config, out)
        self.log_path = os.path.join(work_dir, "prometheus.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={os.path.join(work_dir, 'data')}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until Prometheus answers /-/ready."""
        wait_for(self._ready, timeout, f"Prometheus at {self.url} to become ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"Prometheus exited with {self.process.returncode}: {self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return promql.query(self.url, expr, at=at)

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

    def __enter__(self) -> PrometheusProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
