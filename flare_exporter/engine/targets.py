"""Where the ranks' endpoints are: host:port lines, a Prometheus file_sd JSON file, or a directory of them."""

from __future__ import annotations

import json
import os
from typing import NamedTuple


class TargetsError(ValueError):
    """The targets could not be read; the message names the file and what was wrong."""


class Target(NamedTuple):
    """One rank's endpoint, with the labels its file_sd group gives it (none for host:port lines)."""

    address: str
    labels: dict[str, str]


def read_targets(path: str) -> list[Target]:
    """Every target in `path` (file or directory of *.json / *.txt files), in order, unique by address."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, name)
            for name in os.listdir(path)
            if name.endswith((".json", ".txt")) and not name.startswith(".")
        )
        if not files:
            raise TargetsError(f"targets directory {path}: no *.json or *.txt target files in it")
    elif os.path.exists(path):
        files = [path]
    else:
        raise TargetsError(f"targets {path}: no such file or directory")
    found: dict[str, Target] = {}
    for file in files:
        for target in _read_file(file):
            found.setdefault(target.address, target)
    return list(found.values())


def _read_file(path: str) -> list[Target]:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise TargetsError(f"targets file {path}: cannot read it ({error})") from None
    if path.endswith(".json") or text.lstrip().startswith("["):
        return _file_sd_targets(path, text)
    targets = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        _check_target(line, f"targets file {path}, line {number}")
        targets.append(Target(line, {}))
    return targets


def _file_sd_targets(path: str, text: str) -> list[Target]:
    try:
        groups = json.loads(text)
    except ValueError as error:
        raise TargetsError(f"targets file {path}: not valid JSON ({error})") from None
    if not isinstance(groups, list):
        raise TargetsError(f"targets file {path}: a file_sd file is a JSON list of target groups")
    targets = []
    for group in groups:
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise TargetsError(f"targets file {path}: each target group needs a 'targets' list")
        labels = group.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise TargetsError(f"targets file {path}: 'labels' must map label names to strings")
        for target in group["targets"]:
            _check_target(target, f"targets file {path}")
            targets.append(Target(target, dict(labels)))
    return targets


def _check_target(target: object, where: str) -> None:
    if not isinstance(target, str) or ":" not in target or not target.rsplit(":", 1)[1].isdigit():
        raise TargetsError(f"{where}: {target!r} is not host:port")
