"""A small client for the Prometheus HTTP API (instant and range queries), with one-line errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused the query; the message says which and why."""


def query(base_url: str, expr: str, timeout: float = 10.0, at: float | None = None) -> list[dict[str, Any]]:
    """The result vector of an instant query: [{"metric": {labels}, "value": [ts, "v"]}, ...]."""
    params = {"query": expr}
    if at is not None:
        params["time"] = repr(at)
    return _api(base_url, "query", params, timeout)


def query_range(
    base_url: str, expr: str, start: float, end: float, step: float, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The result matrix of a range query: [{"metric": {labels}, "values": [[ts, "v"], ...]}, ...]."""
    params = {"query": expr, "start": repr(start), "end": repr(end), "step": repr(step)}
    return _api(base_url, "query_range", params, timeout)


def _api(base_url: str, endpoint: str, params: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """The `result` of /api/v1/<endpoint>; PrometheusError (one line) for every way it can fail."""
    expr = params["query"]
    url = base_url.rstrip("/") + f"/api/v1/{endpoint}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        try:
            detail = json.load(error).get("error", error.reason)
        except ValueError:
            detail = error.reason
        raise PrometheusError(f"Prometheus at {base_url} rejected {expr!r}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        reason = getattr(error, "reason", error)
        raise PrometheusError(f"cannot reach Prometheus at {base_url}: {reason}") from None
    except ValueError:
        raise PrometheusError(f"Prometheus at {base_url} answered with something that is not JSON") from None
    if body.get("status") != "success":
        raise PrometheusError(
            f"Prometheus at {base_url} failed {expr!r}: {body.get('error', 'unknown error')}"
        )
    return list(body["data"]["result"])


def values_by(results: list[dict[str, Any]], label: str) -> dict[str, float]:
    """{label value: sample value} for a query result (e.g. by rank)."""
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in results}
