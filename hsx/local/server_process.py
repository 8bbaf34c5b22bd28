"""A local server run as a child process: what the embedded broker
(:mod:`hsx.local.broker`) and the local S3 server (:mod:`hsx.local.s3server`) share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from types import TracebackType
from typing import IO, Any

from typing_extensions import Self

from hsx.local import with_parent


class ServerProcess:
    """One child process in a session of its own (a Ctrl-C in the terminal reaches
    hsx, which then stops it in order). Subclasses implement :meth:`start` with
    :meth:`_launch` and a readiness check, and may add to :meth:`stop`."""

    _proc: subprocess.Popen[bytes] | None = None
    what = "server"
    """Its name in errors."""
    with_parent = False
    """SIGTERMed when this process dies, even by SIGKILL (:mod:`hsx.local.with_parent`)."""

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.what} not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        raise NotImplementedError

    def _launch(self, command: list[str], output: IO[Any] | int = subprocess.DEVNULL) -> None:
        """Start ``command`` with its stdout and stderr to ``output``."""
        if self._proc is not None:
            raise RuntimeError(f"{self.what} already started")
        if self.with_parent:
            command = with_parent.command(os.getpid(), command)
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; first SIGCONT, since a
        test may have left it stopped. Nothing when it is not running."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
