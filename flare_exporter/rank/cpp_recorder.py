"""flare's C++ recorder, a torch extension (csrc/): built once per torch and Python, loaded if built.

    python -m flare_exporter.rank.cpp_recorder            # build it (a C++ compiler, about 30 s), print where

It holds the host dispatch timer (csrc/dispatch_timer.cpp), a torch RecordFunction observer that times
every aten op in a sampling window for tens of ns per op, where the Python dispatch mode (dispatch.py)
costs microseconds, and the per-op shift of its samples from their baseline (csrc/op_shift.cpp, ild.py);
the recording backend (csrc/collectives.cpp), which records every collective of a
gloo group in C++ (process_group.py); the optimizer step hook as a C function (csrc/steps.cpp,
progress.py); and the text format a scrape serves (csrc/text_format.cpp, exposition.py). Built into a
directory named after the sources, torch and Python versions, under `FLARE_CPP_RECORDER_DIR` (or the older
`FLARE_OP_TIMER_DIR`; default:
~/.cache/flare-exporter), so a new torch needs a new build and never loads a stale one. Without a build the
exporter uses the dispatch mode, Python hooks and the Python text format.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import torch

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# compiled together; their headers lie in SOURCE_DIR too
SOURCES = [
    SOURCE_DIR / name
    for name in (
        "module.cpp",
        "dispatch_timer.cpp",
        "op_shift.cpp",
        "collectives.cpp",
        "steps.cpp",
        "text_format.cpp",
    )
]
MODULE_NAME = "flare_cpp_recorder"
DIRECTORY_ENV = ("FLARE_CPP_RECORDER_DIR", "FLARE_OP_TIMER_DIR")  # the second: its name before the rename
COMPILER_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-Wall"]

_loaded: ModuleType | None = None
load_error: str | None = None  # why load() found no recorder, for the exporter's info and the docs


class BuildError(RuntimeError):
    """The recorder could not be compiled; the message names the command's first error line."""


def build_directory() -> Path:
    root = (
        next(filter(None, map(os.environ.get, DIRECTORY_ENV)), None)
        or Path.home() / ".cache" / "flare-exporter"
    )
    sources = sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h"))
    code = b"".join(path.read_bytes() for path in sources)
    identity = code + f"{torch.__version__} {sys.version} {sys.platform}".encode()
    return Path(root) / f"cpp_recorder-{hashlib.sha256(identity).hexdigest()[:16]}"


def library_path() -> Path:
    return build_directory() / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "c++"),
        *COMPILER_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{path}" for path in includes),
        *map(str, SOURCES),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
        "-o",
        str(output),
    ]


def build() -> Path:
    """Compile the recorder into its build directory (atomically) and return the library's path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        command = compile_command(output)
        if shutil.which(command[0]) is None:
            raise BuildError(f"no C++ compiler: {command[0]!r} is not on PATH (set CXX)")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            first = next(
                (line for line in result.stderr.splitlines() if "error" in line), result.stderr[:200]
            )
            raise BuildError(f"compiling {', '.join(path.name for path in SOURCES)} failed: {first.strip()}")
        os.replace(output, target)  # whole, or not at all, for ranks loading it at the same time
    return target


def load() -> ModuleType | None:
    """The built recorder, or None (why: `load_error`). Never builds and never raises."""
    global _loaded, load_error
    if _loaded is not None:
        return _loaded
    path = library_path()
    if not path.exists():
        load_error = f"not built ({path}); build it with: python -m flare_exporter.rank.cpp_recorder"
        return None
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # a broken build must not stop training: fall back to the dispatch mode
        load_error = f"{path}: {error}"
        return None
    _loaded = module
    return module


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m flare_exporter.rank.cpp_recorder", description=__doc__.split("\n")[0]
    )
    parser.parse_args(argv)
    try:
        path = build()
    except (BuildError, OSError) as error:
        print(f"flare cpp_recorder: {error}", file=sys.stderr)
        return 1
    if load() is None:
        print(f"flare cpp_recorder: built but cannot load: {load_error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
