"""flare's C++ recorder, a torch extension (csrc/): built once per torch and Python, loaded if built.

    python -m flare_exporter.rank.cpp_recorder            # build it (a C++ compiler, about 30 s), print where

It holds the host dispatch timer (csrc/dispatch_timer.cpp), a torch RecordFunction observer that times
every aten op in a sampling window for tens of ns per op, where the Python dispatch mode (dispatch.py)
costs microseconds, and the per-op shift of its samples from their baseline (csrc/op_shift.cpp, ild.py);
the recording backend (csrc/collectives.cpp), which records every collective of a
gloo group in C++ (process_group.py); the optimizer step hook as a C function (csrc/steps.cpp,
progress.py); and the text format a scrape serves (csrc/text_format.cpp, exposition.py). Built into a
directory named after the sources, torch and Python versions, under `FLARE_CPP_RECORDER_DIR` (default:
~/.cache/flare-exporter), so a new torch needs a new build and never loads a stale one. Without a build the
exporter uses the dispatch mode, Python hooks and the Python text format.

A plain `pip install` builds nothing. So that it does not silently stay weaker, a launch that finds no build
starts one in the background (`build_later`, the `cpp_recorder_build` config key): one process per build
directory on the host (a lock file there), at the lowest CPU priority, for the next launch; this one runs
the Python hooks and says so in one line (`startup_line`). A build that failed is not tried again: its first
error line stays beside the lock, and the start-up line quotes it.
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
import time
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
DIRECTORY_ENV = "FLARE_CPP_RECORDER_DIR"
COMPILER_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-Wall"]

_loaded: ModuleType | None = None
load_error: str | None = None  # why load() found no recorder, for the exporter's info and the docs


class BuildError(RuntimeError):
    """The recorder could not be compiled; the message names the command's first error line."""


def build_directory() -> Path:
    root = os.environ.get(DIRECTORY_ENV) or Path.home() / ".cache" / "flare-exporter"
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


LOCK_NAME = "building.lock"  # beside the build: the pid of the process building it
FAILED_NAME = "build-failed.txt"  # beside the build: why the last build failed (its first error line)
STALE_LOCK_SECONDS = 900  # a lock older than this is a build that died without removing it


def build_later(command: list[str] | None = None) -> str:
    """Start building the recorder in the background for later launches, unless one is under way or failed
    before; never raises. Returns what happened: `started`, `building` (another process holds the lock),
    `failed before: <why>`, or `cannot start: <why>`. `command` replaces the build (tests)."""
    try:
        directory = build_directory()
        failed = directory / FAILED_NAME
        if failed.exists():
            return f"failed before: {failed.read_text(errors='replace').strip()[:200]}"
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / LOCK_NAME
        if not _take_lock(lock):
            return "building"
        command = command or [sys.executable, "-m", __name__, "--background", str(lock)]
        subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not the job's: a launcher's signals to the ranks leave it be
            close_fds=True,
        )
        return "started"
    except Exception as error:  # a launch never fails for the recorder's build
        return f"cannot start: {error}"


def _take_lock(lock: Path) -> bool:
    """Create `lock` (this process's pid in it) unless another live build holds it."""
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not _stale(lock):
                return False
            lock.unlink(missing_ok=True)  # a build that died: take its place
            continue
        with os.fdopen(descriptor, "w") as handle:
            handle.write(str(os.getpid()))
        return True
    return False


def _stale(lock: Path) -> bool:
    try:
        return time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS
    except FileNotFoundError:
        return True


def _build_in_background(lock: Path) -> int:
    """The background build (`--background LOCK`): at the lowest priority; its failure written beside the
    lock; the lock removed at the end either way."""
    try:
        os.nice(19)
        build()
        return 0
    except (BuildError, OSError) as error:
        (lock.parent / FAILED_NAME).write_text(f"{error}\n")
        return 1
    finally:
        lock.unlink(missing_ok=True)


def startup_line(native: bool, built: str = "") -> str:
    """The one line a launch says of its recorder: the C++ one, or the Python hooks and why (`built`: what
    build_later did)."""
    if native:
        return f"flare-exporter: collectives recorded in C++ (flare's recorder, {library_path()})"
    why = load_error or "switched off (native_collectives: false)"
    line = f"flare-exporter: collectives recorded by Python hooks: the C++ recorder is {why}"
    if built == "started":
        line += "; building it in the background for the next launch"
    elif built:
        line += f"; its build: {built}"
    return line


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m flare_exporter.rank.cpp_recorder", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--background", metavar="LOCK", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.background:
        return _build_in_background(Path(args.background))
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
