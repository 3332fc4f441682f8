"""TLS and basic auth on the endpoint from a web config file, with real TLS clients and a real Prometheus.

Certificates are made here with the openssl command: a CA, a server certificate for 127.0.0.1 and a client
certificate, both signed by the CA.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import shutil
import socket
import ssl
import sys
from pathlib import Path

import bcrypt
import pytest
from conftest import PASSWORD, PASSWORD_HASH
from test_exposition import StepsCollector, make_registry

from flare_exporter.config import Config, ConfigError
from flare_exporter.engine import cli, scrape
from flare_exporter.local.prometheus import PrometheusProcess, wait_for
from flare_exporter.rank import file_sd, web_config
from flare_exporter.rank.attach import build_registry
from flare_exporter.rank.exposition import serve
from flare_exporter.rank.identity import RankIdentity
from flare_exporter.rank.state import FlareState
from flare_exporter.rank.web_config import BasicAuth, WebConfigError


def write_web_config(directory: Path, document: dict, name: str = "web-config.yml") -> str:
    path = directory / name
    path.write_text(json.dumps(document))  # JSON is YAML
    return str(path)


def tls_section(client_auth: str = "NoClientCert", **extra: str) -> dict:
    section = {"cert_file": "server.crt", "key_file": "server.key", "client_auth_type": client_auth, **extra}
    if client_auth != "NoClientCert":
        section["client_ca_file"] = "ca.crt"
    return section


def client_context(certs: Path, with_cert: bool = False, **versions: ssl.TLSVersion) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if with_cert:
        context.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    for attribute, version in versions.items():
        setattr(context, attribute, version)
    return context


def get(port: int, path: str, context: ssl.SSLContext, user: str = "", password: str = "", method="GET"):
    """(status, headers, body) of one HTTPS request to 127.0.0.1:port, through a real TLS client."""
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    headers = {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture
def secured_server(certs):
    """A server with TLS (client certificates verified if given) and basic auth for user `prometheus`."""
    path = write_web_config(
        certs,
        {
            "tls_server_config": tls_section("VerifyClientCertIfGiven"),
            "http_server_config": {"headers": {"X-Frame-Options": "deny"}},
            "basic_auth_users": {"prometheus": PASSWORD_HASH},
        },
    )
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0, web_config_file=path)
    assert server is not None and server.scheme == "https"
    yield server
    server.close()


# ---------------------------------------------------------------------------------------------------------
# the file


def test_parse_full_config_resolves_paths_against_the_file(tmp_path):
    document = {
        "tls_server_config": tls_section("RequireAndVerifyClientCert", min_version="TLS13"),
        "http_server_config": {"http2": True, "headers": {"Strict-Transport-Security": "max-age=60"}},
        "basic_auth_users": {"prometheus": PASSWORD_HASH},
    }
    parsed = web_config.parse(document, str(tmp_path / "web.yml"))
    assert parsed.tls is not None
    assert parsed.tls.cert_file == str(tmp_path / "server.crt")
    assert parsed.tls.client_ca_file == str(tmp_path / "ca.crt")
    assert parsed.tls.client_auth_type == "RequireAndVerifyClientCert"
    assert (parsed.tls.min_version, parsed.tls.max_version) == ("TLS13", "TLS13")
    assert parsed.users == {"prometheus": PASSWORD_HASH.encode()}
    assert parsed.headers == {"Strict-Transport-Security": "max-age=60"}
    assert web_config.parse(None, "empty.yml") == web_config.WebConfig("empty.yml")


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"tls_config": {}}, "unknown key 'tls_config'"),
        ([1, 2], "the file must be a mapping"),
        ({"tls_server_config": "server.crt"}, "key 'tls_server_config' must be a mapping"),
        ({"tls_server_config": {"cert_file": "a.crt"}}, "key 'tls_server_config.key_file' is required"),
        ({"tls_server_config": {**tls_section(), "cert_file": 5}}, "'tls_server_config.cert_file' must be a"),
        (
            {"tls_server_config": {**tls_section(), "certfile": "x"}},
            "unknown key 'tls_server_config.certfile'",
        ),
        (
            {"tls_server_config": {**tls_section(), "cipher_suites": ["x"]}},
            "'tls_server_config.cipher_suites' is not supported",
        ),  # noqa: E501
        ({"tls_server_config": tls_section("RequireAnyClientCert")}, "RequireAnyClientCert is not supported"),
        ({"tls_server_config": tls_section("Always")}, "'Always' is not one of"),
        (
            {"tls_server_config": {**tls_section(), "client_ca_file": "ca.crt"}},
            "client_auth_type is NoClientCert",
        ),  # noqa: E501
        (
            {"tls_server_config": {**tls_section(), "client_auth_type": "RequireAndVerifyClientCert"}},
            "'tls_server_config.client_ca_file' is required",
        ),  # noqa: E501
        ({"tls_server_config": tls_section(min_version="SSL3")}, "'tls_server_config.min_version': 'SSL3'"),
        ({"tls_server_config": tls_section(min_version="TLS13", max_version="TLS12")}, "above max_version"),
        ({"http_server_config": {"headers": {"Server": "x"}}}, "'http_server_config.headers.Server'"),
        ({"http_server_config": {"http2": "yes"}}, "'http_server_config.http2' must be true or false"),
        ({"basic_auth_users": {"prometheus": "plain-text"}}, "'basic_auth_users.prometheus': not a bcrypt"),
        ({"basic_auth_users": {"a:b": PASSWORD_HASH}}, "cannot contain ':'"),
        ({"basic_auth_users": ["prometheus"]}, "key 'basic_auth_users' must be a mapping"),
    ],
)
def test_invalid_web_config_is_one_line_naming_file_and_key(tmp_path, document, message):
    path = str(tmp_path / "web.yml")
    with pytest.raises(WebConfigError) as raised:
        web_config.parse(document, path)
    text = str(raised.value)
    assert message in text
    assert f"web config file {path}" in text and "\n" not in text
    assert isinstance(raised.value, ConfigError)


def test_unreadable_files_name_the_key(tmp_path, certs):
    with pytest.raises(WebConfigError, match="cannot read it"):
        web_config.load(str(tmp_path / "absent.yml"))
    (tmp_path / "bad.yml").write_text("tls_server_config: [\n")
    with pytest.raises(WebConfigError, match="not valid YAML"):
        web_config.load(str(tmp_path / "bad.yml"))
    missing = write_web_config(tmp_path, {"tls_server_config": tls_section()})  # no certificates there
    with pytest.raises(WebConfigError, match=r"'tls_server_config.cert_file/key_file': cannot read"):
        web_config.load(missing)
    (tmp_path / "server.crt").write_text("not a certificate\n")
    (tmp_path / "server.key").write_text("not a key\n")
    with pytest.raises(WebConfigError, match="not a usable certificate or key"):
        web_config.load(missing)
    swapped = write_web_config(certs, {"tls_server_config": tls_section(key_file="client.key")}, "swap.yml")
    with pytest.raises(WebConfigError, match="not a usable certificate or key"):  # key of another cert
        web_config.load(swapped)


def test_users_without_bcrypt_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bcrypt", None)  # import bcrypt now raises ImportError
    with pytest.raises(WebConfigError, match=r"'basic_auth_users' needs the bcrypt package .*\[web\]"):
        web_config.parse({"basic_auth_users": {"prometheus": PASSWORD_HASH}}, str(tmp_path / "w.yml"))
    assert web_config.parse({"tls_server_config": tls_section()}, "w.yml").users == {}  # TLS alone is fine


def test_web_config_file_is_a_config_key(tmp_path):
    assert Config().web_config_file == ""
    from flare_exporter import config

    loaded = config.load(flags={}, environ={"FLARE_WEB_CONFIG_FILE": "/etc/flare/web.yml"})
    assert loaded.web_config_file == "/etc/flare/web.yml"


# ---------------------------------------------------------------------------------------------------------
# basic auth


def header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth_accepts_the_user_and_caches_the_success():
    auth = BasicAuth({"prometheus": PASSWORD_HASH.encode()})
    assert auth.check(header("prometheus", PASSWORD))
    assert auth.check(header("prometheus", PASSWORD))
    assert auth.check(header("prometheus", PASSWORD))
    assert auth.bcrypt_checks == 1  # bcrypt once; then the cache


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        header("prometheus", "wrong"),
        header("someone", PASSWORD),
        "Bearer abc",
        "Basic !!!not-base64",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        header("prometheus", PASSWORD + "\0"),
        "Basic " + "A" * 10000,
    ],
)
def test_basic_auth_refuses(value):
    auth = BasicAuth({"prometheus": PASSWORD_HASH.encode()})
    assert not auth.check(value)
    assert not auth.check(value)  # failures are never cached as successes


def test_wrong_passwords_are_not_cached():
    auth = BasicAuth({"prometheus": PASSWORD_HASH.encode()})
    for _ in range(3):
        assert not auth.check(header("prometheus", "wrong"))
    assert auth.bcrypt_checks == 3
    assert not auth.check(header("nobody", "x"))  # an unknown user costs a bcrypt check too
    assert auth.bcrypt_checks == 4


def test_cache_is_bounded():
    users = {name: bcrypt.hashpw(name.encode(), bcrypt.gensalt(rounds=4)) for name in ("a", "b", "c")}
    auth = BasicAuth(users, cache_size=2)
    for name in ("a", "b", "c"):
        assert auth.check(header(name, name))
    assert len(auth._passed) == 2 and auth.bcrypt_checks == 3
    assert auth.check(header("c", "c")) and auth.bcrypt_checks == 3  # cached
    assert auth.check(header("a", "a")) and auth.bcrypt_checks == 4  # the oldest was evicted


# ---------------------------------------------------------------------------------------------------------
# the endpoint, through a real TLS client


def test_tls_and_basic_auth_endpoint(secured_server, certs):
    context = client_context(certs)
    status, headers, _ = get(secured_server.port, "/metrics", context)
    assert status == 401 and headers["WWW-Authenticate"] == "Basic"
    assert get(secured_server.port, "/metrics", context, "prometheus", "wrong")[0] == 401
    assert get(secured_server.port, "/healthz", context)[0] == 401  # every path needs the credentials
    status, headers, body = get(secured_server.port, "/metrics", context, "prometheus", PASSWORD)
    assert status == 200
    assert b'flare_steps_total{rank="3",run="run-1"} 12\n' in body
    assert headers["X-Frame-Options"] == "deny"
    assert get(secured_server.port, "/healthz", context, "prometheus", PASSWORD)[:3:2] == (200, b"ok\n")
    assert get(secured_server.port, "/debug", context, "prometheus", PASSWORD)[0] == 404
    assert get(secured_server.port, "/metrics", context, "prometheus", PASSWORD, method="POST")[0] == 405
    # a client certificate is verified when given (VerifyClientCertIfGiven)
    with_cert = client_context(certs, with_cert=True)
    assert get(secured_server.port, "/metrics", with_cert, "prometheus", PASSWORD)[0] == 200
    assert (
        secured_server.auth is not None and secured_server.auth.bcrypt_checks == 2
    )  # right once, wrong once


def test_plain_http_and_silent_clients_do_not_stop_the_tls_endpoint(secured_server, certs):
    with socket.create_connection(("127.0.0.1", secured_server.port), timeout=10) as plain:
        plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        try:
            answer = plain.recv(65536)
        except ConnectionResetError:
            answer = b""
        assert b"flare_steps_total" not in answer  # a TLS alert, a reset or nothing; never the metrics
    # a client that connects and never starts the handshake holds one connection thread, not the endpoint
    with socket.create_connection(("127.0.0.1", secured_server.port), timeout=10):
        status, _, body = get(secured_server.port, "/metrics", client_context(certs), "prometheus", PASSWORD)
        assert status == 200 and b"flare_steps_total" in body


def test_client_certificate_required(certs):
    path = write_web_config(certs, {"tls_server_config": tls_section("RequireAndVerifyClientCert")}, "m.yml")
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0, web_config_file=path)
    assert server is not None
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            get(server.port, "/metrics", client_context(certs))  # no client certificate
        status, _, body = get(server.port, "/metrics", client_context(certs, with_cert=True))
        assert status == 200 and b"flare_steps_total" in body
    finally:
        server.close()


def test_min_version_refuses_older_clients(certs):
    path = write_web_config(certs, {"tls_server_config": tls_section(min_version="TLS13")}, "v.yml")
    server = serve(make_registry(StepsCollector()), "127.0.0.1", 0, rank=0, web_config_file=path)
    assert server is not None
    try:
        old = client_context(certs, maximum_version=ssl.TLSVersion.TLSv1_2)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            get(server.port, "/metrics", old)
        assert get(server.port, "/metrics", client_context(certs))[0] == 200
    finally:
        server.close()


def test_invalid_web_config_serves_nothing_and_says_why(tmp_path, caplog):
    path = write_web_config(tmp_path, {"tls_server_config": {"cert_file": "x.crt"}})
    with caplog.at_level(logging.WARNING, logger="flare_exporter"):
        assert serve(make_registry(), "127.0.0.1", 0, rank=4, web_config_file=path) is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "flare_exporter"]
    assert len(warnings) == 1
    assert path in warnings[0] and "'tls_server_config.key_file'" in warnings[0]
    assert "rank 4 serves no metrics, training continues" in warnings[0]


# ---------------------------------------------------------------------------------------------------------
# scraping secured ranks: flare's own client, and a real Prometheus


@pytest.fixture
def secured_rank(certs):
    """A rank's real registry, served with TLS, verified client certificates and basic auth."""
    path = write_web_config(
        certs,
        {
            "tls_server_config": tls_section("RequireAndVerifyClientCert"),
            "basic_auth_users": {"prometheus": PASSWORD_HASH},
        },
        "rank.yml",
    )
    identity = RankIdentity(rank=0, local_rank=0, world_size=1, run="secured", host="node-0", pid=os.getpid())
    state = FlareState.create(Config(), identity)
    server = serve(build_registry(state), "127.0.0.1", 0, rank=0, web_config_file=path)
    assert server is not None
    yield identity, server
    server.close()


def test_cli_scrapes_a_secured_rank(secured_rank, certs, tmp_path, monkeypatch, capsys):
    identity, server = secured_rank
    targets = tmp_path / "hosts.txt"
    targets.write_text(f"127.0.0.1:{server.port}\n")
    tls = ["--ca-file", str(certs / "ca.crt"), "--cert-file", str(certs / "client.crt")]
    tls += ["--key-file", str(certs / "client.key")]
    monkeypatch.setenv(cli.PASSWORD_ENV, PASSWORD)
    code = cli.main(["ranks", "--targets", str(targets), *tls, "--basic-auth-user", "prometheus", "--json"])
    assert code == cli.EXIT_OK, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == "secured" and report["ranks_seen"] == 1
    # without the password the rank does not answer: nothing to decide on
    monkeypatch.setenv(cli.PASSWORD_ENV, "wrong")
    code = cli.main(["ranks", "--targets", str(targets), *tls, "--basic-auth-user", "prometheus"])
    assert code == cli.EXIT_UNDECIDED
    monkeypatch.delenv(cli.PASSWORD_ENV)
    assert cli.main(["ranks", "--targets", str(targets), *tls, "--basic-auth-user", "prometheus"]) == 2
    assert cli.PASSWORD_ENV in capsys.readouterr().err
    assert cli.main(["ranks", "--targets", str(targets), "--ca-file", str(tmp_path / "absent.crt")]) == 2
    assert "CA file" in capsys.readouterr().err


def test_scrape_client_reports_refusal_as_scrape_error(secured_rank, certs):
    _, server = secured_rank
    via = scrape.client("https", str(certs / "ca.crt"))  # no client certificate
    with pytest.raises(scrape.ScrapeError, match=f"127.0.0.1:{server.port}: cannot scrape"):
        scrape.scrape(f"127.0.0.1:{server.port}", 5, via)


@pytest.mark.prometheus
def test_real_prometheus_scrapes_a_secured_rank(secured_rank, certs, tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    identity, server = secured_rank
    targets = tmp_path / "targets"
    assert file_sd.write_target(str(targets), identity, "127.0.0.1", server.port)
    options = {
        "scheme": "https",
        "tls_config": {
            "ca_file": str(certs / "ca.crt"),
            "cert_file": str(certs / "client.crt"),
            "key_file": str(certs / "client.key"),
        },
        "basic_auth": {"username": "prometheus", "password": PASSWORD},
    }
    with PrometheusProcess(str(tmp_path / "prometheus"), str(targets), scrape_options=options) as prometheus:
        up = wait_for(
            lambda: prometheus.query('up{job="flare",run="secured"} == 1'),
            60,
            "Prometheus to scrape over TLS",
        )
        assert up[0]["metric"]["rank"] == "0"
        steps = prometheus.query('flare_rank_info{run="secured",rank="0"}')
        assert steps and steps[0]["metric"]["host"] == "node-0"
    assert server.auth is not None and server.auth.bcrypt_checks == 1  # every later scrape hit the cache
