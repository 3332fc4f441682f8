"""The README's reference tables are generated from the spec and the config; they must not drift."""

from pathlib import Path

from flare_exporter import docs

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_metric_table_matches_the_spec():
    assert docs.metrics_table() in README, "run: python -m flare_exporter.docs, and paste into README.md"


def test_readme_config_table_matches_the_config():
    assert docs.config_table() in README, "run: python -m flare_exporter.docs, and paste into README.md"


def test_readme_opens_with_the_two_commands():
    head = README.split("## ")[0]
    assert "make demo" in head and "make test" in head
