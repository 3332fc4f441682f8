"""Run an unmodified training script as an observed rank.

    python -m flare_exporter.launch [flags] script.py [script args]
    flare-run [flags] -m package.module [module args]
    torchrun --nproc-per-node 8 -m flare_exporter.launch [flags] train.py [args]

Works under any launcher that tells the rank its identity (torchrun, Slurm's srun, mpirun, or plain
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys

from .. import config as config_module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flare-run",
        description="Run a PyTorch training script with a flare-exporter on every rank.",
    )
    config_module.add_flags(parser)
    parser.add_argument(
        "--shim",
        action="store_true",
        help="re-run this command with the launch shim (cuda_hooks/, docs/shim.md) in LD_PRELOAD",
    )
    parser.add_argument(
        "-m", dest="module", default=None, help="run a module (like python -m) instead of a script"
    )
    parser.add_argument(
        "target", nargs=argparse.REMAINDER, help="script.py [args], or the module's args with -m"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    flags = {name: getattr(args, name) for name in config_module.FIELDS}
    try:
        config = config_module.load(flags)
    except config_module.ConfigError as error:
        print(f"flare-run: {error}", file=sys.stderr)
        return 2
    if args.module is None and not args.target:
        parser.print_usage(sys.stderr)
        print("flare-run: error: give a script to run (or -m module)", file=sys.stderr)
        return 2
    if args.shim:
        problem = preload_shim(argv)  # returns only if the shim is loaded already, or cannot be
        if problem:
            print(f"flare-run: {problem}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from .attach import attach  # torch is imported only once the arguments are known to be good

    try:
        attachment = attach(config)
    except config_module.ConfigError as error:  # e.g. RANK=abc from a broken launcher
        print(f"flare-run: {error}", file=sys.stderr)
        return 2
    try:
        if args.module is not None:
            sys.argv = [args.module, *args.target]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            run_script(args.target)
    except SystemExit as ended:  # the script's sys.exit(): its code goes into the exit incident
        attachment.incidents.exit_code = exit_code(ended.code)
        raise
    attachment.incidents.exit_code = 0
    return 0


def exit_code(code: object) -> int:
    """The process exit status of `sys.exit(code)`: None is 0, an int itself, anything else (a message) 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def run_script(command: list[str]) -> None:
    """Run `command` (a script and its arguments) as `python script.py args` would, in this process."""
    sys.argv = list(command)
    sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
    runpy.run_path(command[0], run_name="__main__")


# Set in the re-executed command, so that a shim that failed to load is reported rather than re-tried.
SHIM_REEXEC_ENV = "FLARE_SHIM_REEXEC"


def preload_shim(argv: list[str] | None) -> str | None:
    """Re-execute this command with the launch shim in LD_PRELOAD; an error line if it cannot be loaded.

    Returns None without re-executing when the shim is already loaded (the re-executed command itself).
    """
    from . import shim

    if shim.shim_loaded():
        os.environ.pop(SHIM_REEXEC_ENV, None)
        return None
    library = shim.library_path().resolve()
    if os.environ.get(SHIM_REEXEC_ENV):
        return f"--shim: {library} was in LD_PRELOAD but did not load (see the dynamic loader's message)"
    if not library.is_file():
        return (
            f"--shim: the shim {library} is not built; build it with `make -C cuda_hooks` "
            f"(needs gcc) or point {shim.LIBRARY_ENV} at it"
        )
    environ = dict(os.environ)
    existing = environ.get("LD_PRELOAD", "")
    environ["LD_PRELOAD"] = f"{library}:{existing}" if existing else str(library)
    environ[SHIM_REEXEC_ENV] = "1"
    # The command as started (interpreter options, flare-run or -m, arguments), unless main() was handed
    # its arguments directly.
    if argv is None:
        command = [sys.executable, *sys.orig_argv[1:]]
    else:
        command = [sys.executable, "-m", "flare_exporter.launch", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, environ)
    return None  # not reached: execve replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())
