"""Test-side HTTP: probing the services' operations endpoint."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(port: int, name: str) -> float:
    """The value of an unlabelled series on ``/metrics``."""
    status, body = get(port, "/metrics")
    assert status == 200
    return float(next(line for line in body.splitlines() if line.startswith(name + " ")).split()[1])


def metric_sum(port: int, name: str) -> float:
    """The sum of a labelled series (e.g. lag over all partitions) on ``/metrics``."""
    status, body = get(port, "/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))
