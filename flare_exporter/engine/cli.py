"""The `flare` command: which rank, and why?

    flare diagnose   (--prometheus URL | --targets FILE|DIR | --incidents DIR | --flight-recorder DIR)
                     [--run RUN] [--json] [--at T]
    flare ranks      ...   one line per rank: step, heartbeat age, in-flight op and its state
    flare hang       ...   each process group: in flight, how long, who is behind
    flare stragglers ...   each rank's step time, collective wait per step and straggler score
    flare canary     ...   each rank's hardware canary: value, share of the job's median, failed, drift
    flare report     [--prometheus URL] [--targets FILE|DIR] [--incidents DIR] [--flight-recorder DIR]
                     [--out FILE] [--json]
                           the incident report of a run that is gone: who went first, why, and when
    flare perf       (--prometheus URL | --targets FILE|DIR) [--run RUN] [--window 5m] [--json]
                           where each rank's step time goes: phases, bottleneck class, MFU, seconds lost
    flare rules [--for D] [--selector M] [--scrape-interval D]   the Prometheus rules for this config
                           (mixin/rules_cli.py: flare_exporter/cli.py adds it to the engine's commands)
    flare mcp [--transport stdio|http] [--host 127.0.0.1] [--port N] [--token-file FILE] [--allow-dir DIR]
              [--allow-profile] [--prometheus URL and its credentials' flags] [--targets ...] [--incidents]
                           diagnose, ranks, hang, stragglers, canary, perf and report as read-only tools
                           for agents over the Model Context Protocol, and profile with --allow-profile
                           (mcp_server.py; what a tool may read: mcp_policy.py; needs flare-exporter[mcp])

`--prometheus` reads the Prometheus HTTP API (a fixed number of queries, whatever the rank count);
`--targets` scrapes the ranks' /metrics directly: a file of host:port lines, a file_sd JSON file, or a
directory of them (what FLARE_FILE_SD_DIR holds); `--incidents` reads the incident files the ranks left;
`--flight-recorder` reads PyTorch's flight-recorder dumps, one per rank (a directory, or their path prefix
such as /tmp/nccl_trace_rank_), and judges the moment they show (flight_recorder.py); `flare report` over
them merges the incident files lying beside them.
When no rank of the run answers, the run is gone: the verdict comes from each rank's last word instead
(post_mortem.py), from Prometheus's history within --window before --at (default: now), or from the
incident files beside the targets (their `incidents` subdirectory). The hang threshold is --hang-seconds, else
FLARE_HANG_SECONDS / the config file's hang_seconds, else the one the run's ranks export, else the config's
default (config.HangThreshold); the per-op shift that counts as an ILD regression likewise
(--ild-op-shift-seconds, FLARE_ILD_OP_SHIFT_SECONDS, ild_op_shift_seconds, its default): config.py declares
both.

Exit codes: 0 healthy; 1 anomaly found; 2 usage, input or connection error; 3 could not decide (no
rank answered, or several runs and no --run). `answer(argv)` computes what a diagnosis command's --json
prints, without printing: the MCP server's tools call it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import __version__
from .. import config as config_module
from ..durations import duration_seconds
from ..policies import IldPolicy
from . import (
    canary_view,
    diagnosis,
    flight_recorder,
    history_source,
    incident_source,
    perf_command,
    post_mortem,
    profile_command,
    prometheus_source,
    promql,
    prune,
    records,
    report,
    scrape,
    scrape_source,
)
from .host_load import WARNING
from .promql import PrometheusError
from .rule_types import Snapshot, Verdict
from .targets import TargetsError, read_targets
from .verdict_terms import VerdictKind
from .views import SORTS, RankSelection, hang_view, ranks_view, stragglers_view

EXIT_OK, EXIT_ANOMALY, EXIT_USAGE, EXIT_UNDECIDED = 0, 1, 2, 3
HANG_KINDS: tuple[VerdictKind, ...] = ("host_fault", "rank_down", "mismatch", "hang")
# the commands answer() answers
ANSWERING = ("diagnose", "ranks", "hang", "stragglers", "canary", "perf", "report")


@dataclass(frozen=True)
class Answer:
    """A diagnosis command's answer: its exit code (0 healthy, 1 anomaly found), the JSON object --json
    prints, and the text it prints for people (for `report`, the Markdown report)."""

    code: int
    result: dict[str, Any]
    text: str


class CommandError(Exception):
    """A command that could not answer: its exit code (2 usage, input or connection; 3 undecided) and the
    one line `flare` prints on stderr."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code = code


# ---------------------------------------------------------------------------------------------------------
# command line

COMMANDS: dict[str, tuple[str, Callable[[Verdict], bool]]] = {
    "diagnose": ("all verdicts, most severe first", lambda verdict: True),
    "ranks": ("one line per rank: step, heartbeat age, in-flight op and state", lambda verdict: True),
    "hang": ("each process group: in flight, for how long, who is behind", lambda v: v.kind in HANG_KINDS),
    "stragglers": ("each rank's step time, collective wait and score", lambda v: v.kind == "straggler"),
    "canary": (
        "each rank's hardware canary: value, share of the job's median, failed checks, moving average",
        lambda v: v.kind == "canary",
    ),
}


@dataclass(frozen=True)
class Command:
    """A command of `flare` that another wing provides (the mixin's `flare rules`, which flare_exporter/cli.py
    adds): its name, help line and description, what adds its flags, and what runs it (its exit code)."""

    name: str
    help: str
    description: str | None
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser, added: Sequence[Command] = ()
) -> argparse.ArgumentParser:
    """The parser of `flare`: the engine's commands, and the `added` ones before `flare mcp`."""
    parser = parser_class(prog="flare", description="Which rank, and why? Diagnose a training job.")
    parser.add_argument("--version", action="version", version=f"flare {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # a short usage line
    for name, (help_text, _) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        source = command.add_mutually_exclusive_group(required=True)
        source.add_argument(
            "--prometheus", metavar="URL", help="Prometheus base URL, e.g. http://localhost:9090"
        )
        source.add_argument(
            "--targets",
            metavar="FILE|DIR",
            help="scrape the ranks directly: host:port lines, a file_sd JSON file, or a directory of them",
        )
        source.add_argument("--incidents", metavar="DIR", help="the incident files of a run that is gone")
        source.add_argument("--flight-recorder", metavar="DIR", help=FLIGHT_RECORDER_HELP)
        _add_post_mortem_arguments(command)
        command.add_argument("--run", default="", help="the run to diagnose (needed when several are seen)")
        command.add_argument("--json", action="store_true", help="print one JSON object for programs")
        config_module.add_engine_arguments(command)
        command.add_argument(
            "--timeout", type=float, default=5.0, help="seconds per scrape or query (default 5)"
        )
        command.add_argument(
            "--window", default="5m", help="Prometheus lookback for rates and gone ranks (default 5m)"
        )
        _add_prometheus_arguments(command)
        if name == "ranks":
            _add_selection_arguments(command)
        _add_ranks_access_arguments(command)
    _add_report_command(commands)
    perf_help = "where each rank's step time goes: phases, bottleneck class, MFU, seconds lost"
    perf_command_parser = commands.add_parser("perf", help=perf_help, description=perf_help)
    perf_command.add_arguments(perf_command_parser)
    _add_prometheus_arguments(perf_command_parser)
    _add_ranks_access_arguments(perf_command_parser)
    profile_help = "capture a few steps on chosen ranks with torch.profiler: each rank's bottleneck, evidence"
    profile_parser = commands.add_parser("profile", help=profile_help, description=profile_command.__doc__)
    profile_command.add_arguments(profile_parser)
    _add_prometheus_arguments(profile_parser)
    _add_ranks_access_arguments(profile_parser)
    targets_command = commands.add_parser("targets", help="manage the file_sd target files of runs")
    targets_actions = targets_command.add_subparsers(dest="action", required=True)
    prune_help = "remove the target and incident files of runs that ended (e.g. in a Slurm epilog)"
    prune.add_arguments(targets_actions.add_parser("prune", help=prune_help, description=prune_help))
    for other in added:
        other.add_arguments(commands.add_parser(other.name, help=other.help, description=other.description))
    _add_mcp_command(commands)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "a positive number"  # argparse's error: "invalid a positive number value: '0'"


def _add_selection_arguments(command: argparse.ArgumentParser) -> None:
    """`flare ranks` at thousands of ranks: which rows, in which order, how many (views.RankSelection)."""
    command.add_argument(
        "--problems",
        action="store_true",
        help="only the ranks that are down, dying, behind in a hung group, stalled or named by a verdict",
    )
    command.add_argument(
        "--sort",
        choices=tuple(SORTS),
        default="rank",
        help="order: rank; steps (fewest first); heartbeat or in-flight (oldest first)",
    )
    command.add_argument(
        "--top", type=_positive_int, default=None, metavar="N", help="the first N ranks only"
    )


def _add_ranks_access_arguments(command: argparse.ArgumentParser) -> None:
    """The flags of secured ranks (what _client reads)."""
    secured = command.add_argument_group(
        "secured ranks (--targets whose endpoints have a web config file; see docs/security.md)"
    )
    secured.add_argument("--scheme", choices=("http", "https"), default=None, help="default: http")
    secured.add_argument("--ca-file", default="", help="CA certificate that signed the ranks' certificates")
    secured.add_argument("--cert-file", default="", help="client certificate, for ranks that require one")
    secured.add_argument("--key-file", default="", help="the client certificate's key")
    secured.add_argument(
        "--basic-auth-user",
        default="",
        help=f"user for basic auth; the password is read from {PASSWORD_ENV}",
    )


RANKS_ACCESS_FLAGS = (  # (flag, its dest) of _add_ranks_access_arguments
    ("--scheme", "scheme"),
    ("--ca-file", "ca_file"),
    ("--cert-file", "cert_file"),
    ("--key-file", "key_file"),
    ("--basic-auth-user", "basic_auth_user"),
)


def _add_mcp_command(commands: Any) -> None:
    text = "serve flare's diagnosis commands and views as read-only tools over MCP (docs/mcp.md)"
    command = commands.add_parser("mcp", help=text, description=text)
    command.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio (the client starts `flare mcp`), or http: streamable HTTP at /mcp (default stdio)",
    )
    command.add_argument("--host", default="127.0.0.1", help="http: the address to bind (default 127.0.0.1)")
    command.add_argument("--port", type=int, default=8000, help="http: the port to bind (default 8000)")
    command.add_argument(
        "--token-file",
        default="",
        metavar="FILE",
        help="http: the bearer token every request must carry (default: one made at start, printed once)",
    )
    command.add_argument(
        "--allow-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose files the tools' targets, incidents, flight_recorder may name (repeatable)",
    )
    command.add_argument(
        "--allow-profile",
        action="store_true",
        help="offer the profile tool too: it arms captures on the ranks, which costs their training time",
    )
    sources = command.add_argument_group(
        "the server's own sources: what a tool that names none reads; their paths are always allowed"
    )
    sources.add_argument(
        "--prometheus",
        metavar="URL",
        default="",
        help="the Prometheus the server's credentials go to (a tool naming another URL asks it without them)",
    )
    sources.add_argument("--targets", metavar="FILE|DIR", default="", help="the ranks' file_sd targets")
    sources.add_argument("--incidents", metavar="DIR", default="", help="the ranks' incident files")
    sources.add_argument("--flight-recorder", metavar="DIR", default="", help=FLIGHT_RECORDER_HELP)
    _add_prometheus_arguments(command)
    _add_ranks_access_arguments(command)


FLIGHT_RECORDER_HELP = (
    "PyTorch flight-recorder dumps, one per rank: their directory, or their path prefix (/tmp/trace_)"
)


def _add_post_mortem_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--at",
        metavar="TIME",
        default=None,
        help="a past incident: Prometheus's history as of TIME (Unix seconds or ISO 8601; UTC if no zone)",
    )


def _add_report_command(commands: Any) -> None:
    text = "the incident report of a run that is gone: the originating rank, the cause, a timeline"
    command = commands.add_parser("report", help=text, description=text)
    command.add_argument("--prometheus", metavar="URL", help="read the run's history from this Prometheus")
    _add_prometheus_arguments(command)
    command.add_argument(
        "--targets", metavar="FILE|DIR", help="the file_sd targets: the incident files beside"
    )
    command.add_argument("--incidents", metavar="DIR", help="the directory of the ranks' incident files")
    command.add_argument("--flight-recorder", metavar="DIR", help=FLIGHT_RECORDER_HELP)
    config_module.add_engine_arguments(command)  # --hang-seconds: how flight-recorder dumps are judged
    command.add_argument("--run", default="", help="the run (needed when several are seen)")
    command.add_argument("--window", default="10m", help="Prometheus lookback before --at (default 10m)")
    _add_post_mortem_arguments(command)
    command.add_argument("--timeout", type=float, default=5.0, help="seconds per query (default 5)")
    command.add_argument("--out", metavar="FILE", default="", help="write the Markdown report here")
    command.add_argument("--json", action="store_true", help="print one JSON object for programs")


# the flags of a secured Prometheus: (flag, its promql.Access field, metavar, help)
PROMETHEUS_ACCESS_FLAGS = (
    ("--bearer-token-file", "bearer_token_file", "FILE", "send the bearer token this file holds"),
    (
        "--prometheus-user",
        "user",
        "USER",
        f"basic auth user; its password from --prometheus-password-file or {promql.PASSWORD_ENV}",
    ),
    ("--prometheus-password-file", "password_file", "FILE", "the file of --prometheus-user's password"),
    ("--prometheus-ca-file", "ca_file", "FILE", "CA certificate that signed Prometheus's (https URL)"),
    ("--prometheus-cert-file", "cert_file", "FILE", "client certificate, for a Prometheus that requires one"),
    ("--prometheus-key-file", "key_file", "FILE", "the client certificate's key"),
)


def _add_prometheus_arguments(command: argparse.ArgumentParser) -> None:
    """The flags of a secured Prometheus (an auth proxy, Thanos, Mimir): credentials, TLS, headers."""
    secured = command.add_argument_group(
        "secured Prometheus (--prometheus behind TLS, basic auth, a bearer token; see docs/security.md)"
    )
    for flag, field, metavar, help_text in PROMETHEUS_ACCESS_FLAGS:
        secured.add_argument(flag, dest=f"prometheus_{field}", metavar=metavar, default="", help=help_text)
    secured.add_argument(
        "--header",
        dest="prometheus_headers",
        metavar="'NAME: VALUE'",
        action="append",
        default=[],
        help="send this header to Prometheus too (repeatable), e.g. 'X-Scope-OrgID: tenant-1'",
    )


def _prometheus_connection(args: argparse.Namespace) -> promql.Connection | None:
    """How to ask the Prometheus --prometheus names (None where it names none); AccessError naming the flag
    for a flag of a secured Prometheus given without --prometheus."""
    given = {field: getattr(args, f"prometheus_{field}") for _, field, _, _ in PROMETHEUS_ACCESS_FLAGS}
    if not args.prometheus:
        flags = [flag for flag, field, _, _ in PROMETHEUS_ACCESS_FLAGS if given[field]]
        flags += ["--header"] * bool(args.prometheus_headers)
        if flags:
            raise promql.AccessError(f"flag {flags[0]}: only with --prometheus (it says how to ask it)")
        return None
    password = os.environ.get(promql.PASSWORD_ENV, "")
    access = promql.Access(args.prometheus_headers, password=password, **given)
    return promql.connect(args.prometheus, access)


PASSWORD_ENV = "FLARE_BASIC_AUTH_PASSWORD"


def _client(args: argparse.Namespace) -> scrape.Client:
    """How to scrape the ranks: https when asked for (or when TLS files are given), basic auth if a user."""
    scheme = args.scheme or ("https" if args.ca_file or args.cert_file else "http")
    password = os.environ.get(PASSWORD_ENV, "")
    if args.basic_auth_user and not password:
        raise config_module.ConfigError(f"flag --basic-auth-user: set the password in {PASSWORD_ENV}")
    return scrape.client(scheme, args.ca_file, args.cert_file, args.key_file, args.basic_auth_user, password)


def _detail_for(command: str, hang_seconds: float, ild: IldPolicy) -> Callable[[Snapshot], set[int]] | None:
    """Whose detail (stack sample, GPU health, ...) `command` shows: the culprits' for `diagnose`, every
    rank's for the views (None)."""
    if command not in ("diagnose", "canary"):  # `flare canary` reads in rounds, and its own (_canary_round)
        return None
    return lambda snapshot: {
        rank for verdict in diagnosis.diagnose(snapshot, hang_seconds, ild=ild) for rank in verdict.ranks
    }


def main(argv: list[str] | None = None, added: Sequence[Command] = ()) -> int:
    """`flare ARGV`, with the `added` commands (flare_exporter/cli.py's main: the `flare` console script)."""
    parser = build_parser(added=added)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_USAGE if exit.code else EXIT_OK
    if args.command == "targets":
        return prune.main(args)
    for other in added:
        if args.command == other.name:
            return other.run(args)
    if args.command == "mcp":
        return _serve_mcp(args)
    if args.command == "profile":
        return _profile(args)
    # What a command reads stays alive until it ends (at thousands of ranks, 100 k series and more, then the
    # records): the cyclic garbage collector would walk it again and again and free nothing. At 6,144 ranks
    # it doubled the CPU time of decoding Prometheus's answers.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _print_answer(args)
    finally:
        if collecting:
            gc.enable()


def answer(argv: list[str]) -> tuple[int, dict[str, Any]]:
    """What `flare ARGV --json` says, printing nothing and writing no file (not --out): for a diagnosis
    command (ANSWERING), its exit code (0 healthy, 1 anomaly found) and its JSON object; for a usage, input
    or connection error, or a run it cannot decide, the exit code (2, 3) and {"error": the one line `flare`
    prints}. The MCP server's tools call it."""
    try:
        args = build_parser(_RefusingParser).parse_args(argv)
        if args.command == "profile" and not args.on_alert:
            return _profile_answer(args)
        if args.command not in ANSWERING:
            raise CommandError(EXIT_USAGE, f"flare {args.command}: not one of {', '.join(ANSWERING)}")
        found = _answer(args)
    except CommandError as error:
        return error.code, {"error": str(error)}
    except SystemExit:  # --help, --version
        return EXIT_USAGE, {"error": "flare: asked for help, not for an answer"}
    return found.code, found.result


class _RefusingParser(argparse.ArgumentParser):
    """A parser whose usage errors raise CommandError with the line argparse prints, not exit."""

    def error(self, message: str) -> NoReturn:
        raise CommandError(EXIT_USAGE, f"{self.prog}: error: {message}")


def _print_answer(args: argparse.Namespace) -> int:
    """A diagnosis command's answer as `flare` prints it (its JSON with --json, else its text; the Markdown
    report written to --out), or its error on stderr: main's exit code."""
    try:
        found = _answer(args)
    except CommandError as error:
        print(error, file=sys.stderr)
        return error.code
    out = getattr(args, "out", "")
    if out:
        with open(out, "w") as handle:
            handle.write(found.text)
    if args.json:
        print(json.dumps(found.result, indent=2))
    elif not out:
        sys.stdout.write(found.text)
    return found.code


def _perf(args: argparse.Namespace) -> Answer:
    """`flare perf`: each rank's step breakdown (perf_command.py); exit code 0 (it judges nothing)."""
    if not 0 < args.timeout <= 3600:
        raise config_module.ConfigError(f"flag --timeout: {args.timeout!r} must be in (0, 3600] seconds")
    duration_seconds(args.window, "flag --window")
    result, text = perf_command.answer(args, _prometheus_connection(args), _client(args))
    return Answer(EXIT_OK, result, text)


def _profile(args: argparse.Namespace) -> int:
    """`flare profile` (profile_command.py): its exit code; one line on stderr where it cannot go on."""
    try:
        if args.on_alert:
            return _profile_on_alert(args)
        code, result, text = _profiled(args)
    except CommandError as error:
        print(error, file=sys.stderr)
        return error.code
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else text)
    return code


def _profile_answer(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """`flare profile --json` for answer() (the MCP server's profile tool): (exit code, JSON)."""
    code, result, _ = _profiled(args)
    return code, result


def _profiled(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    """Ask the ranks and await their captures: (exit code, JSON, text); CommandError where it cannot."""
    try:
        if not 0 < args.timeout <= 3600 or not 0 < args.wait <= 86400:
            raise config_module.ConfigError("flags --timeout and --wait: seconds, above 0")
        return profile_command.answer(args, _prometheus_connection(args), _client(args))
    except profile_command.ProfileError as error:
        raise CommandError(error.code, str(error)) from None
    except ENGINE_ERRORS as error:
        raise CommandError(EXIT_USAGE, f"flare profile: {error}") from None


def _profile_on_alert(args: argparse.Namespace) -> int:
    """`flare profile --on-alert HOST:PORT` (profile_on_alert.py): receive until interrupted; 2 with one
    line on a bad flag or an address it cannot listen on."""
    try:
        return _receive_alerts(args)
    except ENGINE_ERRORS as error:
        print(f"flare profile: {error}", file=sys.stderr)
        return EXIT_USAGE


def _receive_alerts(args: argparse.Namespace) -> int:
    from . import profile_on_alert

    host, _, port = args.on_alert.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise config_module.ConfigError(
            f"flag --on-alert: {args.on_alert!r} is not HOST:PORT (e.g. 0.0.0.0:9095)"
        )
    if not 0 <= args.cooldown <= 7 * 86400:
        raise config_module.ConfigError(
            f"flag --cooldown: {args.cooldown!r} must be between 0 and 604800 seconds"
        )
    if not 1 <= args.steps <= 1000:
        raise config_module.ConfigError(f"flag --steps: {args.steps} must be between 1 and 1000")
    connection, client = _prometheus_connection(args), _client(args)
    try:
        return profile_on_alert.run(args, connection, client)
    except OSError as error:  # the address is taken or not this host's
        raise config_module.ConfigError(
            f"flag --on-alert: cannot listen on {args.on_alert}: {error}"
        ) from None


def _serve_mcp(args: argparse.Namespace) -> int:
    """`flare mcp`: the diagnosis commands as tools of a Model Context Protocol server (calls answer())."""
    from . import mcp_policy, mcp_server  # mcp_server loads the SDK when asked: `flare diagnose` never does

    try:
        _prometheus_connection(args)  # the server's access flags, checked once at start
        _client(args)
        prometheus_flags = [(flag, f"prometheus_{field}") for flag, field, _, _ in PROMETHEUS_ACCESS_FLAGS]
        policy = mcp_policy.policy(
            args.allow_dir,
            {name: getattr(args, name) for name in mcp_policy.SOURCES},
            _given_flags(args, [*prometheus_flags, ("--header", "prometheus_headers")]),
            _given_flags(args, RANKS_ACCESS_FLAGS),
            args.allow_profile,
        )
    except (*ENGINE_ERRORS, mcp_policy.Refused) as error:
        print(f"flare mcp: {error}", file=sys.stderr)
        return EXIT_USAGE
    return mcp_server.serve(args.transport, args.host, args.port, answer, policy, args.token_file)


def _given_flags(args: argparse.Namespace, flags: Any) -> list[str]:
    """`--flag=value` of each of `flags` ((flag, dest)) given a value in `args`, once per value of a list."""
    given = []
    for flag, dest in flags:
        value = getattr(args, dest)
        given += [f"{flag}={one}" for one in (value if isinstance(value, list) else [value]) if one]
    return given


def _answer(args: argparse.Namespace) -> Answer:
    """The answer of a diagnosis command (diagnose, ranks, hang, stragglers, report) with its parsed `args`;
    CommandError where it has none."""
    try:
        if args.command == "report":
            return _report(args)
        if args.command == "perf":
            return _perf(args)
        config = config_module.engine_config(args)
        ild = IldPolicy(op_shift_seconds=config.ild_op_shift_seconds)
        _check_common(args)
        if args.incidents or args.at is not None:
            return _dead_run_answer(_dead_run(args))
        hang = _hang_threshold(args, config.hang_seconds)
        snapshot, source = _snapshot(args, hang.seconds, ild)
        if snapshot.ranks_seen == 0:
            return _dead_run_answer(_dead_run(args))
        hang = config_module.hang_of_run(snapshot.hang_seconds, hang)
    except ENGINE_ERRORS as error:
        raise CommandError(EXIT_USAGE, f"flare: {error}") from None
    except records.SourceError as error:
        raise CommandError(EXIT_UNDECIDED, f"flare: cannot decide: {error}") from None
    return _snapshot_answer(args, snapshot, source, hang, ild)


def _hang_threshold(args: argparse.Namespace, configured: float) -> config_module.HangThreshold:
    """The hang threshold the engine was told (`configured`: its config's), else, from Prometheus, the run's
    own (args.run resolved then, as run_hang_threshold would); a direct scrape's comes with its snapshot."""
    hang = config_module.configured_hang(configured, config_module.hang_told_by(args))
    if args.prometheus:
        args.run, hang = prometheus_source.resolve_hang_threshold(
            args.prometheus_connection, args.run, args.window, args.timeout, hang, time.time()
        )
    return hang


ENGINE_ERRORS = (
    config_module.ConfigError,
    TargetsError,
    PrometheusError,
    scrape.ScrapeError,
    incident_source.IncidentError,
    flight_recorder.DumpError,
)


def _check_common(args: argparse.Namespace) -> None:
    """ConfigError naming the flag if --timeout, --window or --at is not usable; AccessError if a flag of a
    secured Prometheus is not (args.prometheus_connection: how to ask --prometheus)."""
    if not 0 < args.timeout <= 3600:  # also refuses nan
        raise config_module.ConfigError(f"flag --timeout: {args.timeout!r} must be in (0, 3600] seconds")
    duration_seconds(args.window, "flag --window")
    args.at = parse_time(args.at) if isinstance(args.at, str) else args.at
    args.prometheus_connection = _prometheus_connection(args)


def parse_time(text: str) -> float:
    """Unix seconds from `text`: a number, or ISO 8601 (UTC where it names no zone)."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise config_module.ConfigError(
                f"flag --at: {text!r} is neither Unix seconds nor an ISO 8601 time (2026-12-05T03:30:00Z)"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.timezone.utc)
        seconds = moment.timestamp()
    if not 0 < seconds < 2**33:
        raise config_module.ConfigError(f"flag --at: {text!r} is not a time after 1970 and before 2242")
    return seconds


def _snapshot(args: argparse.Namespace, hang_seconds: float, ild: IldPolicy) -> tuple[Snapshot, str]:
    """The live snapshot the source flags name, and the source's name."""
    if args.prometheus:
        detail_for = _detail_for(args.command, hang_seconds, ild)
        snapshot = prometheus_source.from_prometheus(
            args.prometheus_connection,
            args.run,
            args.window,
            args.timeout,
            detail_for,
            hang_seconds,
            ild,
            canary_view=args.command == "canary",
        )
        return snapshot, f"prometheus {args.prometheus}"
    if args.flight_recorder:
        return flight_recorder.snapshot_from(args.flight_recorder, args.run), (
            f"flight-recorder {args.flight_recorder}"
        )
    snapshot = scrape_source.from_targets(read_targets(args.targets), args.run, args.timeout, _client(args))
    return snapshot, f"targets {args.targets}"


def _dead_run(args: argparse.Namespace) -> post_mortem.DeadRun:
    """Every rank's last word, from the sources the flags name (Prometheus's history, incident files)."""
    found = []
    if args.prometheus:
        found.append(
            history_source.dead_run_from_prometheus(
                args.prometheus_connection, args.run, args.window, args.timeout, args.at
            )
        )
    for directory in (args.incidents, args.targets):
        if directory and (args.incidents or _has_incidents(directory)):
            run = args.run or (found[0].run if found else "")
            found.append(incident_source.dead_run_from_incidents(directory, run))
    if not found:
        what = args.targets or args.incidents or args.prometheus
        raise records.SourceError(f"no rank answered and no incident file lies in {what}")
    return post_mortem.merge_runs(found)


def _has_incidents(path: str) -> bool:
    directory = incident_source.incident_directory(path)
    return os.path.isdir(directory) and any(name.endswith(".json") for name in os.listdir(directory))


def _dead_run_answer(run: post_mortem.DeadRun) -> Answer:
    """A dead run's verdict, as diagnose answers a live one (JSON with the same keys, and the timeline)."""
    found = report.incident_report(run)
    result = {
        "run": run.run,
        "source": run.source,
        "timestamp_seconds": found["ended_timestamp_seconds"],
        "world_size": run.world_size,
        "ranks_seen": 0,
        "post_mortem": True,
        "verdicts": found["verdicts"],
        "timeline": found["timeline"],
    }
    heard = f"post-mortem of {len(run.ranks)} ranks' last words"
    header = f"run {run.run}: no rank answers; {heard} ({run.source})"
    lines = report.verdict_lines(found["verdicts"]) or ["no rank ended the run: no anomaly found"]
    events = [f"  {event['rank']:>5}  {event['event']}" for event in found["timeline"]]
    text = "\n".join([header, *lines, "", "timeline:", *events]) + "\n"
    return Answer(EXIT_ANOMALY if found["verdicts"] else EXIT_OK, result, text)


def _report(args: argparse.Namespace) -> Answer:
    """`flare report`: the incident report of a dead run, as JSON and as Markdown."""
    if not (args.prometheus or args.targets or args.incidents or args.flight_recorder):
        raise config_module.ConfigError(
            "flare report: name a source: --prometheus, --targets, --incidents or --flight-recorder"
        )
    _check_common(args)
    if args.flight_recorder:
        configured = config_module.engine_config(args).hang_seconds
        hang = config_module.configured_hang(configured, config_module.hang_told_by(args))
        others = [_dead_run(args)] if args.prometheus or args.targets or args.incidents else []
        found = flight_recorder.incident_report(args.flight_recorder, args.run, hang, others)
    else:
        found = report.incident_report(_dead_run(args))
    return Answer(EXIT_ANOMALY if found["verdicts"] else EXIT_OK, found, report.markdown(found))


def _snapshot_answer(
    args: argparse.Namespace,
    snapshot: Snapshot,
    source: str,
    hang: config_module.HangThreshold,
    ild: IldPolicy,
) -> Answer:
    """The live verdicts of a snapshot, and the command's view (judged by the hang threshold `hang`)."""
    hang_seconds = hang.seconds
    verdicts = diagnosis.diagnose(snapshot, hang_seconds, ild=ild)
    _, counts = COMMANDS[args.command]
    shown = [verdict for verdict in verdicts if counts(verdict)]
    result: dict[str, Any] = {
        "run": snapshot.run,
        "source": source,
        "timestamp_seconds": round(snapshot.now, 3),
        "hang_seconds": hang_seconds,
        "hang_seconds_from": hang.source,
        "world_size": snapshot.world_size,
        "ranks_seen": snapshot.ranks_seen,
        "verdicts": [verdict.to_json() for verdict in shown],
    }
    lines: list[str] = []
    if args.command == "ranks":
        selection = RankSelection(args.problems, args.sort, args.top)
        result["ranks_total"] = len(snapshot.ranks)
        result["ranks"], lines = ranks_view(snapshot, verdicts, hang_seconds, selection)
    elif args.command == "hang":
        result["groups"], lines = hang_view(snapshot, hang_seconds)
    elif args.command == "stragglers":
        result["scores"], lines = stragglers_view(snapshot)
        if args.prometheus or args.targets:  # the badput ledger: a column `lost`, most first
            ledger = lambda: perf_command.records(args, args.prometheus_connection, _client(args))[1]  # noqa: E731
            result["scores"], lines = perf_command.stragglers_with_losses(result["scores"], ledger)
    elif args.command == "canary":
        found, lines = canary_view.canary_view(snapshot)
        every_rank = not args.prometheus or prometheus_source.canary_reads_every_rank(snapshot.ranks_seen)
        result.update(found, every_rank=every_rank)
    header = f"run {snapshot.run}: {snapshot.ranks_seen} of {len(snapshot.ranks)} ranks answered ({source})"
    text = "\n".join([header, *lines, *([""] if lines else []), *format_verdicts(shown)]) + "\n"
    pages = [verdict for verdict in shown if verdict.severity != WARNING]  # a busy host: exit 0
    return Answer(EXIT_ANOMALY if pages else EXIT_OK, result, text)


def format_verdicts(verdicts: list[Verdict]) -> list[str]:
    """A line per verdict, as every command prints them under its view: kind, domain, ranks, group, cause
    and summary (WARNING first where it does not page); one line saying so where there is none."""
    if not verdicts:
        return ["no anomaly found"]
    lines = []
    for verdict in verdicts:
        culprits = f"rank {','.join(map(str, verdict.ranks))}" if verdict.ranks else "no single rank"
        group = f" [group {verdict.group}]" if verdict.group else ""
        warning = "WARNING " if verdict.severity == WARNING else ""
        head = f"{warning}{verdict.kind.upper()} ({verdict.domain}: {culprits}){group}, cause {verdict.cause}"
        lines.append(f"{head}: {verdict.summary}")
    return lines


if __name__ == "__main__":  # the engine's commands alone; all of `flare`'s: python -m flare_exporter.cli
    sys.exit(main())
