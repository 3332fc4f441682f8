"""Prometheus durations (15s, 5m, 1h30m) in seconds: the rules' windows and the commands' --window flags.

Shared by the mixin (the rules it writes) and the engine (the windows it asks Prometheus for), so that a
duration one takes the other takes too.
"""

from __future__ import annotations

import re

from .config import ConfigError

DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")
DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str, what: str) -> float:
    """Seconds in a Prometheus duration such as 15s, 5m or 1h30m; ConfigError naming `what` otherwise."""
    if not DURATION.match(text):
        raise ConfigError(f"{what}: {text!r} is not a Prometheus duration such as 30s or 5m")
    return sum(int(number) * _SECONDS[unit] for number, unit in DURATION_PART.findall(text))
