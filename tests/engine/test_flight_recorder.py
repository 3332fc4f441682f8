"""flare reads PyTorch's flight-recorder dumps: `flare diagnose --flight-recorder DIR`, `flare report` over
the same directory, and the loader's refusals.

The loader's tests build per-rank dumps with factory helpers shaped as torch 2.13 writes them (gloo's: no
members in pg_config; NCCL's: members listed) and hostile or broken files. The scenarios run real 4-rank gloo
jobs (world plus pair groups, PyTorch's recorder on) under the launcher, with one faulty rank: stuck in its
own code, frozen by SIGSTOP, or issuing another collective. Each rank's recorder is dumped by the workload's
watchdog (flight_recorder_dumps.py, as NCCL's dump on timeout: gloo has none) and its incident file carries
the recorder's last entries; flare must name the rank and the kind from the dumps alone, from the incident
files alone, and in the report over the directory that holds both.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import flare_json

from flare_exporter.engine import cli, flight_recorder, scrape
from flare_exporter.engine import flight_recorder_records as records
from flare_exporter.engine.flight_recorder import DumpError
from flare_exporter.local import jobs
from flare_exporter.local.prometheus import wait_for
from flare_exporter.local.workloads import train_ddp
from flare_exporter.rank import groups

NOW_NS = 1_796_000_000 * 10**9  # when the dumps of the unit tests were taken


# ---------------------------------------------------------------------------------------------------------
# factory helpers: dumps as torch 2.13 writes them


def entry(seq: int, group: tuple[str, str] = ("0", "default_pg"), pg_id: int = 0, **fields: Any) -> dict:
    """One recorder entry: a completed gloo all_reduce of 10 floats, number `seq`, issued 100 - seq s before
    NOW_NS."""
    found = {
        "record_id": seq,
        "pg_id": pg_id,
        "process_group": group,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": "gloo:all_reduce",
        "time_created_ns": NOW_NS - (100 - seq) * 10**9,
        "input_sizes": [[10]],
        "input_dtypes": ["Float"],
        "output_sizes": [[10]],
        "output_dtypes": ["Float"],
        "state": "scheduled",
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": True,
        "timeout_ms": 30_000,
        "is_p2p": False,
        "thread_id": "1",
        "thread_name": "python",
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 3245}],
    }
    return found | fields


def dump(entries: list[dict], status: dict | None = None, version: str = "2.10", members: dict | None = None):
    """A dump's document: its entries, pg_status by group id (derived from the entries if not given) and
    pg_config (gloo's: none listed)."""
    if status is None:
        status = {}
        for found in entries:
            numbers = status.setdefault(str(found["pg_id"]), {"last_enqueued_collective": 0})
            numbers["last_enqueued_collective"] = max(
                numbers["last_enqueued_collective"], found["collective_seq_id"]
            )
            done = [e["collective_seq_id"] for e in entries if e["pg_id"] == found["pg_id"] and e["retired"]]
            numbers["last_completed_collective"] = max(done, default=-1)
            numbers["last_started_collective"] = -1
    config = members or {"": {"name": "", "desc": "", "ranks": "[]"}}
    return {
        "version": version,
        "comm_lib_version": "",
        "pg_config": config,
        "pg_status": status,
        "entries": entries,
    }


def hung_world(rank: int, behind: bool = False, op: str = "gloo:all_reduce") -> dict:
    """Rank `rank`'s dump of a world group hung in collective 5 (issued 60 s before NOW_NS), or, `behind`,
    of a rank that never issued it."""
    done = [entry(seq) for seq in range(1, 5)]
    if behind:
        return dump(done)
    waiting = entry(5, profiling_name=op, retired=False, time_created_ns=NOW_NS - 60 * 10**9)
    return dump([*done, waiting])


def write_dumps(directory: Path, documents: dict[int, Any], prefix: str = "trace_") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, document in documents.items():
        path = directory / f"{prefix}{rank}"
        path.write_bytes(document if isinstance(document, bytes) else pickle.dumps(document, protocol=2))
        os.utime(path, (NOW_NS / 1e9, NOW_NS / 1e9))
    return directory


def flare(*args: str) -> tuple[int, str, str]:
    """`flare ARGS` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------------------
# the loader: hostile, broken and odd dumps


class RunsCode:
    """What a hostile pickle holds: unpickling it calls os.system, which writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    hostile = dump([entry(1)])
    hostile["entries"][0]["frames"] = [RunsCode(marker)]  # deep inside an otherwise good dump
    directory = write_dumps(tmp_path / "dumps", {0: hung_world(0), 1: hostile})
    code, out, err = flare("diagnose", "--flight-recorder", str(directory), "--json")
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert err.count("\n") == 1 and str(directory / "trace_1") in err and "refused" in err
    assert "system" in err  # names what it asked for
    assert not marker.exists()
    pickle.loads((directory / "trace_1").read_bytes())  # the payload is real: pickle's own loader runs it
    assert marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(getattr, protocol=2),  # GLOBAL __builtin__ getattr: even builtins are refused
        pickle.dumps(os.system, protocol=4),  # STACK_GLOBAL posix system
        pickle.dumps({"version": "2.10", "entries": [shutil.rmtree]}, protocol=2),
        b"\x80\x02P1\n.",  # a persistent id
    ],
)
def test_no_class_or_function_a_pickle_names_is_loaded(tmp_path, payload):
    path = write_dumps(tmp_path, {0: payload}) / "trace_0"
    with pytest.raises(DumpError, match="refused") as error:
        flight_recorder.read_dump(str(path), 0)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "content, message",
    [
        (pickle.dumps(hung_world(0), protocol=2)[:300], "not a readable pickle"),  # truncated
        (b"rank 0 log: all good\n", "neither a pickle nor JSON"),
        (b"", "empty"),
        (pickle.dumps([1, 2, 3], protocol=2), "not a flight-recorder dump (a list)"),
        (pickle.dumps({"version": "2.10"}, protocol=2), "not a flight-recorder dump"),  # no entries
        (pickle.dumps({"entries": "x", "version": "2.10"}, protocol=2), "not a flight-recorder dump"),
        (b'{"version": "2.10", "entries": [', "not readable JSON"),
    ],
)
def test_a_file_that_is_not_a_dump_is_one_line_naming_it(tmp_path, content, message):
    directory = write_dumps(tmp_path, {0: hung_world(0), 1: content})
    code, out, err = flare("diagnose", "--flight-recorder", str(directory))
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert err.count("\n") == 1 and f"flight-recorder dump {directory / 'trace_1'}: " in err
    assert message in err


def test_a_dump_larger_than_the_bound_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(flight_recorder, "MAX_DUMP_BYTES", 64)
    path = write_dumps(tmp_path, {0: hung_world(0)}) / "trace_0"
    with pytest.raises(DumpError, match="larger than 64 bytes"):
        flight_recorder.read_dump(str(path), 0)


def test_fields_of_the_wrong_type_are_left_out(tmp_path):
    odd = hung_world(0)
    odd["entries"] += ["not an entry", {"profiling_name": 7}, entry(6, time_created_ns="soon")]
    odd["entries"][4]["input_sizes"] = [[2**40, 2**40], "x", [[1]], [10**30]]  # the one in flight
    odd["pg_status"] = {"0": "broken", "9": {"last_enqueued_collective": "x"}}
    found = records.parse_dump(odd, 0, "odd", None)
    assert found.issued == {"world": 5} and found.completed == {"world": 4}  # entry 6 has no time
    assert found.unfinished[0].nbytes == 2**63 - 1 and found.status == {"world": records.GroupStatus(0, 0)}


def test_a_directory_of_no_dump_cannot_decide_and_several_prefixes_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = flare("diagnose", "--flight-recorder", str(tmp_path / "empty"))
    assert code == cli.EXIT_UNDECIDED and "no flight-recorder dump" in err
    directory = write_dumps(tmp_path / "mixed", {0: hung_world(0)})
    write_dumps(directory, {0: hung_world(0)}, prefix="other_")
    code, _, err = flare("diagnose", "--flight-recorder", str(directory))
    assert code == cli.EXIT_USAGE and "several prefixes ('other_', 'trace_')" in err
    # the prefix picks one: a path that is not a directory
    assert flare("diagnose", "--flight-recorder", str(directory / "other_"))[0] == cli.EXIT_ANOMALY


# ---------------------------------------------------------------------------------------------------------
# records and verdicts from dumps


def diagnose(directory: Path, *flags: str) -> dict:
    code, report = flare_json("diagnose", "--flight-recorder", str(directory), *flags)
    assert code in (cli.EXIT_OK, cli.EXIT_ANOMALY), report
    return report


def test_a_rank_that_never_issued_the_collective_is_named_by_the_run_s_own_timeout(tmp_path):
    dumps = {rank: hung_world(rank, behind=rank == 2) for rank in range(4)}
    report = diagnose(write_dumps(tmp_path, dumps))
    assert report["source"] == f"flight-recorder {tmp_path}" and report["ranks_seen"] == 4
    # no threshold told: the collective's own timeout (30 s), which it has outlived (60 s at the dump)
    assert (report["hang_seconds"], report["hang_seconds_from"]) == (30.0, "run")
    assert report["timestamp_seconds"] == NOW_NS / 1e9 and report["world_size"] == 4
    (verdict,) = report["verdicts"]
    assert (verdict["kind"], verdict["ranks"], verdict["group"], verdict["cause"]) == (
        "hang",
        [2],
        "world",
        "deadlock",
    )
    assert verdict["evidence"]["last_issued_seq"] == {"2": 4} and verdict["evidence"]["max_issued_seq"] == 5
    assert verdict["evidence"]["oldest_in_flight_seconds"] == 60.0
    # a dump is written because something timed out: a rank behind is named whatever the wait's age
    (verdict,) = diagnose(tmp_path, "--hang-seconds", "900")["verdicts"]
    assert (verdict["kind"], verdict["ranks"]) == ("hang", [2])
    # where every rank is inside the collective, a longer threshold shows no hang yet
    inside = write_dumps(tmp_path / "inside", {rank: hung_world(rank) for rank in range(4)})
    assert diagnose(inside, "--hang-seconds", "900")["verdicts"] == []


def stage(rank: int, *waiting: str) -> dict:
    """A pipeline stage's dump: 4 completed all-reduces, then its sends and receives in flight (profiling
    names as the recorder writes them: `gloo:send 1->2`, `gloo:recv 3<-2`), issued 8 s before the dump."""
    p2p = [
        entry(0, profiling_name=name, is_p2p=True, retired=False, time_created_ns=NOW_NS - 8 * 10**9)
        for name in waiting
    ]
    return dump([*(entry(seq) for seq in range(1, 5)), *p2p])


def test_point_to_point_entries_lead_to_the_stage_that_never_issued_its_side(tmp_path):
    # stage 2 is stuck in its own code: stage 1's send to it and stage 3's receive from it wait
    dumps = {
        0: stage(0, "gloo:send 0->1"),
        1: stage(1, "gloo:send 1->2"),
        2: stage(2),
        3: stage(3, "gloo:recv 3<-2"),
    }
    report = diagnose(write_dumps(tmp_path, dumps))
    (verdict,) = report["verdicts"]  # 8 s old, under the 30 s timeout: judged because the dumps were written
    assert (verdict["kind"], verdict["ranks"]) == ("hang", [2])
    assert verdict["evidence"]["held_up"] == [0, 1, 3]  # stage 0 waits for stage 1, which waits for 2
    # both sides of one transfer in flight wait for neither; two stages that both send first: a deadlock
    dumps = {0: stage(0), 1: stage(1, "gloo:send 1->2"), 2: stage(2, "gloo:send 2->1"), 3: stage(3)}
    (verdict,) = diagnose(write_dumps(tmp_path / "deadlock", dumps))["verdicts"]
    assert (verdict["ranks"], verdict["evidence"]["cycle"]) == ([1, 2], [1, 2])


def test_a_collective_of_another_op_is_a_mismatch_and_its_sizes_count(tmp_path):
    dumps = {
        rank: hung_world(rank, op="gloo:broadcast" if rank == 1 else "gloo:all_reduce") for rank in range(4)
    }
    (verdict,) = diagnose(write_dumps(tmp_path, dumps))["verdicts"]
    assert (verdict["kind"], verdict["ranks"], verdict["cause"]) == ("mismatch", [1], "collective_mismatch")
    assert verdict["evidence"]["in_flight"]["1"] == {
        "op": "broadcast", "seq": 5, "bytes": 40, "state": "issued", "age_seconds": 60.0
    }  # fmt: skip
    bigger = {rank: hung_world(rank) for rank in range(3)}
    bigger[3] = hung_world(3)
    bigger[3]["entries"][-1].update(input_sizes=[[3, 4]], input_dtypes=["BFloat16"])
    (verdict,) = diagnose(write_dumps(tmp_path / "sizes", bigger))["verdicts"]
    assert (verdict["kind"], verdict["ranks"]) == ("mismatch", [3])
    assert verdict["evidence"]["in_flight"]["3"]["bytes"] == 24


def test_missing_ranks_are_gone_and_explain_the_groups_that_wait_on_them(tmp_path):
    pair = ("2", "undefined")  # gloo: the dumps do not list the pair's members
    dumps = {rank: hung_world(rank) for rank in (0, 1)}
    dumps[3] = dump(
        [entry(seq) for seq in range(1, 5)]
        + [entry(3, pair, 1, retired=False, time_created_ns=NOW_NS - 50 * 10**9)]
    )
    report = diagnose(write_dumps(tmp_path, dumps), "--hang-seconds", "10")
    assert report["world_size"] == 4 and report["ranks_seen"] == 3
    (verdict,) = report["verdicts"]  # and no verdict on the pair group of 3 and the frozen rank
    assert (verdict["kind"], verdict["ranks"], verdict["cause"]) == ("rank_down", [2], "node_failure")
    assert verdict["evidence"]["ranks"]["2"]["reason"] == records.NO_DUMP
    assert verdict["evidence"]["hung_groups"] == ["group-pg2", "world"]


def test_dumps_of_different_versions_are_read_together(tmp_path):
    old = {  # torch 2.1: seq_id, no process_group, no pg_status, no dtypes
        "version": "2.1",
        "entries": [
            {
                k: v
                for k, v in entry(seq).items()
                if k not in ("process_group", "collective_seq_id", "input_dtypes")
            }
            | {"seq_id": seq}
            for seq in range(1, 5)
        ],
    }
    json_dump = json.dumps(hung_world(3)).encode()  # _dump_fr_trace_json's form
    dumps = {0: hung_world(0), 1: hung_world(1, behind=True), 2: old, 3: json_dump}
    report = diagnose(write_dumps(tmp_path, dumps), "--hang-seconds", "10")
    (verdict,) = report["verdicts"]
    assert (verdict["kind"], verdict["ranks"]) == ("hang", [1, 2])
    assert verdict["evidence"]["last_issued_seq"] == {"1": 4, "2": 4}


def test_groups_are_named_as_flare_s_ranks_name_them_where_the_dump_lists_members(tmp_path):
    members = {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
        "3": {"name": "3", "desc": "TP group", "ranks": "[2, 3]"},
    }
    found = records.parse_dump(dump([entry(1, ("3", "TP group"), 2)], members=members), 2, "nccl", None)
    (group,) = found.issued
    assert group == groups.group_name("TP group", [3, 2]) and group.startswith("tp_group-")
    assert found.members == {"world": (0, 1, 2, 3), group: (2, 3)} and found.world_size == 4
    assert records.group_name("1", "undefined") == "group-pg1" and records.group_name("0", "") == "world"


NCCL_GROUPS = {
    "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
    "1": {"name": "1", "desc": "dp", "ranks": "[0, 1]"},
    "2": {"name": "2", "desc": "tp", "ranks": "[2, 3]"},
}


def nccl_dump(groups: list[tuple[str, str, int]]) -> dict:
    """An NCCL rank's dump listing every group's members, with an unfinished collective, started on the
    device, in each of `groups` ((name, description, number))."""
    waiting = [
        entry(seq, (name, desc), int(name), profiling_name="nccl:all_reduce", retired=False, state="started")
        for name, desc, seq in groups
    ]
    return dump(waiting, members=NCCL_GROUPS)


def test_members_the_dumps_list_count_even_where_they_recorded_nothing(tmp_path):
    dumps = {0: nccl_dump([("1", "dp", 1)]), 1: dump([], members=NCCL_GROUPS), 2: nccl_dump([("2", "tp", 1)])}
    report = diagnose(write_dumps(tmp_path, dumps))  # no rank 3: the last rank, known from the members
    assert report["world_size"] == 4 and report["ranks_seen"] == 3
    kinds = [(verdict["kind"], verdict["ranks"], verdict["group"]) for verdict in report["verdicts"]]
    # rank 1 never issued dp's first collective; rank 2's tp partner, rank 3, left no dump
    assert kinds == [("rank_down", [3], None), ("hang", [1], groups.group_name("dp", [0, 1]))]
    assert report["verdicts"][0]["evidence"]["hung_groups"] == [groups.group_name("tp", [2, 3])]
    code, view = flare_json("ranks", "--flight-recorder", str(tmp_path))
    assert view["ranks"][0]["in_flight"]["state"] == "started"


def test_the_ranks_and_hang_views_read_dumps_too(tmp_path):
    dumps = {rank: hung_world(rank, behind=rank == 2) for rank in range(4)}
    code, report = flare_json("hang", "--flight-recorder", str(write_dumps(tmp_path, dumps)))
    assert code == cli.EXIT_ANOMALY
    (world,) = report["groups"]
    assert (world["group"], world["behind"], world["hung"], world["max_issued_seq"]) == (
        "world",
        [2],
        True,
        5,
    )
    code, report = flare_json("ranks", "--flight-recorder", str(tmp_path))
    rows = {row["rank"]: row for row in report["ranks"]}
    assert rows[2]["in_flight"] is None and rows[0]["in_flight"]["op"] == "all_reduce"
    assert rows[0]["heartbeat_age_seconds"] == 60.0


def test_the_report_over_dumps_alone_judges_the_moment_they_show(tmp_path):
    dumps = {rank: hung_world(rank, behind=rank == 2) for rank in range(4)}
    code, report = flare_json("report", "--flight-recorder", str(write_dumps(tmp_path, dumps)))
    assert code == cli.EXIT_ANOMALY and report["verdicts_from"] == "flight_recorder"
    assert [(v["kind"], v["ranks"]) for v in report["verdicts"]] == [("hang", [2])]
    assert report["flight_recorder"]["hang_seconds_from"] == "run"
    assert report["ranks"]["0"]["sources"] == ["flight-recorder"]


# ---------------------------------------------------------------------------------------------------------
# real gloo jobs, the recorder dumped by its watchdog

RANKS = 4
FAULT_RANK = 2
FAULT_STEP = 10
DUMP_AFTER = 2.0  # seconds a collective is in flight before the watchdog dumps
HANG = "1"  # flare's threshold: below DUMP_AFTER, so that the collectives in flight count as hung
SCENARIOS = {  # fault -> (train_ddp's --fault, the verdict expected: kind and ranks)
    "stuck": ("stuck", ("hang", [FAULT_RANK])),
    "stop": ("none", ("rank_down", [FAULT_RANK])),
    "mismatch": ("mismatch", ("mismatch", [FAULT_RANK])),
}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def dumped(request, tmp_path_factory):
    """A 4-rank gloo job (world plus pair groups) with the recorder on and one faulty rank, killed once every
    rank that can has dumped its recorder and written its hang incident: the directory holding both."""
    name = request.param
    fault, _ = SCENARIOS[name]
    work = tmp_path_factory.mktemp(f"fr-{name}")
    directory = work / "flight-recorder"
    directory.mkdir()
    env = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": str(directory / "trace_"),
        "FLARE_INCIDENT_DIR": str(directory),
        "FLARE_HANG_SECONDS": str(DUMP_AFTER),
        "FLARE_STALL_SECONDS": "1",
    }
    args = [
        "--steps", "100000", "--step-seconds", "0.05", "--pair-groups", "--pg-timeout", "120",
        "--fr-dump-after", str(DUMP_AFTER), "--fault", fault, "--fault-rank", str(FAULT_RANK),
        "--fault-step", str(FAULT_STEP),
    ]  # fmt: skip
    with jobs.ObservedJob(str(work), train_ddp.__file__, args, RANKS, f"fr-{name}", env=env) as job:
        if name == "stop":
            await_steps(job, FAULT_STEP)
            os.kill(job.processes[FAULT_RANK].pid, signal.SIGSTOP)
        alive = [rank for rank in range(RANKS) if name != "stop" or rank != FAULT_RANK]
        expected = [directory / f"trace_{rank}" for rank in alive]
        expected += [directory / f"fr-{name}-rank{rank}.json" for rank in alive]
        try:
            wait_for(lambda: all(path.exists() for path in expected), 120, "every dump and hang incident")
        except TimeoutError:
            pytest.fail(f"{name}: {sorted(os.listdir(directory))}\n{job.log_tail(0, 40)}")
        job.kill()
    return name, directory


def await_steps(job: jobs.ObservedJob, steps: int) -> None:
    def stepped() -> bool:
        results = scrape.scrape_all(job.targets, timeout=2)
        return all(
            isinstance(samples, list) and (scrape.value(samples, "flare_steps_total") or 0) >= steps
            for samples in results.values()
        )

    wait_for(stepped, 120, f"every rank to take {steps} steps")


def only(directory: Path, target: Path, kept: str) -> Path:
    """A copy of the files of `directory` whose names `kept` matches (dumps: trace_N; incidents: *.json)."""
    target.mkdir()
    for path in directory.iterdir():
        if (path.suffix == ".json") == (kept == "incidents") and not path.name.startswith("."):
            shutil.copy2(path, target / path.name)
    return target


@pytest.mark.multirank
def test_the_dumps_alone_name_the_faulty_rank(dumped, tmp_path):
    name, directory = dumped
    dumps = only(directory, tmp_path / "dumps", "dumps")
    started = time.perf_counter()
    code, report = flare_json("diagnose", "--flight-recorder", str(dumps), "--hang-seconds", HANG)
    elapsed = time.perf_counter() - started
    expected = SCENARIOS[name][1]
    assert code == cli.EXIT_ANOMALY and report["verdicts"], report
    assert (report["verdicts"][0]["kind"], report["verdicts"][0]["ranks"]) == expected, report["verdicts"]
    assert report["world_size"] == RANKS and report["source"] == f"flight-recorder {dumps}"
    assert elapsed < 5, elapsed
    if name == "mismatch":
        in_flight = report["verdicts"][0]["evidence"]["in_flight"]
        assert in_flight[str(FAULT_RANK)]["op"] == "broadcast"
        assert {in_flight[rank]["op"] for rank in in_flight if rank != str(FAULT_RANK)} == {"all_reduce"}
    if name == "stuck":  # the rank in the faulty rank's pair waits on it there: the chain ends at it
        chain = report["verdicts"][0]["evidence"]["chain"]
        assert {hop["rank"] for hop in chain} >= {FAULT_RANK}


@pytest.mark.multirank
def test_the_incident_files_alone_carry_the_recorder_and_name_it_too(dumped, tmp_path):
    name, directory = dumped
    incidents = only(directory, tmp_path / "incidents", "incidents")
    code, report = flare_json("diagnose", "--flight-recorder", str(incidents), "--hang-seconds", HANG)
    assert code == cli.EXIT_ANOMALY and report["verdicts"], report
    assert (report["verdicts"][0]["kind"], report["verdicts"][0]["ranks"]) == SCENARIOS[name][1]
    assert report["run"] == f"fr-{name}"
    written = json.loads((incidents / f"fr-{name}-rank0.json").read_text())["flight_recorder"]
    assert written["entries"] and written["pg_status"] and "pg_config" in written  # gloo's: no members


@pytest.mark.multirank
def test_the_report_over_the_directory_of_both_names_it(dumped):
    name, directory = dumped
    code, report = flare_json("report", "--flight-recorder", str(directory), "--hang-seconds", HANG)
    assert code == cli.EXIT_ANOMALY, report
    assert (report["verdicts"][0]["kind"], report["verdicts"][0]["ranks"]) == SCENARIOS[name][1]
    assert report["run"] == f"fr-{name}" and report["world_size"] == RANKS
    heard = [rank for rank in range(RANKS) if name != "stop" or rank != FAULT_RANK]
    assert report["flight_recorder"]["ranks_without_dump"] == sorted(set(range(RANKS)) - set(heard))
    assert all("incident" in report["ranks"][str(rank)]["sources"] for rank in heard)
