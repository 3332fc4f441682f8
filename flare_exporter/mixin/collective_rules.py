"""Recording and alert rules of the collectives: a hung process group, and the rank the metrics name for it
(one behind, one ahead, one whose op or size differs), as diagnosis.py decides; and the point-to-point
wait-for edges (wait_for.py) where a send or receive waits for a peer that never issues its side, or two
ranks wait for each other. Wired into the rules file by RULE_GROUPS (rules.py): the recordings in
flare.recording, the alerts as the group flare.collectives.
"""

from __future__ import annotations

from .. import config as config_module
from .. import spec
from .rule_model import Alert, Recording, Thresholds, link, selector, up_selector
from .rule_model import with_host as _with_host

COLLECTIVE_IN_FLIGHT_BYTES = spec.series("flare_collective_in_flight_bytes")
COLLECTIVE_IN_FLIGHT_INFO = spec.series("flare_collective_in_flight_info")
COLLECTIVE_IN_FLIGHT_SEQ = spec.series("flare_collective_in_flight_seq")
IN_FLIGHT_STARTED = spec.series("flare_collective_in_flight_started_timestamp_seconds")
COLLECTIVE_LAST_ISSUED_SEQ = spec.series("flare_collective_last_issued_seq")
HANG_THRESHOLD_SECONDS = spec.series("flare_hang_threshold_seconds")
P2P_COMPLETED_TOTAL = spec.series("flare_p2p_completed_total")
P2P_IN_FLIGHT_STARTED_TIMESTAMP_SECONDS = spec.series("flare_p2p_in_flight_started_timestamp_seconds")
P2P_ISSUED_TOTAL = spec.series("flare_p2p_issued_total")
RANK_STACK_INFO = spec.series("flare_rank_stack_info")

# Each run's own hang threshold (see Thresholds.hang_seconds).
RUN_HANG_THRESHOLD = "run:flare_hang_threshold_seconds:max"


# ---------------------------------------------------------------------------------------------------------
# recording rules: collectives in flight and who is behind


def collective_recordings(t: Thresholds) -> list[Recording]:
    """Collectives in flight, the hang threshold, who is behind and who met at the front; point to point."""
    return [
        *_in_flight_age_recordings(t),
        *_hang_threshold_recordings(t),
        *_behind_recordings(t),
        *_front_recordings(t),
        *_point_to_point_recordings(t),
    ]


def _in_flight_age_recordings(t: Thresholds) -> list[Recording]:
    """How long each rank's oldest unfinished collective has been in flight, and the group's worst."""
    return [
        Recording(
            "run_group_rank:flare_collective_in_flight:age_seconds",
            f"max by (run, group, rank) (time() - {IN_FLIGHT_STARTED}{selector(t)})",
        ),
        Recording(
            "run_group:flare_collective_in_flight:max_age_seconds",
            "max by (run, group) (run_group_rank:flare_collective_in_flight:age_seconds)",
        ),
    ]


def _hang_threshold_recordings(t: Thresholds) -> list[Recording]:
    """Each run's hang threshold, where the rules judge every run by its own (Thresholds.hang_seconds None):
    the largest its ranks export, else the default for a run with collectives in flight that exports none."""
    if t.hang_seconds is not None:
        return []
    return [
        Recording(
            RUN_HANG_THRESHOLD,
            f"max by (run) ({HANG_THRESHOLD_SECONDS}{selector(t)})\n"
            "or on (run)\n"
            f"  0 * max by (run) ({IN_FLIGHT_STARTED}{selector(t)})"
            f" + {config_module.Config.hang_seconds:g}",
        )
    ]


def _behind_recordings(t: Thresholds) -> list[Recording]:
    """How many collectives each rank is behind the furthest rank of its group; which ranks' numbers the hang
    alerts may judge, and how many ranks are behind and in all."""
    s = selector(t)
    issued = "run_group_rank:flare_collective_issued"
    return [
        Recording(
            f"{issued}:behind",
            "max by (run, group, rank) (\n"
            f"  max by (run, group) ({COLLECTIVE_LAST_ISSUED_SEQ}{s})\n"
            f"  - on (run, group) group_right {COLLECTIVE_LAST_ISSUED_SEQ}{s}\n)",
        ),
        # The same, of the ranks whose issued number was scraped after the evidence against them: after
        # their group's newest issue (the newest collective in flight in it) and once the group was hung (its
        # oldest collective in flight for the threshold). A number scraped before (the rank's scrapes late:
        # a lagging shard, a Prometheus behind at thousands of ranks) shows where the rank was then, not
        # whether it issued what its group waits in: the hang alerts do not judge it
        # (diagnosis.GroupHang.judges). From raw series, so that a store that sees a recording's result one
        # evaluation later (vmalert) pages no later for it.
        Recording(
            f"{issued}:behind_since_stall",
            f"{issued}:behind\n"
            "and on (run, group, rank) (\n"
            f"  max by (run, group, rank) (timestamp({COLLECTIVE_LAST_ISSUED_SEQ}{s}))\n"
            "  > on (run, group) group_left\n"
            f"    max by (run, group) ({IN_FLIGHT_STARTED}{s})\n"
            "  >= on (run, group) group_left () (\n"
            f"    min by (run, group) ({IN_FLIGHT_STARTED}{s})\n"
            f"    + {_threshold(t)}\n"
            "  )\n)",
        ),
        Recording(
            "run_group:flare_collective_issued:behind_ranks",
            f"count by (run, group) ({issued}:behind_since_stall > 0)",
        ),
        Recording(
            "run_group:flare_collective_issued:ranks",
            f"count by (run, group) ({COLLECTIVE_LAST_ISSUED_SEQ}{s})",
        ),
    ]


def _front_recordings(t: Thresholds) -> list[Recording]:
    """Ranks whose oldest unfinished collective is the group's newest (the ones that met at the front),
    how many of them wait in each op, and the sizes they wait with."""
    s = selector(t)
    return [
        Recording(
            "run_group_rank_op:flare_collective_in_flight:at_front",
            f"max by (run, group, rank, op) ({COLLECTIVE_IN_FLIGHT_INFO}{s})\n"
            f"and on (run, group, rank)\n"
            f"  ({COLLECTIVE_IN_FLIGHT_SEQ}{s}\n"
            f"   == on (run, group) group_left max by (run, group) ({COLLECTIVE_LAST_ISSUED_SEQ}{s}))",
        ),
        Recording(
            "run_group_op:flare_collective_in_flight:at_front_ranks",
            "count by (run, group, op) (run_group_rank_op:flare_collective_in_flight:at_front)",
        ),
        Recording(
            "run_group_rank:flare_collective_in_flight:at_front_bytes",
            f"max by (run, group, rank) ({COLLECTIVE_IN_FLIGHT_BYTES}{s})\n"
            "and on (run, group, rank) run_group_rank_op:flare_collective_in_flight:at_front",
        ),
    ]


P2P_KEY = "run, group, rank, peer, direction"
P2P_WAITS = "run_group_rank_peer:flare_p2p:waits_for_seconds"


def _peer_view(expr: str, by: str) -> str:
    """`expr` (series by `by`, which holds rank and peer) with its rank and peer labels swapped."""
    kept = f'label_replace({expr}, "swapped", "$1", "rank", "(.*)")'
    moved = f'label_replace({kept}, "rank", "$1", "peer", "(.*)")'
    return f'max by ({by}) (label_replace({moved}, "peer", "$1", "swapped", "(.*)"))'


def _matching_issued(t: Thresholds, direction: str, opposite: str) -> str:
    """The peers' counts of their ops of `direction`, as the view of the rank at the other end, whose op is
    of the `opposite` direction: the n-th send from A to B is B's n-th receive from A."""
    matcher = 'direction="' + direction + '"'
    issued = f"max by ({P2P_KEY}) ({P2P_ISSUED_TOTAL}{selector(t, matcher)})"
    flipped = f'label_replace({issued}, "direction", "{opposite}", "direction", "{direction}")'
    return _peer_view(flipped, P2P_KEY)


def _point_to_point_recordings(t: Thresholds) -> list[Recording]:
    """The wait-for graph's point-to-point edges (wait_for.py): how long each rank's oldest send or receive
    per peer and direction has been in flight, how many of the matching op its peer issued, and the edges
    where the peer has not issued it (the value: the wait's age)."""
    s = selector(t)
    counterpart = "run_group_rank_peer:flare_p2p_counterpart:issued"
    return [
        Recording(
            "run_group_rank_peer:flare_p2p_in_flight:age_seconds",
            f"max by ({P2P_KEY}) (time() - {P2P_IN_FLIGHT_STARTED_TIMESTAMP_SECONDS}{s})",
        ),
        # the peer's count of the matching op, as this rank's series; 0 where the peer has none (it never
        # issued one, or it is gone)
        Recording(
            counterpart,
            f"{_matching_issued(t, 'recv', 'send')}\nor\n{_matching_issued(t, 'send', 'recv')}\n"
            f"or\n0 * max by ({P2P_KEY}) ({P2P_ISSUED_TOTAL}{s})",
        ),
        Recording(
            P2P_WAITS,
            "run_group_rank_peer:flare_p2p_in_flight:age_seconds\n"
            f"and on ({P2P_KEY}) (\n"
            f"  max by ({P2P_KEY}) ({P2P_COMPLETED_TOTAL}{s}) + 1 > on ({P2P_KEY}) {counterpart}\n)",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------
# alert rules


def _threshold(t: Thresholds) -> str:
    """The right-hand side of a comparison of a (run, group) vector with the hang threshold."""
    if t.hang_seconds is not None:
        return f"{t.hang_seconds:g}"
    return f"on (run) group_left () {RUN_HANG_THRESHOLD}"


def _hung(t: Thresholds) -> str:
    gap = " " if t.hang_seconds is not None else "\n  "
    return f"run_group:flare_collective_in_flight:max_age_seconds{gap}>= {_threshold(t)}"


_RANK_FRAMES = (
    f'{{{{ with printf "{RANK_STACK_INFO}{{run=%q, rank=%q}}" $labels.run $labels.rank | query }}}}'
    "{{ with first . }} It is in {{ .Labels.activity }}: {{ .Labels.frames }}.{{ end }}{{ end }}"
)


def collective_alerts(t: Thresholds) -> list[Alert]:
    """A hung group, and the rank the metrics name for it: one behind, one ahead, or one that differs; a
    rank that its peers' sends and receives wait for, and two ranks that wait for each other."""
    return [
        _group_hang(t),
        _hang_culprit(t),
        _extra_collective(t),
        _odd_collective(t),
        _point_to_point_culprit(t),
        _point_to_point_deadlock(t),
    ]


def _point_to_point_culprit(t: Thresholds) -> Alert:
    """A live rank that a peer's send or receive has waited for since the hang threshold, and that waits for
    nobody itself (no send or receive waiting for a peer, no collective in flight): where the chain ends."""
    waits = f"max by (run, group, peer) ({P2P_WAITS} >= {_threshold(t)})"
    waited_for = f'label_replace({waits}, "rank", "$1", "peer", "(.*)")'
    return Alert(
        "FlarePointToPointCulprit",
        _with_host(
            f"max by (run, rank, group) ({waited_for})\n"
            f"  unless on (run, rank) {P2P_WAITS}\n"
            "  unless on (run, rank) run_group_rank:flare_collective_in_flight:age_seconds\n"
            f"  and on (run, rank) (max by (run, rank) (up{up_selector(t)}) == 1)"
        ),
        t.hang_for,
        "critical",
        "Rank {{ $labels.rank }} holds up the sends and receives of group {{ $labels.group }}",
        "In run {{ $labels.run }}, a send or receive of group {{ $labels.group }} has waited "
        "{{ $value | humanizeDuration }} for rank {{ $labels.rank }} (host {{ $labels.host }}), which never "
        "issued its side and waits for nobody." + _RANK_FRAMES,
        "flarepointtopointculprit",
        link("rank", "rank", "group"),
    )


def _point_to_point_deadlock(t: Thresholds) -> Alert:
    """Two ranks whose sends or receives wait for each other (both send first, say); longer cycles only
    `flare hang` follows."""
    back = _peer_view(f"max by (run, group, rank, peer) ({P2P_WAITS})", "run, group, rank, peer")
    return Alert(
        "FlarePointToPointDeadlock",
        _with_host(
            f"max by (run, rank, group) (\n  {P2P_WAITS} >= {_threshold(t)}\n"
            f"  and on (run, group, rank, peer) {back}\n)"
        ),
        t.hang_for,
        "critical",
        "Rank {{ $labels.rank }} is in a deadlock in group {{ $labels.group }}",
        "In run {{ $labels.run }}, rank {{ $labels.rank }} (host {{ $labels.host }}) and a peer of group "
        "{{ $labels.group }} wait for each other's send or receive for {{ $value | humanizeDuration }}: "
        "neither will ever issue its side. `flare hang` names the cycle.",
        "flarepointtopointdeadlock",
        link("rank", "rank", "group"),
    )


def _ranks_of_hung_group(t: Thresholds, ranks: str, behind: str) -> str:
    """The `ranks` (a condition by run, group and rank) of hung groups where the ranks judged behind,
    doubled, compare by `behind` (e.g. `behind_ranks * 2 <=`: a minority) with the group's size.

    Hung as its front says: some rank at the group's top issued number waits in a collective since the
    threshold. Ranks whose scrapes lag still show the old hung collective after it completed, and would
    look behind the ranks scraped since, which wait in nothing (as when a hang ends)."""
    counts = "run_group:flare_collective_issued"
    return _with_host(
        f"max by (run, rank, group) ({ranks})\n"
        f"  and on (run, group) ({_hung(t)})\n"
        f"  and on (run, group) ({behind} {counts}:ranks)\n"
        f"  and on (run, group) ({_front_waiting(t)})"
    )


def _front_waiting(t: Thresholds) -> str:
    """The ranks at their group's top issued number that wait in a collective since the hang threshold (a
    late scrape cannot show a number higher than the rank's; a rank whose collective completed waits in
    nothing)."""
    return (
        "run_group_rank:flare_collective_issued:behind == 0\n"
        f"    and on (run, group, rank) ({_waiting_since_hung(t)})"
    )


def _group_hang(t: Thresholds) -> Alert:
    """A group whose oldest unfinished collective is older than hang_seconds."""
    return Alert(
        "FlareCollectiveHang",
        _hung(t),
        t.hang_for,
        "critical",
        "Group {{ $labels.group }} of run {{ $labels.run }} is hung",
        "A collective of process group {{ $labels.group }} in run {{ $labels.run }} has been unfinished "
        "for {{ $value | humanizeDuration }}. The culprit alerts (FlareCollectiveHangCulprit, "
        "FlareRankDown, FlareCollectiveMismatch) name the rank when the metrics tell; "
        "`flare diagnose` says why.",
        "flarecollectivehang",
        link("collectives", "group"),
    )


def _hang_culprit(t: Thresholds) -> Alert:
    """A rank of a hung group that never issued the collective the others wait in (a minority behind)."""
    return Alert(
        "FlareCollectiveHangCulprit",
        _ranks_of_hung_group(
            t,
            # a rank that itself waits in a collective (of another group) waits on others: the one it waits
            # for is named there, as `flare diagnose` follows the chain
            "run_group_rank:flare_collective_issued:behind_since_stall > 0\n"
            "  unless on (run, rank) run_group_rank:flare_collective_in_flight:age_seconds",
            "run_group:flare_collective_issued:behind_ranks * 2 <=",
        ),
        t.hang_for,
        "critical",
        "Rank {{ $labels.rank }} holds up group {{ $labels.group }} of run {{ $labels.run }}",
        "Group {{ $labels.group }} of run {{ $labels.run }} is hung, and rank {{ $labels.rank }} (host "
        "{{ $labels.host }}) never issued the collective the others wait in: it is {{ $value }} "
        "collective(s) behind." + _RANK_FRAMES,
        "flarecollectivehangculprit",
        link("rank", "rank", "group"),
    )


def _waiting_since_hung(t: Thresholds) -> str:
    """Ranks waiting in a collective of the group for as long as a hang takes: what a rank named for a hung
    group's mismatch does (its own scrape says so, whatever the others' lag)."""
    return f"run_group_rank:flare_collective_in_flight:age_seconds >= {_threshold(t)}"


def _extra_collective(t: Thresholds) -> Alert:
    """A rank of a hung group ahead of most ranks: it issued a collective they never issue."""
    return Alert(
        "FlareCollectiveMismatch",
        _ranks_of_hung_group(
            t,
            # at the top and waiting there itself since the group hung: a rank whose collective completed
            # is not ahead of the others, their scrapes lag it (as when a hang ends)
            _front_waiting(t),
            "run_group:flare_collective_issued:behind_ranks * 2 >",
        ),
        t.mismatch_for,
        "critical",
        "Rank {{ $labels.rank }} issued a collective in group {{ $labels.group }} that most ranks never "
        "issued",
        "In hung group {{ $labels.group }} of run {{ $labels.run }}, rank {{ $labels.rank }} (host "
        "{{ $labels.host }}) is ahead of most ranks: it issued a collective they never issue (a "
        "code path that only some ranks take).",
        "flarecollectivemismatch",
        link("rank", "rank", "group"),
        (("mismatch", "extra_collective"),),
    )


# Ranks at the front of their group in an op fewer ranks wait in than in another, or with a size other than
# the median's: they issued a different collective at the same sequence number.
_ODD_OP = (
    "run_group_rank_op:flare_collective_in_flight:at_front\n"
    "  and on (run, group, op) (run_group_op:flare_collective_in_flight:at_front_ranks\n"
    "    < on (run, group) group_left max by (run, group) "
    "(run_group_op:flare_collective_in_flight:at_front_ranks))"
)
_ODD_SIZE = (
    "run_group_rank:flare_collective_in_flight:at_front_bytes\n"
    "  != on (run, group) group_left quantile by (run, group) "
    "(0.5, run_group_rank:flare_collective_in_flight:at_front_bytes)"
)


def _odd_collective(t: Thresholds) -> Alert:
    """A rank of a hung group that waits in a collective of another op or size than the majority's."""
    return Alert(
        "FlareCollectiveMismatch",
        _with_host(
            f"max by (run, rank, group) (({_ODD_OP})\n  or on (run, group, rank) ({_ODD_SIZE}))\n"
            f"  and on (run, group) ({_hung(t)})\n"
            f"  and on (run, group, rank) ({_waiting_since_hung(t)})"
        ),
        t.mismatch_for,
        "critical",
        "Rank {{ $labels.rank }} issued a different collective in group {{ $labels.group }}",
        "In hung group {{ $labels.group }} of run {{ $labels.run }}, rank {{ $labels.rank }} (host "
        "{{ $labels.host }}) issued a collective with a different op or size than the majority at the "
        "same sequence number.",
        "flarecollectivemismatch",
        link("rank", "rank", "group"),
        (("mismatch", "op_or_size"),),
    )
