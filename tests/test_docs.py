"""The README's reference tables are generated from the spec and the config; they must not drift."""

from pathlib import Path

from flare_exporter.mixin import reference_tables

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_metric_table_matches_the_spec():
    assert reference_tables.metrics_table() in README, (
        "run: python -m flare_exporter.mixin.reference_tables, and paste into README.md"
    )


def test_readme_config_table_matches_the_config():
    assert reference_tables.config_table() in README, (
        "run: python -m flare_exporter.mixin.reference_tables, and paste into README.md"
    )


def test_readme_opens_with_the_two_commands():
    head = README.split("## ")[0]
    assert "make demo" in head and "make test" in head
