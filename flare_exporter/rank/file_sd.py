"""Prometheus file_sd target files: one per rank, so a Prometheus watching the directory finds every rank."""

from __future__ import annotations

import logging
import os
import socket

from .atomic_files import file_name_part, write_json_atomically
from .identity import RankIdentity

log = logging.getLogger("flare_exporter")

_ANY_ADDRESS = ("", "0.0.0.0", "::")


def target_path(directory: str, identity: RankIdentity) -> str:
    return os.path.join(directory, f"flare-{file_name_part(identity.run)}-rank{identity.rank}.json")


def reachable_address(addr: str, port: int) -> str:
    """host:port at which others reach an exporter bound to `addr` (this host's name for any address)."""
    host = socket.gethostname() if addr in _ANY_ADDRESS else addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_document(identity: RankIdentity, addr: str, port: int) -> list[dict]:
    """The file_sd document; `rank` and `run` label the target so that `up` says which rank is down.

    `__meta_flare_host` tells `flare --targets` which host a rank that no longer answers was on;
    Prometheus drops labels that start with `__` once relabeling is done, so no series carries it.
    """
    return [
        {
            "targets": [reachable_address(addr, port)],
            "labels": {"rank": str(identity.rank), "run": identity.run, "__meta_flare_host": identity.host},
        }
    ]


def write_target(directory: str, identity: RankIdentity, addr: str, port: int) -> str | None:
    """Write this rank's target file atomically; on failure warn, return None, and let training go on."""
    path = target_path(directory, identity)
    try:
        write_json_atomically(path, target_document(identity, addr, port))
        return path
    except OSError as error:
        log.warning(
            "flare-exporter: cannot write file_sd target file in %s (%s); Prometheus will not "
            "discover rank %d, training continues",
            directory,
            error.strerror or error,
            identity.rank,
        )
        return None


def remove_target(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
