"""`flare targets prune`: remove the target files, and incident files, of runs that ended.

    flare targets prune --dir DIR [--older-than DURATION] [--run RUN] [--dry-run] [--timeout SECONDS]

Each rank writes `DIR/flare-<run>-rank<N>.json` (rank/file_sd.py) and, when it dies, hangs or exits,
`DIR/incidents/<run>-rank<N>.json` (rank/incident.py). A rank killed with SIGKILL, or by a node that went
away, leaves its target file behind, and Prometheus scrapes the dead address for ever. This removes the
files of every run that ended: none of its targets answers as that run, and the newest of its files is older
than --older-than (default 10m: long enough for Prometheus to record the run's last state and for
`flare report` to read its incident files). With --run, it removes that run's files whatever their age and
without scraping (a Slurm epilog: `flare targets prune --dir $DIR --run $SLURM_JOB_ID`; a Slurm job id also
names its steps' runs, `<job>.<step>`).

A target answers as its run when its /metrics carries flare_rank_info with that run. A target that cannot
be verified (an HTTP error, a TLS handshake that fails, a connection closed before an answer: a rank secured
by a web config file) counts as answering, so a live run is never pruned for want of credentials. A target
that refuses the connection, does not answer within --timeout, cannot be resolved, or answers with another
run's metrics (a later run on the same port) or with no flare exposition does not.

Files that are not flare's (other names, unreadable JSON, no run label) are never touched. One line per file
removed (`would remove` with --dry-run); exit 0, or 2 with one line for bad input or a file that could not be
removed.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import config as config_module
from .. import spec
from ..durations import duration_seconds
from . import incident_source, scrape
from .targets import Target, TargetsError, read_targets

RANK_INFO = spec.series("flare_rank_info")

EXIT_OK, EXIT_USAGE = 0, 2
DEFAULT_OLDER_THAN = "10m"
DEFAULT_TIMEOUT = 3.0
SCRAPES_AT_ONCE = 256  # a dead node's ranks time out: thousands of them take timeout x targets / this
TARGET_FILE = re.compile(r"flare-.+-rank\d+\.json")  # rank/file_sd.py's target_path
INCIDENT_FILE = re.compile(r".+-rank\d+\.json")  # rank/incident.py's incident_path
# What a scrape's error says when no process listens at the address or none answers in time
# (rank_client._reason): the rank is gone, or its node is.
NOBODY_THERE = (
    *(
        f"[Errno {number}]"
        for number in (
            errno.ECONNREFUSED,
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
            errno.ETIMEDOUT,
            errno.EHOSTDOWN,
        )
    ),
    "timed out",
    "Name or service not known",
    "nodename nor servname provided",
    "Temporary failure in name resolution",
    "No address associated with hostname",
    "malformed exposition",  # something else listens there
)


class PruneError(ValueError):
    """The directory cannot be pruned; the message names it and what is wrong."""


@dataclass
class RunFiles:
    """One run's files in the directory: its targets' addresses, the files, and the newest's mtime."""

    run: str
    addresses: set[str] = field(default_factory=set)
    files: list[str] = field(default_factory=list)
    newest: float = 0.0

    def add(self, path: str, mtime: float, addresses: Iterable[str] = ()) -> None:
        self.files.append(path)
        self.addresses.update(addresses)
        self.newest = max(self.newest, mtime)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `flare targets prune`."""
    parser.add_argument("--dir", required=True, help="the file_sd directory (FLARE_FILE_SD_DIR)")
    parser.add_argument(
        "--older-than",
        default=DEFAULT_OLDER_THAN,
        metavar="DURATION",
        help=f"prune a run whose targets do not answer once its newest file is this old (default "
        f"{DEFAULT_OLDER_THAN}; a Prometheus duration)",
    )
    parser.add_argument(
        "--run",
        default="",
        help="remove this run's files, whatever their age, without scraping (a Slurm job id: its steps' too)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds a target has to answer (default {DEFAULT_TIMEOUT:g})",
    )


def main(args: argparse.Namespace) -> int:
    """Remove (or with --dry-run, name) the files of the runs that ended; the exit code."""
    try:
        older_than = duration_seconds(args.older_than, "flag --older-than")
        if not args.timeout > 0:
            raise PruneError(f"flag --timeout: {args.timeout} is not a positive number of seconds")
        runs = runs_in(args.dir)
    except (config_module.ConfigError, PruneError) as error:
        print(f"flare: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.run:
        chosen = [files for run, files in runs.items() if names_run(args.run, run)]
    else:
        chosen = ended(runs, time.time() - older_than, args.timeout)
    failed = sum(not remove(files, args.dry_run) for files in chosen)
    return EXIT_USAGE if failed else EXIT_OK


def names_run(wanted: str, run: str) -> bool:
    """Whether --run `wanted` names `run`: the same, or `run` is a step of job `wanted` (`<job>.<step>`)."""
    return run == wanted or re.fullmatch(re.escape(wanted) + r"\.\d+", run) is not None


def runs_in(directory: str) -> dict[str, RunFiles]:
    """Every run with files in `directory` (target files) or its `incidents` subdirectory, by run id."""
    if not os.path.isdir(directory):
        raise PruneError(f"targets directory {directory}: no such directory")
    runs: dict[str, RunFiles] = {}
    for path, mtime in _files(directory, TARGET_FILE):
        targets = _targets(path)
        run = targets[0].labels.get("run", "") if targets else ""
        if run and all(target.labels.get("run") == run for target in targets):
            runs.setdefault(run, RunFiles(run)).add(path, mtime, [target.address for target in targets])
    for path, mtime in _files(os.path.join(directory, incident_source.INCIDENTS_SUBDIRECTORY), INCIDENT_FILE):
        run = _incident_run(path)
        if run:
            runs.setdefault(run, RunFiles(run)).add(path, mtime)
    return runs


def _files(directory: str, pattern: re.Pattern[str]) -> list[tuple[str, float]]:
    """(path, mtime) of the regular files in `directory` whose names match `pattern`; none if it is absent."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    except OSError as error:
        raise PruneError(f"directory {directory}: cannot read it ({error.strerror or error})") from None
    found = []
    for entry in sorted(entries, key=lambda entry: entry.name):
        if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                found.append((entry.path, entry.stat(follow_symlinks=False).st_mtime))
            except FileNotFoundError:  # removed since the listing (a rank that exited, another prune)
                continue
    return found


def _targets(path: str) -> list[Target]:
    try:
        return read_targets(path)
    except TargetsError:  # not a file_sd file: not flare's to remove
        return []


def _incident_run(path: str) -> str:
    try:
        identity = incident_source.read_incident(path)["identity"]
    except incident_source.IncidentError:  # not an incident file: not flare's to remove
        return ""
    run = identity.get("run")
    return run if isinstance(run, str) else ""


def ended(runs: dict[str, RunFiles], written_before: float, timeout: float) -> list[RunFiles]:
    """The runs whose files are all older than `written_before` (Unix time) and none of whose targets
    answers as the run, within `timeout` seconds each (all scraped at once)."""
    old = [files for files in runs.values() if files.newest < written_before]
    addresses = sorted({address for files in old for address in files.addresses})
    answers = scrape.scrape_all(addresses, timeout, SCRAPES_AT_ONCE, wanted={RANK_INFO})
    return [
        files
        for files in old
        if not any(answers_as(answers[address], files.run) for address in files.addresses)
    ]


def answers_as(answer: list[scrape.Sample] | scrape.ScrapeError, run: str) -> bool:
    """Whether a target's scrape says it may be a rank of `run`: its flare_rank_info names the run, or an
    error that does not say nobody is there (an endpoint that wants credentials cannot be verified)."""
    if isinstance(answer, scrape.ScrapeError):
        message = str(answer)
        return not any(marker in message for marker in NOBODY_THERE)
    return any(sample.name == RANK_INFO and sample.labels.get("run") == run for sample in answer)


def remove(files: RunFiles, dry_run: bool) -> bool:
    """Remove the run's files (with `dry_run`, only say so), one line each; False if one could not be."""
    removed_all = True
    for path in files.files:
        if dry_run:
            print(f"would remove {path} (run {files.run})")
            continue
        try:
            os.remove(path)
        except FileNotFoundError:  # gone since the listing
            continue
        except OSError as error:
            print(f"flare: cannot remove {path} ({error.strerror or error})", file=sys.stderr)
            removed_all = False
            continue
        print(f"removed {path} (run {files.run})")
    return removed_all
