"""The direct scrape's HTTP client (engine/rank_client.py) against real sockets: addresses tried in turn,
names that do not resolve, answers in pieces, timeouts that hold no other rank back, more ranks than
exchanges at once."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from flare_exporter.engine import rank_client, scrape

PAGE = b'# TYPE flare_steps_total counter\nflare_steps_total{rank="0",run="r"} 7\n'


def _serve(answer: bytes, pieces: int = 1, close: bool = True) -> tuple[socket.socket, str]:
    """A listener that answers every connection with `answer`, written in `pieces` parts, then closes
    (or, with close=False, keeps the connection open and silent)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # the test closed the listener
                return
            connection.recv(65536)
            size = -(-len(answer) // pieces)
            for start in range(0, len(answer), size):
                connection.sendall(answer[start : start + size])
            if close:
                connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def rank() -> Iterator[str]:
    listener, target = _serve(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE)
    yield target
    listener.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_each_address_of_a_host_is_tried_in_turn(rank, monkeypatch):
    port = int(rank.rsplit(":", 1)[1])
    addresses = [(socket.AF_INET, ("127.0.0.1", _closed_port())), (socket.AF_INET, ("127.0.0.1", port))]
    monkeypatch.setattr(rank_client, "_resolve", lambda name: list(addresses))
    samples = scrape.scrape(f"rank-host:{port}", timeout=5)
    assert scrape.value(samples, "flare_steps_total") == 7
    monkeypatch.setattr(rank_client, "_resolve", lambda name: addresses[:1])
    with pytest.raises(
        scrape.ScrapeError, match=r"rank-host:\d+: cannot scrape \(\[Errno \d+\] Connection refused\)"
    ):
        scrape.scrape(f"rank-host:{port}", timeout=5)


def test_a_name_that_does_not_resolve_is_that_rank_s_error_alone(rank):
    results = scrape.scrape_all(["no-such-rank.invalid:9400", rank, "node-1:port"], timeout=5)
    assert scrape.value(results[rank], "flare_steps_total") == 7  # type: ignore[arg-type]
    unresolved, bad = results["no-such-rank.invalid:9400"], results["node-1:port"]
    assert isinstance(unresolved, scrape.ScrapeError)
    assert str(unresolved).startswith("no-such-rank.invalid:9400: cannot scrape (")
    assert isinstance(bad, scrape.ScrapeError) and "not a host:port" in str(bad)


@pytest.mark.parametrize("length", [True, False])
def test_a_large_answer_in_many_pieces_is_read_whole(length):
    page = PAGE + b"".join(b'flare_x{rank="0",i="%d"} %d\n' % (i, i) for i in range(60000))
    head = b"HTTP/1.0 200 OK\r\n" + (b"Content-Length: %d\r\n" % len(page) if length else b"") + b"\r\n"
    listener, target = _serve(head + page, pieces=40)
    try:
        assert scrape.fetch(target, timeout=10).encode() == page
    finally:
        listener.close()


def test_a_silent_rank_times_out_without_holding_the_others(rank):
    listener, silent = _serve(b"HTTP/1.0 200 OK\r\nContent-Length: 999\r\n\r\npartial", close=False)
    try:
        results = scrape.scrape_all([silent, rank], timeout=0.5)
    finally:
        listener.close()
    assert str(results[silent]) == f"{silent}: cannot scrape (timed out)"
    assert scrape.value(results[rank], "flare_steps_total") == 7  # type: ignore[arg-type]


def test_more_ranks_than_exchanges_at_once_are_all_answered(rank):
    listeners = [_serve(b"HTTP/1.0 200 OK\r\n\r\n" + PAGE.replace(b"7", str(n).encode())) for n in range(12)]
    try:
        results = scrape.scrape_all([target for _, target in listeners], timeout=5, workers=3)
    finally:
        for listener, _ in listeners:
            listener.close()
    assert [scrape.value(results[t], "flare_steps_total") for _, t in listeners] == list(range(12))  # type: ignore[arg-type]


def test_a_name_the_resolver_answers_too_late_for_is_timed_out(rank, monkeypatch):
    released = threading.Event()

    def stuck(name: tuple[str, int]) -> list:
        released.wait(30)  # a resolver that does not answer within the scrape's timeout
        return []

    monkeypatch.setattr(rank_client, "_resolve", stuck)
    try:
        results = scrape.scrape_all(["slow-dns:9400", rank], timeout=0.3)
    finally:
        released.set()
    assert str(results["slow-dns:9400"]) == "slow-dns:9400: cannot scrape (timed out)"
    assert scrape.value(results[rank], "flare_steps_total") == 7  # type: ignore[arg-type]
