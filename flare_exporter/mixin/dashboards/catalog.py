"""The four dashboards, in the order of their links."""

from __future__ import annotations

from .collectives import collectives
from .issue_latency import issue_latency
from .model import Dashboard
from .overview import overview
from .rank_detail import rank_detail


def dashboards() -> tuple[Dashboard, ...]:
    """Every dashboard: the run overview, the collectives, issue latency and the rank detail."""
    return (overview(), collectives(), issue_latency(), rank_detail())
