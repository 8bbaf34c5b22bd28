"""Reassembling samples from ``hidden_states.blocks`` records, one partition at a
time (all records of a request share its key, hence its partition).

Block records wait, per (request_id, attempt_id), for their manifest. The
manifest completes the sample only if every block it lists arrived with the same
attempt id, verifies (decodes, where the sample is stored decoded) and
matches the manifest's checksums, token ranges and shape (fp8 blocks, ``hsx
extract --wire-dtype fp8``, also that their codes and scales are what the
quantization can produce). Anything else becomes a
:class:`RejectedRecords` with a reason; attempts whose
manifest never comes are rejected after a timeout, or as soon as another attempt
of the same request completes (a killed extractor's leftovers).

The checks themselves are :mod:`hsx.sink.block_checks`.

A by-reference manifest (one with a ``payload``) comes without block records: it
becomes :class:`Staged`, and :meth:`Assembler.complete` verifies the blocks once
they are read from the payload store (:mod:`hsx.sink.payloads`), as it would
block records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson
from pydantic import ValidationError
from typing_extensions import Buffer

from hsx.dataset.encoding import records_fit
from hsx.dataset.sample import Pieces, Sample
from hsx.runtime.errors import InvalidInput, unexpected
from hsx.schemas import BlockRecordHeaders, ErrorClass, Manifest, RecordKind, format_validation_error
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.block_checks import check_headers, decoded, fp8_decoded, verified


@dataclass
class Record:
    """The parts of a Kafka record the assembler needs."""

    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes | None]] | None


@dataclass
class RejectedRecords:
    """Records that will never become a sample, and why."""

    error_class: ErrorClass
    reason: str
    offsets: list[int]
    request_id: str | None = None
    value: bytes = b""
    """What goes to the DLQ: the manifest's bytes when there is one."""


@dataclass
class Staged:
    """A by-reference manifest whose blocks are still in the payload store."""

    manifest: Manifest
    offset: int
    value: bytes
    """The manifest's bytes (what goes to the DLQ)."""

    def reject(self, error_class: ErrorClass, reason: str) -> RejectedRecords:
        return RejectedRecords(error_class, reason, [self.offset], self.manifest.request_id, self.value)


@dataclass
class _Pending:
    blocks: dict[int, Record] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(len(r.value) for r in self.blocks.values())


DEFAULT_MAX_SAMPLE_BYTES = 8 << 30
"""``hsx sink --max-sample-bytes``: 8 GiB, a 128K-token sample of four 4096-wide
bf16 layers (an 8B model's EAGLE-3 capture) with room to spare."""


class Assembler:
    """Turns one partition's records into samples and rejections.

    ``stored_as`` is the dataset codec the samples go to. Under ``byteplane-zstd``
    a sample whose block records are stored as they came
    (:func:`~hsx.dataset.encoding.records_fit`) comes out already encoded: each
    block is verified against the checksum of its payload, never decoded, and its
    raw bytes are checked where the sample is read; this saves the sink the decode,
    a sample-sized allocation and the page faults of filling it."""

    def __init__(self, incomplete_timeout: float = 600.0, stored_as: DatasetCodec = DatasetCodec.RAW,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._pending_bytes = 0  # of every pending block record: the sink checks it after each record
        self._timeout = incomplete_timeout
        self._keep_records = stored_as is DatasetCodec.BYTEPLANE_ZSTD
        self._max_sample_bytes = max_sample_bytes

    @property
    def keeps_records(self) -> bool:
        """Whether samples whose records fit are stored as the records came."""
        return self._keep_records

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def add(self, record: Record) -> Sample | Staged | RejectedRecords | None:
        """Feed one record; returns a finished sample, a by-reference manifest to
        fetch the blocks of, or a rejection, if any. Never raises for a record's
        content: an exception no rule names rejects the record (and its blocks)
        as ``unexpected``."""
        key_text = (record.key or b"").decode("utf-8", "replace") or None
        try:
            headers = BlockRecordHeaders.from_kafka(record.headers)
            request_id = (record.key or b"").decode()
        except (ValidationError, UnicodeDecodeError) as exc:
            return RejectedRecords(ErrorClass.INVALID_RECORD, f"unreadable block record: {exc}", [record.offset],
                                   key_text, record.value)
        except Exception as exc:
            return _unexpected(exc, f"block record @{record.offset}", [record.offset], key_text, record.value)
        key = (request_id, headers.attempt_id)
        if headers.kind is RecordKind.BLOCK:
            assert headers.block_index is not None
            blocks = self._pending.setdefault(key, _Pending()).blocks
            if headers.block_index not in blocks:  # else a copy: the first one counts
                blocks[headers.block_index] = record
                self._pending_bytes += len(record.value)
            return None
        pending = self._take(key)
        offsets = sorted(r.offset for r in pending.blocks.values()) + [record.offset]
        try:
            return self._manifest(record, request_id, headers.attempt_id, pending, offsets)
        except Exception as exc:
            return _unexpected(exc, f"manifest @{record.offset}", offsets, request_id, record.value)

    def _manifest(self, record: Record, request_id: str, attempt_id: str, pending: _Pending,
                  offsets: list[int]) -> Sample | Staged | RejectedRecords:
        """What a manifest record and the blocks of its attempt make."""
        try:
            manifest = Manifest.model_validate(orjson.loads(record.value), strict=False)
        except (orjson.JSONDecodeError, ValidationError) as exc:
            reason = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            return RejectedRecords(ErrorClass.INVALID_MANIFEST, f"manifest does not validate: {reason}", offsets, request_id, record.value)
        if manifest.request_id != request_id or manifest.attempt_id != attempt_id:
            return RejectedRecords(ErrorClass.INVALID_MANIFEST, "manifest does not match its record key / attempt header",
                            offsets, request_id, record.value)
        if (too_large := self._too_large(manifest)) is not None:
            return RejectedRecords(ErrorClass.SAMPLE_TOO_LARGE, too_large, offsets, request_id, record.value)
        if manifest.payload is not None:
            if pending.blocks:
                return RejectedRecords(ErrorClass.INVALID_MANIFEST, f"a by-reference manifest, but "
                                       f"{len(pending.blocks)} block record(s) of its attempt arrived", offsets,
                                       request_id, record.value)
            return Staged(manifest, record.offset, record.value)
        return self._sample(manifest, {i: r.value for i, r in pending.blocks.items()}, offsets, record.value)

    def complete(self, staged: Staged, staged_object: memoryview, location: str) -> Sample | RejectedRecords:
        """The sample of a by-reference manifest from the staged object read from
        ``location`` (its blocks back to back, as the manifest's offsets say); a
        block that does not verify is ``payload_corrupt`` naming it."""
        blocks = {ref.index: staged_object[ref.offset or 0:(ref.offset or 0) + ref.compressed_nbytes]
                  for ref in staged.manifest.blocks}
        try:
            done = self._sample(staged.manifest, blocks, [staged.offset], staged.value, back_to_back=staged_object)
        except Exception as exc:
            return staged.reject(ErrorClass.UNEXPECTED, unexpected(exc, f"staged object {location}").reason)
        if isinstance(done, RejectedRecords):
            error_class = ErrorClass.PAYLOAD_CORRUPT if done.error_class is ErrorClass.CORRUPT_BLOCK else done.error_class
            return staged.reject(error_class, f"staged object {location}: {done.reason}")
        return done

    def _too_large(self, manifest: Manifest) -> str | None:
        """Why the sample is over ``max_sample_bytes``, checked before anything is
        fetched or decoded: its raw hidden states, or its staged object."""
        raw = manifest.captured_tokens * len(manifest.layer_ids) * manifest.hidden_size * manifest.dtype.itemsize
        staged = manifest.payload.nbytes if manifest.payload is not None else 0
        if max(raw, staged) <= self._max_sample_bytes:
            return None
        what = f"{raw} bytes of hidden states" if raw >= staged else f"a staged object of {staged} bytes"
        return f"the manifest declares {what}, more than the sink's --max-sample-bytes {self._max_sample_bytes}"

    def supersede(self, request_id: str) -> list[RejectedRecords]:
        """Reject the unfinished attempts of a request that now has a complete one.

        The extractor starts a new attempt only after the previous one ended
        (failed, or its process died), so their missing records will never come;
        rejecting them now, instead of after the timeout, lets the partition's
        committed offset move past them."""
        stale = [key for key in self._pending if key[0] == request_id]
        return [self._incomplete(key, ErrorClass.SUPERSEDED_ATTEMPT, "a later attempt completed") for key in stale]

    def expire(self, now: float | None = None) -> list[RejectedRecords]:
        """Reject attempts whose manifest has not come within the timeout."""
        now = time.monotonic() if now is None else now
        expired = [k for k, p in self._pending.items() if now - p.first_seen > self._timeout]
        return [self._incomplete(key, ErrorClass.INCOMPLETE_SAMPLE, f"no manifest within {self._timeout:.0f}s") for key in expired]

    def _take(self, key: tuple[str, str]) -> _Pending:
        """Stop holding an attempt's blocks; returns them (none if none came)."""
        pending = self._pending.pop(key, _Pending())
        self._pending_bytes -= pending.nbytes
        return pending

    def _incomplete(self, key: tuple[str, str], error_class: ErrorClass, why: str) -> RejectedRecords:
        pending = self._take(key)
        request_id, attempt_id = key
        return RejectedRecords(error_class, f"attempt {attempt_id}: {len(pending.blocks)} block(s) but {why}",
                        sorted(r.offset for r in pending.blocks.values()), request_id)


    def _sample(self, manifest: Manifest, blocks: dict[int, Buffer], offsets: list[int], manifest_value: bytes,
                back_to_back: memoryview | None = None) -> Sample | RejectedRecords:
        """The sample the manifest vouches for, from its blocks' values by index
        (and all of them in one buffer, in order, when they came so)."""
        try:
            headers = check_headers(manifest, blocks)
            records = [blocks[ref.index] for ref in manifest.blocks]
            if manifest.quantization is not None:
                return Sample(manifest, b"", offsets, records, fp8=fp8_decoded(manifest, records))
            if self._keep_records and records_fit(headers):
                stored = back_to_back if back_to_back is not None else Pieces.of(records)
                return Sample(manifest, stored, offsets, codec=DatasetCodec.BYTEPLANE_ZSTD,
                              checksum=verified(manifest, records, headers))
            raw, checksum = decoded(manifest, records, headers)
            return Sample(manifest, raw, offsets, records, checksum=checksum)
        except InvalidInput as exc:
            return RejectedRecords(exc.error_class, exc.reason, offsets, manifest.request_id, manifest_value)


def _unexpected(error: Exception, what: str, offsets: list[int], request_id: str | None,
                value: bytes) -> RejectedRecords:
    return RejectedRecords(ErrorClass.UNEXPECTED, unexpected(error, what).reason, offsets, request_id, value)
