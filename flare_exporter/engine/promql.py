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


def label_values(
    base_url: str, label: str, match: str, start: float, end: float, timeout: float = 10.0
) -> list[str]:
    """The values of `label` on the series that `match` selects with samples from `start` to `end`, from
    Prometheus's index: no sample is read. Prometheus may name values of series whose samples all lie
    before `start` (those of its in-memory head, the last two hours or so)."""
    params = {"match[]": match, "start": repr(start), "end": repr(end)}
    asked = f"the values of {label} on {match}"
    found = _data(base_url, f"label/{label}/values", params, timeout, asked)
    if not isinstance(found, list):
        raise PrometheusError(f"Prometheus at {base_url} answered {asked} without a list")
    return [str(value) for value in found]


def _api(base_url: str, endpoint: str, params: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """The `result` of a query at /api/v1/<endpoint>; PrometheusError (one line) for every way it fails."""
    expr = params["query"]
    data = _data(base_url, endpoint, params, timeout, repr(expr))
    if not isinstance(data, dict) or not isinstance(data.get("result"), list):
        raise PrometheusError(f"Prometheus at {base_url} answered {expr!r} without a result list")
    return list(data["result"])


def _data(base_url: str, endpoint: str, params: dict[str, str], timeout: float, asked: str) -> Any:
    """The `data` of /api/v1/<endpoint>, asked for `asked` (named in errors); PrometheusError (one line)
    for every way it can fail."""
    url = base_url.rstrip("/") + f"/api/v1/{endpoint}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        try:
            detail = json.load(error).get("error", error.reason)
        except ValueError:
            detail = error.reason
        raise PrometheusError(f"Prometheus at {base_url} rejected {asked}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        reason = getattr(error, "reason", error)
        raise PrometheusError(f"cannot reach Prometheus at {base_url}: {reason}") from None
    except ValueError:
        raise PrometheusError(f"Prometheus at {base_url} answered with something that is not JSON") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        why = body.get("error", "unknown error") if isinstance(body, dict) else "not an API answer"
        raise PrometheusError(f"Prometheus at {base_url} failed {asked}: {why}")
    return body.get("data")


def values_by(results: list[dict[str, Any]], label: str) -> dict[str, float]:
    """{label value: sample value} for a query result (e.g. by rank)."""
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in results}
