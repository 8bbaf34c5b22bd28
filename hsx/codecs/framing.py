"""The framing every hsx record shares: block records and fp8 samples::

    magic | u32 little-endian header length | header (JSON) | payload

and :class:`CorruptBlock`, what every reader of such bytes raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from typing_extensions import Buffer

import orjson
from pydantic import BaseModel, ValidationError

from hsx.schemas.blocks import FRAME_PREFIX, MAX_HEADER_BYTES, BlockHeader

H = TypeVar("H", bound=BaseModel)


class CorruptBlock(ValueError):
    """A block record that cannot be decoded or fails its checksum."""


@dataclass(frozen=True)
class Record:
    """One record's bytes as pieces, its framing and header first, and the header
    they carry: whoever sends it writes the pieces one by one or joins them
    (:meth:`value`). Each piece is its own (none is a view of a reused buffer or
    of the rows it was encoded from)."""

    header: BlockHeader
    pieces: list[Buffer]
    """The framing, the header, then the payload's segments; or all of it joined
    into one ``bytes`` (``framed(..., joined=True)``: what a Kafka record needs)."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self.pieces)

    def value(self) -> bytes:
        """The record value: the pieces back to back."""
        return self.pieces[0] if len(self.pieces) == 1 and isinstance(self.pieces[0], bytes) else b"".join(self.pieces)


def read_frame(value: Buffer, magic: bytes, model: type[H], what: str) -> tuple[H, memoryview]:
    """Parse ``magic | u32 header length | JSON header | payload``, the framing of
    block records and of fp8 samples, validating the header as ``model``."""
    view = memoryview(value).cast("B")
    if view.nbytes < FRAME_PREFIX.size:
        raise CorruptBlock(f"{what} of {view.nbytes} bytes is shorter than its prefix")
    found, header_len = FRAME_PREFIX.unpack_from(view)
    if found != magic:
        raise CorruptBlock(f"not a {what} (magic {bytes(found)!r})")
    if header_len > MAX_HEADER_BYTES or FRAME_PREFIX.size + header_len > view.nbytes:
        raise CorruptBlock(f"header length {header_len} exceeds the {what}")
    try:
        header = model.model_validate(orjson.loads(view[FRAME_PREFIX.size : FRAME_PREFIX.size + header_len]), strict=False)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        raise CorruptBlock(f"invalid {what.split()[0]} header: {exc}") from exc
    return header, view[FRAME_PREFIX.size + header_len :]


def frame(magic: bytes, header: BaseModel, parts: list[Buffer]) -> bytes:
    """``magic | u32 header length | JSON header | parts``: one record's bytes.
    Unset (``None``) fields are left out, so that a header field added later
    (``quantization``) leaves the records without it exactly as they were."""
    return b"".join(_framing(magic, header) + parts)


def framed(magic: bytes, header: BlockHeader, parts: list[Buffer], *, joined: bool = False) -> Record:
    """:func:`frame`'s bytes as a :class:`Record`: of pieces, the parts that are
    views (raw segments: of the caller's rows, of a reused buffer) copied; or
    ``joined``, one piece, every part copied once (where the views were first
    copied and then joined, raw planes were copied twice)."""
    if joined:
        return Record(header, [frame(magic, header, parts)])
    owned = [part if isinstance(part, bytes) else bytes(part) for part in parts]
    return Record(header, _framing(magic, header) + owned)


def _framing(magic: bytes, header: BaseModel) -> list[Buffer]:
    header_bytes = header.model_dump_json(exclude_none=True).encode()
    return [FRAME_PREFIX.pack(magic, len(header_bytes)), header_bytes]
