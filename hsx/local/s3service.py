"""An S3 service to talk to, wherever it runs: its endpoint, keys and region,
the ``AWS_*`` environment that points product code (obstore reads it) at it, an
:mod:`obstore` store per bucket, and bucket creation (``PUT /bucket``, presigned
by obstore: its API has no call for it, and the same request works on SeaweedFS,
MinIO and AWS alike). :func:`external_s3` describes the one that
``HSX_TEST_S3_ENDPOINT`` names; :mod:`hsx.local.s3server` runs a local one.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obstore.store import S3Store

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"

ENDPOINT_ENV = "HSX_TEST_S3_ENDPOINT"
ACCESS_KEY_ENV = "HSX_TEST_S3_ACCESS_KEY_ID"
SECRET_KEY_ENV = "HSX_TEST_S3_SECRET_ACCESS_KEY"
REGION_ENV = "HSX_TEST_S3_REGION"

AWS_ENV_OVERRIDDEN = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_S3_EXPRESS",
)
"""``AWS_*`` variables of the caller's shell that :meth:`S3Service.child_environ`
removes: a session token or profile meant for another account would be sent
with (or replace) the service's keys and the request refused."""

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Error(RuntimeError):
    """An S3 request of this module was answered with an error status."""

    def __init__(self, method: str, url: str, status: int, code: str, message: str) -> None:
        super().__init__(f"{method} {url}: {status} {code or 'error'}" + (f": {message}" if message else ""))
        self.status = status
        self.code = code


def presigned_request(
    store: S3Store, method: str, key: str, *, body: bytes = b"", headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """One request for ``key`` of ``store``'s bucket ("" for the bucket itself),
    signed by obstore (a presigned URL: object_store's SigV4), for what obstore's
    API has no call for: creating a bucket, a raw ranged GET. The status and the
    body; no error status raises, the caller reads it."""
    import obstore

    url = obstore.sign(store, method, key, timedelta(minutes=5))  # type: ignore[arg-type]
    request = urllib.request.Request(url, data=body if method in ("PUT", "POST") else None, method=method,
                                     headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def error_of(body: bytes) -> tuple[str, str]:
    """``(Code, Message)`` of an S3 error document, empty when it is none."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return "", body[:200].decode(errors="replace")
    return root.findtext("Code") or "", root.findtext("Message") or ""


@dataclass(eq=False)
class S3Service:
    """An S3 service to talk to: where it is and the keys to sign with."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = DEFAULT_REGION

    can_pause = False
    """Whether :meth:`pause` / :meth:`resume` work: only on a server this process runs."""

    def environ(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point obstore (and boto, the AWS CLI) at
        this service; ``AWS_ALLOW_HTTP`` only for an ``http://`` endpoint."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }
        if self.endpoint.startswith("http://"):
            env["AWS_ALLOW_HTTP"] = "true"
        return env

    def child_environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with :meth:`environ` set and the
        variables in :data:`AWS_ENV_OVERRIDDEN` removed: for child processes."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in AWS_ENV_OVERRIDDEN}
        env.update(self.environ())
        return env

    def store(self, bucket: str, prefix: str | None = None, **config: Any) -> S3Store:
        """An obstore store of ``bucket`` (under ``prefix``) with this service's
        keys; ``config`` goes to ``S3Store`` (``retry_config=``, ``client_options=``...)."""
        from obstore.store import S3Store

        client_options = {"allow_http": self.endpoint.startswith("http://"), **config.pop("client_options", {})}
        return S3Store(
            bucket,
            prefix=prefix,
            endpoint=self.endpoint,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            region=self.region,
            client_options=client_options,
            **config,
        )

    def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, bytes]:
        """A signed request for ``path`` (``/bucket`` or ``/bucket/key``) on this
        service: ``(status, body)``; see :func:`presigned_request`."""
        bucket, _, key = path.lstrip("/").partition("/")
        return presigned_request(self.store(bucket), method, key, body=body, headers=headers, timeout=timeout)

    def with_keys(self, access_key: str | None = None, secret_key: str | None = None) -> S3Service:
        """The same endpoint and region with other keys (tests of refused keys)."""
        return S3Service(
            self.endpoint, access_key or self.access_key, secret_key or self.secret_key, self.region
        )

    def create_bucket(self, name: str, exist_ok: bool = True) -> None:
        """Create the bucket ``name``; one that exists and these keys can read is
        fine when ``exist_ok``. Raises :class:`S3Error` when refused."""
        if not _BUCKET_NAME.match(name):
            raise ValueError(f"{name!r} is no S3 bucket name: 3-63 lowercase letters, digits, '.', '-'")
        body = b""
        if self.region != DEFAULT_REGION:  # AWS wants the region spelt out everywhere else
            body = (
                '<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<LocationConstraint>{self.region}</LocationConstraint></CreateBucketConfiguration>"
            ).encode()
        status, answer = self.request("PUT", f"/{name}", body)
        if status == 200:
            log.info("created bucket %s on %s", name, self.endpoint)
            return
        code, message = error_of(answer)
        if status == 409 and exist_ok:
            # BucketAlreadyOwnedByYou (SeaweedFS, AWS); some servers say BucketAlreadyExists
            # to the owner too, which the owner's HEAD tells apart from someone else's bucket.
            if code == "BucketAlreadyOwnedByYou" or self.request("HEAD", f"/{name}")[0] == 200:
                return
        raise S3Error("PUT", f"{self.endpoint}/{name}", status, code, message)

    def pause(self) -> None:
        raise NotImplementedError(
            f"pause() needs the S3 server that this process runs; {self.endpoint} is an external "
            f"service ({ENDPOINT_ENV} is set) that it cannot stop"
        )

    def resume(self) -> None:
        raise NotImplementedError(f"resume(): {self.endpoint} is an external service ({ENDPOINT_ENV} is set)")


def external_s3() -> S3Service | None:
    """The S3 service that ``HSX_TEST_S3_ENDPOINT`` names, or ``None`` when unset.
    Keys and region: ``HSX_TEST_S3_ACCESS_KEY_ID``, ``HSX_TEST_S3_SECRET_ACCESS_KEY``,
    ``HSX_TEST_S3_REGION``, else the standard ``AWS_*`` variables."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    access_key = os.environ.get(ACCESS_KEY_ENV) or os.environ.get("AWS_ACCESS_KEY_ID")
    secret_key = os.environ.get(SECRET_KEY_ENV) or os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access_key or not secret_key:
        raise ValueError(
            f"{ENDPOINT_ENV}={endpoint} needs keys: set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} "
            "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        )
    region = os.environ.get(REGION_ENV) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return S3Service(endpoint.rstrip("/"), access_key, secret_key, region or DEFAULT_REGION)
