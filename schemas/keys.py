"""The sink's dedupe keys on disk: ``keys/<shard>.keys`` beside each shard index,
and one roll-up per partition (``keys/<topic>-<partition>-rollup.keys``).

A key file is the 8-byte magic ``HSXKEYS1`` followed by 24-byte little-endian
records, one per stored sample: a 64-bit hash of its request id, a 64-bit hash
of its token ids, and the offset that names its shard (the shard's first
offset). Fixed-size binary records, not JSON: a sink loads a partition's keys
with one read per file and no parsing per sample, and holds them in 24 bytes a
sample. The full ready event stays in the shard index (``ShardIndex``), read
back only for a sample that is met again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEYS_MAGIC = b"HSXKEYS1"
KEY_RECORD = np.dtype([("request", "<u8"), ("tokens", "<u8"), ("shard", "<u8")])
"""One sample: ``request_key``, ``token_key``, and its shard's first offset."""


def request_key(request_id: str) -> int:
    """The 64-bit key of a request id (a hash: a match is confirmed against the index)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def token_key(token_ids: Sequence[int] | np.ndarray) -> int:
    """The 64-bit key of a sample's token ids: two copies of a request with equal
    keys hold the same prompt (a collision is 1 in 2^64)."""
    raw = np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def encode_keys(records: np.ndarray) -> bytes:
    """A key file's bytes; ``records`` has dtype :data:`KEY_RECORD`."""
    if records.dtype != KEY_RECORD:
        raise ValueError(f"key records must have dtype {KEY_RECORD}, not {records.dtype}")
    return KEYS_MAGIC + np.ascontiguousarray(records).tobytes()


def decode_keys(data: bytes, name: str) -> np.ndarray:
    """The records of the key file ``name`` (read-only, no copy); ``ValueError``
    naming the file when it is not one."""
    if not data.startswith(KEYS_MAGIC):
        raise ValueError(f"{name} is not a key file (it does not start with {KEYS_MAGIC!r})")
    body = len(data) - len(KEYS_MAGIC)
    if body % KEY_RECORD.itemsize:
        raise ValueError(f"{name} is truncated: {body} bytes after the magic, not a multiple of "
                         f"{KEY_RECORD.itemsize}")
    return np.frombuffer(data, dtype=KEY_RECORD, offset=len(KEYS_MAGIC))
