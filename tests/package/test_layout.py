"""The package's layout: no import cycles, the rank wing loads nothing of the other wings, and the engine
nothing of the mixin or local wings (the `flare` command puts the engine's and the mixin's commands
together above both: flare_exporter/cli.py). The tests' layout: each test module in the folder of the wing
it tests (or of real jobs end to end, or of the package as a whole), each under a name of its own.

The graph counts every import the code makes: at the top of a module, inside a function, and under
`if TYPE_CHECKING:` (a cycle hidden by typing is still a cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "flare_exporter"
WINGS = ("rank", "engine", "mixin", "local")
# tests/: a folder per wing, one for real jobs end to end, one for the package as a whole (its layout, its
# shared modules, its docs); beside them conftest.py and the user programs both rank and e2e tests run
TEST_FOLDERS = (*WINGS, "e2e", "package")
SHARED_TEST_FOLDERS = ("programs",)
RANK_MAY_NOT_IMPORT = ("engine", "mixin", "local")
# wing -> the wings it may not import: a training process loads only the rank wing; `flare diagnose` reads
# the recording rules' names and the config the mixin shares with it from outside the mixin
MAY_NOT_IMPORT = {"rank": RANK_MAY_NOT_IMPORT, "engine": ("mixin", "local")}


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its __init__'s)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, node: ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The package's modules a `from ... import ...` names: the modules imported from, or the module."""
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        origin = ".".join([*base, *(node.module.split(".") if node.module else [])])
    else:
        origin = node.module or ""
    named = [f"{origin}.{alias.name}" for alias in node.names if f"{origin}.{alias.name}" in modules]
    everything_named = len(named) == len(node.names)
    return named if everything_named or origin not in modules else [*named, origin]


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its code."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                targets = _imported(module, path, node, modules)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name in modules]
            else:
                continue
            graph[module].update(target for target in targets if target != module and target != package)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def wing_violations(graph: dict[str, set[str]], package: str = PACKAGE, wing: str = "rank") -> list[str]:
    """`a -> b` for every import from `wing` into a wing it may not import (MAY_NOT_IMPORT)."""
    prefix = f"{package}.{wing}"
    forbidden = tuple(f"{package}.{other}" for other in MAY_NOT_IMPORT[wing])
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == prefix or module.startswith(prefix + ".")
        for target in targets
        if target.startswith(forbidden)
    )


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph(REPO)) == []


def test_the_rank_wing_imports_nothing_of_the_engine_mixin_or_local_wings():
    assert wing_violations(import_graph(REPO)) == []


def test_the_engine_imports_nothing_of_the_mixin_or_local_wings():
    assert wing_violations(import_graph(REPO), wing="engine") == []


def misplaced_tests(tests: Path) -> list[str]:
    """What breaks the tests' layout under `tests`: a folder of no known name, a test module outside a
    TEST_FOLDERS folder (at the root, deeper, or in another folder), a module name used twice (pytest's
    prepend import mode imports each test module by its bare name)."""
    known = (*TEST_FOLDERS, *SHARED_TEST_FOLDERS, "__pycache__")
    problems = [
        f"{path.name}/: not a test folder"
        for path in sorted(tests.iterdir())
        if path.is_dir() and not path.name.startswith(".") and path.name not in known
    ]
    modules = sorted(tests.rglob("test_*.py"))
    for path in modules:
        relative = path.relative_to(tests)
        if len(relative.parts) != 2 or relative.parts[0] not in TEST_FOLDERS:
            problems.append(f"{relative.as_posix()}: not in a wing's folder")
    uses = Counter(path.name for path in modules)
    return problems + [f"{name}: in several folders" for name, count in uses.items() if count > 1]


def test_every_test_module_is_in_its_wings_folder():
    tests = REPO / "tests"
    assert {path.parent.name for path in tests.rglob("test_*.py")} >= {"rank", "engine", "mixin", "e2e"}
    assert misplaced_tests(tests) == []


def test_the_checker_finds_a_test_at_the_root_in_an_unknown_folder_or_twice(tmp_path):
    files = "conftest.py test_back_at_the_root.py rank/test_a.py rank/golden/test_deep.py engine/test_a.py"
    for name in [*files.split(), "programs/train.py", "programs/test_program.py", "misc/test_b.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert misplaced_tests(tmp_path) == [
        "misc/: not a test folder",
        "misc/test_b.py: not in a wing's folder",
        "programs/test_program.py: not in a wing's folder",
        "rank/golden/test_deep.py: not in a wing's folder",
        "test_back_at_the_root.py: not in a wing's folder",
        "test_a.py: in several folders",
    ]


def test_every_wing_exists_and_holds_modules():
    graph = import_graph(REPO)
    for wing in WINGS:
        assert any(name.startswith(f"{PACKAGE}.{wing}.") for name in graph), wing


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_cycle_hidden_in_a_function_and_one_hidden_by_typing(tmp_path):
    _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from . import b\n",
            "b.py": "from .a import f\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
            "d.py": "from . import c\nclass D: ...\n",
            "e.py": "from . import a\n",  # imports into a cycle, is not part of one
        },
    )
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_the_checker_finds_a_rank_module_importing_another_wing(tmp_path):
    _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "spec.py": "",
            "rank/__init__.py": "",
            "rank/hook.py": "from .. import spec\ndef late():\n    from ..engine import rules\n",
            "engine/__init__.py": "",
            "engine/rules.py": "from ..rank import hook\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert wing_violations(graph, "pkg") == ["pkg.rank.hook -> pkg.engine.rules"]
    assert cycles(graph) == [["pkg.engine.rules", "pkg.rank.hook"]]


def test_the_checker_finds_an_engine_module_importing_the_mixin_or_local(tmp_path):
    _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "config.py": "",
            "engine/__init__.py": "",
            "engine/cli.py": "from .. import config\nfrom ..mixin import rules\n",
            "engine/sources.py": "def late():\n    from ..local.prometheus import wait_for\n",
            "engine/views.py": "import typing\nif typing.TYPE_CHECKING:\n    from ..mixin.rules import X\n",
            "mixin/__init__.py": "",
            "mixin/rules.py": "X = 1\n",
            "local/__init__.py": "",
            "local/prometheus.py": "",
        },
    )
    assert wing_violations(import_graph(tmp_path, "pkg"), "pkg", "engine") == [
        "pkg.engine.cli -> pkg.mixin.rules",
        "pkg.engine.sources -> pkg.local.prometheus",
        "pkg.engine.views -> pkg.mixin.rules",
    ]


@pytest.mark.process
@pytest.mark.parametrize("entry", ["flare_exporter.rank.attach", "flare_exporter.launch"])
def test_a_training_process_loads_no_module_of_the_other_wings(entry):
    probe = (
        f"import importlib, json, sys; importlib.import_module({entry!r}); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('flare_exporter'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    assert entry in loaded and any(name.startswith(f"{PACKAGE}.rank.") for name in loaded), loaded
    assert [
        name for name in loaded if name.startswith(tuple(f"{PACKAGE}.{w}" for w in RANK_MAY_NOT_IMPORT))
    ] == []
