"""flare-exporter: per-rank Prometheus exporters that say which rank slowed or hung a PyTorch job."""

from .attach import Attachment, attach

__all__ = ["attach", "Attachment"]
__version__ = "0.1.0"
