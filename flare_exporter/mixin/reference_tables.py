"""docs/reference.md, generated from the config and the metric spec (a test keeps it in step).

    python -m flare_exporter.mixin.reference_tables            # writes docs/reference.md
    python -m flare_exporter.mixin.reference_tables --check    # exit 1 if docs/reference.md is stale

The page is a short header and two tables, the configuration keys and the metrics; tests/package/test_docs.py
checks that the committed page is exactly this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import config, spec

PROCESS_GROUP_INFO = spec.series("flare_process_group_info")
RANK_INFO = spec.series("flare_rank_info")

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "reference.md"

HEADER = """\
# Reference: configuration and metrics

Generated from `flare_exporter/config.py` and `flare_exporter/spec.py` by
`python -m flare_exporter.mixin.reference_tables`; do not edit it by hand. With `--check` the command exits
with status 1 when this page is stale, and `tests/package/test_docs.py` fails.
"""

CONFIG_INTRO = """\
## Configuration

One frozen configuration is read from a YAML file (`--config` or `FLARE_CONFIG`), then from `FLARE_*`
environment variables, then from launcher flags. Later sources win. Unknown keys, wrong types and
out-of-range values are errors that name the key and the file, variable or flag.
"""

METRICS_INTRO = f"""\
## Metrics

Every metric is declared once, in `flare_exporter/spec.py`. Every series carries `rank` (the global rank)
and `run` (the training run's id). Everything else about a rank lives in `{RANK_INFO}`: join on `rank`
with `group_left`.
"""

LABELS_NOTE = f"""\
Collective ops (label `op`) are the ProcessGroup method names: `allreduce`, `broadcast`, `allgather`,
`allgather_base`, `reduce_scatter`, `reduce_scatter_base`, `alltoall_base`, `barrier`, `send`, `recv`, and
so on. Point-to-point ops are timed but take no sequence number, since they are not group-wide.

Process groups (label `group`) are `world` for the default group. Any other group is named by its
description plus a hash of its sorted global ranks (e.g. `data_parallel-3f2a9c1e`), identical on every
member. `{PROCESS_GROUP_INFO}` gives its role (`dp`, `tp`, `pp`, `ep`, `cp`, `world`, `other`) and
its size.
"""


def metrics_table() -> str:
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for metric in spec.METRICS:
        labels = ", ".join(spec.COMMON_LABELS + metric.labels)
        meaning = f"{metric.help} {metric.detail}".strip()
        lines.append(f"| `{metric.name}` | {metric.type} | {labels} | {meaning} |")
    return "\n".join(lines)


def config_table() -> str:
    lines = ["| YAML key | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for name, field in config.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        lines.append(
            f"| `{name}` | `{config.ENV_PREFIX}{name.upper()}` | `{flag}` | `{field.default!r}` | "
            f"{field.metadata['help']} |"
        )
    return "\n".join(lines)


def reference_page() -> str:
    """The whole of docs/reference.md."""
    parts = [HEADER, CONFIG_INTRO, config_table() + "\n", METRICS_INTRO, metrics_table() + "\n", LABELS_NOTE]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flare_exporter.mixin.reference_tables", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help="the page to write (default: docs/reference.md)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the output")
    args = parser.parse_args(argv)
    out = Path(args.out)
    text = reference_page()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(
                f"flare: stale {out} (run python -m flare_exporter.mixin.reference_tables)", file=sys.stderr
            )
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
