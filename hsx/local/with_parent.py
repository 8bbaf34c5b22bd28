"""``python -m hsx.local.with_parent PARENT_PID -m MODULE ARGS...`` runs ``python
-m MODULE ARGS...`` in this process, and ``... PARENT_PID PROGRAM ARGS...`` execs
``PROGRAM`` (e.g. the broker's binary) in it; either way Linux sends it SIGTERM
when its parent dies, however it died (``prctl(PR_SET_PDEATHSIG)``, which an exec
keeps).

Why: hsx's children run in sessions of their own (a Ctrl-C in the terminal
reaches only the parent, which stops them in order), so a parent killed with
SIGKILL would leave them running: ``hsx serve``'s vLLM server holding its port
and gigabytes of memory, a sink writing for nobody. SIGTERM lets the child drain
as it would on its parent's request. The signal follows the *thread* that
started the child: start it from a thread that lives as long as the parent
(``hsx serve`` starts its children from its main thread). Elsewhere than Linux
the module runs unguarded.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 1


def guard(parent: int) -> bool:
    """Ask for SIGTERM when the parent dies; False when it died already (before
    the request, which then never fires)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    return os.getppid() == parent


def command(parent: int, argv: list[str], python: str = sys.executable) -> list[str]:
    """``argv`` (``-m MODULE ARGS...`` for ``python``, or ``PROGRAM ARGS...``) under this guard."""
    return [python, "-m", __name__, str(parent), *argv]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    if not guard(parent):
        sys.exit(EXIT_ORPHANED)
    if argv[0] != "-m":
        os.execvp(argv[0], argv)
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
