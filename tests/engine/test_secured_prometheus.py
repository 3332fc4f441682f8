"""`--prometheus` of a secured Prometheus: TLS with a private CA or a client certificate, basic auth, a bearer
token, headers (Thanos's or Mimir's X-Scope-OrgID); every flag that cannot be used is one line naming it.

A stand-in Prometheus (http.server) records the headers it is sent; a real Prometheus serving TLS with basic
auth (its --web.config.file) holds a virtual cluster's series and answers `flare` with the credentials only.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import PASSWORD, PASSWORD_HASH, flare_json

from flare_exporter.engine import cli, promql
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.local.testing import virtual_cluster as vc

COMMANDS = ("diagnose", "ranks", "hang", "stragglers", "report")
TOKEN = "tok-3n7"
NOWHERE = "http://127.0.0.1:1"  # never asked: the flags are refused first
NO_CREDENTIALS = "authentication failed (HTTP 401 Unauthorized; sent no credentials)"


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    return error.strip()


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A token, a password, an empty file, two lines and no certificate; no password in the environment."""
    monkeypatch.delenv(promql.PASSWORD_ENV, raising=False)
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "password").write_text("pw\n")
    (tmp_path / "empty").write_text("")
    (tmp_path / "two-lines").write_text("a\nb\n")
    (tmp_path / "not-a-cert").write_text("hello\n")
    return tmp_path


# ---------------------------------------------------------------------------------------------------------
# the flags


# each: the flags after `flare diagnose` (--prometheus NOWHERE unless named) => the flag named: what it says;
# {dir} holds the `files`, {https} names an https Prometheus
BAD_FLAGS = [
    "--prometheus not-a-url => --prometheus: 'not-a-url' is not an http(s)://host URL",
    "--prometheus ftp://h:9090 => --prometheus: is not an http(s)://host URL",
    "--prometheus http://:9090 => --prometheus: is not an http(s)://host URL",
    "--prometheus http://h:99999 => --prometheus: is not a URL",
    "--prometheus http://u:pw@h:9090 => --prometheus: credentials go in --prometheus-user",
    "--prometheus http://h:9090/?x=1 => --prometheus: has no user, query or fragment",
    "--header X-Scope-OrgID => --header: is not 'Name: value'",
    "--header X-Scope-OrgID: => --header: is not 'Name: value'",
    "--header 'Bad Name: v' => --header: is not 'Name: value'",
    "--bearer-token-file {dir}/missing => --bearer-token-file: cannot read {dir}/missing",
    "--bearer-token-file {dir}/empty => --bearer-token-file: {dir}/empty must hold one line",
    "--bearer-token-file {dir}/two-lines => --bearer-token-file: not several",
    "--bearer-token-file {dir}/token --prometheus-user u => --bearer-token-file: not both",
    "--bearer-token-file {dir}/token --header 'Authorization: Basic x' => --header: is already set",
    f"--prometheus-user u => --prometheus-user: --prometheus-password-file or {promql.PASSWORD_ENV}",
    "--prometheus-user a:b --prometheus-password-file {dir}/password => --prometheus-user: holds no ':'",
    "--prometheus-password-file {dir}/password => --prometheus-password-file: of --prometheus-user",
    "--prometheus-user u --prometheus-password-file {dir}/missing => --prometheus-password-file: cannot read",
    "--prometheus-ca-file {dir}/not-a-cert => --prometheus-ca-file: for an https:// Prometheus",
    "{https} --prometheus-ca-file {dir}/missing => --prometheus-ca-file: cannot read {dir}/missing",
    "{https} --prometheus-ca-file {dir}/not-a-cert => --prometheus-ca-file: holds no CA certificate",
    "{https} --prometheus-cert-file {dir}/not-a-cert => --prometheus-cert-file: no client certificate",
    "{https} --prometheus-key-file {dir}/not-a-cert => --prometheus-key-file: the key of",
    "{https} --prometheus-cert-file {dir}/missing => --prometheus-cert-file: cannot read {dir}",
]


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_each_flag_that_cannot_be_used_is_one_line_naming_it(files, capsys, case):
    flags, expected = case.format(dir=files, https="--prometheus https://h").split(" => ")
    flag, says = expected.split(": ", 1)
    argv = shlex.split(flags)
    if "--prometheus" not in argv:
        argv = ["--prometheus", NOWHERE, *argv]
    assert cli.main(["diagnose", *argv]) == cli.EXIT_USAGE
    error = one_line_error(capsys)
    assert error.startswith(f"flare: flag {flag}: ") and says in error, error
    assert ":pw@" not in error  # a URL's password is never echoed


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_reads_prometheus_takes_the_flags(files, capsys, command):
    secured = ["--header", "X-Scope-OrgID: t", "--bearer-token-file", str(files / "token")]
    assert cli.main([command, "--prometheus", "not-a-url", *secured]) == cli.EXIT_USAGE
    assert one_line_error(capsys).startswith("flare: flag --prometheus: 'not-a-url' is not an http(s)://host")
    assert cli.main([command, "--prometheus", NOWHERE, "--header", "nonsense"]) == cli.EXIT_USAGE
    assert one_line_error(capsys).startswith("flare: flag --header: 'nonsense' is not 'Name: value'")
    # without --prometheus, they would be ignored: a security setting that is not applied is refused
    assert cli.main([command, "--targets", str(files), *secured]) == cli.EXIT_USAGE
    assert (
        one_line_error(capsys)
        == "flare: flag --bearer-token-file: only with --prometheus (it says how to ask it)"
    )


def test_connect_builds_the_headers_and_a_plain_url_stays_a_connection(files, monkeypatch):
    connection = promql.connect(
        "http://h:9090/prom",
        promql.Access(
            ["X-Scope-OrgID: tenant-1", "X-Other :  two words "], bearer_token_file=str(files / "token")
        ),
    )
    assert connection.headers == (
        ("X-Scope-OrgID", "tenant-1"),
        ("X-Other", "two words"),
        ("Authorization", f"Bearer {TOKEN}"),
    )
    assert connection.context is None and str(connection) == "http://h:9090/prom"
    basic = promql.connect("http://h:9090", promql.Access(user="flare", password="pw"))
    assert basic.headers == (("Authorization", "Basic ZmxhcmU6cHc="),)  # flare:pw
    assert basic.credentials == "basic auth as user 'flare'"
    assert promql.connection("http://x") == promql.Connection("http://x")
    assert promql.connection(basic) is basic


def test_a_plain_url_that_is_not_one_is_a_one_line_error_not_json():
    with pytest.raises(promql.PrometheusError, match="not an http\\(s\\) URL"):
        promql.query("not-a-url", "up")


# ---------------------------------------------------------------------------------------------------------
# a stand-in Prometheus that records what it is sent


@dataclass
class StandIn:
    url: str
    headers: list[dict[str, str]]  # of each request, in order, by lowercase name


@contextlib.contextmanager
def stand_in(token: str = TOKEN) -> Iterator[StandIn]:
    """A Prometheus that answers every query with an empty result to the bearer `token`; 401 without an
    Authorization header, 403 with another."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append({name.lower(): value for name, value in self.headers.items()})  # HTTP: any case
            authorization = self.headers.get("Authorization")
            if authorization != f"Bearer {token}":
                self.answer(401 if authorization is None else 403, b"not you\n")
                return
            data: object = [] if "/label/" in self.path else {"resultType": "vector", "result": []}
            self.answer(200, json.dumps({"status": "success", "data": data}).encode())

        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield StandIn(f"http://127.0.0.1:{server.server_address[1]}", seen)
        finally:
            server.shutdown()
            thread.join(timeout=10)


def test_every_request_carries_the_headers_and_the_bearer_token(files, capsys):
    with stand_in() as prometheus:
        argv = ["diagnose", "--prometheus", prometheus.url, "--run", "r", "--timeout", "5"]
        argv += ["--header", "X-Scope-OrgID: tenant-1", "--bearer-token-file", str(files / "token")]
        # the run has no rank in an empty Prometheus: nothing to decide, after the live and the history rounds
        assert cli.main(argv) == cli.EXIT_UNDECIDED
        assert "no rank of run 'r' was scraped" in one_line_error(capsys)
    assert len(prometheus.headers) > 5
    assert {(h.get("x-scope-orgid"), h.get("authorization")) for h in prometheus.headers} == {
        ("tenant-1", f"Bearer {TOKEN}")
    }


def test_a_401_or_403_is_one_line_saying_authentication_failed(files, capsys):
    with stand_in(token="another") as prometheus:
        assert cli.main(["hang", "--prometheus", prometheus.url]) == cli.EXIT_USAGE
        error = one_line_error(capsys)
        assert error == f"flare: Prometheus at {prometheus.url}: {NO_CREDENTIALS}"
        token = ["--bearer-token-file", str(files / "token")]
        assert cli.main(["report", "--prometheus", prometheus.url, *token]) == cli.EXIT_USAGE
        error = one_line_error(capsys)
        assert "authentication failed (HTTP 403 Forbidden; sent a bearer token from " in error


# ---------------------------------------------------------------------------------------------------------
# a real Prometheus serving TLS with basic auth, holding a run's series

RUN = "secured-run"
RANKS = 4
USER = "flare"


@dataclass
class Secured:
    url: str
    ca_file: str
    password_file: str


@pytest.fixture(scope="module")
def secured(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A virtual cluster of RANKS ranks of run RUN, scraped by a Prometheus that answers over TLS (the test
    CA's server certificate for 127.0.0.1) to basic auth as USER only."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    work = tmp_path_factory.mktemp("secured_prometheus")
    web = {
        "tls_server_config": {"cert_file": str(certs / "server.crt"), "key_file": str(certs / "server.key")},
        "basic_auth_users": {USER: PASSWORD_HASH},
    }
    (work / "web.yml").write_text(json.dumps(web))  # JSON is YAML
    (work / "password").write_text(PASSWORD + "\n")
    access = promql.Access(user=USER, password=PASSWORD, ca_file=str(certs / "ca.crt"))
    targets = str(work / "targets")
    with vc.ClusterServer(vc.render_cluster(RANKS, RUN)) as cluster:
        vc.write_file_sd(targets, RUN, cluster.targets(), RANKS)
        with PrometheusProcess(
            str(work / "prometheus"),
            targets,
            web_config_file=str(work / "web.yml"),
            access=promql.connect("https://127.0.0.1", access),
        ) as prometheus:
            assert prometheus.url.startswith("https://127.0.0.1:")
            expr = f'count(flare_rank_info{{run="{RUN}"}}) == {RANKS}'
            wait_for(lambda: prometheus.query(expr), 60, f"Prometheus to scrape the {RANKS} ranks")
            yield Secured(prometheus.url, str(certs / "ca.crt"), str(work / "password"))


@pytest.mark.prometheus
def test_flare_asks_a_prometheus_with_tls_and_basic_auth(secured, monkeypatch):
    monkeypatch.delenv(promql.PASSWORD_ENV, raising=False)
    tls = ["--prometheus", secured.url, "--prometheus-ca-file", secured.ca_file]
    user = ["--prometheus-user", USER]
    code, found = flare_json("diagnose", *tls, *user, "--prometheus-password-file", secured.password_file)
    assert code in (cli.EXIT_OK, cli.EXIT_ANOMALY), found
    assert (found["run"], found["ranks_seen"], found["source"]) == (RUN, RANKS, f"prometheus {secured.url}")
    # the password from the environment; the history rounds (flare report) ask the same way
    monkeypatch.setenv(promql.PASSWORD_ENV, PASSWORD)
    code, found = flare_json("ranks", *tls, *user)
    assert code in (cli.EXIT_OK, cli.EXIT_ANOMALY) and [row["rank"] for row in found["ranks"]] == [
        *range(RANKS)
    ]
    code, found = flare_json("report", *tls, *user, "--run", RUN)
    assert code in (cli.EXIT_OK, cli.EXIT_ANOMALY) and found["run"] == RUN


@pytest.mark.prometheus
def test_without_credentials_or_the_ca_a_secured_prometheus_is_one_line(secured, files, capsys):
    tls = ["--prometheus", secured.url, "--prometheus-ca-file", secured.ca_file]
    assert cli.main(["diagnose", *tls, "--json"]) == cli.EXIT_USAGE
    error = one_line_error(capsys)
    assert error == f"flare: Prometheus at {secured.url}: {NO_CREDENTIALS}"
    wrong = ["--prometheus-user", USER, "--prometheus-password-file", str(files / "password")]
    assert cli.main(["diagnose", *tls, *wrong, "--json"]) == cli.EXIT_USAGE
    assert "authentication failed (HTTP 401 Unauthorized; sent basic auth as user 'flare')" in one_line_error(
        capsys
    )
    # the system's CAs do not know the test CA
    password = ["--prometheus-password-file", secured.password_file]
    assert cli.main(["diagnose", "--prometheus", secured.url, "--prometheus-user", USER, *password]) == 2
    error = one_line_error(capsys)
    assert error.startswith(f"flare: cannot reach Prometheus at {secured.url}: ")
    assert "CERTIFICATE_VERIFY_FAILED" in error and error.endswith("name its CA with --prometheus-ca-file")
