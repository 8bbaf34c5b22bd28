"""Reading a service's operations endpoint (``--health-port``): plain HTTP GETs
of ``/healthz``, ``/readyz`` and ``/metrics``, and single values out of the
Prometheus text format."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(port: int, path: str) -> tuple[int, str]:
    """``GET http://127.0.0.1:PORT/PATH``: the status and the body, error statuses
    included; ``OSError`` when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metrics(port: int) -> list[str]:
    status, body = get(port, "/metrics")
    if status != 200:
        raise OSError(f"/metrics on port {port} answered {status}")
    return body.splitlines()


def metric(port: int, name: str) -> float:
    """The value of an unlabelled series on ``/metrics``; ``StopIteration`` when
    the series is not there (yet)."""
    return float(next(line for line in _metrics(port) if line.startswith(name + " ")).split()[1])


def metric_sum(port: int, name: str) -> float:
    """The sum of a labelled series (e.g. lag over all partitions) on ``/metrics``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in _metrics(port) if line.startswith(name + "{"))
