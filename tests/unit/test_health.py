"""The operations endpoint over real HTTP."""

from __future__ import annotations

import time

import pytest
from prometheus_client import Counter

from hsx.local.scrape import get
from hsx.runtime.health import HealthServer

PROBE = Counter("hsx_test_probe", "A counter only this test moves")


def test_health_readiness_and_metrics() -> None:
    state = {"ready": False}
    server = HealthServer(0, lambda: (state["ready"], "ok" if state["ready"] else "loading the model"),
                          host="127.0.0.1").start()
    try:
        assert get(server.port, "/healthz") == (200, "ok\n")
        assert get(server.port, "/readyz") == (503, "loading the model\n")
        state["ready"] = True
        assert get(server.port, "/readyz") == (200, "ok\n")
        PROBE.inc(3)
        status, body = get(server.port, "/metrics")
        assert status == 200 and "hsx_test_probe_total 3.0" in body
        assert get(server.port, "/nope")[0] == 404
    finally:
        server.stop()


def test_port_in_use_is_a_clear_error() -> None:
    first = HealthServer(0, lambda: (True, ""), host="127.0.0.1")
    try:
        with pytest.raises(OSError):
            HealthServer(first.port, lambda: (True, ""), host="127.0.0.1")
    finally:
        first.stop()


def test_a_prober_that_hangs_up_leaves_no_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    import socket
    import struct
    import threading

    answered = threading.Event()

    def slow_check() -> tuple[bool, str]:
        time.sleep(0.3)  # the prober times out meanwhile
        answered.set()
        return True, "ok"

    server = HealthServer(0, slow_check, host="127.0.0.1").start()
    try:
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.close()
        assert answered.wait(5)
        time.sleep(0.3)
        assert get(server.port, "/healthz") == (200, "ok\n")  # still serving
    finally:
        server.stop()
    assert "Exception occurred during processing of request" not in capsys.readouterr().err  # socketserver's traceback
