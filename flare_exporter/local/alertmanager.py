"""Run a real Alertmanager on loopback, and a webhook receiver that collects its pages (demo and tests).

The Alertmanager runs the example configuration in alerts/alertmanager/alertmanager.yml (routes,
grouping by run, inhibitions) with its receivers pointed at the local webhook and its waits shortened, so
that what the tests see delivered is what that configuration pages.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from ..mixin import rule_model, rules_render
from .prometheus import PrometheusProcess, ServerProcess
from .prometheus import find_binary as find_prometheus

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "alerts" / "alertmanager" / "alertmanager.yml"
BINARIES = ("prometheus-alertmanager", "alertmanager")  # Debian's name, then upstream's


def find_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def can_alert() -> bool:
    """Whether both Prometheus and Alertmanager are installed."""
    return find_prometheus() is not None and find_binary() is not None


def local_config(webhook_url: str, example: Path = EXAMPLE_CONFIG, wait: str = "1s") -> dict[str, Any]:
    """The example configuration with every receiver sending to `webhook_url` and waits of `wait`."""
    config = yaml.safe_load(example.read_text())
    for receiver in config["receivers"]:
        receiver["webhook_configs"] = [{"url": webhook_url, "send_resolved": False}]
    config["route"].update({"group_wait": wait, "group_interval": wait})
    return config


class WebhookReceiver:
    """An HTTP server that records every notification Alertmanager POSTs to it, with its arrival time."""

    def __init__(self) -> None:
        self.notifications: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server interface)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.notifications.append((time.time(), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)
        self._thread.start()

    def alerts(self, **labels: str) -> list[tuple[float, dict[str, Any]]]:
        """(arrival time, alert) for every firing alert delivered so far whose labels include `labels`."""
        with self._lock:
            delivered = list(self.notifications)
        return [
            (arrived, alert)
            for arrived, notification in delivered
            for alert in notification.get("alerts", [])
            if alert.get("status") == "firing"
            and all(alert["labels"].get(name) == value for name, value in labels.items())
        ]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AlertmanagerProcess(ServerProcess):
    """An Alertmanager in `work_dir` with `config`, no clustering; `address` is its host:port."""

    name = "alertmanager"

    def __init__(self, work_dir: str, config: dict[str, Any], binary: str | None = None) -> None:
        binary = binary or find_binary()
        if binary is None:
            raise FileNotFoundError("alertmanager is not installed (apt-get install prometheus-alertmanager)")
        flags = [f"--storage.path={os.path.join(work_dir, 'data')}", "--cluster.listen-address="]  # no gossip
        super().__init__(work_dir, binary, config, flags)


class AlertingStack:
    """Prometheus evaluating `flare rules` (for `hang_seconds`, every for: `for_`, the slow groups every
    `slow_interval`, by default at every evaluation) over the ranks in `file_sd_dir`, sending to an
    Alertmanager with the example configuration, which pages `pages`."""

    def __init__(
        self,
        work_dir: str,
        file_sd_dir: str,
        hang_seconds: float,
        scrape_seconds: int = 1,
        for_: str = "0s",
        slow_interval: str = "",
    ) -> None:
        thresholds = rule_model.Thresholds(
            hang_seconds=hang_seconds, scrape_interval_seconds=scrape_seconds, slow_interval=slow_interval
        )
        rules_file = os.path.join(work_dir, "flare.rules.yml")
        os.makedirs(work_dir, exist_ok=True)
        with open(rules_file, "w") as out:
            out.write(rules_render.render(thresholds.with_for(for_)))
        self.pages = WebhookReceiver()
        self.alertmanager = AlertmanagerProcess(
            os.path.join(work_dir, "alertmanager"), local_config(self.pages.url, wait=f"{scrape_seconds}s")
        )
        self.prometheus = PrometheusProcess(
            os.path.join(work_dir, "prometheus"),
            file_sd_dir,
            f"{scrape_seconds}s",
            rule_files=[rules_file],
            alertmanager=self.alertmanager.address,
        )

    def wait_ready(self) -> None:
        try:
            self.alertmanager.wait_ready()
            self.prometheus.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.prometheus.stop()
        self.alertmanager.stop()
        self.pages.stop()
