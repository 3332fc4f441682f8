"""The `flare` command: which rank, and why?

    flare diagnose   (--prometheus URL | --targets FILE|DIR | --incidents DIR) [--run RUN] [--json] [--at T]
    flare ranks      ...   one line per rank: step, heartbeat age, in-flight op and its state
    flare hang       ...   each process group: in flight, how long, who is behind
    flare stragglers ...   each rank's step time, collective wait per step and straggler score
    flare report     [--prometheus URL] [--targets FILE|DIR] [--incidents DIR] [--out FILE] [--json]
                           the incident report of a run that is gone: who went first, why, and when
    flare rules [--for D] [--selector M] [--scrape-interval D]   the Prometheus rules for this config

`--prometheus` reads the Prometheus HTTP API (a fixed number of queries, whatever the rank count);
`--targets` scrapes the ranks' /metrics directly: a file of host:port lines, a file_sd JSON file, or a
directory of them (what FLARE_FILE_SD_DIR holds); `--incidents` reads the incident files the ranks left.
When no rank of the run answers, the run is gone: the verdict comes from each rank's last word instead
(post_mortem.py), from Prometheus's history within --window before --at (default: now), or from the
incident files beside the targets (their `incidents` subdirectory). The hang threshold is --hang-seconds, else
FLARE_HANG_SECONDS / the config file's hang_seconds, else the one the run's ranks export (thresholds.py), else
300 s; the per-op shift that counts as an ILD regression likewise (--ild-op-shift-seconds,
FLARE_ILD_OP_SHIFT_SECONDS, ild_op_shift_seconds, 400 ns).

Exit codes: 0 healthy; 1 anomaly found; 2 usage, input or connection error; 3 could not decide (no
rank answered, or several runs and no --run).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import __version__
from .. import config as config_module
from ..mixin import rules
from . import (
    diagnosis,
    history_source,
    incident_source,
    post_mortem,
    promql,
    prune,
    report,
    scrape,
    sources,
    thresholds,
)
from .diagnosis import Snapshot, Verdict
from .promql import PrometheusError
from .targets import TargetsError, read_targets

EXIT_OK, EXIT_ANOMALY, EXIT_USAGE, EXIT_UNDECIDED = 0, 1, 2, 3
HANG_KINDS = ("host_fault", "rank_down", "mismatch", "hang")


# ---------------------------------------------------------------------------------------------------------
# views: each turns a snapshot and its verdicts into (rows for JSON, lines for people, verdicts that count)


def ranks_view(snapshot: Snapshot) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    for record in snapshot.ranks.values():
        flight_group, flight = _oldest_in_flight(record)
        rows.append(
            {
                "rank": record.rank,
                "host": record.host or None,
                "up": record.up,
                "down_reason": record.down_reason
                or (f"exception {record.exception}" if record.exception else None),
                "steps": record.steps,
                "heartbeat_age_seconds": diagnosis.age_of(snapshot, record.heartbeat),
                "in_flight": None
                if flight is None
                else {
                    "group": flight_group,
                    "op": flight.op,
                    "seq": flight.seq,
                    "state": flight.state,
                    "age_seconds": diagnosis.age_of(snapshot, flight.started_at),
                },
                "activity": record.activity or None,
                "frames": record.frames or None,
            }
        )
    lines = [f"{'rank':>5} {'host':<14} {'steps':>7} {'heartbeat':>10}  {'in flight':<34} {'state':<8} doing"]
    for row in rows:
        if not row["up"]:
            lines.append(
                f"{row['rank']:>5} {row['host'] or '-':<14} {'-':>7} {'-':>10}  DOWN: {row['down_reason']}"
            )
            continue
        flight = row["in_flight"]
        in_flight = (
            "-"
            if flight is None
            else f"{flight['group']} {flight['op']} #{flight['seq']} {flight['age_seconds']:.1f}s"
        )
        doing = "-" if not row["activity"] else f"{row['activity']}: {row['frames']}"
        if row["down_reason"]:
            doing = f"DYING: {row['down_reason']}"
        lines.append(
            f"{row['rank']:>5} {row['host'] or '-':<14} {_int(row['steps']):>7} "
            f"{_seconds(row['heartbeat_age_seconds']):>10}  {in_flight:<34} "
            f"{'-' if flight is None else flight['state']:<8} {doing}"
        )
    return rows, lines


def hang_view(snapshot: Snapshot, hang_seconds: float) -> tuple[list[dict[str, Any]], list[str]]:
    hung = {hang.name for hang in diagnosis.hung_groups(snapshot, hang_seconds)}
    names = sorted({name for record in snapshot.ranks.values() for name in record.groups})
    rows: list[dict[str, Any]] = []
    for name in names:
        members = diagnosis.members_of(snapshot, name)
        live = [
            snapshot.ranks[r] for r in members if snapshot.ranks[r].up and name in snapshot.ranks[r].groups
        ]
        issued = {record.rank: record.groups[name].last_issued for record in live}
        top = max(issued.values(), default=0)
        ages = [
            snapshot.now - flight.started_at
            for record in live
            if (flight := record.groups[name].in_flight) is not None
        ]
        rows.append(
            {
                "group": name,
                "members": len(members),
                "down": [r for r in members if snapshot.ranks[r].gone],
                "max_issued_seq": top,
                "min_completed_seq": min((record.groups[name].last_completed for record in live), default=0),
                "oldest_in_flight_seconds": round(max(ages), 3) if ages else None,
                "behind": sorted(rank for rank, seq in issued.items() if seq < top),
                "hung": name in hung,
            }
        )
    lines = [f"{'group':<36} {'ranks':>5} {'issued':>7} {'completed':>9} {'in flight':>10}  state"]
    for row in rows:
        state = "HUNG" if row["hung"] else "ok"
        if row["behind"]:
            state += f", behind: {_ranks(row['behind'])}"
        if row["down"]:
            state += f", down: {_ranks(row['down'])}"
        lines.append(
            f"{row['group']:<36} {row['members']:>5} {row['max_issued_seq']:>7} "
            f"{row['min_completed_seq']:>9} {_seconds(row['oldest_in_flight_seconds']):>10}  {state}"
        )
    return rows, lines


def stragglers_view(snapshot: Snapshot) -> tuple[list[dict[str, Any]], list[str]]:
    scores = diagnosis.straggler_scores(snapshot)
    rows = [
        {"rank": rank, **{key: round(value, 6) for key, value in row.items()}} for rank, row in scores.items()
    ]
    lines = [f"{'rank':>5} {'step':>10} {'wait/step':>10} {'score':>7}"]
    lines += [
        f"{row['rank']:>5} {row['step_seconds'] * 1000:>8.2f}ms "
        f"{row['wait_seconds_per_step'] * 1000:>8.2f}ms {row['score']:>7.1f}"
        for row in rows
    ]
    if not rows:
        lines.append("(no step and collective timings yet)")
    return rows, lines


def format_verdicts(verdicts: list[Verdict]) -> list[str]:
    if not verdicts:
        return ["no anomaly found"]
    lines = []
    for verdict in verdicts:
        culprits = f"rank {_ranks(list(verdict.ranks))}" if verdict.ranks else "no single rank"
        group = f" [group {verdict.group}]" if verdict.group else ""
        head = f"{verdict.kind.upper()} ({verdict.domain}: {culprits}){group}, cause {verdict.cause}"
        lines.append(f"{head}: {verdict.summary}")
    return lines


def _oldest_in_flight(record: diagnosis.RankRecord) -> tuple[str, diagnosis.InFlight | None]:
    flights = [
        (state.in_flight.started_at, name, state.in_flight)
        for name, state in record.groups.items()
        if state.in_flight
    ]
    if not flights:
        return "", None
    _, name, flight = min(flights, key=lambda item: item[:2])
    return name, flight


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _int(value: float | None) -> str:
    return "-" if value is None else str(int(value))


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


# ---------------------------------------------------------------------------------------------------------
# command line

COMMANDS: dict[str, tuple[str, Callable[[Verdict], bool]]] = {
    "diagnose": ("all verdicts, most severe first", lambda verdict: True),
    "ranks": ("one line per rank: step, heartbeat age, in-flight op and state", lambda verdict: True),
    "hang": ("each process group: in flight, for how long, who is behind", lambda v: v.kind in HANG_KINDS),
    "stragglers": ("each rank's step time, collective wait and score", lambda v: v.kind == "straggler"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flare", description="Which rank, and why? Diagnose a training job."
    )
    parser.add_argument("--version", action="version", version=f"flare {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
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
        _add_post_mortem_arguments(command)
        command.add_argument("--run", default="", help="the run to diagnose (needed when several are seen)")
        command.add_argument("--json", action="store_true", help="print one JSON object for programs")
        rules.add_engine_arguments(command)
        command.add_argument(
            "--timeout", type=float, default=5.0, help="seconds per scrape or query (default 5)"
        )
        command.add_argument(
            "--window", default="5m", help="Prometheus lookback for rates and gone ranks (default 5m)"
        )
        _add_prometheus_arguments(command)
        secured = command.add_argument_group(
            "secured ranks (--targets whose endpoints have a web config file; see docs/security.md)"
        )
        secured.add_argument("--scheme", choices=("http", "https"), default=None, help="default: http")
        secured.add_argument(
            "--ca-file", default="", help="CA certificate that signed the ranks' certificates"
        )
        secured.add_argument("--cert-file", default="", help="client certificate, for ranks that require one")
        secured.add_argument("--key-file", default="", help="the client certificate's key")
        secured.add_argument(
            "--basic-auth-user",
            default="",
            help=f"user for basic auth; the password is read from {PASSWORD_ENV}",
        )
    _add_report_command(commands)
    targets_command = commands.add_parser("targets", help="manage the file_sd target files of runs")
    targets_actions = targets_command.add_subparsers(dest="action", required=True)
    prune_help = "remove the target and incident files of runs that ended (e.g. in a Slurm epilog)"
    prune.add_arguments(targets_actions.add_parser("prune", help=prune_help, description=prune_help))
    rules_command = commands.add_parser(
        "rules", help="print the Prometheus recording and alert rules", description=rules.__doc__
    )
    rules.add_arguments(rules_command)
    return parser


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


def _detail_for(
    command: str, hang_seconds: float, ild: diagnosis.IldPolicy
) -> Callable[[Snapshot], set[int]] | None:
    """Whose detail (stack sample, GPU health, ...) `command` shows: the culprits' for `diagnose`, every
    rank's for the views (None)."""
    if command != "diagnose":
        return None
    return lambda snapshot: {
        rank for verdict in diagnosis.diagnose(snapshot, hang_seconds, ild=ild) for rank in verdict.ranks
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_USAGE if exit.code else EXIT_OK
    if args.command == "targets":
        return prune.main(args)
    if args.command == "rules":
        return rules.main(args)
    # What a command reads stays alive until it ends (at thousands of ranks, 100 k series and more, then the
    # records): the cyclic garbage collector would walk it again and again and free nothing. At 6,144 ranks
    # it doubled the CPU time of decoding Prometheus's answers.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    finally:
        if collecting:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    """A diagnosis command (diagnose, ranks, hang, stragglers, report) with its parsed `args`: main's exit
    code."""
    try:
        if args.command == "report":
            return _report(args)
        config = rules.engine_config(args)
        ild = diagnosis.IldPolicy(op_shift_seconds=config.ild_op_shift_seconds)
        _check_common(args)
        if args.incidents or args.at is not None:
            return _print_dead_run(args, _dead_run(args))
        hang = _hang_threshold(args, config.hang_seconds)
        snapshot, source = _snapshot(args, hang.seconds, ild)
        if snapshot.ranks_seen == 0:
            return _print_dead_run(args, _dead_run(args))
        hang = thresholds.of_snapshot(snapshot, hang)
    except ENGINE_ERRORS as error:
        print(f"flare: {error}", file=sys.stderr)
        return EXIT_USAGE
    except sources.SourceError as error:
        print(f"flare: cannot decide: {error}", file=sys.stderr)
        return EXIT_UNDECIDED
    return _print_snapshot(args, snapshot, source, hang, ild)


def _hang_threshold(args: argparse.Namespace, configured: float) -> thresholds.Threshold:
    """The hang threshold the engine was told (`configured`: its config's), else, from Prometheus, the run's
    own (args.run resolved then, as from_prometheus would); a direct scrape's comes with its snapshot."""
    hang = thresholds.configured(configured, thresholds.told(args))
    if args.prometheus:
        args.run, hang = thresholds.resolve_prometheus(
            args.prometheus_connection, args.run, args.window, args.timeout, hang, time.time()
        )
    return hang


ENGINE_ERRORS = (
    config_module.ConfigError,
    TargetsError,
    PrometheusError,
    scrape.ScrapeError,
    incident_source.IncidentError,
)


def _check_common(args: argparse.Namespace) -> None:
    """ConfigError naming the flag if --timeout, --window or --at is not usable; AccessError if a flag of a
    secured Prometheus is not (args.prometheus_connection: how to ask --prometheus)."""
    if not 0 < args.timeout <= 3600:  # also refuses nan
        raise config_module.ConfigError(f"flag --timeout: {args.timeout!r} must be in (0, 3600] seconds")
    rules.duration_seconds(args.window, "flag --window")
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


def _snapshot(
    args: argparse.Namespace, hang_seconds: float, ild: diagnosis.IldPolicy
) -> tuple[Snapshot, str]:
    """The live snapshot the source flags name, and the source's name."""
    if args.prometheus:
        detail_for = _detail_for(args.command, hang_seconds, ild)
        snapshot = sources.from_prometheus(
            args.prometheus_connection, args.run, args.window, args.timeout, detail_for, hang_seconds, ild
        )
        return snapshot, f"prometheus {args.prometheus}"
    snapshot = sources.from_targets(read_targets(args.targets), args.run, args.timeout, _client(args))
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
        raise sources.SourceError(f"no rank answered and no incident file lies in {what}")
    return post_mortem.merge_runs(found)


def _has_incidents(path: str) -> bool:
    directory = incident_source.incident_directory(path)
    return os.path.isdir(directory) and any(name.endswith(".json") for name in os.listdir(directory))


def _print_dead_run(args: argparse.Namespace, run: post_mortem.DeadRun) -> int:
    """A dead run's verdict, as diagnose prints a live one (JSON with the same keys, and the timeline)."""
    found = report.incident_report(run)
    if args.json:
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
        print(json.dumps(result, indent=2))
    else:
        heard = f"post-mortem of {len(run.ranks)} ranks' last words"
        header = f"run {run.run}: no rank answers; {heard} ({run.source})"
        lines = report.verdict_lines(found["verdicts"]) or ["no rank ended the run: no anomaly found"]
        events = [f"  {event['rank']:>5}  {event['event']}" for event in found["timeline"]]
        print("\n".join([header, *lines, "", "timeline:", *events]))
    return EXIT_ANOMALY if found["verdicts"] else EXIT_OK


def _report(args: argparse.Namespace) -> int:
    """`flare report`: the incident report of a dead run, as Markdown (--out) and/or JSON (--json)."""
    if not (args.prometheus or args.targets or args.incidents):
        raise config_module.ConfigError("flare report: name a source: --prometheus, --targets or --incidents")
    _check_common(args)
    found = report.incident_report(_dead_run(args))
    if args.out:
        with open(args.out, "w") as out:
            out.write(report.markdown(found))
    if args.json:
        print(json.dumps(found, indent=2))
    elif not args.out:
        print(report.markdown(found), end="")
    return EXIT_ANOMALY if found["verdicts"] else EXIT_OK


def _print_snapshot(
    args: argparse.Namespace,
    snapshot: Snapshot,
    source: str,
    hang: thresholds.Threshold,
    ild: diagnosis.IldPolicy,
) -> int:
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
        result["ranks"], lines = ranks_view(snapshot)
    elif args.command == "hang":
        result["groups"], lines = hang_view(snapshot, hang_seconds)
    elif args.command == "stragglers":
        result["scores"], lines = stragglers_view(snapshot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        header = (
            f"run {snapshot.run}: {snapshot.ranks_seen} of {len(snapshot.ranks)} ranks answered ({source})"
        )
        print("\n".join([header, *lines, *([""] if lines else []), *format_verdicts(shown)]))
    return EXIT_ANOMALY if shown else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
