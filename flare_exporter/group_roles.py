"""A process group's role (dp, tp, pp, ep, cp, world, other) from its name: shared by the rank side, which
labels its groups with it, and the engine, which names it in verdicts and views."""

from __future__ import annotations

import re

# Words of a group's description (a DeviceMesh dimension's name: mesh_dp, mesh_tp; Megatron's and
# torchtitan's) and the role each says; a group is named `<words>-<hash>` (rank/groups.group_name).
_ROLE_WORDS = {
    "dp": "dp", "data": "dp", "fsdp": "dp", "replicate": "dp", "shard": "dp",
    "tp": "tp", "tensor": "tp",
    "pp": "pp", "pipeline": "pp",
    "ep": "ep", "expert": "ep", "moe": "ep",
    "cp": "cp", "context": "cp",
}  # fmt: skip


def group_role(name: str) -> str:
    """dp/tp/pp/ep/cp when the group's description says so, `world` for the world, else `other`."""
    if name == "world":
        return "world"
    for word in re.split(r"[^a-z]+", name.split("-")[0].lower()):
        if word in _ROLE_WORDS:
            return _ROLE_WORDS[word]
    return "other"
