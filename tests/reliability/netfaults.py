"""A fault-injecting TCP proxy between the services and a broker, for the
network-fault tests only (never product code).

The broker advertises the proxy's address, so every connection a Kafka client
opens (bootstrap and broker alike) goes through it. Each accepted connection is
attributed to the process that opened it (its peer port looked up in the
kernel's socket table) and, through ``classify``, to a service name; faults are
set per service while the proxy runs:

* ``latency``: seconds added to every chunk in each direction;
* ``reset_rate``: the share of new connections that are reset (RST, not FIN)
  after their first bytes went through;
* ``partitioned``: nothing moves in either direction and new connections hang,
  as when packets are dropped; TCP keeps the bytes, so they flow on when it ends,
  unless the sender died meanwhile (then they are lost, as its kernel's were);
* ``bandwidth``: bytes per second in each direction (0: unlimited).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

CHUNK = 64 << 10


@dataclass
class Faults:
    latency: float = 0.0
    reset_rate: float = 0.0
    partitioned: bool = False
    bandwidth: float = 0.0


@dataclass(eq=False)
class _Connection:
    service: str
    client: asyncio.StreamWriter
    broker: asyncio.StreamWriter


class FaultProxy:
    """``listen_port`` → ``target_port`` on 127.0.0.1, in a thread of its own."""

    def __init__(self, listen_port: int, target_port: int, classify: Callable[[int], str | None],
                 seed: int = 0) -> None:
        self.listen_port, self.target_port = listen_port, target_port
        self._classify = classify
        self._faults: dict[str, Faults] = {}
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._server: asyncio.base_events.Server | None = None
        self._live: set[_Connection] = set()
        self.connections: dict[str, int] = {}
        self.resets: dict[str, int] = {}

    # -- control, from the test's thread ------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for conn in list(self._live):
                conn.client.transport.abort()
                conn.broker.transport.abort()
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()  # its self-pipe sockets, else left to the garbage collector

    def set(self, service: str, **faults: float | bool) -> None:
        """Replace ``service``'s faults (``set(name)`` clears them)."""
        self._faults[service] = Faults(**faults)  # type: ignore[arg-type]

    def reset_some(self, share: float) -> int:
        """Reset ``share`` of the live connections of known services, chosen at
        random (at least one while any is open); returns how many were."""
        async def reset() -> int:
            known = [c for c in self._live if c.service != "unknown"]
            doomed = self._rng.sample(known, min(len(known), max(1, round(share * len(known)))))
            for conn in doomed:
                self.resets[conn.service] = self.resets.get(conn.service, 0) + 1
                _abort_with_rst(conn.client)
                _abort_with_rst(conn.broker)
            return len(doomed)

        return asyncio.run_coroutine_threadsafe(reset(), self._loop).result(10)

    def faults(self, service: str | None) -> Faults:
        return self._faults.get(service or "", Faults())

    # -- the proxy, on its own loop ----------------------------------------------------

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)

    def _owner(self, peer_port: int) -> str | None:
        """The service whose process holds the client end of this connection."""
        for conn in psutil.net_connections(kind="tcp4"):
            if conn.laddr and conn.laddr.port == peer_port and conn.raddr and conn.raddr.port == self.listen_port:
                return self._classify(conn.pid) if conn.pid else None
        return None

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        peer_port = client_w.get_extra_info("peername")[1]
        service = await asyncio.to_thread(self._owner, peer_port)
        name = service or "unknown"
        self.connections[name] = self.connections.get(name, 0) + 1
        while self.faults(service).partitioned:  # a dropped SYN-ACK: the client waits
            await asyncio.sleep(0.1)
        try:
            broker_r, broker_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        reset = self._rng.random() < self.faults(service).reset_rate
        conn = _Connection(name, client_w, broker_w)
        self._live.add(conn)
        try:
            await asyncio.gather(self._pipe(client_r, broker_w, service, reset),
                                 self._pipe(broker_r, client_w, service, False))
        except (ConnectionError, asyncio.IncompleteReadError, _Reset):
            pass
        finally:
            self._live.discard(conn)
            if reset:
                self.resets[name] = self.resets.get(name, 0) + 1
            for writer in (client_w, broker_w):
                (_abort_with_rst if reset else _abort)(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, service: str | None,
                    reset: bool) -> None:
        """One direction. Reading and writing are separate tasks, so that latency
        delays every chunk without limiting how many are on the way (as on a wire)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        closed = asyncio.Event()

        async def read() -> None:
            while data := await reader.read(CHUNK):
                queue.put_nowait((time.monotonic() + self.faults(service).latency, data))
            closed.set()
            queue.put_nowait((0.0, b""))

        async def write() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    raise ConnectionError("peer closed")
                held = False
                while self.faults(service).partitioned:
                    held = True
                    await asyncio.sleep(0.1)
                if held and closed.is_set():
                    raise ConnectionError("the sender died while cut off: what it sent is lost")
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
                if bandwidth := self.faults(service).bandwidth:
                    await asyncio.sleep(len(data) / bandwidth)
                if reset:  # the first request went through; the connection dies under the client
                    raise _Reset

        tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(write())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()


class _Reset(Exception):
    pass


def _abort(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer sees a connection reset, not an orderly close."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def is_connector(extractor_pid: int, pid: int) -> bool:
    """Whether ``pid`` is one of vLLM's processes under an extractor (its engine
    core or worker, where the connector produces the block records): a process of
    the extractor's own process group other than the service itself."""
    if pid == extractor_pid:
        return False
    try:
        return os.getpgid(pid) == extractor_pid
    except ProcessLookupError:
        return False


def wait(seconds: float, tick: Callable[[], None] = lambda: None) -> None:
    """Sleep ``seconds`` while calling ``tick`` twice a second."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tick()
        time.sleep(0.5)
