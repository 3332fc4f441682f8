"""The overhead benchmark's scraper: Prometheus's part, on the job's own cores, with as little work as it can.

Imported by overhead.py, which puts the checkout on sys.path first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from flare_exporter.local.testing import PROMETHEUS_SCRAPE_HEADERS

SCRAPE_TIMEOUT_S = 2.0


@dataclass
class ScrapeCounts:
    """What a run's scrapes came to: done, failed, and the attempts not counted either way."""

    done: int = 0  # attempts that returned flare metrics
    during_training: int = 0  # of those, the ones that started while the rank was taking its steps
    failed: int = 0  # attempts that failed between the rank's first answer and the end of its training
    startup: int = 0  # refused before the rank's endpoint first answered (the rank is still importing torch)
    shutdown: int = 0  # failed after the rank finished training (its endpoint closes as the process exits)
    never_answered: list[int] = field(default_factory=list)  # ranks that never answered in this run
    failures: list[str] = field(default_factory=list)  # first few failure reasons
    attempts: int = 0  # every attempt, whatever its outcome
    scraper_cpu_s: float = 0.0  # the scraper thread's CPU time: the benchmark's own, on the job's cores

    def add(self, other: ScrapeCounts) -> None:
        self.done += other.done
        self.during_training += other.during_training
        self.failed += other.failed
        self.startup += other.startup
        self.shutdown += other.shutdown
        self.never_answered += other.never_answered
        self.failures += other.failures[: max(0, 5 - len(self.failures))]
        self.attempts += other.attempts
        self.scraper_cpu_s += other.scraper_cpu_s


Span = tuple[float, float]  # (began, ended), wall time


READ_BYTES = 65536  # a socket read: below malloc's mmap threshold, and more than a rank's gzipped page
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a rank's page is tens of KiB; a larger Content-Length is not read


class ScrapeAnswerError(Exception):
    """An answer to a scrape that is not a whole HTTP response with a Content-Length."""


def scrape_request(port: int) -> bytes:
    """The bytes of a scrape of 127.0.0.1:`port`, as Prometheus asks: HTTP/1.1, its headers, gzip."""
    headers = "".join(f"{name}: {value}\r\n" for name, value in PROMETHEUS_SCRAPE_HEADERS.items())
    return f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}\r\n".encode("latin-1")


def exchange(connection: socket.socket, request: bytes) -> tuple[int, bytes, bool]:
    """Send `request` on a kept-alive connection and read the answer: (status, body, whether the connection
    stays open). The body is decompressed if it came gzipped.

    The scraper shares the job's cores, where Prometheus scrapes from another machine: so it reads the answer
    with as little work as it can (http.client parsed every header with the email package, and took about
    three times the CPU per scrape).
    """
    connection.sendall(request)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        if len(data) > READ_BYTES:
            raise ScrapeAnswerError("a response head over 64 KiB")
        chunk = connection.recv(READ_BYTES)
        if not chunk:
            raise ScrapeAnswerError("connection closed before a response")
        data += chunk
    status_line, _, fields = data[:end].decode("latin-1").partition("\r\n")
    body = data[end + 4 :]
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ScrapeAnswerError(f"not an HTTP response: {status_line[:80]!r}")
    lines = (line.partition(":") for line in fields.lower().split("\r\n"))
    header = {name.strip(): value.strip() for name, _, value in lines}
    if not header.get("content-length", "").isdigit():
        raise ScrapeAnswerError("a response without Content-Length")
    length = int(header["content-length"])
    if length > MAX_ANSWER_BYTES:
        raise ScrapeAnswerError(f"a body of {length} bytes, over {MAX_ANSWER_BYTES}")
    while len(body) < length:
        chunk = connection.recv(READ_BYTES)
        if not chunk:
            raise ScrapeAnswerError(f"truncated response: {length - len(body)} bytes missing")
        body += chunk
    if header.get("content-encoding") == "gzip":
        try:
            body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
        except zlib.error as error:
            raise ScrapeAnswerError(f"a gzip body that does not decompress: {error}") from None
    keep_alive = parts[0] == "HTTP/1.1" and header.get("connection") != "close"
    return int(parts[1]), body, keep_alive


class Scraper(threading.Thread):
    """Scrapes every rank's /metrics once per second until stopped, as Prometheus does: one kept-alive
    connection per rank, gzip and Prometheus's Accept header. Classifies failures afterwards."""

    def __init__(self, base_port: int, ranks: int, interval: float, gated: bool = False) -> None:
        super().__init__(name="overhead-scraper", daemon=True)
        self.interval = interval
        self.ports = [base_port + rank for rank in range(ranks)]
        self.connections: list[socket.socket | None] = [None] * ranks
        self.requests = [scrape_request(port) for port in self.ports]
        self.stop_event = threading.Event()
        # per rank: (wall time the attempt started, None if it succeeded else the reason)
        self.attempts: list[list[tuple[float, str | None]]] = [[] for _ in self.ports]
        self.cpu_seconds = 0.0  # this thread's own CPU: the benchmark's, on the same cores as the job
        self.rounds: list[Span] = []  # wall time each round's first request began, and its last ended
        # gated (interleaved runs): scrape only while the job runs, from resume() to pause(); a pause waits
        # for the round in flight, so that no request is left waiting on a paused rank
        self.running: threading.Event | None = threading.Event() if gated else None
        self._busy = threading.Lock()

    def resume(self) -> None:
        """The job runs again: scrape it (gated only)."""
        assert self.running is not None
        self.running.set()

    def pause(self, pause_job: Callable[[], None]) -> None:
        """Stop scraping, then `pause_job`, once the round in flight has its answers (gated only)."""
        assert self.running is not None
        with self._busy:
            self.running.clear()
            pause_job()

    def stop(self) -> None:
        """End the scrapes and wait for the thread (a round's requests time out in SCRAPE_TIMEOUT_S each)."""
        self.stop_event.set()
        if self.running is not None:
            self.running.set()  # out of its wait for a resume
        if self.is_alive():
            self.join(timeout=SCRAPE_TIMEOUT_S * len(self.ports) + 1)

    def run(self) -> None:
        # Prometheus scrapes from another machine; this thread shares the job's cores, so it takes their idle
        # time at the lowest priority rather than the ranks' (Linux: a thread's own nice value)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        started_cpu = time.thread_time()
        next_at = time.monotonic()
        while not self.stop_event.wait(max(0.0, next_at - time.monotonic())):
            if self.running is not None and not self.running.is_set():  # the job is paused
                self.running.wait()  # set by resume(), and by stop()
                next_at = time.monotonic() + self.interval / 2  # its first round half an interval in
                continue
            with self._busy:
                if self.stop_event.is_set() or (self.running is not None and not self.running.is_set()):
                    continue  # stopped, or paused, since the wait
                began, began_at = time.time(), time.monotonic()
                for rank in range(len(self.ports)):
                    self.attempts[rank].append((time.time(), self._scrape(rank)))
                self.rounds.append((began, time.time()))
            self.cpu_seconds = time.thread_time() - started_cpu
            # a round that began late (after a slow one) sets the pace from then on, rather than the next
            # ones catching up in a burst
            next_at = max(next_at, began_at) + self.interval
        for connection in self.connections:
            if connection is not None:
                connection.close()

    def _scrape(self, rank: int) -> str | None:
        connection = self.connections[rank]
        try:
            if connection is None:
                connection = socket.create_connection(("127.0.0.1", self.ports[rank]), SCRAPE_TIMEOUT_S)
                self.connections[rank] = connection
            status, body, keep_alive = exchange(connection, self.requests[rank])
        except (OSError, ScrapeAnswerError) as error:
            if connection is not None:
                connection.close()  # a new connection at the next attempt
            self.connections[rank] = None
            return f"{type(error).__name__}: {error}"
        if not keep_alive:
            connection.close()
            self.connections[rank] = None
        if status != 200:
            return f"HTTP {status}"
        if b"flare_" not in body:
            return "200 without flare_ metrics"
        return None

    def counts(self, training: list[tuple[float, float]]) -> ScrapeCounts:
        """Classify the attempts; `training` is each rank's (first step began, last step ended), wall time."""
        counts = ScrapeCounts(
            attempts=sum(len(attempts) for attempts in self.attempts), scraper_cpu_s=self.cpu_seconds
        )
        for rank, attempts in enumerate(self.attempts):
            answered = False
            trained_from, trained_until = training[rank]
            for at, failure in attempts:
                if failure is None:
                    answered = True
                    counts.done += 1
                    counts.during_training += trained_from <= at < trained_until
                elif not answered and "Refused" in failure:
                    counts.startup += 1
                elif at >= trained_until:
                    counts.shutdown += 1
                else:
                    counts.failed += 1
                    if len(counts.failures) < 5:
                        counts.failures.append(f"rank {rank}: {failure}")
            if not answered:
                counts.never_answered.append(rank)
        return counts


def scraper_cpu_text(scrapes: ScrapeCounts) -> str:
    """The benchmark's own scraper's CPU per attempt: what this machine's cores gave to Prometheus's part."""
    per_attempt = scrapes.scraper_cpu_s / max(1, scrapes.attempts)
    return f"the benchmark's scraper used {per_attempt * 1e6:.0f} us of CPU per attempt"
