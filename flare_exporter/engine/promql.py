"""A small client for the Prometheus HTTP API (instant and range queries), with one-line errors.

A Prometheus is named by its base URL, or by a `Connection` where it is secured (TLS with a private CA or a
client certificate, basic auth, a bearer token, headers such as Thanos's or Mimir's X-Scope-OrgID): `connect`
builds one from the `flare` flags that name them (cli._add_prometheus_arguments). A VictoriaMetrics store is
asked for its newest samples, which it would otherwise hold back for its latency offset (see _data).
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused the query; the message says which and why."""


@dataclass(frozen=True)
class Connection:
    """How to ask one Prometheus: its base URL, the headers every request carries (credentials, a tenant),
    the TLS context of an https URL (None: the system's CAs) and what the credentials are, for the message
    of a 401 or 403."""

    url: str
    headers: tuple[tuple[str, str], ...] = ()
    context: ssl.SSLContext | None = None
    credentials: str = "no credentials"

    def __str__(self) -> str:
        return self.url


Prometheus: TypeAlias = "str | Connection"  # a base URL (no credentials), or a Connection


def connection(prometheus: Prometheus) -> Connection:
    """`prometheus` as a Connection (a plain base URL: no headers, the system's CAs)."""
    return prometheus if isinstance(prometheus, Connection) else Connection(prometheus)


def query(
    prometheus: Prometheus, expr: str, timeout: float = 10.0, at: float | None = None
) -> list[dict[str, Any]]:
    """The result vector of an instant query: [{"metric": {labels}, "value": [ts, "v"]}, ...]."""
    params = {"query": expr}
    if at is not None:
        params["time"] = repr(at)
    return _api(prometheus, "query", params, timeout)


def query_range(
    prometheus: Prometheus, expr: str, start: float, end: float, step: float, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The result matrix of a range query: [{"metric": {labels}, "values": [[ts, "v"], ...]}, ...]."""
    params = {"query": expr, "start": repr(start), "end": repr(end), "step": repr(step)}
    return _api(prometheus, "query_range", params, timeout)


def label_values(
    prometheus: Prometheus, label: str, match: str, start: float, end: float, timeout: float = 10.0
) -> list[str]:
    """The values of `label` on the series that `match` selects with samples from `start` to `end`, from
    Prometheus's index: no sample is read. Prometheus may name values of series whose samples all lie
    before `start` (those of its in-memory head, the last two hours or so)."""
    params = {"match[]": match, "start": repr(start), "end": repr(end)}
    asked = f"the values of {label} on {match}"
    found = _data(prometheus, f"label/{label}/values", params, timeout, asked)
    if not isinstance(found, list):
        raise PrometheusError(f"Prometheus at {prometheus} answered {asked} without a list")
    return [str(value) for value in found]


def urlopen(prometheus: Prometheus, path: str, timeout: float) -> Any:
    """The response to GET <base URL><path>, with the connection's headers and TLS context; ValueError if
    the base URL is not one, urllib's errors as urllib raises them. A redirect to another scheme://host:port
    is followed without the headers (credentials, tenant), which go to the connection's origin only."""
    where = connection(prometheus)
    request = urllib.request.Request(where.url.rstrip("/") + path, headers=dict(where.headers))
    handlers: list[urllib.request.BaseHandler] = [_SameOriginHeaders()]
    if where.context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=where.context))
    return urllib.request.build_opener(*handlers).open(request, timeout=timeout)


class _SameOriginHeaders(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, less the request's headers where one leaves the origin (urllib keeps them: an
    auth proxy that sends a client to its login page elsewhere would be handed the bearer token)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        there = _origin(new.full_url)
        if there is None or there != _origin(req.full_url):
            new.headers.clear()
            new.unredirected_hdrs.clear()
        return new


def _origin(url: str) -> tuple[str, str | None, int | None] | None:
    """(scheme, host, port) of `url`; None where its port is not one (no origin is equal to it)."""
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.scheme, parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _api(
    prometheus: Prometheus, endpoint: str, params: dict[str, str], timeout: float
) -> list[dict[str, Any]]:
    """The `result` of a query at /api/v1/<endpoint>; PrometheusError (one line) for every way it fails."""
    expr = params["query"]
    data = _data(prometheus, endpoint, params, timeout, repr(expr))
    if not isinstance(data, dict) or not isinstance(data.get("result"), list):
        raise PrometheusError(f"Prometheus at {prometheus} answered {expr!r} without a result list")
    return list(data["result"])


# VictoriaMetrics answers a query at a time within its -search.latencyOffset of now (30 s by default; 1.79
# takes no less than 1 s) with its samples of that much earlier, unless the query says nocache=1: flare's
# "now" would be half a minute old, and a collective then in flight would look hung for half a minute more.
# It names itself in every answer's X-Server-Hostname header, which Prometheus does not send. Before its
# first request to a store, flare asks it `time()` to see whether it does: a store that does is asked with
# nocache=1. What flare sends a store that does not
# (Prometheus) is unchanged. Asking each first query again instead had doubled a diagnosis's first round
# (7 queries at once) against VictoriaMetrics.
STORE_HEADER = "X-Server-Hostname"
FRESH = {"nocache": "1"}
PROBE = {"query": "time()"}
_holds_back: dict[str, bool] = {}  # base URL -> whether the store holds back its newest samples


def _data(prometheus: Prometheus, endpoint: str, params: dict[str, str], timeout: float, asked: str) -> Any:
    """The `data` of /api/v1/<endpoint>, asked for `asked` (named in errors), with the newest samples of a
    store that would hold them back (_holds_back); PrometheusError (one line) for every way it can fail."""
    where = connection(prometheus)
    fresh = _store_holds_back(where, timeout, asked)
    body, _ = _answer(where, endpoint, params | FRESH if fresh else params, timeout, asked)
    if not isinstance(body, dict) or body.get("status") != "success":
        why = body.get("error", "unknown error") if isinstance(body, dict) else "not an API answer"
        raise PrometheusError(f"Prometheus at {where.url} failed {asked}: {why}")
    return body.get("data")


def _store_holds_back(where: Connection, timeout: float, asked: str) -> bool:
    """Whether the store at `where` holds back its newest samples (names itself as VictoriaMetrics does):
    asked (PROBE) until one answer says; its errors are those of `asked`. Threads that ask at once each
    probe, so that a store that does not answer keeps none waiting for another's timeout."""
    known = _holds_back.get(where.url)
    if known is None:
        _, known = _answer(where, "query", PROBE, timeout, asked)
        _holds_back[where.url] = known
    return known


def _answer(
    where: Connection, endpoint: str, params: dict[str, str], timeout: float, asked: str
) -> tuple[Any, bool]:
    """The JSON answer of /api/v1/<endpoint>, and whether it came from a store that names itself as
    VictoriaMetrics does (STORE_HEADER); PrometheusError (one line) where there is none."""
    try:
        response = urlopen(where, f"/api/v1/{endpoint}?" + urllib.parse.urlencode(params), timeout)
    except urllib.error.HTTPError as error:
        raise _rejected(where, asked, error) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", error)
        hint = (
            "; name its CA with --prometheus-ca-file"
            if isinstance(reason, ssl.SSLCertVerificationError)
            else ""
        )
        raise PrometheusError(f"cannot reach Prometheus at {where.url}: {reason}{hint}") from None
    except ValueError as error:  # before any request: the base URL is not one
        raise PrometheusError(f"Prometheus at {where.url}: not an http(s) URL ({error})") from None
    try:
        with response:
            return json.load(response), response.headers.get(STORE_HEADER) is not None
    except (OSError, TimeoutError) as error:
        raise PrometheusError(f"cannot reach Prometheus at {where.url}: {error}") from None
    except ValueError:
        raise PrometheusError(f"Prometheus at {where.url} answered with something that is not JSON") from None


def _rejected(where: Connection, asked: str, error: urllib.error.HTTPError) -> PrometheusError:
    """The one-line error of an HTTP error answer: authentication (401, 403) or the API's own error."""
    if error.code in (401, 403):
        status = f"HTTP {error.code} {error.reason}"
        return PrometheusError(
            f"Prometheus at {where.url}: authentication failed ({status}; sent {where.credentials})"
        )
    try:
        detail = json.load(error).get("error", error.reason)
    except (ValueError, AttributeError, OSError):
        detail = error.reason
    return PrometheusError(f"Prometheus at {where.url} rejected {asked}: {detail}")


def values_by(results: list[dict[str, Any]], label: str) -> dict[str, float]:
    """{label value: sample value} for a query result (e.g. by rank)."""
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in results}


# ---------------------------------------------------------------------------------------------------------
# a secured Prometheus, from the flags that name how to ask it

PASSWORD_ENV = "FLARE_PROMETHEUS_PASSWORD"
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)


@dataclass(frozen=True)
class Access:
    """The flags of a secured Prometheus (file names as given; `password` from PASSWORD_ENV)."""

    headers: Sequence[str] = ()  # --header 'Name: value'
    bearer_token_file: str = ""
    user: str = ""
    password_file: str = ""
    password: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""


class AccessError(PrometheusError):
    """A flag of a secured Prometheus that cannot be used; the message names the flag (one line)."""


def connect(url: str, access: Access = Access()) -> Connection:
    """The Connection to the Prometheus at `url` that `access` describes; AccessError (one line, naming the
    flag and the file) for a URL that is not http(s)://host..., a header that is not `Name: value`, a file
    that cannot be read or loaded, and flags that do not go together."""
    scheme = _checked_url(url)
    headers = [_header(text) for text in access.headers]
    authorization, credentials = _authorization(access)
    if authorization:
        if any(name.lower() == "authorization" for name, _ in headers):
            raise AccessError("flag --header: Authorization is already set by the credentials' flags")
        headers.append(("Authorization", authorization))
    tls = [flag for flag, path in _tls_files(access) if path]
    if tls and scheme != "https":
        raise AccessError(f"flag {tls[0]}: for an https:// Prometheus, and {url!r} is not one")
    context = _tls_context(access) if tls else None
    return Connection(url, tuple(headers), context, credentials)


def _checked_url(url: str) -> str:
    """The scheme of `url`, a base URL http(s)://host[:port][/path]; AccessError otherwise."""
    example = "e.g. http://localhost:9090"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError as error:
        raise AccessError(f"flag --prometheus: {url!r} is not a URL ({error}; {example})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AccessError(f"flag --prometheus: {url!r} is not an http(s)://host URL ({example})")
    if parts.username is not None or parts.query or parts.fragment:
        raise AccessError(
            f"flag --prometheus: {parts.scheme}://{parts.hostname}...: a base URL has no user, query or"
            " fragment (credentials go in --prometheus-user or --bearer-token-file)"
        )
    return parts.scheme


def _header(text: str) -> tuple[str, str]:
    """('Name', 'value') of `--header 'Name: value'`; AccessError otherwise."""
    name, colon, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not colon or not HEADER_NAME.fullmatch(name) or not value or any(c in value for c in "\r\n\0"):
        raise AccessError(f"flag --header: {text!r} is not 'Name: value' (e.g. 'X-Scope-OrgID: tenant-1')")
    return name, value


def _authorization(access: Access) -> tuple[str, str]:
    """The Authorization header the credentials' flags make ('' for none), and what it is, in words."""
    if access.password_file and not access.user:
        raise AccessError("flag --prometheus-password-file: the password of --prometheus-user, not given")
    if access.bearer_token_file and access.user:
        raise AccessError("flag --bearer-token-file: give a bearer token or --prometheus-user, not both")
    if access.bearer_token_file:
        token = _secret(access.bearer_token_file, "--bearer-token-file")
        return f"Bearer {token}", f"a bearer token from {access.bearer_token_file}"
    if not access.user:
        return "", "no credentials"
    if ":" in access.user:
        raise AccessError(f"flag --prometheus-user: {access.user!r}: a basic auth user name holds no ':'")
    if access.password_file:
        password = _secret(access.password_file, "--prometheus-password-file")
    elif access.password:
        password = access.password
    else:
        raise AccessError(
            f"flag --prometheus-user: give its password in --prometheus-password-file or {PASSWORD_ENV}"
        )
    token = base64.b64encode(f"{access.user}:{password}".encode()).decode("ascii")
    return f"Basic {token}", f"basic auth as user {access.user!r}"


def _secret(path: str, flag: str) -> str:
    """The one line file `path` holds (a token, a password), without its line end; AccessError otherwise."""
    text = _read(path, flag).decode("utf-8", errors="replace").strip("\r\n")
    if not text or any(c in text for c in "\r\n\0"):
        raise AccessError(
            f"flag {flag}: {path} must hold one line (the secret), not {'none' if not text else 'several'}"
        )
    return text


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise AccessError(f"flag {flag}: cannot read {path} ({error.strerror or error})") from None


def _tls_files(access: Access) -> list[tuple[str, str]]:
    """(flag, file) of each TLS file."""
    return [
        ("--prometheus-ca-file", access.ca_file),
        ("--prometheus-cert-file", access.cert_file),
        ("--prometheus-key-file", access.key_file),
    ]


def _tls_context(access: Access) -> ssl.SSLContext:
    """The TLS context of the TLS files' flags: the CA that signed Prometheus's certificate (the system's
    CAs where none is named), the client certificate and its key where named."""
    if access.key_file and not access.cert_file:
        raise AccessError("flag --prometheus-key-file: the key of --prometheus-cert-file, not given")
    for flag, path in _tls_files(access):
        if path:
            _read(path, flag)  # a missing file named by its own flag
    try:
        context = ssl.create_default_context(cafile=access.ca_file or None)
    except (OSError, ssl.SSLError) as error:
        raise AccessError(
            f"flag --prometheus-ca-file: {access.ca_file} holds no CA certificate ({error})"
        ) from None
    if access.cert_file:
        try:
            context.load_cert_chain(access.cert_file, access.key_file or None)
        except (OSError, ssl.SSLError) as error:
            key = f" and {access.key_file}" if access.key_file else ""
            what = f"{access.cert_file}{key}: no client certificate and its key"
            raise AccessError(f"flag --prometheus-cert-file: {what} ({error})") from None
    return context
