"""hsx's exceptions: one root, one rejection type for bad input, and the exit code
each stands for.

Every ``hsx`` command maps an :class:`HsxError` that reaches it to
``exc.exit_code`` (see :func:`hsx.cli.main`); the table is :class:`ExitCode`.
"""

from __future__ import annotations

import logging
from enum import IntEnum

from hsx.schemas import ErrorClass

log = logging.getLogger(__name__)


class ExitCode(IntEnum):
    """What an ``hsx`` command's exit status means (the table in docs/cli.md)."""

    OK = 0
    FAILED = 1
    """The run started and could not finish safely: the engine died or stalled, a
    record hsx produced was refused by Kafka, ``--on-invalid fail`` met an
    invalid line. Nothing unfinished was committed; a restart resumes."""
    USAGE = 2
    """Bad command line or local input (argparse uses 2 as well)."""
    UNAVAILABLE = 3
    """The Kafka cluster did not answer in time (``--connect-timeout``)."""
    INTERRUPTED = 130
    """Ctrl-C (SIGINT) before the command finished (128 + SIGINT, as shells report
    it); child processes were stopped and the same command resumes. Services
    (``extract``, ``sink``) take a SIGINT once running as a drain and exit 0."""
    BROKEN_PIPE = 141
    """The reader of the command's output went away (``hsx inspect ... | head``):
    128 + SIGPIPE, as shells report a tool that the signal stopped."""


class HsxError(Exception):
    """Root of every error hsx raises on purpose."""

    exit_code: ExitCode = ExitCode.FAILED


class UsageError(HsxError):
    """A command-line value or local file that cannot work; nothing was started."""

    exit_code = ExitCode.USAGE


class ServiceFailed(HsxError):
    """A service cannot go on safely (engine dead or stuck, a dead letter lost)."""


class InvalidInput(HsxError):
    """Input that will never be processed: the rule it broke and why. Services
    dead-letter it with these two as headers; nothing else about it is special."""

    def __init__(self, error_class: ErrorClass, reason: str) -> None:
        super().__init__(reason)
        self.error_class = error_class
        self.reason = reason


def unexpected(error: Exception, record: str) -> InvalidInput:
    """The last line of defence for one record, as Kafka Streams' deserialization
    exception handler: an exception that no rule names, raised while parsing or
    checking ``record``, becomes a dead letter of class ``unexpected`` (with the
    exception's type and message) so that the service's loop goes on. Logged
    with its traceback: every one is a defect in hsx to fix and report."""
    log.error("unexpected %s while checking %s: dead-lettered; this is a defect in hsx, please report it",
              type(error).__name__, record, exc_info=error)
    return InvalidInput(ErrorClass.UNEXPECTED, f"unexpected {type(error).__name__} while checking the record: {error}")
