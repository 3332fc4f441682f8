"""The one-thread HTTP transport: requests in pieces, bad and oversized requests, silent clients, load."""

from __future__ import annotations

import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from flare_exporter.local.prometheus import wait_for
from flare_exporter.rank.exporter_health import ExporterHealth
from flare_exporter.rank.http_server import MAX_REQUEST_BYTES, HttpServer


def echo_app(environ, start_response):
    """Answers with what it was asked: method, path, query and the Accept-Encoding header."""
    start_response("200 OK", [("Content-Type", "text/plain")])
    fields = (environ["REQUEST_METHOD"], environ["PATH_INFO"], environ["QUERY_STRING"])
    return [" ".join(fields).encode(), b" ", environ.get("HTTP_ACCEPT_ENCODING", "-").encode()]


@pytest.fixture
def server():
    health = ExporterHealth()
    server = HttpServer("127.0.0.1", 0, echo_app, health=health, max_connections=8, timeout=1.0)
    yield server
    server.close()


def exchange(port: int, *pieces: bytes, pause: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause)  # a slow client: the request arrives in pieces
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_an_http_1_0_request_is_answered_with_its_length_and_the_connection_closed(server):
    answer = exchange(server.port, b"GET /metrics?x=1 HTTP/1.0\r\nAccept-Encoding: gzip\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n")
    assert b"Connection: close" in head and f"Content-Length: {len(body)}".encode() in head
    assert body == b"GET /metrics x=1 gzip"


def test_an_http_1_1_connection_is_kept_for_the_next_requests_until_it_says_close(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /one HTTP/1.1\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: keep-alive" in first
        assert first.endswith(b"GET /one  -")
        # two more at once (pipelined), the last asking to close: both answered in order, then EOF
        sock.sendall(b"GET /two HTTP/1.1\r\n\r\nGET /three HTTP/1.1\r\nConnection: close\r\n\r\n")
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    assert rest.count(b"HTTP/1.1 200 OK") == 2
    assert rest.index(b"GET /two") < rest.index(b"GET /three") and rest.endswith(b"GET /three  -")
    assert b"Connection: close" in rest.split(b"GET /two  -")[1]


def test_a_request_with_a_body_is_answered_and_closed_its_body_never_read_as_a_request(server):
    body = b"GET /smuggled HTTP/1.1\r\n\r\n"
    request = b"POST /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    answer = exchange(server.port, request)
    assert answer.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in answer
    assert answer.endswith(b"POST /metrics  -") and b"smuggled" not in answer


def test_a_request_in_pieces_is_answered_once_whole(server):
    answer = exchange(
        server.port, b"GET /a", b"%20b HTTP/1.0\r\nAccept-", b"Encoding: br\r\n\r\n", pause=0.05
    )
    assert answer.endswith(b"GET /a b  br")


def test_a_bad_request_line_is_400_and_an_oversized_head_431(server):
    assert exchange(server.port, b"HELLO\r\n\r\n").startswith(b"HTTP/1.0 400")
    assert exchange(server.port, b"GET / HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.0 400")
    oversized = b"GET / HTTP/1.1\r\nX-Filler: " + b"a" * MAX_REQUEST_BYTES
    assert exchange(server.port, oversized).startswith(b"HTTP/1.0 431")


def test_a_silent_client_is_closed_at_its_deadline_and_others_are_served_meanwhile(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as silent:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/x", timeout=5) as response:
            assert response.read() == b"GET /x  identity"
        assert silent.recv(10) == b""  # closed by the server: its 1 s deadline passed
        assert 0.9 <= time.monotonic() - started < 5
    assert wait_for(lambda: not server.connections, 5, "the silent connection to be forgotten")


def test_connections_beyond_the_limit_are_closed_and_counted(server):
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(8)]
    try:
        wait_for(lambda: len(server.connections) == 8, 5, "eight held connections")
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            extra.sendall(b"GET / HTTP/1.1\r\n\r\n")
            try:
                answer = extra.recv(10)
            except ConnectionResetError:  # closed with the request unread: the kernel resets, not FIN
                answer = b""
            assert answer == b""
        assert server.health.dropped["http_connections"] == 1
    finally:
        for sock in held:
            sock.close()


def test_many_concurrent_clients_are_all_answered(server):
    def fetch(index: int) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/n?{index}", timeout=10) as response:
            return response.read()

    with ThreadPoolExecutor(max_workers=6) as pool:  # under the limit of 8
        answers = list(pool.map(fetch, range(300)))
    assert answers == [f"GET /n {index} identity".encode() for index in range(300)]
    assert server.health.errors == {} and server.health.dropped == {}


def test_an_app_that_raises_is_a_500_and_counted():
    def broken(environ, start_response):
        raise RuntimeError("collector state")

    server = HttpServer("127.0.0.1", 0, broken)
    try:
        assert exchange(server.port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")
        assert server.health.errors["http_app"] == 1
    finally:
        server.close()


def test_close_stops_the_thread_and_frees_the_port():
    server = HttpServer("127.0.0.1", 0, echo_app)
    port = server.port
    server.close()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
