"""The cause every verdict carries: the rules engine's verdict kinds mapped to flare_exporter.causes.

Rules, in order (versioned with flare_exporter.causes.CAUSE_RULES_VERSION):
- a verdict that has a cause already keeps it (the post-mortem rules set theirs);
- mismatch -> collective_mismatch; straggler -> straggler; an ILD shift on a rank or host -> straggler (a
  slow host), on the whole job -> unknown (software, driver or configuration, not one rank);
- rank_down (and a host_fault over it): a culprit that vanished without a word -> node_failure; else the
  cause its exception was classified as, where the rank exported one (a survivor's: communication);
  else software_exception;
- hang in a group whose members are all inside the collective -> communication; a culprit stalled
  waiting for its input (activity `data`) -> data_stall; otherwise a rank never reached the collective the
  others wait in -> deadlock;
- canary (a check of the hardware canary failed, by its evidence's measurement): storage_read -> storage;
  all-reduce and all-gather bus bandwidth -> communication (the link); compute, copies and the GPU's state
  -> straggler (a slow device: fail-slow, not failed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .. import causes
from ..causes import Cause
from .verdict_terms import Domain, VerdictKind


class Culprit(Protocol):
    """What the cause rules read of a culprit's record (rule_types.RankRecord)."""

    @property
    def exception(self) -> str: ...

    @property
    def exception_cause(self) -> str: ...

    @property
    def activity(self) -> str: ...


CANARY_CAUSES: dict[str, Cause] = {
    "storage_read": "storage",
    "allreduce_busbw": "communication",
    "allgather_busbw": "communication",
}


def cause_of(
    kind: VerdictKind, domain: Domain, culprits: Sequence[Culprit], evidence: Mapping[str, Any] | None = None
) -> Cause:
    """The cause of a verdict of `kind` over `domain` that names `culprits` (their records), with its
    `evidence` (a canary verdict's names its measurement)."""
    if kind == "canary":
        return CANARY_CAUSES.get(str((evidence or {}).get("measurement", "")), "straggler")
    if kind == "mismatch":
        return "collective_mismatch"
    if kind == "straggler":
        return "straggler"
    if kind == "ild_regression":
        return "straggler" if domain in ("rank", "host") else "unknown"
    if kind in ("rank_down", "host_fault"):
        return _gone_cause(culprits)
    if kind == "hang":
        return _hang_cause(domain, culprits)
    return "unknown"


def _gone_cause(records: Sequence[Culprit]) -> Cause:
    if not records or any(not record.exception for record in records):
        return "node_failure"
    found = {cause for cause in (record.exception_cause for record in records) if causes.is_cause(cause)}
    primary = sorted(found - causes.SECONDARY_CAUSES)
    if primary:
        return primary[0]
    return "communication" if found else "software_exception"


def _hang_cause(domain: Domain, records: Sequence[Culprit]) -> Cause:
    if domain == "group":
        return "communication"
    activities = {record.activity for record in records}
    return "data_stall" if activities == {"data"} else "deadlock"
