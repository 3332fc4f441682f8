"""What a tool call of `flare mcp` may make the server read, and to whom the server's credentials go.

Runs in the `flare mcp` process, between a tool's arguments and the `flare` argv they become (mcp_server.py).
An agent names sources; the server owns everything secret and decides what may be read:

- paths (`targets`, `incidents`, `flight_recorder`) must resolve, symbolic links followed, inside a directory
  the server was started with (--allow-dir, or its own --targets, --incidents, --flight-recorder), and the
  directory the command lists may hold no symbolic link that leads outside them;
- the server's secured-Prometheus flags (credentials, TLS files, --header) go only with its own --prometheus
  URL, or another URL of the same scheme://host:port; any other `prometheus` is asked without them;
- the secured-ranks flags (--scheme, --ca-file, ..., --basic-auth-user) go with a targets file that the rules
  above let the tool read;
- a tool that names no source reads the server's first of --prometheus, --targets, --incidents,
  --flight-recorder.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .incident_source import INCIDENTS_SUBDIRECTORY

SOURCES = ("prometheus", "targets", "incidents", "flight_recorder")  # in the order a default is taken
PATHS = ("targets", "incidents", "flight_recorder")  # the sources that are paths
# the tools that scrape a targets file's ranks
SCRAPING = ("diagnose", "ranks", "hang", "stragglers", "canary", "perf", "profile")
DEFAULT_PORTS = {"http": 80, "https": 443}
ALLOW_HINT = "start `flare mcp` with --allow-dir DIR (or --targets, --incidents, --flight-recorder)"


class Refused(Exception):
    """A tool call the server will not make: the one line that says which argument and why."""


@dataclass(frozen=True)
class Policy:
    """The server's side of every tool call.

    `roots`: the real paths the tools' paths must lie in; `defaults`: (source, value) of the server's own
    sources, in SOURCES order; `prometheus_flags`, `ranks_flags`: the `--flag=value` of its secured-Prometheus
    and secured-ranks flags, added to the argv where they may go."""

    roots: tuple[str, ...] = ()
    defaults: tuple[tuple[str, str], ...] = ()
    prometheus_flags: tuple[str, ...] = ()
    ranks_flags: tuple[str, ...] = ()
    profile: bool = False  # --allow-profile: the `profile` tool, which acts on the ranks, is offered

    def arguments(self, tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """`arguments` as the server runs them: the server's default source where none is named, each path
        replaced by the real path it resolves to; Refused for a path outside the roots."""
        given = {name: value for name, value in arguments.items() if value is not None and value != ""}
        if self.defaults and not any(name in given for name in SOURCES):
            name, value = self.defaults[0]
            return {**given, name: value}
        for name in PATHS:
            if name in given:  # a number too is a path to `flare`
                given[name] = self.confined(tool, name, str(given[name]))
        return given

    def confined(self, tool: str, name: str, path: str) -> str:
        """The real path of `path`, the value of argument `name`, if the tool may read it; Refused if not."""
        if not self.roots:
            raise Refused(f"flare {tool}: argument {name}: this server reads no path; {ALLOW_HINT}")
        resolved = os.path.realpath(path)
        allowed = ", ".join(self.roots)
        if not self.inside(resolved):
            raise Refused(
                f"flare {tool}: argument {name}: {path!r} is outside the directories this server may read "
                f"({allowed}; symbolic links followed)"
            )
        if resolved not in self.default_paths():
            escaping = self.escaping_link(resolved)
            if escaping:
                raise Refused(
                    f"flare {tool}: argument {name}: {escaping} is a symbolic link that leads outside the "
                    f"directories this server may read ({allowed})"
                )
        return resolved

    def inside(self, resolved: str) -> bool:
        return any(
            resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots
        )

    def default_paths(self) -> set[str]:
        return {value for name, value in self.defaults if name in PATHS}

    def escaping_link(self, resolved: str) -> str:
        """A symbolic link, in the directories `flare` lists for `resolved` (a directory and its incidents
        subdirectory; a file's or a dump prefix's directory), that leads outside the roots ('' if none)."""
        directory = resolved if os.path.isdir(resolved) else os.path.dirname(resolved)
        for listed in (directory, os.path.join(directory, INCIDENTS_SUBDIRECTORY)):
            try:
                entries = list(os.scandir(listed))
            except OSError:  # not a directory, or unreadable: `flare` says so itself
                continue
            for entry in entries:
                if entry.is_symlink() and not self.inside(os.path.realpath(entry.path)):
                    return entry.path
        return ""

    def flags(self, tool: str, arguments: Mapping[str, Any]) -> list[str]:
        """The server's access flags that go with `arguments` (as Policy.arguments made them)."""
        flags: list[str] = []
        prometheus = arguments.get("prometheus")
        own = dict(self.defaults).get("prometheus")
        if isinstance(prometheus, str) and own and same_origin(prometheus, own):
            flags += self.prometheus_flags
        if tool in SCRAPING and isinstance(arguments.get("targets"), str):
            flags += self.ranks_flags
        return flags


def same_origin(url: str, other: str) -> bool:
    """Whether two URLs have the same scheme://host:port (default ports spelt or not); False for a URL that
    is not one."""
    found = origin(url)
    return found is not None and found == origin(other)


def origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None or port is None:
        return None
    return scheme, parts.hostname.lower(), port


def policy(
    allowed: Sequence[str],
    sources: Mapping[str, str],
    prometheus_flags: Sequence[str] = (),
    ranks_flags: Sequence[str] = (),
    profile: bool = False,
) -> Policy:
    """The Policy of a server started with --allow-dir `allowed`, its default `sources` ({source: value},
    any of SOURCES) and the `--flag=value` of its access flags; Refused for an --allow-dir that is not a
    directory."""
    for directory in allowed:
        if not os.path.isdir(directory):
            raise Refused(f"--allow-dir {directory}: not a directory")
    defaults = tuple(
        (name, os.path.realpath(sources[name]) if name in PATHS else sources[name])
        for name in SOURCES
        if sources.get(name)
    )
    roots = [os.path.realpath(directory) for directory in allowed]
    roots += [value for name, value in defaults if name in PATHS]
    return Policy(tuple(dict.fromkeys(roots)), defaults, tuple(prometheus_flags), tuple(ranks_flags), profile)
