"""TLS and basic auth for the endpoint, from a Prometheus exporter-toolkit web config file.

The file has the format of node_exporter's `--web.config.file` (`web-config.yml`):

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: ca.crt
      min_version: TLS12               # TLS10 .. TLS13; also max_version
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2b$12$...           # bcrypt hash (htpasswd -nBC 12 "" | tr -d ':\\n')

Keys flare cannot honour (`cipher_suites`, `curve_preferences`, inline `cert`/`key`, `client_allowed_sans`,
the client auth types that accept unverified certificates) are errors rather than silently ignored: a
security setting that is not applied must not look applied. Every error is a WebConfigError, one line
naming the file and the key. Parsing (`parse`) is apart from reading files and building the TLS context
(`load`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import ssl
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, read_yaml


class WebConfigError(ConfigError):
    """A web config file that cannot be used; the message names the file and the key."""


TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# exporter-toolkit keys that flare does not implement; using one is an error, never a silent no-op
UNSUPPORTED = {
    "tls_server_config": {"cert", "key", "cipher_suites", "curve_preferences", "client_allowed_sans"},
    "http_server_config": set(),
}
TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
TLS_KEYS |= {"prefer_server_cipher_suites"}  # accepted; a no-op in Go's TLS since 1.18 as well
HTTP_KEYS = {"headers", "http2"}  # http2: accepted; the endpoint speaks HTTP/1.x
# the response headers exporter-toolkit lets a web config set
ALLOWED_HEADERS = (
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
    "Content-Security-Policy",
)
BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")


@dataclass(frozen=True)
class TLSSettings:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = "TLS13"


@dataclass(frozen=True)
class WebConfig:
    """A parsed web config: TLS settings (None: plain HTTP), users and their bcrypt hashes, headers."""

    path: str
    tls: TLSSettings | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (reads the certificate files); WebConfigError if they are unusable."""
        return None if self.tls is None else _server_context(self.path, self.tls)

    def authenticator(self) -> BasicAuth | None:
        return BasicAuth(self.users) if self.users else None


def load(path: str) -> tuple[WebConfig, ssl.SSLContext | None]:
    """Read, check and apply the web config file at `path`: the config and its TLS context."""
    config = parse(read_yaml(path, "web config file", WebConfigError), path)
    return config, config.ssl_context()


def parse(document: Any, path: str) -> WebConfig:
    """A WebConfig from the YAML document of file `path` (relative file names resolve against it)."""
    where = f"web config file {path}"
    if document is None:
        return WebConfig(path)
    section = _mapping(document, where, "")
    _known(section, {"tls_server_config", "http_server_config", "basic_auth_users"}, where, "")
    tls = None
    if section.get("tls_server_config") is not None:
        tls = _tls(_mapping(section["tls_server_config"], where, "tls_server_config"), path)
    headers: dict[str, str] = {}
    if section.get("http_server_config") is not None:
        http = _mapping(section["http_server_config"], where, "http_server_config")
        _known(http, HTTP_KEYS, where, "http_server_config")
        if http.get("http2") is not None and not isinstance(http["http2"], bool):
            raise WebConfigError(f"{where}: key 'http_server_config.http2' must be true or false")
        for name, value in _mapping(http.get("headers") or {}, where, "http_server_config.headers").items():
            if name not in ALLOWED_HEADERS:
                raise WebConfigError(
                    f"{where}: key 'http_server_config.headers.{name}': only {', '.join(ALLOWED_HEADERS)} "
                    "may be set"
                )
            headers[name] = _string(value, where, f"http_server_config.headers.{name}")
    users: dict[str, bytes] = {}
    if section.get("basic_auth_users") is not None:
        for user, hashed in _mapping(section["basic_auth_users"], where, "basic_auth_users").items():
            key = f"basic_auth_users.{user}"
            text = _string(hashed, where, key)
            if ":" in str(user):
                raise WebConfigError(f"{where}: key {key!r}: a user name cannot contain ':'")
            if not text.startswith(BCRYPT_PREFIXES) or len(text) != 60:
                raise WebConfigError(f"{where}: key {key!r}: not a bcrypt hash ($2b$..., 60 characters)")
            users[str(user)] = text.encode("ascii", "replace")
        if users:
            _require_bcrypt(where)
    return WebConfig(path, tls, users, headers)


def _tls(section: dict[str, Any], path: str) -> TLSSettings:
    where = f"web config file {path}"
    _known(section, TLS_KEYS, where, "tls_server_config")
    values: dict[str, str] = {}
    directory = os.path.dirname(os.path.abspath(path))
    for key in ("cert_file", "key_file", "client_ca_file"):
        if section.get(key) not in (None, ""):
            values[key] = os.path.join(directory, _string(section[key], where, f"tls_server_config.{key}"))
    for key in ("cert_file", "key_file"):
        if key not in values:
            raise WebConfigError(f"{where}: key 'tls_server_config.{key}' is required")
    if section.get("client_auth_type") in ("RequestClientCert", "RequireAnyClientCert"):
        raise WebConfigError(
            f"{where}: key 'tls_server_config.client_auth_type': {section['client_auth_type']} is not "
            "supported (it accepts client certificates without verifying them)"
        )
    auth = _choice(section, "client_auth_type", CLIENT_AUTH_TYPES, "NoClientCert", where)
    if auth != "NoClientCert" and "client_ca_file" not in values:
        raise WebConfigError(f"{where}: key 'tls_server_config.client_ca_file' is required with {auth}")
    if auth == "NoClientCert" and "client_ca_file" in values:
        raise WebConfigError(
            f"{where}: key 'tls_server_config.client_ca_file' is set but client_auth_type is NoClientCert"
        )
    minimum = _choice(section, "min_version", TLS_VERSIONS, "TLS12", where)
    maximum = _choice(section, "max_version", TLS_VERSIONS, "TLS13", where)
    if TLS_VERSIONS[minimum] > TLS_VERSIONS[maximum]:
        raise WebConfigError(f"{where}: key 'tls_server_config.min_version' is above max_version")
    return TLSSettings(
        values["cert_file"], values["key_file"], auth, values.get("client_ca_file", ""), minimum, maximum
    )


def _server_context(path: str, tls: TLSSettings) -> ssl.SSLContext:
    where = f"web config file {path}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.minimum_version = TLS_VERSIONS[tls.min_version]
        context.maximum_version = TLS_VERSIONS[tls.max_version]
    except ValueError as error:  # a version this OpenSSL refuses
        raise WebConfigError(f"{where}: key 'tls_server_config.min_version': {error}") from None
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as error:
        key = "tls_server_config.cert_file/key_file"
        raise WebConfigError(f"{where}: key '{key}': {_reason(error)}") from None
    if tls.client_ca_file:
        try:
            context.load_verify_locations(tls.client_ca_file)
        except (OSError, ssl.SSLError) as error:
            key = "tls_server_config.client_ca_file"
            raise WebConfigError(f"{where}: key '{key}': {_reason(error)}") from None
    context.verify_mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    return context


def _reason(error: OSError) -> str:
    if isinstance(error, ssl.SSLError):
        return f"not a usable certificate or key ({error.reason or error})"
    return f"cannot read {error.filename or 'it'} ({error.strerror or error})"


def _require_bcrypt(where: str) -> None:
    try:
        import bcrypt  # noqa: F401
    except ImportError:
        raise WebConfigError(
            f"{where}: key 'basic_auth_users' needs the bcrypt package (pip install 'flare-exporter[web]')"
        ) from None


def _mapping(value: Any, where: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(name, (str, int)) for name in value):
        what = f"key {key!r}" if key else "the file"
        raise WebConfigError(f"{where}: {what} must be a mapping, got {type(value).__name__}")
    return {str(name): item for name, item in value.items()}


def _known(section: Mapping[str, Any], known: set[str], where: str, prefix: str) -> None:
    for name in section:
        full = f"{prefix}.{name}" if prefix else name
        if name in UNSUPPORTED.get(prefix, set()):
            raise WebConfigError(f"{where}: key {full!r} is not supported by flare-exporter")
        if name not in known:
            raise WebConfigError(f"{where}: unknown key {full!r}; known keys: {', '.join(sorted(known))}")


def _string(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value or "\n" in value:
        raise WebConfigError(f"{where}: key {key!r} must be a non-empty string on one line")
    return value


def _choice(
    section: Mapping[str, Any], key: str, choices: Mapping[str, Any], default: str, where: str
) -> str:
    value = section.get(key)
    if value is None:
        return default
    if value not in choices:
        raise WebConfigError(
            f"{where}: key 'tls_server_config.{key}': {value!r} is not one of {', '.join(choices)}"
        )
    return str(value)


class BasicAuth:
    """Checks `Authorization: Basic` headers against bcrypt hashes, remembering credentials that passed.

    bcrypt is slow by design (tens to hundreds of milliseconds a check), and Prometheus sends the same
    credentials on every scrape: as exporter-toolkit does, a successful check is cached (a bounded LRU of
    SHA-256 digests of user and password, never the password itself). Checks that reach bcrypt run one at a
    time, so a flood of wrong passwords costs the rank's host at most one core, never every core.
    """

    def __init__(self, users: Mapping[str, bytes], cache_size: int = 64) -> None:
        self.users = dict(users)
        self.cache_size = cache_size
        self.bcrypt_checks = 0  # how many checks reached bcrypt (tests read it)
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()  # scrape threads only; never the training thread
        self._decoy: bytes | None = None

    def check(self, header: str | None) -> bool:
        """Whether an Authorization header value carries the credentials of a configured user."""
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        user, password = credentials
        digest = hashlib.sha256(user + b"\0" + password).digest()
        with self._cache_lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return True
        import bcrypt

        hashed = self.users.get(user.decode("utf-8", "replace"))
        with self._bcrypt_lock:
            self.bcrypt_checks += 1
            # an unknown user costs a bcrypt check too, so that timing does not tell which users exist
            target = hashed or self._decoy_hash(bcrypt)
            try:
                matches = bool(bcrypt.checkpw(password, target)) and hashed is not None
            except ValueError:  # a password bcrypt refuses (e.g. a NUL byte)
                matches = False
        if matches:
            with self._cache_lock:
                self._passed[digest] = None
                while len(self._passed) > self.cache_size:
                    self._passed.popitem(last=False)
        return matches

    def _decoy_hash(self, bcrypt: Any) -> bytes:
        if self._decoy is None:
            some_hash = next(iter(self.users.values()))
            rounds = int(some_hash[4:6]) if some_hash[4:6].isdigit() else 10
            self._decoy = bcrypt.hashpw(b"decoy", bcrypt.gensalt(rounds=max(4, min(rounds, 31))))
        return self._decoy


def _basic_credentials(header: str | None) -> tuple[bytes, bytes] | None:
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic" or len(encoded) > 4096:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None
