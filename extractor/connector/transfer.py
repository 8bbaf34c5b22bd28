"""The state of one request attempt in flight in the
:class:`~hsx.extractor.connector.sender.BlockSender`, guarded by its own lock."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hsx.codecs.framing import Record
from hsx.extractor.connector.gather import Gathered
from hsx.extractor.connector.metadata import SendJob
from hsx.schemas import BlockRef
from hsx.schemas.connector import RequestParams
from hsx.schemas.reports import CompletionReport


@dataclass(eq=False)  # compared (and hashed) by identity: a member of the stalled set
class Transfer:
    """State of one request attempt in flight."""

    job: SendJob
    params: RequestParams
    gathered: Gathered
    ranges: list[tuple[int, int]]
    raw_bytes: int
    encoded: list[Record | None] = field(default_factory=list)
    """Inline: blocks encoded and not yet produced (each one piece)."""
    encoding: int = 0
    """Inline: blocks still on the compression pool."""
    refs: list[BlockRef] = field(default_factory=list)
    """What the manifest will say of the blocks sent so far."""
    next_to_produce: int = 0
    manifest: bytes | None = None
    """The manifest record, once built (kept while the queue is full)."""
    unacked: int = 0
    manifest_sent: bool = False
    completed: bool = False
    compressed_bytes: int = 0
    kafka_bytes: int = 0
    """Of the records queued: keys, values and headers."""
    error: str | None = None
    refused: bool = False
    """Kafka refused one of its records: fatal for the extractor, not retried."""
    uploading: bool = False
    """By reference: the staged object is being written."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def block_sent(self, ref: BlockRef, nbytes: int) -> None:
        """Count the next block as sent (queued inline, staged by reference), as
        ``ref`` in the manifest. Called with :attr:`lock` held."""
        self.refs.append(ref)
        self.compressed_bytes += nbytes
        self.next_to_produce += 1

    def report(self) -> CompletionReport:
        """What the attempt's completion report says, once it ended (acknowledged or failed)."""
        return CompletionReport(
            request_id=self.params.request_id, attempt_id=self.params.attempt_id, ok=self.error is None,
            error=self.error, refused=self.refused, num_tokens=self.gathered.tensor.shape[0],
            raw_bytes=self.raw_bytes, compressed_bytes=self.compressed_bytes, kafka_bytes=self.kafka_bytes,
            seconds=time.time() - self.job.finished_at if self.job.finished_at else None)
