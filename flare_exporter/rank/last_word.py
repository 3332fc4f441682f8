"""A dying rank's last word: what ended it, and a wait until Prometheus has scraped it.

A rank dying of an exception or of a termination signal says so in flare_rank_exception_info or
flare_rank_terminated_timestamp_seconds; without a wait it usually exits before the next scrape, and the
store never learns why it died. So the exposition records when each scrape of /metrics starts and completes
(`ScrapeTimes`, written on the endpoint's thread only, with plain attribute stores that need no lock), and
the dying rank polls it (`wait_for_last_word`) until a scrape whose render started after the death began
has been sent, at most min(last_word_seconds, twice the observed scrape interval plus a margin). A rank
never scraped does not wait: nobody is listening. The wait holds nothing the scrape path takes, sleeps in
short steps (the GIL is free), never raises and always ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import causes

MAX_TYPE_CHARS = 64  # of the exception type in flare_rank_exception_info's label
# Beyond twice the scrape interval: a render reused for half a second (exposition.RENDER_REUSE_SECONDS), a
# scrape's own render and send, a scraper's jitter.
MARGIN_SECONDS = 1.0
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class RaisedException:
    """The exception ending the rank, as flare_rank_exception_info says it: bounded words only."""

    type: str  # the class name, at most MAX_TYPE_CHARS
    cause: str  # one of causes.EXCEPTION_CAUSES, from its root cause
    timestamp_seconds: float  # Unix time it was seen leaving the training script

    @classmethod
    def of(cls, exception: BaseException, timestamp_seconds: float) -> RaisedException:
        try:
            cause = causes.classify(exception).cause
        except Exception:  # the classifier reads messages; a message that cannot be read is no cause
            cause = "software_exception"
        return cls(type(exception).__name__[:MAX_TYPE_CHARS], cause, timestamp_seconds)


@dataclass(frozen=True)
class Termination:
    """A signal ending the rank: its name (SIGTERM, SIGINT, SIGHUP), who sent it, and when."""

    signal: str
    sender: str  # launcher (torchrun's elastic agent, Slurm's srun) or unknown
    timestamp_seconds: float


# torchrun's elastic agent sets these in its workers' environment, srun SLURM_STEP_ID in its tasks': both stop
# the survivors of a failed rank with SIGTERM.
LAUNCHER_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")


def signal_sender(environ: Mapping[str, str]) -> str:
    """`launcher` if a launcher that stops its ranks with signals started this one, else `unknown`."""
    return "launcher" if any(name in environ for name in LAUNCHER_VARIABLES) else "unknown"


class ScrapeTimes:
    """When scrapes of /metrics started and completed. Written by the endpoint's thread only; each value is
    one attribute (a tuple replaced whole), so a reader on another thread needs no lock."""

    def __init__(self) -> None:
        self.starts: tuple[float, ...] = ()  # monotonic times the last two scrapes arrived, oldest first
        # the last scrape sent in full: (monotonic time its body's render started, Unix time it was sent)
        self.completed: tuple[float, float] | None = None

    def started(self, now: float) -> None:
        """A scrape of /metrics arrived at monotonic time `now`."""
        self.starts = (*self.starts[-1:], now)

    def sent(self, rendered_at: float) -> None:
        """A scrape's response, rendered from monotonic time `rendered_at` on, was sent in full."""
        self.completed = (rendered_at, time.time())

    def interval(self) -> float | None:
        """Seconds between the last two scrapes' starts; None before two were seen."""
        starts = self.starts
        return starts[1] - starts[0] if len(starts) == 2 else None

    def seen(self) -> bool:
        return bool(self.starts)

    def completed_after(self, event: float) -> bool:
        """Whether a scrape whose render started after monotonic time `event` has been sent."""
        completed = self.completed
        return completed is not None and completed[0] > event

    @property
    def last_completed_timestamp_seconds(self) -> float | None:
        completed = self.completed
        return None if completed is None else completed[1]


def last_word_bound(
    scrapes: ScrapeTimes | None, limit_seconds: float, margin: float = MARGIN_SECONDS
) -> float:
    """How long a dying rank waits at most for its last word to be scraped: 0 when never scraped or
    disabled, else min(limit, 2 x the observed scrape interval + margin) (the limit before an interval
    is known)."""
    if scrapes is None or limit_seconds <= 0 or not scrapes.seen():
        return 0.0
    interval = scrapes.interval()
    return limit_seconds if interval is None else min(limit_seconds, 2 * max(interval, 0.0) + margin)


def wait_for_last_word(
    scrapes: ScrapeTimes | None,
    event: float,
    limit_seconds: float,
    margin: float = MARGIN_SECONDS,
    poll: float = POLL_SECONDS,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until a scrape that started after monotonic time `event` has completed: True then, False when
    the bound (last_word_bound, counted from `event`) passed first or there was nothing to wait for.
    Never raises (a second signal or Ctrl-C while waiting ends the wait), never holds a lock."""
    try:
        deadline = event + last_word_bound(scrapes, limit_seconds, margin)
        while scrapes is not None:
            if scrapes.completed_after(event):
                return True
            remaining = deadline - clock()
            if remaining <= 0:
                return False
            time.sleep(min(poll, remaining))
    except BaseException:  # noqa: BLE001 - the rank is dying; whatever interrupts the wait ends it
        return False
    return False
