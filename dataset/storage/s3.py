"""A dataset in an S3-compatible object store (AWS S3, MinIO, Ceph, SeaweedFS),
through obstore (Rust's ``object_store``).

Configuration is the AWS convention, read from the environment by the library:
``AWS_ENDPOINT_URL`` (unset for AWS itself), ``AWS_REGION``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, or
the rest of the usual chain (web identity / IRSA, ECS and instance metadata).
A plain ``http://`` endpoint is allowed as given. Credentials never reach a
message: errors name the dataset URL, the operation and the S3 error code.

The library retries what can pass (5xx, timeouts, throttling) with backoff;
what still fails becomes :class:`StorageUnavailable` (the sink keeps its data
and retries later). What cannot pass (access denied, no such bucket) becomes
:class:`StorageRefused`.
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timedelta, timezone
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import obstore
from obstore.exceptions import BaseError, PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from hsx.dataset.storage.base import StorageRefused, StorageUnavailable, UnsupportedLocation, Writer, checked_parts
from hsx.runtime.errors import HsxError, UsageError

MIN_PART_BYTES = 5 << 20
"""S3's smallest multipart part (all but the last)."""
DEFAULT_PART_BYTES = 16 << 20
UPLOAD_CONCURRENCY = 4
"""Parts in flight per upload."""
_REFUSED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                  "InvalidBucketName", "AllAccessDisabled", "AccountProblem", "InvalidToken", "ExpiredToken", "403"}
_CODE = re.compile(r"<Code>(\w+)</Code>")
_STATUS = re.compile(r"(?<!\w)(\d{3}) [A-Z]")
_LIST_PAGE = 1000
_RUNTIME_PID: int | None = None
"""The process whose obstore runtime is running: a forked copy of it hangs."""


class ForkedClient(HsxError, RuntimeError):
    """obstore used in a forked child of a process that already used it."""


def store_config(endpoint: str) -> dict[str, Any]:
    """What hsx sets beyond the environment for the store at ``endpoint`` (``""``:
    AWS itself). Over TLS, request bodies are sent with SigV4's ``UNSIGNED-PAYLOAD``
    (as minio-go does over HTTPS): TLS protects them in transit and hsx's own
    CRCs end to end, so hashing every uploaded byte with SHA-256 for the signature
    buys nothing (it was 6 % of the connector's CPU staging to S3, perf). Over
    plain HTTP the payload stays signed. ``AWS_UNSIGNED_PAYLOAD``, when set, decides."""
    if "AWS_UNSIGNED_PAYLOAD" in os.environ or endpoint.startswith("http://"):
        return {}
    return {"unsigned_payload": True}


class S3Storage:
    def __init__(self, url: str, part_bytes: int = DEFAULT_PART_BYTES) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise UnsupportedLocation(f"{url}: an object-store dataset is s3://BUCKET[/PREFIX]")
        if part_bytes < MIN_PART_BYTES:
            raise UsageError(f"upload part size {part_bytes} is below S3's minimum of {MIN_PART_BYTES} bytes")
        self.url = url.rstrip("/")
        self.bucket, self.prefix, self.part_bytes = bucket, prefix.strip("/"), part_bytes
        self._store: S3Store | None = None
        self._pid = 0
        # obstore's runtime does not survive fork(): a child that inherits it hangs on
        # its first request. A child of a process that never used it is fine.

    def __getstate__(self) -> dict[str, Any]:  # a spawned DataLoader worker makes its own client
        return {**self.__dict__, "_store": None}

    @property
    def store(self) -> S3Store:
        global _RUNTIME_PID
        if self._store is None or self._pid != os.getpid():
            if _RUNTIME_PID not in (None, os.getpid()):
                raise ForkedClient("this process was forked after its parent read or wrote s3://: the object-store "
                                   "client (tokio) cannot work in a forked child; start workers with spawn or "
                                   "forkserver, e.g. DataLoader(..., multiprocessing_context='forkserver')")
            _RUNTIME_PID = os.getpid()
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
            self._store = S3Store(self.bucket, prefix=self.prefix or None, config=store_config(endpoint),
                                  client_options={"allow_http": True} if endpoint.startswith("http://") else None)
            self._pid = os.getpid()
        return self._store

    def probe(self) -> None:
        """One listing request, so that a wrong key or bucket is refused at start,
        before anything else happens."""
        with self._translated("list", ""):
            next(iter(obstore.list(self.store, None, chunk_size=1)), None)

    def local_path(self, relative: str) -> None:
        return None

    def write_atomic(self, relative: str, data: bytes) -> None:
        with self._translated("write", relative):
            obstore.put(self.store, _key(relative), data)

    @contextmanager
    def open_atomic(self, relative: str, cache: bool = True) -> Iterator[Writer]:
        """A multipart upload of ``part_bytes`` parts, completed when the block
        exits and aborted when it raises, so the object is whole or absent
        (``cache`` means nothing here: no page cache stands between). The
        writer references the buffers it is given (bench: a 1 GiB shard's upload
        grew the sink's RSS by 4 MiB); they must stay unchanged until the block exits."""
        with self._translated("write", relative):
            with obstore.open_writer(self.store, _key(relative), buffer_size=self.part_bytes,
                                     max_concurrency=UPLOAD_CONCURRENCY) as writer:
                yield writer

    def read(self, relative: str) -> bytes:
        with self._translated("read", relative):
            return bytes(obstore.get(self.store, _key(relative)).bytes())

    def read_ranges(self, relative: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        if not ranges:
            return []
        with self._translated("read", relative):
            if len(ranges) == 1:  # get_range cuts a range past the end; get_ranges refuses it
                start, end = ranges[0]
                return [memoryview(obstore.get_range(self.store, _key(relative), start=start, end=end))]
            wanted = [(start, end) for start, end in ranges if end > start]  # S3 has no empty range
            parts = iter(obstore.get_ranges(self.store, _key(relative), starts=[s for s, _ in wanted],
                                            ends=[e for _, e in wanted]) if wanted else [])
            return [memoryview(next(parts)) if end > start else memoryview(b"") for start, end in ranges]

    def list(self, prefix: str, starting: str = "", after: str = "") -> list[str]:
        folder = _key(prefix)
        names: list[str] = []
        with self._translated("list", prefix):
            # StartAfter: the listing begins at the first name that can match, and
            # stops at the first past ``starting`` (keys come sorted).
            pages = obstore.list(self.store, folder, offset=f"{folder}/{max(starting, after)}", chunk_size=_LIST_PAGE)
            for page in pages:
                for meta in page:
                    name = meta["path"][len(folder) + 1:]
                    if not name.startswith(starting):
                        if name > starting:
                            return sorted(names)
                        continue
                    if "/" not in name and not name.startswith(".") and name > after:
                        names.append(f"{prefix}/{name}")
        return sorted(names)

    def stale(self, suffix: str, older_than: float) -> list[str]:
        """Incomplete multipart uploads are not objects: a bucket lifecycle rule
        aborts them (docs/operations.md)."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than)
        names = []
        with self._translated("list", ""):
            for page in obstore.list(self.store, None, chunk_size=_LIST_PAGE):  # paths relative to the prefix
                names += [meta["path"] for meta in page if "/" not in meta["path"]
                          and meta["path"].endswith(suffix) and meta["last_modified"] < cutoff]
        return sorted(names)

    def size(self, relative: str) -> int:
        with self._translated("read", relative):
            return int(obstore.head(self.store, _key(relative))["size"])

    def delete(self, relative: str) -> None:
        with self._translated("delete", relative):
            obstore.delete(self.store, _key(relative))

    def delete_many(self, paths: Sequence[str]) -> None:
        if paths:
            with self._translated("delete", paths[0]):
                obstore.delete(self.store, [_key(p) for p in paths])

    @contextmanager
    def _translated(self, operation: str, relative: str) -> Iterator[None]:
        """obstore's errors as hsx's: refused, unavailable, or (an absent object)
        FileNotFoundError, each naming the URL and the S3 error code only."""
        where = f"{self.url}/{relative}".rstrip("/")
        try:
            yield
        except (BaseError, FileNotFoundError) as exc:  # obstore's NotFoundError is a FileNotFoundError
            raise _translate(exc, operation, where, self.bucket) from None


def _translate(exc: Exception, operation: str, where: str, bucket: str) -> Exception:
    text = str(exc)
    code = _error_code(exc, text)
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    if code == "NoSuchBucket":
        return StorageRefused(f"{where}: bucket {bucket!r} does not exist at {endpoint} (create it first)")
    if "169.254.169.254" in text or "169.254.170.2" in text:  # the chain fell through to instance metadata
        return StorageRefused(f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                              "or run with a role); instance metadata did not answer")
    if code in _REFUSED_CODES or isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return StorageRefused(f"{where}: {operation} refused by {endpoint} ({code}): check AWS_ACCESS_KEY_ID / "
                              "AWS_SECRET_ACCESS_KEY (or the role) and the bucket's policy")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{where}: no such object")
    first_line = text.split("\n", 1)[0][:300]
    return StorageUnavailable(f"{where}: {operation} failed after retries ({code}): {first_line}")


def _error_code(exc: Exception, text: str) -> str:
    """The S3 error code in obstore's message (``<Code>…</Code>``), else the
    HTTP status it quotes, else the exception's type."""
    for pattern in (_CODE, _STATUS):
        if match := pattern.search(text):
            return match[1]
    return type(exc).__name__


def _key(relative: str) -> str:
    return "/".join(checked_parts(relative))
