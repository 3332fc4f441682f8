"""The incident report of a dead run (`flare report`): one JSON object for programs, Markdown for people.

Both carry the same facts: the verdict (the originating rank or the shared fault domain, its cause and the
evidence), the timeline of who stopped when, and each rank's last word (where it was read, its exception
and root cause, termination, steps, heartbeat, what it had in flight).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .post_mortem import DeadRun, LastWord, merge_runs, post_mortem, timeline

__all__ = ["incident_report", "markdown", "merge_runs"]


def incident_report(run: DeadRun) -> dict[str, Any]:
    """The report of a dead run, as one JSON-ready object."""
    words = run.every_rank()
    verdicts = post_mortem(run)
    return {
        "run": run.run,
        "source": run.source,
        "world_size": run.world_size,
        "ranks_heard_of": len(run.ranks),
        "ended_timestamp_seconds": run.ended_at,
        "verdicts": [verdict.to_json() for verdict in verdicts],
        "timeline": timeline(words),
        "ranks": {str(rank): _rank_json(word) for rank, word in words.items()},
    }


def _rank_json(word: LastWord) -> dict[str, Any]:
    exception = word.exception
    return {
        "host": word.host or None,
        "topology": dict(word.topology),
        "sources": list(word.sources),
        "last_seen_timestamp_seconds": word.last_seen,
        "heartbeat_timestamp_seconds": word.heartbeat,
        "steps": word.steps,
        "exception": None
        if exception is None
        else {
            "type": exception.type,
            "cause": exception.cause,
            "timestamp_seconds": exception.at,
            "root_cause": {"type": exception.root_type, "message": exception.root_message}
            if exception.root_type
            else None,
        },
        "terminated": None
        if word.terminated is None
        else {
            "signal": word.terminated.signal,
            "sender": word.terminated.sender,
            "timestamp_seconds": word.terminated.at,
        },
        "ended_normally": word.exited,
        "groups": {
            name: {
                "last_issued_seq": state.last_issued,
                "last_completed_seq": state.last_completed,
                "in_flight": None
                if state.in_flight is None
                else {"op": state.in_flight.op, "seq": state.in_flight.seq, "state": state.in_flight.state},
            }
            for name, state in sorted(word.groups.items())
        },
    }


def markdown(report: Mapping[str, Any]) -> str:
    """The report for people: the verdict first, then the timeline, then one row per rank."""
    heard = f"Ranks: {report['world_size']}, heard of: {report['ranks_heard_of']}."
    lines = [f"# Incident report: run {report['run']}", "", f"Source: {report['source']}. {heard}"]
    lines += ["", "## Verdict", ""]
    lines += [_verdict_line(verdict) for verdict in report["verdicts"]] or [NO_VERDICT]
    for verdict in report["verdicts"]:
        lines += ["", "Evidence:", "", "```json", _evidence_text(verdict), "```"]
    lines += ["", "## Timeline", "", "| time (UTC) | rank | event |", "|---|---|---|"]
    lines += [
        _row([_utc(event["timestamp_seconds"]), str(event["rank"]), event["event"]])
        for event in report["timeline"]
    ]
    lines += ["", "## Ranks", "", _row(RANK_COLUMNS), _row(["---"] * len(RANK_COLUMNS))]
    lines += [_rank_row(rank, word) for rank, word in report["ranks"].items()]
    return "\n".join(lines) + "\n"


NO_VERDICT = "No rank caused the end: no verdict."
RANK_COLUMNS = ["rank", "host", "steps", "last seen (UTC)", "exception", "root cause", "terminated"]


def _verdict_line(verdict: Mapping[str, Any], markdown: bool = True) -> str:
    """A verdict (its JSON) in one line: a Markdown list item with its kind and cause in bold, else plain."""

    def strong(text: str) -> str:
        return f"**{text}**" if markdown else text

    ranks = ", ".join(map(str, verdict["ranks"])) or "no single rank"
    head = f"{strong(verdict['kind'])}, cause {strong(verdict['cause'])}, {verdict['domain']} ({ranks})"
    line = f"{head}: {verdict['summary']}"
    return f"- {line}" if markdown else line


def _evidence_text(verdict: Mapping[str, Any]) -> str:
    shown = {key: value for key, value in verdict["evidence"].items() if key != "timeline"}
    return json.dumps(shown, indent=2, sort_keys=True)


def _rank_row(rank: str, word: Mapping[str, Any]) -> str:
    exception = word["exception"] or {}
    root = exception.get("root_cause") or {}
    terminated = word["terminated"] or {}
    ended = "ended normally" if word["ended_normally"] else "-"
    cells = [
        rank,
        word["host"] or "-",
        "-" if word["steps"] is None else str(int(word["steps"])),
        _utc(word["last_seen_timestamp_seconds"]),
        f"{exception['type']} ({exception['cause']})" if exception else ended,
        f"{root.get('type')}: {root.get('message')}" if root else "-",
        f"{terminated['signal']} ({terminated['sender']})" if terminated else "-",
    ]
    return _row(cells)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def _utc(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def verdict_lines(verdicts: list[Mapping[str, Any]]) -> list[str]:
    """One line per verdict (its JSON, as incident_report holds it), as `flare diagnose` prints them for a
    dead run."""
    return [_verdict_line(verdict, markdown=False) for verdict in verdicts]
