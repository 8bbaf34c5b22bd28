"""The S3 test harness (:mod:`hsx.local.s3server`) against a real server: what the
dataset tests rely on it for (byte-exact ranged reads, refused keys, missing
buckets, an outage that ends) holds, so a failure there is the product's."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import obstore
import pytest
from obstore.store import S3Store

from hsx.local.s3server import LocalS3, dev_s3
from hsx.local.s3service import S3Error, S3Service, external_s3


def _split(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.netloc, parts.path.lstrip("/")


def _payload(size: int) -> bytes:
    # Distinct bytes everywhere (no repeating 256-byte pattern): an off-by-N range shows.
    return b"".join(i.to_bytes(4, "little") for i in range(size // 4))


def test_objects_read_back_byte_exact(s3_server: S3Service, s3_dataset_url: str) -> None:
    bucket, prefix = _split(s3_dataset_url)
    store = s3_server.store(bucket, prefix)
    data = _payload(3 << 20)  # over obstore's 1 MiB range coalescing gap, several chunks
    obstore.put(store, "shard-000.safetensors", data)

    assert bytes(obstore.get(store, "shard-000.safetensors").bytes()) == data
    ranged = bytes(obstore.get_range(store, "shard-000.safetensors", start=1_000_003, end=1_000_003 + 4097))
    assert ranged == data[1_000_003:1_000_003 + 4097]
    head, tail = obstore.get_ranges(store, "shard-000.safetensors", starts=[0, len(data) - 7], ends=[5, len(data)])
    assert (bytes(head), bytes(tail)) == (data[:5], data[-7:])

    listed = obstore.list(store).collect()
    assert [(meta["path"], meta["size"]) for meta in listed] == [("shard-000.safetensors", len(data))]


def test_ranged_get_is_a_partial_response(s3_server: S3Service, s3_bucket: str) -> None:
    """The server itself answers a Range header with 206 and those bytes only (not
    the whole object for the client to cut)."""
    key = f"raw-{uuid.uuid4().hex[:8]}/blob"
    data = _payload(64 << 10)
    obstore.put(s3_server.store(s3_bucket), key, data)
    assert s3_server.request("GET", f"/{s3_bucket}/{key}") == (200, data)
    status, body = s3_server.request("GET", f"/{s3_bucket}/{key}", headers={"Range": "bytes=10-19"})
    assert (status, body) == (206, data[10:20])
    status, body = s3_server.request("GET", f"/{s3_bucket}/{key}", headers={"Range": f"bytes={len(data) - 3}-"})
    assert (status, body) == (206, data[-3:])


def test_aws_environment_reaches_obstore(s3_server: S3Service, s3_dataset_url: str) -> None:
    """Product code builds its store from the URL and the environment alone."""
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint
    store = S3Store.from_url(s3_dataset_url)
    obstore.put(store, "from-env", b"written through AWS_*")
    bucket, prefix = _split(s3_dataset_url)
    assert bytes(obstore.get(s3_server.store(bucket, prefix), "from-env").bytes()) == b"written through AWS_*"


def test_wrong_keys_are_refused(s3_server: S3Service, s3_dataset_url: str) -> None:
    bucket, prefix = _split(s3_dataset_url)
    obstore.put(s3_server.store(bucket, prefix), "secret", b"right keys only")
    no_retry = {"retry_config": {"max_retries": 0, "retry_timeout": timedelta(seconds=5)}}

    wrong_secret = s3_server.with_keys(secret_key=s3_server.secret_key + "x")
    with pytest.raises(obstore.exceptions.PermissionDeniedError, match="SignatureDoesNotMatch|403 Forbidden"):
        obstore.get(wrong_secret.store(bucket, prefix, **no_retry), "secret")
    with pytest.raises(obstore.exceptions.PermissionDeniedError, match="SignatureDoesNotMatch|403 Forbidden"):
        obstore.put(wrong_secret.store(bucket, prefix, **no_retry), "intruder", b"x")

    wrong_key = s3_server.with_keys(access_key="AKIANOTTHEKEY0000000")
    with pytest.raises(obstore.exceptions.PermissionDeniedError, match="InvalidAccessKeyId|403 Forbidden"):
        obstore.get(wrong_key.store(bucket, prefix, **no_retry), "secret")

    # Unsigned, as an anonymous client would ask.
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(f"{s3_server.endpoint}/{bucket}/{prefix}/secret", timeout=10)
    assert anonymous.value.code == 403

    # The refused write left nothing behind.
    paths = [meta["path"] for meta in obstore.list(s3_server.store(bucket, prefix)).collect()]
    assert paths == ["secret"]


def test_missing_bucket_is_an_error(s3_server: S3Service) -> None:
    missing = f"hsx-missing-{uuid.uuid4().hex[:8]}"
    store = s3_server.store(missing, retry_config={"max_retries": 0})
    with pytest.raises(FileNotFoundError, match="NoSuchBucket"):
        obstore.put(store, "x", b"no bucket, no object")  # no auto-creation on write
    with pytest.raises(FileNotFoundError):
        obstore.get(store, "x")
    with pytest.raises(ValueError, match="bucket name"):
        s3_server.create_bucket("x")  # S3 names have 3-63 characters


def test_create_bucket_is_idempotent(s3_server: S3Service) -> None:
    name = f"hsx-made-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(name)
    s3_server.create_bucket(name)  # exist_ok
    assert s3_server.request("HEAD", f"/{name}")[0] == 200
    with pytest.raises(S3Error, match="409"):
        s3_server.create_bucket(name, exist_ok=False)
    obstore.put(s3_server.store(name), "first", b"1")
    assert bytes(obstore.get(s3_server.store(name), "first").bytes()) == b"1"


def test_get_during_pause_completes_after_resume(s3_server: S3Service, s3_dataset_url: str) -> None:
    if not s3_server.can_pause:
        pytest.skip("the S3 service is external (HSX_TEST_S3_ENDPOINT): it cannot be paused")
    bucket, prefix = _split(s3_dataset_url)
    store = s3_server.store(bucket, prefix)
    data = _payload(256 << 10)
    obstore.put(store, "during-outage", data)

    got: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.append(bytes(obstore.get_range(store, "during-outage", start=100, end=200_100)))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    s3_server.pause()
    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(2.0)
        assert reader.is_alive(), f"answered while the server was stopped: {got or errors}"
    finally:
        s3_server.resume()
    reader.join(30.0)
    assert not reader.is_alive() and not errors
    assert got == [data[100:200_100]]


def test_second_server_keeps_its_data_dir(s3_server: S3Service, tmp_path: Path) -> None:
    """A second local server runs beside the session's (no fixed port shared:
    iceberg/lance are off), and one started again on a given data_dir serves what
    the first stored; the directory is the caller's and stays."""
    if external_s3() is not None:
        pytest.skip("HSX_TEST_S3_ENDPOINT is set: the local server is not under test")
    data_dir = tmp_path / "weed-data"
    started = time.monotonic()
    with LocalS3(data_dir) as first:
        start_s = time.monotonic() - started
        assert start_s < 30, start_s
        assert first.endpoint != s3_server.endpoint
        first.create_bucket("kept")
        obstore.put(first.store("kept"), "a/b", b"survives a restart")
        with pytest.raises(obstore.exceptions.PermissionDeniedError):  # its own keys, not the session's
            obstore.get(first.with_keys(s3_server.access_key, s3_server.secret_key)
                        .store("kept", retry_config={"max_retries": 0}), "a/b")
        first_pid, run_dir = first.pid, first.log_path.parent
    assert not Path(f"/proc/{first_pid}").exists()  # stopped and reaped
    assert not run_dir.exists() and data_dir.is_dir()

    with LocalS3(data_dir) as second:
        # S3 answers before the restarted volume server has loaded the old volumes:
        # reads fail with 500 for a few seconds (environment.md saw up to 18 s).
        deadline = time.monotonic() + 60
        while True:
            try:
                assert bytes(obstore.get(second.store("kept"), "a/b").bytes()) == b"survives a restart"
                break
            except obstore.exceptions.GenericError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def test_stop_removes_only_the_grpc_sockets_the_server_made() -> None:
    """weed leaves its gRPC unix sockets in /tmp, named by port; a server that took
    one of a stopping server's ports makes a file of the same name, which is not
    the stopping server's to remove."""
    if external_s3() is not None:
        pytest.skip("HSX_TEST_S3_ENDPOINT is set: the local server is not under test")
    server = LocalS3().start()
    try:
        made = sorted(server._grpc_sockets())
        assert len(made) >= 3, made  # master, volume, filer (and the S3 API's own)
        assert server._proc is not None
        server._proc.kill()  # gone without removing its files (at SIGTERM weed removes them by name)
        server._proc.wait()
        taken = made[0]
        taken.unlink()
        time.sleep(0.05)  # another ctime
        taken.touch()  # what another server on that port makes
    finally:
        server.stop()
    try:
        assert taken.exists()
        assert [p for p in made[1:] if p.exists()] == []
    finally:
        taken.unlink()


def test_a_start_that_never_answers_says_where_the_s3_api_waits() -> None:
    """The start's timeout error carries the S3 API's goroutine stacks (weed's
    dump at SIGQUIT), since the log goes with the server."""
    if external_s3() is not None:
        pytest.skip("HSX_TEST_S3_ENDPOINT is set: the local server is not under test")
    server = LocalS3().start()
    try:
        stacks = server._s3_stacks()
        assert stacks.lstrip().startswith("goroutine ") and "weed/s3api" in stacks, stacks[:2000]
        assert server._proc is not None and server._proc.poll() is not None  # the dump ends the process
    finally:
        server.stop()


def test_external_service_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_TEST_S3_ENDPOINT", "https://s3.example.test/")
    monkeypatch.delenv("HSX_TEST_S3_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("HSX_TEST_S3_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("HSX_TEST_S3_REGION", raising=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(ValueError, match="HSX_TEST_S3_ACCESS_KEY_ID"):
        external_s3()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aws-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("HSX_TEST_S3_SECRET_ACCESS_KEY", "hsx-secret")
    with dev_s3() as service:  # starts nothing
        assert (service.endpoint, service.access_key, service.secret_key, service.region) == (
            "https://s3.example.test", "aws-key", "hsx-secret", "eu-west-3")
        assert not service.can_pause and "AWS_ALLOW_HTTP" not in service.environ()
        assert "hsx-secret" not in repr(service)
        with pytest.raises(NotImplementedError, match="external"):
            service.pause()
