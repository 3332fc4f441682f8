"""The rank's HTTP(S) transport: one thread, a selector loop, a WSGI app answered in place.

A thread per connection and wsgiref's request machinery cost a rank ~0.25 ms of interpreter time per
scrape, taken from the training thread through the GIL; this loop costs a few tens of µs (the rest is
system calls, which release the GIL). Scrapers are few and requests small, so one thread serves them all:

- each connection is non-blocking and owns a deadline (accept + `timeout`) for its TLS handshake, request
  and response together; a client that goes silent is closed at its deadline, never waited for;
- at most `max_connections` at once; beyond that a connection is closed unanswered and counted;
- a request is its head only (GET has no body), at most MAX_REQUEST_BYTES; the app sees a minimal WSGI
  environ (method, path, query, HTTP_* headers) and its answer is sent with Content-Length;
- an app's answer may be a `Response`, whose `sent` is called once it has been sent in full (the
  exposition records when each scrape completed: a dying rank waits for one, see last_word.py);
- an HTTP/1.1 connection is kept alive for the next request (Prometheus keeps its scrape connections
  open: no TCP or TLS handshake per scrape), with a fresh deadline, unless the client says
  `Connection: close`; an HTTP/1.0 one is closed after its answer.

The loop sleeps in select() until a connection, a byte or a deadline: an idle endpoint costs nothing.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from .exporter_health import ExporterHealth

MAX_REQUEST_BYTES = 16384  # a request head longer than this is answered 431 and closed
# Connections served at once; beyond it a connection is closed unanswered and counted as dropped, so a
# flood of connections costs the rank bounded memory.
MAX_CONNECTIONS = 64
# A connection's TLS handshake, request and response must all finish within this, so a client that
# connects and goes silent holds a connection slot for a while, never the endpoint.
REQUEST_TIMEOUT_SECONDS = 10.0
READ_BYTES = 65536

App = Callable[[dict[str, str], Callable[..., Any]], Iterable[bytes]]


class Response(list[bytes]):
    """A WSGI response body that wants to know when it has been sent: HttpServer calls `sent()` once its
    last byte is handed to the kernel, not if the connection ends before (any other server sees a list)."""

    def __init__(self, chunks: Iterable[bytes], sent: Callable[[], None]) -> None:
        super().__init__(chunks)
        self.sent = sent


class _Connection:
    __slots__ = ("sock", "request", "response", "deadline", "handshaking", "keep_alive", "on_sent")

    def __init__(self, sock: socket.socket, deadline: float, handshaking: bool) -> None:
        self.sock = sock
        self.request = b""
        self.response: bytes | None = None  # set once the request is answered; what is left to send
        self.deadline = deadline
        self.handshaking = handshaking
        self.keep_alive = False  # after this answer, wait for the next request
        self.on_sent: Callable[[], None] | None = None  # the answer's Response.sent, once it is sent


class HttpServer:
    """Serves `app` on (addr, port) from its own daemon thread, until close()."""

    def __init__(
        self,
        addr: str,
        port: int,
        app: App,
        ssl_context: ssl.SSLContext | None = None,
        health: ExporterHealth | None = None,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        self.app = app
        self.ssl_context = ssl_context
        self.health = health or ExporterHealth()
        self.max_connections = max_connections
        self.timeout = timeout
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((addr, port))
            self.listener.listen(128)
        except BaseException:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.connections: dict[socket.socket, _Connection] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flare-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        try:
            self._wake_writer.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for connection in list(self.connections.values()):
            self._close(connection)
        for sock in (self.listener, self._wake_reader, self._wake_writer):
            sock.close()
        self._selector.close()

    # --- the loop (its own thread only) ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            try:
                events = self._selector.select(self._until_next_deadline())
                for key, _ in events:
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is not self._wake_reader:
                        self._serve(key.data)
                self._expire()
            except Exception as error:  # the endpoint outlives any one bad connection
                self.health.error("http_server", error)

    def _until_next_deadline(self) -> float | None:
        if not self.connections:
            return None
        return max(0.0, min(c.deadline for c in self.connections.values()) - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # e.g. out of file descriptors: count it, keep serving the others
                self.health.error("http_accept", error)
                return
            if len(self.connections) >= self.max_connections:
                self.health.drop("http_connections")
                sock.close()
                continue
            sock.setblocking(False)
            handshaking = self.ssl_context is not None
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            connection = _Connection(sock, time.monotonic() + self.timeout, handshaking)
            self.connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _serve(self, connection: _Connection) -> None:
        sock = connection.sock
        try:
            if connection.handshaking:
                sock.do_handshake()  # type: ignore[attr-defined]  # an SSLSocket
                connection.handshaking = False
            if connection.response is None:
                self._read(connection)
            while connection.response is not None:
                sent = sock.send(connection.response)
                connection.response = connection.response[sent:]
                if connection.response:
                    self._selector.modify(sock, selectors.EVENT_WRITE, connection)
                    return
                self._sent(connection)
                if not connection.keep_alive:
                    self._close(connection)
                    return
                connection.response = None  # answered: wait for the next request on this connection
                connection.deadline = time.monotonic() + self.timeout
                self._selector.modify(sock, selectors.EVENT_READ, connection)
                self._take_request(connection)  # one the client sent without waiting (pipelined)
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, connection)
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, connection)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as error:  # ssl.SSLError included: a plain-HTTP client, a bad or missing cert, a reset
            if connection.handshaking:
                self.health.error("http_tls_handshake", error)
            self._close(connection)

    def _sent(self, connection: _Connection) -> None:
        on_sent, connection.on_sent = connection.on_sent, None
        if on_sent is not None:
            try:
                on_sent()
            except Exception as error:
                self.health.error("http_sent", error)

    def _read(self, connection: _Connection) -> None:
        data = connection.sock.recv(READ_BYTES)
        if not data:  # the client left before its request was whole
            self._close(connection)
            return
        connection.request += data
        self._take_request(connection)

    def _take_request(self, connection: _Connection) -> None:
        """Answer the request at the head of the connection's buffer, if it is whole."""
        head, found, rest = connection.request.partition(b"\r\n\r\n")
        if found:
            connection.request = rest
            connection.response, connection.keep_alive, connection.on_sent = self._answer(head)
        elif len(connection.request) > MAX_REQUEST_BYTES:
            connection.response = _response("HTTP/1.0", "431 Request Header Fields Too Large", [], b"")
            connection.keep_alive = False

    def _answer(self, head: bytes) -> tuple[bytes, bool, Callable[[], None] | None]:
        """The response to one request head, whether the connection stays open after it, and what to call
        once it is sent (a Response's `sent`)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
            text = [("Content-Type", "text/plain")]
            return _response("HTTP/1.0", "400 Bad Request", text, b"bad request line\n"), False, None
        method, target, version = parts
        path, _, query = target.partition("?")
        environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        keep_alive = (
            version == "HTTP/1.1"
            and environ.get("HTTP_CONNECTION", "").lower() != "close"
            # a request with a body (never one we serve) is answered and closed, its body unread
            and environ.get("HTTP_CONTENT_LENGTH", "0") == "0"
            and "HTTP_TRANSFER_ENCODING" not in environ
        )
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            answer["status"], answer["headers"] = status, headers

        try:
            result = self.app(environ, start_response)
            body = b"".join(result)
        except Exception as error:
            self.health.error("http_app", error)
            text = [("Content-Type", "text/plain")]
            return _response(version, "500 Internal Server Error", text, b"error\n"), False, None
        on_sent = result.sent if isinstance(result, Response) else None
        return _response(version, answer["status"], answer["headers"], body, keep_alive), keep_alive, on_sent

    def _expire(self) -> None:
        now = time.monotonic()
        for connection in [c for c in self.connections.values() if c.deadline <= now]:
            self._close(connection)

    def _close(self, connection: _Connection) -> None:
        if self.connections.pop(connection.sock, None) is not None:
            try:
                self._selector.unregister(connection.sock)
            except (KeyError, ValueError):
                pass
        try:
            connection.sock.close()
        except OSError:
            pass


def _response(
    version: str, status: str, headers: list[tuple[str, str]], body: bytes, keep_alive: bool = False
) -> bytes:
    lines = [f"{version} {status}", *(f"{name}: {value}" for name, value in headers)]
    lines += [
        f"Content-Length: {len(body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        "",
        "",
    ]
    return "\r\n".join(lines).encode("latin-1") + body
