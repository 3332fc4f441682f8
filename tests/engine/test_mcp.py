"""`flare mcp`, driven by the MCP SDK's own client: over stdio against a real 4-rank gloo job with one rank
stuck in compute, whose culprit the `diagnose` tool names (and `report` once the job is gone); the tools it
lists, and their errors, which carry the line `flare` prints; what it refuses to read (paths outside its
allowed directories, symbolic links included) and where its credentials go (its own Prometheus only, seen by
HTTP servers that record the headers they get); streamable HTTP on loopback, which answers only requests
with its bearer token, against a virtual cluster; and `flare` without the SDK.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from conftest import flare_json
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from flare_exporter.engine import cli, mcp_server, report
from flare_exporter.local.jobs import ObservedJob, free_port
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.testing import virtual_cluster as vc
from flare_exporter.local.workloads import train_ddp

REPO = Path(__file__).resolve().parents[2]
FLARE_MCP = [sys.executable, "-m", "flare_exporter.cli", "mcp"]
TOOLS = {"diagnose", "ranks", "hang", "stragglers", "canary", "perf", "report"}
RANKS, STUCK, FAULT_STEP, HANG_SECONDS = 4, 2, 15, 3


class Client:
    """A session with a `flare mcp` server, called synchronously from a test (through an anyio portal)."""

    def __init__(self, portal: BlockingPortal, session: ClientSession) -> None:
        self.portal, self.session = portal, session

    def tools(self) -> list[types.Tool]:
        return self.portal.call(self.session.list_tools).tools

    def call(self, tool: str, **arguments: Any) -> types.CallToolResult:
        return self.portal.call(self.session.call_tool, tool, arguments)

    def answer(self, tool: str, **arguments: Any) -> dict:
        """The tool's JSON; the test fails with its message if the call was an error."""
        result = self.call(tool, **arguments)
        assert not result.is_error, result.content
        assert result.structured_content == json.loads(result.content[0].text)
        return result.structured_content


@contextlib.asynccontextmanager
async def session_over(transport: Any) -> AsyncIterator[ClientSession]:
    async with transport as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@contextlib.contextmanager
def connected(transport: Any) -> Iterator[Client]:
    """A Client over `transport` (the SDK's stdio_client or streamable_http_client, not yet entered)."""
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(session_over(transport)) as session,
    ):
        yield Client(portal, session)


@pytest.fixture(scope="module")
def flare_mcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """`flare mcp` started by the SDK's stdio client, as an MCP host starts it (a bare environment), allowed
    to read the tests' temporary directories."""
    allowed = ["--allow-dir", str(tmp_path_factory.getbasetemp())]
    server = StdioServerParameters(command=FLARE_MCP[0], args=[*FLARE_MCP[1:], *allowed], cwd=str(REPO))
    with connected(stdio_client(server)) as client:
        yield client


# ---------------------------------------------------------------------------------------------------------
# a real job, one rank stuck in compute before a collective, read through its file_sd directory


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ObservedJob, dict[str, Any]]]:
    """4 ranks of the DDP workload, rank STUCK looping in Python from step FAULT_STEP on; the tools'
    source arguments for it. Its incident files go where `flare` looks beside the targets."""
    work = tmp_path_factory.mktemp("mcp_job")
    env = {"FLARE_STALL_SECONDS": "1", "FLARE_HANG_SECONDS": str(HANG_SECONDS)}
    hosts = {rank: {"FLARE_HOST": f"node-{rank // 2}"} for rank in range(RANKS)}
    args = ["--steps", "100000", "--step-seconds", "0.02", "--fault-step", str(FAULT_STEP)]
    args += ["--fault", "stuck", "--fault-rank", str(STUCK)]
    job = ObservedJob(str(work), train_ddp.__file__, args, RANKS, "mcp-stuck", env=env, rank_env=hosts)
    source = {"targets": job.file_sd_dir, "run": "mcp-stuck", "timeout": 2, "hang_seconds": HANG_SECONDS}
    with job:
        yield job, source


def first_verdict(client: Client, tool: str, source: dict[str, Any], expected: tuple[str, list[int]]) -> dict:
    """The tool's JSON once its first verdict is `expected` (kind, ranks); until the ranks answer and the
    hang has lasted HANG_SECONDS, the tool answers otherwise, or errs (no target file yet)."""
    seen: list[Any] = []

    def named() -> dict | None:
        result = client.call(tool, **source)
        seen.append(result.content[0].text[:3000])
        verdicts = [] if result.is_error else result.structured_content["verdicts"]
        return (
            result.structured_content
            if verdicts and (verdicts[0]["kind"], verdicts[0]["ranks"]) == expected
            else None
        )

    try:
        return wait_for(named, 120, f"{tool} to name {expected}")
    except TimeoutError:
        pytest.fail(f"{tool} never named {expected}; it last said: {seen[-1:]}")


@pytest.mark.multirank
def test_the_diagnose_tool_names_the_rank_stuck_in_a_live_job(flare_mcp, stuck_job):
    _, source = stuck_job
    found = first_verdict(flare_mcp, "diagnose", source, ("hang", [STUCK]))
    verdict = found["verdicts"][0]
    assert found["ranks_seen"] == RANKS and found["hang_seconds"] == HANG_SECONDS
    assert (verdict["domain"], verdict["group"], verdict["cause"]) == ("rank", "world", "deadlock")
    culprit = verdict["evidence"]["culprits"][str(STUCK)]
    assert culprit["activity"] == "compute" and "stuck_in_compute" in culprit["frames"]

    # the same answer as `flare diagnose --json` (the job is stuck: nothing moves between the two)
    argv = ["diagnose", "--targets", source["targets"], "--run", source["run"], "--timeout", "2"]
    code, printed = flare_json(*argv, "--hang-seconds", str(HANG_SECONDS))
    assert code == cli.EXIT_ANOMALY and printed.keys() == found.keys()
    assert [(v["kind"], v["ranks"], v["cause"]) for v in printed["verdicts"]] == [
        (v["kind"], v["ranks"], v["cause"]) for v in found["verdicts"]
    ]


@pytest.mark.multirank
def test_the_evidence_tools_show_the_stuck_rank_behind_its_peers(flare_mcp, stuck_job):
    _, source = stuck_job
    hang = first_verdict(flare_mcp, "hang", source, ("hang", [STUCK]))
    (world,) = [group for group in hang["groups"] if group["group"] == "world"]
    assert world["hung"] and world["behind"] == [STUCK] and world["down"] == []

    ranks = {row["rank"]: row for row in flare_mcp.answer("ranks", **source)["ranks"]}
    assert ranks[STUCK]["activity"] == "compute" and ranks[STUCK]["in_flight"] is None
    waiting = [
        rank for rank, row in ranks.items() if row["in_flight"] and row["in_flight"]["group"] == "world"
    ]
    assert sorted(waiting) == [rank for rank in range(RANKS) if rank != STUCK]

    stragglers = flare_mcp.answer("stragglers", **source)
    assert all(verdict["kind"] == "straggler" for verdict in stragglers["verdicts"])


def hang_incidents(directory: Path) -> dict[int, dict]:
    """The incident files in `directory` that say the rank hung, by rank."""
    found = [json.loads(path.read_text()) for path in directory.glob("*.json")]
    return {incident["identity"]["rank"]: incident for incident in found if incident["reason"] == "hang"}


@pytest.mark.multirank
def test_the_report_tool_reads_the_incident_files_once_the_job_is_gone(flare_mcp, stuck_job):
    job, source = stuck_job
    incidents = Path(job.file_sd_dir) / "incidents"
    wait_for(lambda: len(hang_incidents(incidents)) == RANKS, 60, "every rank's hang incident file")
    job.kill()
    job.wait(timeout=30)

    arguments = {key: source[key] for key in ("targets", "run", "timeout")}
    result = flare_mcp.call("report", **arguments)
    found = flare_mcp.answer("report", **arguments)
    code, printed = flare_json("report", "--targets", source["targets"], "--run", source["run"])
    assert found == printed and code == (cli.EXIT_ANOMALY if found["verdicts"] else cli.EXIT_OK)
    assert found["ranks_heard_of"] == RANKS and found["source"] == f"incidents {incidents}"
    # and the Markdown report, as text: nothing is written (report's --out is not offered)
    assert [block.text for block in result.content][1] == report.markdown(found)
    assert not list(Path(job.file_sd_dir).rglob("*.md"))

    # the same run through diagnose: no rank answers, so the ranks' last words are judged
    post_mortem = flare_mcp.answer("diagnose", **source)
    assert post_mortem["post_mortem"] and post_mortem["ranks_seen"] == 0
    assert post_mortem["verdicts"] == found["verdicts"]


# ---------------------------------------------------------------------------------------------------------
# the tools, and their errors


SERVER_SIDE = {  # what only the server says: credentials, TLS files, headers, how to reach the ranks
    "bearer_token_file", "prometheus_user", "prometheus_password_file", "prometheus_ca_file",
    "prometheus_cert_file", "prometheus_key_file", "headers", "scheme", "ca_file", "cert_file", "key_file",
    "basic_auth_user",
}  # fmt: skip


def test_the_server_lists_exactly_the_read_only_tools(flare_mcp):
    tools = {tool.name: tool for tool in flare_mcp.tools()}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.annotations.read_only_hint and not tool.annotations.destructive_hint, tool.name
        assert tool.input_schema["additionalProperties"] is False
        assert not {"out", "json", "prune"} & set(tool.input_schema["properties"]), tool.name
        assert not SERVER_SIDE & set(tool.input_schema["properties"]), tool.name
    assert "Start here" in tools["diagnose"].description and "gone" in tools["report"].description


def test_every_tool_argument_is_a_flag_of_its_command():
    parser = cli.build_parser()
    (commands,) = [action for action in parser._actions if action.dest == "command"]
    for tool in [*TOOLS, "profile"]:
        flags = {flag for action in commands.choices[tool]._actions for flag in action.option_strings}
        wanted = {argument.flag for argument in mcp_server.ARGUMENTS if tool in argument.tools}
        assert wanted <= flags, (tool, wanted - flags)


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`flare ARGV`'s exit code and the one line it printed on stderr (its usage lines aside)."""
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_tool_error_is_the_line_flare_prints(flare_mcp, tmp_path, capsys):
    unreachable = f"http://127.0.0.1:{free_port()}"
    missing = os.path.realpath(tmp_path / "missing")  # the server names a path by its real path
    cases = [
        (("diagnose", {"prometheus": unreachable, "timeout": 2}), ["diagnose", "--prometheus", unreachable]),
        (("ranks", {"targets": missing}), ["ranks", "--targets", missing]),
        (("report", {"incidents": missing}), ["report", "--incidents", missing]),
        (("diagnose", {"flight_recorder": missing}), ["diagnose", "--flight-recorder", missing]),
        (("hang", {}), ["hang"]),
        (
            ("stragglers", {"targets": missing, "timeout": "soon"}),
            ["stragglers", "--targets", missing, "--timeout", "soon"],
        ),
        # a value that looks like a flag is a value: --window=-x
        (("ranks", {"targets": missing, "window": "-x"}), ["ranks", "--targets", missing, "--window=-x"]),
    ]
    for (tool, arguments), argv in cases:
        result = flare_mcp.call(tool, **arguments)
        code, line = cli_error(argv, capsys)
        assert code in (cli.EXIT_USAGE, cli.EXIT_UNDECIDED), (argv, code)
        assert result.is_error and [block.text for block in result.content] == [line], (tool, line)
        assert result.structured_content is None

    # what no flag takes is refused, by name
    result = flare_mcp.call("report", incidents=missing, out=str(tmp_path / "report.md"))
    assert result.is_error and "no argument 'out'" in result.content[0].text
    assert not (tmp_path / "report.md").exists()
    result = flare_mcp.call("diagnose", targets=missing, hang_seconds=[3])
    assert (
        result.is_error
        and result.content[0].text == "flare diagnose: argument hang_seconds: [3] is not a number"
    )
    result = flare_mcp.call("diagnose", prometheus=unreachable, bearer_token_file=missing)
    assert result.is_error and "no argument 'bearer_token_file'" in result.content[0].text


# ---------------------------------------------------------------------------------------------------------
# what the server reads: paths inside the directories it allows, and nothing a symbolic link leads out to


def refusal(client: Client, tool: str, **arguments: Any) -> str:
    """The one line of a tool call the server refused."""
    result = client.call(tool, **arguments)
    assert result.is_error and len(result.content) == 1, (tool, arguments, result.content)
    return result.content[0].text


def test_a_path_outside_the_allowed_directories_is_refused(flare_mcp, tmp_path, tmp_path_factory, capsys):
    allowed = os.path.realpath(tmp_path_factory.getbasetemp())
    outside = REPO / "README.md"
    # flare itself would read it, and its error would echo the file's third line
    code, line = cli_error(["ranks", "--targets", str(outside)], capsys)
    echoed = outside.read_text().splitlines()[2]
    assert code == cli.EXIT_USAGE and echoed in line
    text = refusal(flare_mcp, "ranks", targets=str(outside))
    assert text == (
        f"flare ranks: argument targets: {str(outside)!r} is outside the directories this server may read "
        f"({allowed}; symbolic links followed)"
    )
    assert echoed not in text
    up = str(tmp_path / ".." / "..")  # the pytest-of-<user> directory above the allowed one
    assert "argument incidents: " in refusal(flare_mcp, "report", incidents=up)

    # a symbolic link inside an allowed directory that leads out: named, or listed by the command
    (tmp_path / "escape").symlink_to(REPO)
    for tool, name, path in [
        ("report", "incidents", tmp_path / "escape"),
        ("diagnose", "flight_recorder", tmp_path / "escape" / "nccl_trace_rank_"),
        ("hang", "targets", tmp_path / "escape" / "pyproject.toml"),
    ]:
        text = refusal(flare_mcp, tool, **{name: str(path)})
        assert text.startswith(f"flare {tool}: argument {name}: {str(path)!r} is outside"), text
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "ranks.txt").write_text(f"127.0.0.1:{free_port()}\n")
    (targets / "more.json").symlink_to(REPO / "pyproject.toml")
    text = refusal(flare_mcp, "diagnose", targets=str(targets), timeout=1)
    link = os.path.join(os.path.realpath(targets), "more.json")
    assert text == (
        f"flare diagnose: argument targets: {link} is a symbolic link that leads outside the directories "
        f"this server may read ({allowed})"
    )
    # without the link the same directory is read
    (targets / "more.json").unlink()
    text = refusal(flare_mcp, "diagnose", targets=str(targets), timeout=1)
    assert "outside" not in text and text.startswith("flare"), text


# ---------------------------------------------------------------------------------------------------------
# where the server's credentials go: to its own --prometheus only


class Recorder(http.server.ThreadingHTTPServer):
    """An HTTP server on loopback that records the path and headers of every GET and answers each with an
    empty Prometheus result, or a redirect to `away` for a path under /away."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), RecordingHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.away = ""

    def headers_seen(self) -> list[dict[str, str]]:
        return [headers for _, headers in self.seen]


class RecordingHandler(http.server.BaseHTTPRequestHandler):
    server: Recorder

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append((self.path, {name.lower(): value for name, value in self.headers.items()}))
        if self.path.startswith("/away/"):
            self.send_response(302)
            self.send_header("Location", self.server.away + self.path.removeprefix("/away"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


SECRET, TENANT = "s3cret-token-of-the-server", "tenant-1"


@pytest.fixture(scope="module")
def secured_mcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Recorder, Recorder]]:
    """`flare mcp --prometheus OWN` with a bearer token file and a tenant header, and no --allow-dir; OWN
    and another Prometheus (FOREIGN), both recorders; OWN redirects /away/... to FOREIGN."""
    token_file = tmp_path_factory.mktemp("mcp_secret") / "token"
    token_file.write_text(SECRET + "\n")
    with recording() as own, recording() as foreign:
        own.away = foreign.url
        flags = ["--prometheus", own.url, "--bearer-token-file", str(token_file)]
        flags += ["--header", f"X-Scope-OrgID: {TENANT}"]
        server = StdioServerParameters(command=FLARE_MCP[0], args=[*FLARE_MCP[1:], *flags], cwd=str(REPO))
        with connected(stdio_client(server)) as client:
            yield client, own, foreign


def asked(client: Client, recorder: Recorder, tool: str, **arguments: Any) -> list[dict[str, str]]:
    """The headers of the requests `recorder` got while `tool` ran (at least one)."""
    recorder.seen.clear()
    client.call(tool, timeout=2, **arguments)
    assert recorder.seen, f"{tool} {arguments} asked {recorder.url} nothing"
    return recorder.headers_seen()


def test_the_servers_credentials_go_to_its_own_prometheus_only(secured_mcp):
    client, own, foreign = secured_mcp
    # its own Prometheus: the default source, or named (its origin spelt otherwise: a trailing slash)
    for arguments in ({}, {"prometheus": own.url + "/"}):
        for headers in asked(client, own, "diagnose", **arguments):
            assert headers["authorization"] == f"Bearer {SECRET}" and headers["x-scope-orgid"] == TENANT
    # another Prometheus the tool names is asked without them
    for tool in ("diagnose", "report"):
        for headers in asked(client, foreign, tool, prometheus=foreign.url):
            assert "authorization" not in headers and "x-scope-orgid" not in headers, (tool, headers)
    # nor does a redirect from its own Prometheus to another hand them on
    own.seen.clear()
    headers_there = asked(client, foreign, "diagnose", prometheus=own.url + "/away")
    assert own.seen and own.headers_seen()[0]["authorization"] == f"Bearer {SECRET}"
    assert all("authorization" not in headers and "x-scope-orgid" not in headers for headers in headers_there)


def test_a_server_that_allows_no_directory_reads_no_path(secured_mcp, tmp_path):
    client, _, _ = secured_mcp
    assert refusal(client, "ranks", targets=str(tmp_path)) == (
        "flare ranks: argument targets: this server reads no path; start `flare mcp` with --allow-dir DIR "
        "(or --targets, --incidents, --flight-recorder)"
    )


def test_flare_mcp_refuses_to_start_with_what_it_cannot_use(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("a" * 40)
    token.chmod(0o644)
    cases = [
        (["--allow-dir", str(tmp_path / "missing")], f"--allow-dir {tmp_path / 'missing'}: not a directory"),
        (["--bearer-token-file", str(token)], "flag --bearer-token-file: only with --prometheus"),
        (["--token-file", str(token)], "--token-file: for --transport http only"),
        (["--transport", "http", "--token-file", str(token)], "others than its owner may read or write it"),
    ]
    for flags, expected in cases:
        assert cli.main(["mcp", *flags]) == cli.EXIT_USAGE, flags
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("flare mcp: ") and expected in line, (flags, line)
    token.chmod(0o600)
    token.write_text("short\n")
    assert cli.main(["mcp", "--transport", "http", "--token-file", str(token)]) == cli.EXIT_USAGE
    (line,) = capsys.readouterr().err.splitlines()
    assert "at least 16 characters" in line and "short" not in line


# ---------------------------------------------------------------------------------------------------------
# streamable HTTP


def listening_addresses(port: int) -> set[str]:
    """The local addresses (as /proc/net/tcp* write them) of the TCP sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@contextlib.contextmanager
def http_server(*flags: str) -> Iterator[tuple[str, list[str]]]:
    """`flare mcp --transport http FLAGS` on a port the kernel picks: its URL, from the line it prints, and
    the lines it printed after it (without --token-file: the one with its token)."""
    process = subprocess.Popen(
        [*FLARE_MCP, "--transport", "http", "--port", "0", *flags],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stderr.readline()
        assert line.startswith("flare mcp: streamable HTTP at http://127.0.0.1:"), (
            line + process.stderr.read()
        )
        after = [] if "--token-file" in flags else [process.stderr.readline()]
        yield line.split()[-1], after
    finally:
        process.terminate()
        process.wait(timeout=30)


def with_token(token: str) -> httpx2.AsyncClient:
    """The HTTP client an MCP client is given to send the server's bearer token."""
    return httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc")
def test_streamable_http_listens_on_loopback_only_and_answers_a_client_with_its_token(tmp_path):
    token = "t" * 20 + "-the-servers-own"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    # a virtual cluster of 4 ranks, rank 1 stuck in compute for 10 minutes, the others waiting in the world
    hung_at = time.perf_counter() - 600
    pages = vc.render_cluster(RANKS, "mcp-http", vc.Faults(hung=1, hung_at=hung_at))
    flags = ["--token-file", str(token_file), "--allow-dir", str(tmp_path)]
    with vc.ClusterServer(pages) as cluster, http_server(*flags) as (url, _):
        targets = vc.write_file_sd(str(tmp_path / "targets"), "mcp-http", cluster.targets(), RANKS)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and no other address
        # no token, another token, the token given otherwise than as a bearer token: 401
        assert post_status(url, None, None) == 401
        assert post_status(url, None, "u" * 36) == 401
        assert post_status(url, None, token, scheme="Basic") == 401
        with connected(streamable_http_client(url, http_client=with_token(token))) as client:
            assert {tool.name for tool in client.tools()} == TOOLS
            found = client.answer("hang", targets=targets)
        (world,) = [group for group in found["groups"] if group["group"] == "world"]
        assert world["hung"] and world["behind"] == [1]
        assert [(v["kind"], v["ranks"]) for v in found["verdicts"]] == [("hang", [1])]
        # a page whose name resolves to 127.0.0.1 (DNS rebinding) is refused by its Host header
        assert post_status(url, "evil.example", token) == 421
        assert post_status(url, None, token) not in (401, 421)


def test_without_a_token_file_the_server_makes_one_and_says_it_once(tmp_path):
    with http_server() as (url, after):
        (line,) = after
        token = line.split("bearer token is ", 1)[1].split(":", 1)[0]
        assert len(token) >= mcp_server.MIN_TOKEN_CHARACTERS
        assert line.startswith("flare mcp: no --token-file") and f"'Authorization: Bearer {token}'" in line
        assert post_status(url, None, None) == 401 and post_status(url, None, token + "x") == 401
        with connected(streamable_http_client(url, http_client=with_token(token))) as client:
            assert {tool.name for tool in client.tools()} == TOOLS


def post_status(url: str, host: str | None, token: str | None, scheme: str = "Bearer") -> int:
    """The HTTP status of a JSON-RPC ping POSTed to `url` with this Host header (None: the URL's) and this
    token (None: no Authorization header)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    headers.update({"Host": host} if host else {})
    headers.update({"Authorization": f"{scheme} {token}"} if token else {})
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


# ---------------------------------------------------------------------------------------------------------
# the command


def test_flare_mcp_has_help_and_a_place_in_flares(capsys):
    assert cli.main(["mcp", "--help"]) == cli.EXIT_OK
    helped = capsys.readouterr().out
    assert "--transport {stdio,http}" in helped and "--allow-dir DIR" in helped and "--token-file" in helped
    assert cli.main(["--help"]) == cli.EXIT_OK
    assert "mcp" in capsys.readouterr().out
    assert cli.main(["mcp", "--transport", "sse"]) == cli.EXIT_USAGE
    assert "invalid choice: 'sse'" in capsys.readouterr().err


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_the_sdk_flare_mcp_says_what_to_install_and_diagnose_never_loads_it(tmp_path):
    blocked = "import sys; sys.modules['mcp'] = None; from flare_exporter.engine import cli; "
    done = run_python(blocked + "sys.exit(cli.main(['mcp']))")
    assert done.returncode == cli.EXIT_USAGE and done.stdout == ""
    assert done.stderr == mcp_server.INSTALL_HINT + "\n"

    missing = str(tmp_path / "missing")
    done = run_python(
        "import sys; from flare_exporter.engine import cli; "
        f"code = cli.main(['diagnose', '--targets', {missing!r}]); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types', 'uvicorn')))"
    )
    assert done.stdout.split(maxsplit=1) == [str(cli.EXIT_USAGE), "[]\n"], done.stderr


def test_an_address_that_cannot_be_listened_on_is_one_line():
    done = subprocess.run(
        [*FLARE_MCP, "--transport", "http", "--port", "70000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == cli.EXIT_USAGE
    assert (
        done.stderr.startswith("flare mcp: cannot listen on 127.0.0.1:70000: ")
        and done.stderr.count("\n") == 1
    )


def test_the_ranks_tool_takes_the_selection_of_flare_ranks():
    argv = mcp_server.command_line("ranks", {"problems": True, "sort": "heartbeat", "top": 5})
    assert argv == ["ranks", "--problems", "--sort=heartbeat", "--top=5"]
    assert mcp_server.command_line("ranks", {"problems": False}) == ["ranks"]
    with pytest.raises(mcp_server.ArgumentError, match="problems"):
        mcp_server.command_line("ranks", {"problems": "yes"})
    with pytest.raises(mcp_server.ArgumentError, match="no argument 'top'"):
        mcp_server.command_line("diagnose", {"top": 5})


# ---------------------------------------------------------------------------------------------------------
# profile: the one tool that acts, offered only by a server started with --allow-profile


def test_the_profile_tool_is_refused_unless_the_server_allows_it_and_takes_flare_profiles_flags():
    from flare_exporter.engine.mcp_policy import Policy

    asked: list[list[str]] = []

    def answer(argv: list[str]) -> tuple[int, dict]:
        asked.append(argv)
        return 2, {"run": "r", "ranks": [{"rank": 1, "state": "refused", "error": "profiling is off"}]}

    arguments = {"targets": "/t", "ranks": "1,2", "steps": 2, "compare": True}
    failed, texts, _ = mcp_server.call(answer, "profile", arguments, Policy(roots=("/",)))
    assert failed and "--allow-profile" in texts[0] and asked == []
    failed, texts, result = mcp_server.call(answer, "profile", arguments, Policy(roots=("/",), profile=True))
    assert not failed and result["ranks"][0]["state"] == "refused"  # each rank's state is the answer
    assert asked == [["profile", "--targets=/t", "--ranks=1,2", "--steps=2", "--compare"]]


@pytest.mark.multirank
def test_a_server_started_with_allow_profile_offers_profile_and_captures_a_live_rank(tmp_path):
    args = ["--steps", "100000", "--step-seconds", "0.02"]
    env = {"FLARE_PROFILE": "1"}
    with ObservedJob(str(tmp_path), train_ddp.__file__, args, 2, "mcp-profile", env=env) as job:
        allowed = ["--allow-dir", str(tmp_path), "--allow-profile"]
        server = StdioServerParameters(command=FLARE_MCP[0], args=[*FLARE_MCP[1:], *allowed], cwd=str(REPO))
        with connected(stdio_client(server)) as client:
            tools = {tool.name: tool for tool in client.tools()}
            assert set(tools) == TOOLS | {"profile"}
            assert (
                not tools["profile"].annotations.read_only_hint
                and tools["diagnose"].annotations.read_only_hint
            )
            wait_for(lambda: len(list(Path(job.file_sd_dir).glob("*.json"))) == 2, 60, "the targets")
            found = client.answer("profile", targets=job.file_sd_dir, ranks="1", steps=2)
        job.release()
    [row] = found["ranks"]
    assert (row["rank"], row["state"], row["steps"]) == (1, "captured", 2) and row["bottleneck"]
