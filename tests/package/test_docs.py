"""The docs stay true: docs/reference.md is generated, the README names what exists, links resolve."""

import re
import unicodedata
from pathlib import Path

import yaml

from flare_exporter import cli
from flare_exporter.mixin import reference_tables

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = ROOT / "docs" / "reference.md"
REGENERATE = "run: python -m flare_exporter.mixin.reference_tables"


def test_reference_page_is_the_generators_output():
    assert REFERENCE.read_text() == reference_tables.reference_page(), REGENERATE


def test_reference_metric_table_matches_the_spec():
    assert reference_tables.metrics_table() in REFERENCE.read_text(), REGENERATE


def test_reference_config_table_matches_the_config():
    assert reference_tables.config_table() in REFERENCE.read_text(), REGENERATE


def test_reference_check_flag_fails_on_a_stale_page(tmp_path, capsys):
    page = tmp_path / "docs" / "reference.md"
    assert reference_tables.main(["--check", "--out", str(page)]) == 1  # missing
    assert reference_tables.main(["--out", str(page)]) == 0
    assert page.read_text() == reference_tables.reference_page()
    assert reference_tables.main(["--check", "--out", str(page)]) == 0
    page.write_text(page.read_text().replace("`flare_rank_info`", "`flare_rank_inf`", 1))
    assert reference_tables.main(["--check", "--out", str(page)]) == 1
    assert "python -m flare_exporter.mixin.reference_tables" in capsys.readouterr().err


def test_readme_opens_with_the_two_commands():
    head = README.split("## ")[0]
    assert "make demo" in head and "make test" in head


def test_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_readme_names_every_flare_subcommand():
    (commands,) = [action for action in cli.build_parser()._actions if action.dest == "command"]
    for name in commands.choices:
        assert f"| `flare {name}` |" in README, f"README's command table lacks flare {name}"


def test_readme_names_every_alert():
    rules = yaml.safe_load((ROOT / "alerts" / "flare.rules.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    assert alerts
    for alert in sorted(alerts):
        assert f"| `{alert}` |" in README, f"README's alert table lacks {alert}"


# ---------------------------------------------------------------------------------------------------------
# links between the README and docs/*.md: every relative link names a file that exists, and a heading there

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    anchors: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = "".join(
            char for char in text if char in " -_" or unicodedata.category(char)[0] in "LN"
        ).replace(" ", "-")
        candidate, number = slug, 0
        while candidate in anchors:
            number += 1
            candidate = f"{slug}-{number}"
        anchors.add(candidate)
    return anchors


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# docs/design.md's "A signal's path": the files it names, in order, exist

PATH_SECTION = re.compile(r"^## A signal's path$(.*?)^## ", re.MULTILINE | re.DOTALL)
NAMED_FILE = re.compile(r"`([\w./-]+\.(?:py|cpp|json|yml))`")


def files_named_in_signal_path(design: str) -> list[str]:
    section = PATH_SECTION.search(design)
    assert section, 'docs/design.md has no section "A signal\'s path"'
    return NAMED_FILE.findall(section.group(1))


def test_the_signal_paths_name_files_that_exist():
    named = files_named_in_signal_path((ROOT / "docs" / "design.md").read_text())
    assert len(named) >= 22  # both paths, each file in full from the repository's root
    assert [name for name in named if not (ROOT / name).is_file()] == []


STEP = re.compile(r"^\d+\. `([\w./-]+)`", re.MULTILINE)


def steps_of_each_path(design: str) -> dict[str, list[str]]:
    """Each path of the section (named by the line that opens it, ending in a colon) and the files of its
    numbered steps, in order."""
    section = PATH_SECTION.search(design)
    assert section, 'docs/design.md has no section "A signal\'s path"'
    paths: dict[str, list[str]] = {}
    name = ""
    for block in section.group(1).split("\n\n"):
        steps = STEP.findall(block)
        if steps and name:
            paths[name] = steps
        elif block.strip().endswith(":"):
            name = block.strip()
    return paths


def test_each_signal_path_takes_at_most_ten_files():
    paths = steps_of_each_path((ROOT / "docs" / "design.md").read_text())
    assert len(paths) == 2, paths  # a collective's duration and the hang verdict
    assert {name: len(set(steps)) for name, steps in paths.items() if len(set(steps)) > 10} == {}


def test_the_path_count_finds_a_path_of_eleven_files():
    steps = "\n".join(f"{number}. `flare_exporter/step{number}.py`: x" for number in range(1, 12))
    paths = steps_of_each_path(f"## A signal's path\n\nThe hang verdict:\n\n{steps}\n\n## Next\n")
    assert [len(found) for found in paths.values()] == [11]


def test_the_signal_path_check_finds_a_file_that_is_gone():
    design = (
        "## A signal's path\n\n1. `flare_exporter/spec.py`: x\n2. `flare_exporter/gone.py`: y\n\n## Next\n"
    )
    named = files_named_in_signal_path(design)
    assert named == ["flare_exporter/spec.py", "flare_exporter/gone.py"]
    assert [name for name in named if not (ROOT / name).is_file()] == ["flare_exporter/gone.py"]
