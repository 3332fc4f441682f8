"""The README's reference tables, generated from the spec and the config (a test keeps them in step).

python -m flare_exporter.mixin.reference_tables     # prints both tables
"""

from __future__ import annotations

from .. import config, spec


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


if __name__ == "__main__":
    print(metrics_table(), config_table(), sep="\n\n")
