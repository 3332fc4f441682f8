"""`flare mcp`: flare's diagnosis as read-only tools of a Model Context Protocol server, for agents.

Runs where `flare` runs (a workstation, a login node, beside Prometheus): started by an MCP client over stdio,
or as a local service speaking streamable HTTP at http://HOST:PORT/mcp, bound to 127.0.0.1 unless told
otherwise. Each tool is one `flare` command with --json (diagnose, ranks, hang, stragglers, canary, perf,
report), takes
that command's source arguments under the flags' names (`targets` is --targets, `hang_seconds` is
--hang-seconds), and returns the JSON object the command prints, computed by `cli.answer`; a usage, input
or connection error, or a run it cannot decide, is a tool error carrying the one line `flare` prints.

Nothing here acts on a cluster unless the person who starts it says so: the tools only read (Prometheus's
API, the ranks' /metrics, incident files, flight-recorder dumps); `flare targets prune` and report's --out
are not offered, and no tool writes a file. One tool acts, and only on a server started with
--allow-profile: `profile` (`flare profile`) arms a capture of a few steps on chosen ranks, which costs
their training time.
What they may read, and where the server's credentials go, is the server's to say (mcp_policy.py): paths
only inside --allow-dir directories, credentials only to the server's own --prometheus; over HTTP every
request carries the server's bearer token.
The mcp SDK (2.x: `pip install 'flare-exporter[mcp]'`) is imported by `serve` only, so that the rest of
`flare` never loads it. See docs/mcp.md.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..config import HANG_KEY, ILD_OP_SHIFT_KEY, Config
from . import report
from .mcp_policy import Policy, Refused

if TYPE_CHECKING:  # the SDK is loaded by serve() only
    import mcp_types as types
    from mcp.server import Server, ServerRequestContext

Answerer = Callable[[list[str]], tuple[int, dict[str, Any]]]  # cli.answer: argv -> (exit code, JSON)
ANSWERED = (0, 1)  # the exit codes of an answer (healthy, anomaly found); 2 and 3 come with {"error": line}
EXIT_USAGE = 2
INSTALL_HINT = "flare mcp: needs the mcp SDK 2.x: pip install 'flare-exporter[mcp]'"
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # where the SDK turns its DNS rebinding protection on

INSTRUCTIONS = """\
flare names the rank that hung, died or slowed a PyTorch distributed training job, and says why.
Triage: call `diagnose` first; it returns every verdict, most severe first, each with its culprit ranks,
fault domain, cause and evidence (no verdict: healthy). Then, for evidence: `hang` (per process group: who is
behind, what is in flight), `ranks` (per rank: steps, heartbeat, in-flight collective, stack frames),
`stragglers` (per rank: step time, collective wait, score), `canary` (per rank and measurement: the hardware
canary's benchmarks, against the job's median and the rank's own preflight), `perf` (per rank: where the
step time goes, bottleneck, MFU, seconds lost). For a run that is gone (every rank exited),
`report` gives the originating rank, the cause and a timeline. Give each the source the user has: a
Prometheus URL (`prometheus`), the ranks' file_sd directory (`targets`), an incident directory
(`incidents`) or flight-recorder dumps (`flight_recorder`); with none, the server's own source is read.
Paths are read only inside the directories the server allows (a refusal names them). Every tool only
reads."""
PROFILE_INSTRUCTIONS = """\
This server was started with --allow-profile: `profile` captures a few optimizer steps with torch.profiler
on chosen ranks (each rank's bottleneck class and its evidence; `compare` for two ranks). A capture costs
those ranks' training time: ask the user before calling it, and name the ranks (a straggler and a healthy
peer)."""

TOOLS: dict[str, str] = {
    "diagnose": (
        "Start here: which rank, and why. Every verdict about the run, most severe first (hang, rank down, "
        "collective mismatch, host fault, straggler, hardware canary, ILD regression), each naming the "
        "culprit rank(s), the fault domain (rank, host, link, group, job), the cause (deadlock, "
        "out_of_memory, data_stall, ...) and the evidence that decided it. An empty `verdicts` list "
        "means healthy. Reads a live run from `prometheus` or `targets`; when no rank answers (or given "
        "`incidents`, `flight_recorder` or `at`) it judges the ranks' last words instead (`post_mortem`: "
        "true, with a `timeline`)."
    ),
    "ranks": (
        "Evidence per rank, after diagnose: up or down (and why), steps taken, heartbeat age, the oldest "
        "collective in flight (group, op, sequence number, state, age) and what the training thread is "
        "doing (activity and innermost stack frames), to compare the culprit with its peers."
    ),
    "hang": (
        "Evidence for a hang, per process group: members, ranks down, highest issued and lowest completed "
        "collective sequence number, how long the oldest collective has been in flight, which ranks are "
        "behind (never reached it) and whether the group is hung; with the hang verdicts only."
    ),
    "stragglers": (
        "Evidence for a slowdown, per rank: step time, collective wait per step and straggler score "
        "against the group's median (a straggler computes longest and waits least); with the straggler "
        "verdicts only."
    ),
    "canary": (
        "Evidence of the hardware, per rank, measurement and scope: the canary's benchmarks (GEMM FLOP/s, "
        "all-reduce and all-gather bus bandwidth within and across hosts, host-device copies, storage "
        "reads, NVML's PCIe width and clocks) before the first step and in flight: value, share of the "
        "job's median, last in-flight value, moving average over the preflight value, failed checks, "
        "drift; with the canary verdicts only (the rank, host or link named, its measurement and baseline)."
    ),
    "perf": (
        "Where each rank's step time goes (data, optimizer, exposed collectives, compute), its bottleneck "
        "class, achieved FLOP/s and MFU, and the seconds it cost the job (the badput ledger); from "
        "`prometheus` (over `window`) or `targets`. No verdicts."
    ),
    "report": (
        "The incident report of a run that is gone (every rank exited or was killed): the rank that "
        "originated it, the cause, each rank's last word and a timeline, from Prometheus's history "
        "(`prometheus`, `at`), the incident files (`incidents`, or beside `targets`) or flight-recorder "
        "dumps. Returns the JSON and, as a second text block, the same report in Markdown; writes nothing."
    ),
}


PROFILE_TOOL = (
    'Capture a few optimizer steps with torch.profiler on the `ranks` named (e.g. "3,5": a straggler and '
    "a healthy peer), reduced on their nodes: per rank the bottleneck class (input, communication, "
    "transfer, launch or compute bound), the measurements that decided it and the summary (compute, "
    "communication, copies, idle, top ops); with `compare` and two ranks, the ops whose time differs most. "
    "Acts on the job: it costs those ranks' training time, and ranks started without profile: on refuse. "
    "Only on a server started with --allow-profile."
)
READING = tuple(TOOLS)  # the tools that only read
WITH_PROFILE = (*READING, "profile")


@dataclass(frozen=True)
class Argument:
    """A tool argument: the `flare` flag it becomes, its JSON schema, and the tools that take it."""

    name: str
    flag: str
    description: str
    schema: Mapping[str, Any]
    tools: tuple[str, ...] = READING


DIAGNOSING = tuple(tool for tool in TOOLS if tool != "perf")  # the tools that judge: perf only breaks down
TEXT: Mapping[str, Any] = {"type": "string"}
NUMBER: Mapping[str, Any] = {"type": "number"}
FLAG: Mapping[str, Any] = {"type": "boolean"}  # a flag without a value: given when true
ARGUMENTS = (
    # sources
    Argument(
        "prometheus",
        "--prometheus",
        "Prometheus base URL (or Thanos, Mimir, VictoriaMetrics), e.g. http://localhost:9090",
        TEXT,
        WITH_PROFILE,
    ),
    Argument(
        "targets",
        "--targets",
        "scrape the ranks directly: their file_sd directory (FLARE_FILE_SD_DIR), a file_sd JSON file or "
        "a file of host:port lines; a run that is gone is read from the incident files beside it",
        TEXT,
        WITH_PROFILE,
    ),
    Argument(
        "incidents", "--incidents", "the directory of the incident files a run's ranks left", TEXT, DIAGNOSING
    ),
    Argument(
        "flight_recorder",
        "--flight-recorder",
        "PyTorch flight-recorder dumps, one per rank: their directory, or their path prefix "
        "(e.g. /tmp/nccl_trace_rank_); judged as the moment they show",
        TEXT,
        DIAGNOSING,
    ),
    # which run, when, how long to look
    Argument("run", "--run", "the run (needed when a source holds several)", TEXT, WITH_PROFILE),
    Argument(
        "at",
        "--at",
        "a past incident: Prometheus's history as of this time (Unix seconds or ISO 8601, UTC if no zone)",
        TEXT,
        DIAGNOSING,
    ),
    Argument(
        "window",
        "--window",
        "Prometheus lookback, a duration such as 5m (default 5m; report: 10m)",
        TEXT,
    ),
    Argument("timeout", "--timeout", "seconds per scrape or query (default 5)", NUMBER, WITH_PROFILE),
    Argument(
        HANG_KEY,
        "--hang-seconds",
        "hang threshold in seconds (default: the server's FLARE_HANG_SECONDS, else the run's own, else "
        f"{Config.hang_seconds:g})",
        NUMBER,
        DIAGNOSING,
    ),
    Argument(
        ILD_OP_SHIFT_KEY,
        "--ild-op-shift-seconds",
        "per-op issue-latency shift that counts as an ILD regression "
        f"(default {Config.ild_op_shift_seconds:g})",
        NUMBER,
        DIAGNOSING,
    ),
    # which ranks `ranks` lists, at thousands of ranks
    Argument(
        "problems",
        "--problems",
        "only the ranks that are down, dying, behind in a hung group, stalled or named by a verdict",
        FLAG,
        ("ranks",),
    ),
    Argument(
        "sort",
        "--sort",
        "order: rank; steps (fewest first); heartbeat or in-flight (oldest first)",
        {"enum": ["rank", "steps", "heartbeat", "in-flight"]},
        ("ranks",),
    ),
    Argument("top", "--top", "the first N ranks only", {"type": "integer", "minimum": 1}, ("ranks",)),
    # what `profile` captures
    Argument(
        "ranks",
        "--ranks",
        "the ranks to capture, e.g. 3,5 (default: every rank, at most 64)",
        TEXT,
        ("profile",),
    ),
    Argument(
        "steps",
        "--steps",
        "optimizer steps per capture (default 3)",
        {"type": "integer", "minimum": 1, "maximum": 1000},
        ("profile",),
    ),
    Argument("wait", "--wait", "seconds to wait for the captures to end (default 120)", NUMBER, ("profile",)),
    Argument(
        "compare", "--compare", "two ranks: the ops whose time per step differs most", FLAG, ("profile",)
    ),
)


def input_schema(tool: str) -> dict[str, Any]:
    """The JSON schema of `tool`'s arguments: every one optional (the command says which source it needs)."""
    properties = {
        argument.name: {**argument.schema, "description": argument.description}
        for argument in ARGUMENTS
        if tool in argument.tools
    }
    return {"type": "object", "properties": properties, "additionalProperties": False}


class ArgumentError(Exception):
    """A tool call's arguments that no flag takes: the one line that says which."""


def command_line(tool: str, arguments: Mapping[str, Any]) -> list[str]:
    """The `flare` argv that `tool` with `arguments` stands for (`--flag=value`, so that no value is read as
    a flag); ArgumentError for an unknown tool, an argument it does not take or a value of the wrong kind."""
    if tool not in WITH_PROFILE:
        raise ArgumentError(f"flare mcp: no tool {tool!r}; the tools: {', '.join(TOOLS)}")
    taken = {argument.name: argument for argument in ARGUMENTS if tool in argument.tools}
    argv = [tool]
    for name, value in arguments.items():
        argument = taken.get(name)
        if argument is None:
            raise ArgumentError(f"flare {tool}: no argument {name!r}; it takes {', '.join(taken)}")
        if value is None or value is False and argument.schema is FLAG:
            continue
        if argument.schema is FLAG:
            if value is not True:
                raise ArgumentError(f"flare {tool}: argument {name}: {value!r} is not a boolean")
            argv.append(argument.flag)
            continue
        values = value if argument.schema.get("type") == "array" and isinstance(value, list) else [value]
        for one in values:
            if isinstance(one, bool) or not isinstance(one, str | int | float):
                raise ArgumentError(f"flare {tool}: argument {name}: {one!r} is not a {_kind(argument)}")
            argv.append(f"{argument.flag}={one}")
    return argv


def _kind(argument: Argument) -> str:
    kind = argument.schema.get("type", "string")
    return "list of strings" if kind == "array" else kind


def call(
    answer: Answerer, tool: str, arguments: Mapping[str, Any], policy: Policy
) -> tuple[bool, list[str], dict[str, Any]]:
    """`tool` called with `arguments`, as `policy` lets it read: (is it an error, its text blocks, its JSON).

    The text: the JSON, and for report its Markdown too; for an error, the one line `flare` prints, or the
    one that says what the policy refused."""
    try:
        command_line(tool, arguments)  # an unknown tool or argument, a wrong kind: said before the policy
        if tool == "profile" and not policy.profile:
            raise Refused(
                "flare mcp: the profile tool is off: a capture costs the ranks' training time, so only a "
                "server started with --allow-profile offers it"
            )
        allowed = policy.arguments(tool, arguments)
        code, result = answer(command_line(tool, allowed) + policy.flags(tool, allowed))
    except (ArgumentError, Refused) as error:
        return True, [str(error)], {}
    if code not in ANSWERED and (tool != "profile" or "error" in result):  # profile: each rank's state
        return True, [result.get("error", f"flare {tool}: exit code {code}")], {}
    texts = [json.dumps(result, indent=2)]
    if tool == "report":
        texts.append(report.markdown(result))
    return False, texts, result


# ---------------------------------------------------------------------------------------------------------
# the server (the mcp SDK from here on)


def serve(
    transport: str, host: str, port: int, answer: Answerer, policy: Policy, token_file: str = ""
) -> int:
    """Serve the tools over `transport` (stdio, or http: streamable HTTP on host:port, each request with the
    bearer token `token_file` holds, or one made now) until the client goes (stdio) or the process is
    stopped: `flare mcp`'s exit code; 2 with one line if the SDK is missing, the token file is not usable or
    the address cannot be listened on."""
    try:
        token = _token(transport, token_file)
    except TokenError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    try:
        server = build_server(answer, policy)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_USAGE
    try:
        if transport == "stdio":
            import anyio
            from mcp.server.stdio import stdio_server

            async def run_stdio() -> None:
                async with stdio_server() as (read, write):
                    await server.run(read, write, server.create_initialization_options())

            anyio.run(run_stdio)
            return 0
        return _serve_http(server, host, port, token, made=not token_file)
    except KeyboardInterrupt:
        return 0


class TokenError(Exception):
    """A --token-file that cannot be used: the one line that says why."""


MIN_TOKEN_CHARACTERS = 16


def _token(transport: str, token_file: str) -> str:
    """The bearer token of the http transport: the one `token_file` holds, else a new one ('' for stdio,
    where the client that starts the server is the only one that can speak to it)."""
    if transport == "stdio":
        if token_file:
            raise TokenError("flare mcp: --token-file: for --transport http only (stdio needs no token)")
        return ""
    return read_token(token_file) if token_file else secrets.token_urlsafe(32)


def read_token(path: str) -> str:
    """The bearer token the file `path` holds: one line of at least MIN_TOKEN_CHARACTERS printable ASCII
    characters, in a file that only its owner may read or write; TokenError (never echoing it) if not."""
    try:
        with open(path, encoding="ascii") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            token = handle.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not ASCII"
        raise TokenError(f"flare mcp: --token-file {path}: cannot read it ({reason})") from None
    if stat.S_IMODE(mode) & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"flare mcp: --token-file {path}: others than its owner may read or write it "
            f"(mode {stat.S_IMODE(mode):o}); chmod 600 {path}"
        )
    if len(token) < MIN_TOKEN_CHARACTERS or not token.isprintable() or " " in token:
        raise TokenError(
            f"flare mcp: --token-file {path}: must hold one token of at least {MIN_TOKEN_CHARACTERS} "
            "characters, no spaces (e.g. made by: openssl rand -hex 32)"
        )
    return token


def build_server(answer: Answerer, policy: Policy) -> Server[Any]:
    """The MCP server (the SDK's low-level `Server`) whose tools call `answer` as `policy` lets them;
    ImportError without mcp 2."""
    import anyio.to_thread
    import mcp_types as types
    from mcp.server import Server

    offered = {**TOOLS, "profile": PROFILE_TOOL} if policy.profile else TOOLS
    tools = [
        types.Tool(
            name=name,
            title=f"flare {name}",
            description=description,
            input_schema=input_schema(name),
            annotations=types.ToolAnnotations(
                read_only_hint=name != "profile",
                destructive_hint=False,
                idempotent_hint=name != "profile",
                open_world_hint=True,
            ),
        )
        for name, description in offered.items()
    ]

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        # a thread: the command blocks on scrapes and queries for up to its timeout
        failed, texts, result = await anyio.to_thread.run_sync(
            call, answer, params.name, params.arguments or {}, policy
        )
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text) for text in texts],
            structured_content=None if failed else result,
            is_error=failed,
        )

    return Server(
        "flare",
        version=__version__,
        title="flare: which rank, and why?",
        instructions=INSTRUCTIONS + ("\n" + PROFILE_INSTRUCTIONS if policy.profile else ""),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def _serve_http(server: Server[Any], host: str, port: int, token: str, made: bool) -> int:
    """Streamable HTTP at http://host:port/mcp (uvicorn), on a socket bound here so that a refused address
    is one line, answering only requests that carry `token` (401 otherwise); a token `made` at start is
    printed once on stderr, after the URL; a host other than loopback is said on stderr."""
    import uvicorn

    try:
        listener = _listen(host, port)
    except OSError as error:
        print(f"flare mcp: cannot listen on {host}:{port}: {error}", file=sys.stderr)
        return EXIT_USAGE
    bound = listener.getsockname()
    address = f"[{bound[0]}]" if listener.family == socket.AF_INET6 else bound[0]
    url = f"http://{address}:{bound[1]}/mcp"
    print(f"flare mcp: streamable HTTP at {url}", file=sys.stderr, flush=True)
    if made:
        print(
            f"flare mcp: no --token-file, so this run's bearer token is {token}: put the header "
            f"'Authorization: Bearer {token}' in the client's settings for this server "
            "(--token-file FILE keeps one token across restarts)",
            file=sys.stderr,
            flush=True,
        )
    if host not in LOOPBACK:
        print(
            f"flare mcp: {host} is not loopback: whoever holds the token and reaches it can call the tools, "
            "and plain HTTP shows the token to the network between (prefer an SSH tunnel to 127.0.0.1)",
            file=sys.stderr,
        )
    uvicorn.Server(uvicorn.Config(_authenticated_app(server, host, url, token), log_level="warning")).run(
        sockets=[listener]
    )
    return 0


def _authenticated_app(server: Server[Any], host: str, url: str, token: str) -> Any:
    """The SDK's streamable HTTP app with its own bearer authentication: a request without
    `Authorization: Bearer <token>` gets 401 before it reaches the transport."""
    from mcp.server.auth.provider import AccessToken
    from mcp.server.auth.settings import AuthSettings

    expected = token.encode()

    class ServerToken:  # the SDK's TokenVerifier: the one token this server was started with
        async def verify_token(self, given: str) -> AccessToken | None:
            if not hmac.compare_digest(given.encode(), expected):
                return None
            return AccessToken(token="flare-mcp-token", client_id="flare-mcp", scopes=[])

    # the settings want an issuer; nothing uses it: no OAuth routes (no provider, no resource_server_url)
    auth = AuthSettings(issuer_url=url, resource_server_url=None)  # type: ignore[arg-type]
    return server.streamable_http_app(host=host, auth=auth, token_verifier=ServerToken())


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6 as `host` resolves; port 0: the kernel picks)."""
    if not 0 <= port <= 65535:  # getaddrinfo would take 70000 for 4464
        raise OSError(f"port {port} is not in 0..65535")
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address[:2], family=family)
