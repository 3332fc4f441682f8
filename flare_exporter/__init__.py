"""flare-exporter: per-rank Prometheus exporters that say which rank slowed or hung a PyTorch job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config
    from .rank.attach import Attachment

__all__ = ["attach"]
__version__ = "0.1.0"


def attach(config: Config | None = None) -> Attachment:
    """Observe this process as one rank of a distributed job; see flare_exporter.rank.attach.attach.

    Imported lazily so that `import flare_exporter` (and the launcher's argument checks) need no torch.
    """
    from .rank import attach as attach_module

    return attach_module.attach(config)


def __getattr__(name: str) -> Any:
    if name == "Attachment":
        from .rank.attach import Attachment

        return Attachment
    raise AttributeError(name)
