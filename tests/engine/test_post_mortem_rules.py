"""The post-mortem rules, the cause of every verdict, and the incident and history sources, on built inputs.

Each scenario is a dead run built from per-rank last words (factory helpers below), as a rank's incident
file or Prometheus's history would give them; tests/e2e/test_post_mortem.py runs the same faults for real.
"""

from __future__ import annotations

import json
import os

import pytest

from flare_exporter import causes
from flare_exporter.engine import cli, history_source, incident_source, verdict_causes
from flare_exporter.engine.post_mortem import (
    DeadRun,
    ExceptionWord,
    LastWord,
    Termination,
    behind_at,
    merge_runs,
    post_mortem,
)
from flare_exporter.engine.records import SourceError
from flare_exporter.engine.rule_types import GroupState, InFlight, PointToPoint, RankRecord

T0 = 1_800_000_000.0


def word(rank: int, **fields) -> LastWord:
    fields.setdefault("host", f"h{rank}")
    fields.setdefault("last_seen", T0 + 10)
    fields.setdefault("sources", ("incident",))
    return LastWord(rank, **fields)


def raised(kind: str, cause: str, at: float, root: tuple[str, str] = ("", "")) -> ExceptionWord:
    return ExceptionWord(kind, cause, at, *root)


def reset(at: float) -> ExceptionWord:
    return raised("RuntimeError", "communication", at)


def sigterm(at: float, sender: str = "launcher") -> Termination:
    return Termination("SIGTERM", sender, at)


def run_of(*words: LastWord, world_size: int = 4) -> DeadRun:
    return DeadRun("r", world_size, {w.rank: w for w in words}, "test")


def only(verdicts):
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def test_an_exception_of_its_own_names_its_rank_and_cause_before_the_survivors_resets():
    run = run_of(
        word(0, exception=reset(T0 + 2)),
        word(1, exception=reset(T0 + 1.5)),  # a survivor that raised before the culprit's time is known
        word(2, exception=raised("OutOfMemoryError", "out_of_memory", T0 + 1.6)),
        word(3, exception=reset(T0 + 2.1)),
    )
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.cause, verdict.domain) == (
        "rank_down",
        (2,),
        "out_of_memory",
        "rank",
    )
    assert verdict.evidence["followed_by"] == [0, 1, 3]
    assert [event["rank"] for event in verdict.evidence["timeline"]] == [1, 2, 0, 3]


def test_the_root_cause_of_a_data_loader_worker_is_named_in_the_summary():
    storage = raised("OSError", "storage", T0, ("OSError", "[Errno 116] Stale file handle"))
    run = run_of(
        word(0, terminated=sigterm(T0 + 1)), word(1, exception=storage), word(2, terminated=sigterm(T0 + 1))
    )
    verdict = only(post_mortem(run))
    assert verdict.ranks == (1,) and verdict.cause == "storage"
    assert "Stale file handle" in verdict.summary and verdict.evidence["root_cause"]["type"] == "OSError"


def test_the_earliest_of_several_exceptions_of_their_own_is_the_culprit():
    run = run_of(
        word(0, exception=raised("ValueError", "software_exception", T0 + 3)),
        word(1, exception=raised("KeyError", "software_exception", T0 + 1)),
    )
    verdict = only(post_mortem(run))
    assert verdict.ranks == (1,) and verdict.evidence["also_raised"] == {"0": "ValueError"}


@pytest.mark.parametrize("survivors", ["reset", "sigterm"])
def test_a_rank_gone_without_a_word_is_a_node_failure_whatever_the_survivors_said(survivors):
    said = {"exception": reset(T0 + 2)} if survivors == "reset" else {"terminated": sigterm(T0 + 2)}
    run = run_of(word(0, **said), word(1, **said), word(2, last_seen=T0), word(3, **said))
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.cause) == ("rank_down", (2,), "node_failure")
    assert 2 not in verdict.evidence["followed_by"]


def test_a_rank_nothing_was_ever_read_of_is_gone_without_a_word():
    run = run_of(word(0, exception=reset(T0)), word(1, exception=reset(T0)), world_size=3)
    verdict = only(post_mortem(run))
    assert verdict.ranks == (2,) and verdict.cause == "node_failure"
    assert {"rank": 2, "event": "never heard of", "timestamp_seconds": None} in verdict.evidence["timeline"]


def test_two_silent_ranks_of_one_host_are_the_host():
    run = run_of(
        word(0, host="a", terminated=sigterm(T0 + 2)),
        word(1, host="a", terminated=sigterm(T0 + 2)),
        word(2, host="b", last_seen=T0),
        word(3, host="b", last_seen=T0),
    )
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.domain, verdict.ranks, verdict.cause) == (
        "host_fault",
        "host",
        (2, 3),
        "node_failure",
    )
    assert verdict.evidence["host"] == "b" and verdict.summary.startswith("host b:")


def test_silent_ranks_on_two_hosts_of_one_switch_are_the_switch():
    run = run_of(
        word(0, exception=reset(T0)),
        word(1, topology={"switch": "sw3"}),
        word(2, topology={"switch": "sw3", "rack": "r1"}),
        word(3, exception=reset(T0)),
    )
    verdict = only(post_mortem(run))
    assert (verdict.domain, verdict.evidence["switch"]) == ("switch", "sw3")


def world(issued: int, flight: InFlight | None) -> dict[str, GroupState]:
    return {"world": GroupState(issued, issued - 1, flight)}


def test_a_mismatched_collective_at_the_end_is_named_by_majority():
    def reduce(rank: int, op: str = "allreduce") -> LastWord:
        return word(rank, exception=reset(T0 + 30), groups=world(7, InFlight(op, 7, 64, "started", T0)))

    run = run_of(reduce(0), reduce(1), reduce(2, "broadcast"), reduce(3))
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.cause) == ("mismatch", (2,), "collective_mismatch")


def test_a_rank_behind_its_group_at_the_end_never_reached_the_collective():
    waiting = InFlight("allreduce", 9, 64, "started", T0)
    run = run_of(
        word(0, exception=reset(T0 + 30), groups=world(9, waiting)),
        word(1, exception=reset(T0 + 30), groups=world(8, None)),
        word(2, exception=reset(T0 + 30), groups=world(9, waiting)),
        world_size=3,
    )
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.cause) == ("hang", (1,), "deadlock")
    assert behind_at(run.every_rank()) == {"world": [1]}


def test_survivors_resets_alone_with_no_origin_are_a_communication_fault():
    run = run_of(word(0, exception=reset(T0 + 1)), word(1, exception=reset(T0)), world_size=2)
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.domain, verdict.cause, verdict.ranks) == (
        "hang",
        "job",
        "communication",
        (0, 1),
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"exited": True},  # a run that ended normally: every rank's file says so
        {},  # every rank left no word (Prometheus: a normal end is not scraped)
        {"terminated": sigterm(T0)},  # the launcher (or the scheduler) stopped every rank: a person's choice
    ],
    ids=["exited", "all-silent", "all-stopped"],
)
def test_a_run_that_ended_without_a_failure_has_no_verdict(fields):
    assert post_mortem(run_of(*(word(rank, **fields) for rank in range(4)))) == []


def test_merging_prefers_what_the_rank_wrote_and_keeps_the_latest_sighting():
    scraped = DeadRun(
        "r",
        4,
        {
            2: word(
                2,
                exception=raised("OutOfMemoryError", "out_of_memory", T0),
                last_seen=T0 + 5,
                sources=("prometheus",),
            )
        },
        "prometheus p",
    )
    written = DeadRun(
        "r",
        4,
        {
            2: word(
                2,
                exception=ExceptionWord("OutOfMemoryError", "out_of_memory", None, "X", "y"),
                last_seen=T0 + 1,
            )
        },
        "incidents d",
    )
    merged = merge_runs([written, scraped]).ranks[2]
    assert merged.exception == ExceptionWord("OutOfMemoryError", "out_of_memory", T0, "X", "y")
    assert merged.last_seen == T0 + 5 and merged.sources == ("prometheus", "incident")


# ---------------------------------------------------------------------------------------------------------
# the cause of live verdicts


@pytest.mark.parametrize(
    ("kind", "domain", "records", "cause"),
    [
        ("mismatch", "rank", [], "collective_mismatch"),
        ("straggler", "rank", [], "straggler"),
        ("ild_regression", "host", [], "straggler"),
        ("ild_regression", "job", [], "unknown"),
        ("rank_down", "rank", [RankRecord(1, up=False)], "node_failure"),
        (
            "rank_down",
            "rank",
            [RankRecord(1, exception="OutOfMemoryError", exception_cause="out_of_memory")],
            "out_of_memory",
        ),
        (
            "rank_down",
            "rank",
            [RankRecord(1, exception="RuntimeError", exception_cause="communication")],
            "communication",
        ),
        ("rank_down", "rank", [RankRecord(1, exception="RuntimeError")], "software_exception"),
        ("host_fault", "host", [RankRecord(1, up=False), RankRecord(2, up=False)], "node_failure"),
        ("hang", "group", [], "communication"),
        ("hang", "rank", [RankRecord(1, activity="data")], "data_stall"),
        ("hang", "rank", [RankRecord(1, activity="compute")], "deadlock"),
        ("something_new", "rank", [], "unknown"),
    ],
)
def test_every_verdict_kind_gets_a_cause(kind, domain, records, cause):
    assert verdict_causes.cause_of(kind, domain, records) == cause
    assert cause in causes.CAUSES


# ---------------------------------------------------------------------------------------------------------
# the exception classifier both sides apply


@pytest.mark.parametrize(
    ("raised_as", "cause"),
    [
        (
            causes.Raised("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"),
            "out_of_memory",
        ),
        (
            causes.Raised(
                "RuntimeError",
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
            ),
            "out_of_memory",
        ),
        (causes.Raised("OSError", "[Errno 116] Stale file handle", 116), "storage"),
        (causes.Raised("OSError", "something", 5), "storage"),
        (causes.Raised("RuntimeError", "DataLoader worker (pid(s) 1234) exited unexpectedly"), "data_stall"),
        (
            causes.Raised(
                "RuntimeError", "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:5"
            ),
            "communication",
        ),
        (
            causes.Raised("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp, remote process exited"),
            "communication",
        ),
        (
            causes.Raised("RuntimeError", "Timed out waiting 10000ms for recv operation to complete"),
            "communication",
        ),
        (causes.Raised("ValueError", "bad shape"), "software_exception"),
    ],
)
def test_the_exception_classifier(raised_as, cause):
    assert causes.exception_cause(raised_as) == cause


def test_a_data_loader_re_raise_is_unwrapped_to_the_workers_exception():
    message = (
        "Caught OSError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 3, in __getitem__\n    raise OSError(116)\n'
        "OSError: [Errno 116] Stale file handle\n"
    )
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise OSError(message) from None
    except OSError as error:
        found = causes.classify(error)
    assert found.cause == "storage" and found.root == causes.Raised(
        "OSError", "[Errno 116] Stale file handle", 116
    )


def test_the_chain_is_followed_to_the_innermost_specific_cause():
    try:
        try:
            raise MemoryError("no memory")
        except MemoryError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as error:
        found = causes.classify(error)
    assert [link.type for link in found.chain] == [
        "RuntimeError",
        "MemoryError",
    ] and found.cause == "out_of_memory"


# ---------------------------------------------------------------------------------------------------------
# incident files as untrusted input


def incident(rank: int, reason: str = "exception", **more) -> dict:
    document = {
        "version": 2,
        "reason": reason,
        "timestamp_seconds": T0 + rank,
        "identity": {"rank": rank, "world_size": 4, "run": "r", "host": "h", "topology": {"switch": "s1"}},
        "steps": 12,
        "heartbeat_timestamp_seconds": T0,
        "groups": {
            "world": {
                "last_issued_seq": 5,
                "last_completed_seq": 4,
                "in_flight": {
                    "op": "allreduce",
                    "seq": 5,
                    "bytes": 8,
                    "state": "started",
                    "issued_timestamp_seconds": T0,
                },
            }
        },
        "exception": None,
        "terminated": None,
    }
    document.update(more)
    return document


def write(directory, name: str, content) -> None:
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))


def test_incident_files_of_version_2_and_1_become_last_words(tmp_path):
    write(
        tmp_path,
        "r-rank0.json",
        incident(
            0,
            exception={
                "type": "OSError",
                "message": "x",
                "cause": "storage",
                "root_cause": {"type": "OSError", "message": "[Errno 116] Stale file handle", "errno": 116},
            },
        ),
    )
    write(
        tmp_path,
        "r-rank1.json",
        incident(
            1,
            reason="signal",
            terminated={"signal": "SIGTERM", "sender": "launcher", "timestamp_seconds": T0 + 3},
        ),
    )
    write(tmp_path, "r-rank2.json", incident(2, reason="exit"))
    v1 = incident(
        3,
        reason="exception RuntimeError",
        version=1,
        exception={"type": "RuntimeError", "message": "Connection reset by peer"},
    )
    write(tmp_path, "r-rank3.json", v1)
    run = incident_source.dead_run_from_incidents(str(tmp_path))
    assert (run.run, run.world_size, sorted(run.ranks)) == ("r", 4, [0, 1, 2, 3])
    assert run.ranks[0].exception == ExceptionWord(
        "OSError", "storage", T0, "OSError", "[Errno 116] Stale file handle"
    )
    assert run.ranks[1].terminated == Termination("SIGTERM", "launcher", T0 + 3)
    assert run.ranks[2].exited and run.ranks[3].exception.cause == "communication"
    assert run.ranks[0].groups["world"].in_flight == InFlight("allreduce", 5, 8, "started", T0)
    assert run.ranks[0].topology == {"switch": "s1"}
    assert only(post_mortem(run)).ranks == (0,)


def test_the_incidents_subdirectory_of_a_file_sd_directory_is_found(tmp_path):
    (tmp_path / "incidents").mkdir()
    write(tmp_path, "r-rank0.json", [{"targets": ["127.0.0.1:1"], "labels": {"rank": "0"}}])  # a target file
    write(tmp_path / "incidents", "r-rank0.json", incident(0))
    assert incident_source.incident_directory(str(tmp_path)) == str(tmp_path / "incidents")
    assert sorted(incident_source.dead_run_from_incidents(str(tmp_path)).ranks) == [0]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"identity": {"rank": "zero"}}), "not a flare incident file"),
        ("[" * 100_000 + "]" * 100_000, "not JSON"),
    ],
    ids=["broken", "list", "no-rank", "deep"],
)
def test_a_file_that_is_not_an_incident_is_one_line_naming_it(tmp_path, content, says):
    write(tmp_path, "r-rank0.json", content)
    with pytest.raises(incident_source.IncidentError) as raised_error:
        incident_source.dead_run_from_incidents(str(tmp_path))
    message = str(raised_error.value)
    assert says in message and str(tmp_path / "r-rank0.json") in message and "\n" not in message


def test_an_oversized_incident_file_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    monkeypatch.setattr(incident_source, "MAX_INCIDENT_BYTES", 1000)
    write(tmp_path, "r-rank0.json", json.dumps(incident(0, padding="x" * 5000)))
    with pytest.raises(incident_source.IncidentError, match="larger than 1000 bytes"):
        incident_source.dead_run_from_incidents(str(tmp_path))


def test_fields_of_the_wrong_type_are_ignored_not_trusted(tmp_path):
    hostile = incident(
        0, steps="many", groups={"world": "x", "g": {"last_issued_seq": 1e400}}, exception={"type": 3}
    )
    hostile["heartbeat_timestamp_seconds"] = float("nan")
    write(tmp_path, "r-rank0.json", json.dumps(hostile).replace("Infinity", "1e400"))
    found = incident_source.dead_run_from_incidents(str(tmp_path)).ranks[0]
    assert found.steps is None and found.heartbeat is None and found.exception is None
    assert found.groups == {"g": GroupState(0, 0, None)}


def test_several_runs_need_a_run(tmp_path):
    write(tmp_path, "a-rank0.json", incident(0))
    other = incident(0)
    other["identity"]["run"] = "other"
    write(tmp_path, "b-rank0.json", other)
    with pytest.raises(SourceError, match="several runs"):
        incident_source.dead_run_from_incidents(str(tmp_path))
    assert incident_source.dead_run_from_incidents(str(tmp_path), "other").run == "other"


def test_an_unreadable_directory_is_one_line(tmp_path):
    with pytest.raises(incident_source.IncidentError, match="cannot read it"):
        incident_source.read_incidents(os.path.join(str(tmp_path), "absent"))


# ---------------------------------------------------------------------------------------------------------
# Prometheus's history, from answers


def test_history_keeps_only_the_collectives_the_last_scrape_held():
    rank = {"rank": "1"}
    series = {
        "flare_rank_info": [({**rank, "host": "h1", "world_size": "2", "switch": "s"}, 1.0)],
        history_source.LAST_SEEN: [(rank, T0 + 10)],
        "flare_rank_exception_info": [({**rank, "type": "OSError", "cause": "storage"}, 1.0)],
        "flare_rank_exception_timestamp_seconds": [(rank, T0 + 9)],
        history_source.TERMINATED: [],
        "flare_collective_last_issued_seq": [
            ({**rank, "group": "world"}, 7.0),
            ({**rank, "group": "dp"}, 3.0),
        ],
        history_source.FLIGHT_STARTED: [({**rank, "group": "world"}, T0), ({**rank, "group": "dp"}, T0 - 50)],
        history_source.FLIGHT_SEEN: [
            ({**rank, "group": "world"}, T0 + 10),
            ({**rank, "group": "dp"}, T0 - 40),
        ],
        history_source.FLIGHT_INFO: [
            ({**rank, "group": "world", "op": "allreduce", "state": "started"}, 1.0),
            ({**rank, "group": "world", "op": "broadcast", "state": "issued"}, 1.0),  # DDP's first, long done
        ],
        history_source.INFO_SEEN: [
            ({**rank, "group": "world", "op": "broadcast", "state": "issued"}, T0 - 300),
            ({**rank, "group": "world", "op": "allreduce", "state": "started"}, T0 + 10),
        ],
    }
    run = history_source.dead_run(series, "r", "prometheus p", T0 + 60)
    found = run.ranks[1]
    assert (run.world_size, found.host, found.topology, found.last_seen) == (
        2,
        "h1",
        {"switch": "s"},
        T0 + 10,
    )
    assert found.exception == ExceptionWord("OSError", "storage", T0 + 9)
    assert found.groups["world"].in_flight.op == "allreduce" and found.groups["dp"].in_flight is None


def test_history_subquery_steps_stay_bounded():
    assert history_source.subquery_step(300) == "1s"
    assert history_source.subquery_step(3600) == "6s"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1800000000", 1_800_000_000.0),
        ("2027-01-15T08:00:00Z", 1_800_000_000.0),
        ("2027-01-15T08:00:00", 1_800_000_000.0),
    ],
)
def test_at_takes_unix_seconds_or_iso_8601(text, seconds):
    assert cli.parse_time(text) == seconds


@pytest.mark.parametrize("text", ["yesterday", "-5", "nan"])
def test_a_bad_at_is_a_usage_error(tmp_path, capsys, text):
    assert cli.main(["diagnose", "--incidents", str(tmp_path), "--at", text]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("flare: flag --at:")


def test_diagnose_and_report_read_an_incident_directory(tmp_path, capsys):
    write(
        tmp_path,
        "r-rank0.json",
        incident(
            0,
            reason="signal",
            terminated={"signal": "SIGTERM", "sender": "launcher", "timestamp_seconds": T0},
        ),
    )
    write(
        tmp_path,
        "r-rank1.json",
        incident(
            1,
            exception={"type": "OutOfMemoryError", "message": "CUDA out of memory", "cause": "out_of_memory"},
        ),
    )
    assert cli.main(["diagnose", "--incidents", str(tmp_path), "--json"]) == cli.EXIT_ANOMALY
    result = json.loads(capsys.readouterr().out)
    assert result["post_mortem"] and [(v["ranks"], v["cause"]) for v in result["verdicts"]] == [
        ([1], "out_of_memory")
    ]
    assert cli.main(["diagnose", "--incidents", str(tmp_path)]) == cli.EXIT_ANOMALY  # for people
    assert "\nrank_down, cause out_of_memory, rank (1): rank 1 raised" in capsys.readouterr().out
    out = tmp_path / "report.md"
    assert cli.main(["report", "--incidents", str(tmp_path), "--out", str(out)]) == cli.EXIT_ANOMALY
    text = out.read_text()
    assert (
        "cause **out_of_memory**" in text and "| 0 | h |" in text and "got SIGTERM from its launcher" in text
    )


def test_report_without_a_source_is_a_usage_error(capsys):
    assert cli.main(["report"]) == cli.EXIT_USAGE
    assert "name a source" in capsys.readouterr().err


def test_an_exception_whose_text_cannot_be_printed_is_still_classified():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    found = causes.classify(Unprintable())
    assert found.cause == "software_exception" and found.root.message == "<Unprintable: unprintable>"


def test_collectives_in_flight_at_a_normal_end_are_no_evidence():
    """Ranks of a healthy run, each last scraped at another moment of its last collectives."""
    run = run_of(
        word(0, groups=world(7, InFlight("allreduce", 7, 64, "started", T0))),
        word(1, groups=world(6, None)),
        word(2, groups=world(7, InFlight("broadcast", 7, 64, "issued", T0))),
        world_size=3,
    )
    assert post_mortem(run) == []


def test_a_mismatch_is_named_where_the_collectives_differ_though_another_rank_ran_ahead():
    """gloo may complete a mismatched pair on some ranks: rank 0 went on to the next collective."""

    def at(rank: int, number: int, op: str) -> LastWord:
        return word(
            rank, exception=reset(T0 + 9), groups=world(number, InFlight(op, number, 64, "issued", T0))
        )

    run = run_of(
        at(0, 47, "allreduce"), at(1, 46, "allreduce"), at(2, 46, "broadcast"), at(3, 46, "allreduce")
    )
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.group, verdict.cause) == (
        "mismatch",
        (2,),
        "world",
        "collective_mismatch",
    )


def test_a_pipeline_stage_its_peers_sends_and_receives_waited_for_at_the_end():
    def stage(rank: int, done: dict, flight: tuple | None) -> LastWord:
        issued = dict(done)
        if flight is not None:
            issued[flight[:2]] = done.get(flight[:2], 0) + 1
        flights = () if flight is None else ((*flight, T0),)
        groups = {"world": GroupState(1, 1, p2p=PointToPoint(issued, done, flights))}
        return word(rank, exception=reset(T0 + 30), groups=groups)

    run = run_of(
        stage(0, {("send", 1): 9}, ("send", 1)),
        stage(1, {("recv", 0): 9, ("send", 2): 8}, ("send", 2)),
        stage(2, {("recv", 1): 8, ("send", 3): 8}, None),  # stuck in its own code, then torn down
        stage(3, {("recv", 2): 8}, ("recv", 2)),
    )
    verdict = only(post_mortem(run))
    assert (verdict.kind, verdict.ranks, verdict.cause) == ("hang", (2,), "deadlock")
    # the same last words, as a rank's incident file writes them, read back
    written = {
        "p2p": {"issued": [["recv", 1, 8], ["send", 3, 8]], "completed": [["recv", 1, 8], ["send", 3, 8]]}
    }
    assert incident_source._groups({"world": written})["world"].p2p == PointToPoint(
        {("recv", 1): 8, ("send", 3): 8}, {("recv", 1): 8, ("send", 3): 8}
    )
