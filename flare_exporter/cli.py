"""`flare` (its console script, and `python -m flare_exporter.cli`): the engine's commands (engine/cli.py)
and the mixin's `flare rules` (mixin/rules_cli.py), put together here so that the engine imports nothing of
the mixin.
"""

from __future__ import annotations

import argparse
import sys

from .engine import cli as engine_cli
from .mixin import rules_cli

RULES = engine_cli.Command(
    "rules",
    "print the Prometheus recording and alert rules",
    rules_cli.__doc__,
    rules_cli.add_arguments,
    rules_cli.main,
)
ADDED = (RULES,)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `flare`, every command's."""
    return engine_cli.build_parser(added=ADDED)


def main(argv: list[str] | None = None) -> int:
    return engine_cli.main(argv, ADDED)


if __name__ == "__main__":
    sys.exit(main())
