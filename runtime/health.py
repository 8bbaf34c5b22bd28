"""The operations endpoint every service serves: ``/healthz`` (the process is
alive and not stuck: see :meth:`hsx.runtime.kafka.member.GroupMember` for what
"stuck" means), ``/readyz`` (it can do its job) and ``/metrics`` (Prometheus text format,
rendered by prometheus_client)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]
"""Returns (passing, a short reason shown to the prober)."""


def _alive() -> tuple[bool, str]:
    return True, "ok"


class HealthServer:
    """A small HTTP server on a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, port: int, ready: Check, live: Check = _alive, host: str = "0.0.0.0") -> None:

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path in ("/healthz", "/readyz"):
                    ok, reason = (live if path == "/healthz" else ready)()
                    self._reply(200 if ok else 503, f"{reason}\n".encode(), "text/plain")
                elif path == "/metrics":
                    self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: keep logs quiet
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                # A prober that gave up (timeout) before a busy process answered is
                # routine, not a traceback on stderr.
                if not isinstance(sys.exception(), ConnectionError):
                    super().handle_error(request, client_address)  # type: ignore[arg-type]

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="hsx-health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health and metrics on :%d (/healthz, /readyz, /metrics)", self.port)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve loop that must be running
            self._server.shutdown()
        self._server.server_close()
