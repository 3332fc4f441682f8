"""Start a small multi-rank job on this machine: one process per rank, torchrun-style environment.

The demo, the tests and the benchmarks use it to run an unmodified script under the launcher.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports; a port chosen there may be taken by one."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = map(int, handle.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()  # ports this process chose; never chosen twice (a job binds them later)


def free_port_block(count: int, attempts: int = 200) -> int:
    """A base port such that base .. base+count-1 are all free on loopback.

    Chosen below the ephemeral range, so that no outgoing connection (a scrape, a rendezvous) takes one of
    them between this check and the moment the ranks bind them.
    """
    low, high = _ephemeral_ports()
    start, stop = (10000, low - count) if low - count > 10000 else (high + 1, 65535 - count)
    for _ in range(attempts):
        base = random.randint(start, stop)
        block = range(base, base + count)
        if _handed_out.intersection(block):  # free now, but promised to a job that has not bound it yet
            continue
        probes = []
        try:
            for port in block:
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            _handed_out.update(block)
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no block of {count} free ports found on 127.0.0.1")


def free_port() -> int:
    """A TCP port on loopback that nobody listens on right now (outside the ephemeral range)."""
    return free_port_block(1)


class LocalJob:
    """`ranks` processes running `command` (a list after `python`), rank i with RANK=i and LOCAL_RANK=i."""

    def __init__(
        self,
        command: Sequence[str],
        ranks: int,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.command = list(command)
        self.ranks = ranks
        self.master_port = free_port()
        self.processes: list[subprocess.Popen] = []
        self.log_paths: list[str] = []
        base_env = dict(os.environ)
        base_env.update({"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"})
        base_env.update(env or {})
        for rank in range(ranks):
            rank_environment = dict(base_env)
            rank_environment.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(ranks),
                    "MASTER_PORT": str(self.master_port),
                }
            )
            rank_environment.update((rank_env or {}).get(rank, {}))
            if log_dir:
                path = os.path.join(log_dir, f"rank{rank}.log")
                output = open(path, "wb")
                self.log_paths.append(path)
            else:
                output = subprocess.DEVNULL  # type: ignore[assignment]
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, *self.command],
                    env=rank_environment,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            if log_dir:
                output.close()

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of every rank; ranks still running after `timeout` seconds are killed (-9)."""
        deadline = time.monotonic() + timeout
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                codes.append(process.wait())
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def log_tail(self, rank: int, lines: int = 20) -> str:
        if not self.log_paths:
            return ""
        with open(self.log_paths[rank], "rb") as handle:
            return "\n".join(handle.read().decode(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for process in self.processes:
            process.wait()


class ObservedJob(LocalJob):
    """`ranks` ranks of `script` under the flare launcher, exporters on loopback, file_sd targets in work_dir.

    The script is given `--wait-for DONE_FILE` after its own arguments and must stay alive until that
    file exists, so that the ranks can be scraped after training; `release()` creates it.
    """

    def __init__(
        self,
        work_dir: str,
        script: str,
        script_args: Sequence[str],
        ranks: int,
        run: str,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        self.file_sd_dir = os.path.join(work_dir, "targets")
        self.done_file = os.path.join(work_dir, "done")
        base_port = free_port_block(ranks)
        self.targets = [f"127.0.0.1:{base_port + rank}" for rank in range(ranks)]
        flare_env = {
            "FLARE_PORT": str(base_port),
            "FLARE_ADDR": "127.0.0.1",
            "FLARE_RUN": run,
            "FLARE_FILE_SD_DIR": self.file_sd_dir,
        }
        flare_env.update(env or {})
        command = ["-m", "flare_exporter.launch", script, *script_args, "--wait-for", self.done_file]
        super().__init__(command, ranks, env=flare_env, rank_env=rank_env, log_dir=work_dir)

    def release(self) -> None:
        """Let the ranks finish."""
        open(self.done_file, "w").close()
