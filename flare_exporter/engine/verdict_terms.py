"""The words a verdict is made of, each defined once as a Literal type that mypy checks: its kind and its
domain (its cause is flare_exporter.causes.Cause). KINDS, their order, derives from the type."""

from __future__ import annotations

from typing import Literal, get_args

# What a verdict says happened, most severe first (KINDS orders a diagnosis's verdicts).
VerdictKind = Literal["host_fault", "rank_down", "mismatch", "hang", "straggler", "canary", "ild_regression"]
KINDS: tuple[VerdictKind, ...] = get_args(VerdictKind)
# What a verdict blames: one rank, its host, a link, a switch or rack, a process group, or the whole job.
Domain = Literal["rank", "host", "link", "switch", "rack", "group", "job"]
