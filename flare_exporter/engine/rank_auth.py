"""How the engine reaches ranks: scheme, TLS context (CA, client certificate) and basic auth."""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass

from .samples import ScrapeError


@dataclass(frozen=True)
class Client:
    """How to reach ranks: scheme, TLS context (CA, client certificate) and basic auth credentials."""

    scheme: str = "http"
    ssl_context: ssl.SSLContext | None = None
    username: str = ""
    password: str = ""

    def headers(self) -> dict[str, str]:
        if not self.username:
            return {}
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode("ascii")
        return {"Authorization": "Basic " + token}


def client(
    scheme: str = "http",
    ca_file: str = "",
    cert_file: str = "",
    key_file: str = "",
    username: str = "",
    password: str = "",
) -> Client:
    """A Client; ScrapeError naming the file if a CA or client certificate cannot be loaded."""
    context = None
    if scheme == "https":
        try:
            context = ssl.create_default_context(cafile=ca_file or None)
        except (OSError, ssl.SSLError) as error:
            raise ScrapeError(f"CA file {ca_file}: cannot load it ({error})") from None
        if cert_file:
            try:
                context.load_cert_chain(cert_file, key_file or None)
            except (OSError, ssl.SSLError) as error:
                raise ScrapeError(f"client certificate {cert_file}: cannot load it ({error})") from None
    elif scheme != "http":
        raise ScrapeError(f"scheme {scheme!r}: expected http or https")
    return Client(scheme, context, username, password)
