"""A sample's line in the text format up to its value: names checked, label values escaped.

Shared by the collectors, which keep each series' prefix from one scrape to the next, and the exposition,
which writes them (and hands anything else to prometheus_client's writer).
"""

from __future__ import annotations

import re


class NotPlain(Exception):
    """A family render_text does not write itself (generate_latest does)."""


is_legacy_name = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z").match
_LABEL_NAMES: set[str] = set()  # label names seen to need no escaping


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def sample_prefix(name: str, labels: dict[str, str]) -> str:
    """`name{label="value",...} `: the line up to its value, label names checked, values escaped."""
    if not labels:
        return name + " "
    if not _LABEL_NAMES.issuperset(labels):
        for key in labels:
            if not is_legacy_name(key) or key.startswith("__"):
                raise NotPlain(key)
            _LABEL_NAMES.add(key)
    text = ",".join(f'{key}="{_escape_value(value)}"' for key, value in sorted(labels.items()))
    return f"{name}{{{text}}} "
