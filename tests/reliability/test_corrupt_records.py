"""Corrupt block records, interleaved with good samples, through a real sink:
none reaches the dataset, each is reported in the blocks DLQ with its class."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import zstandard
from isal import isal_zlib

from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas.blocks import FRAME_PREFIX, MAGIC
from hsx.sink.assembler import Record
from tests.reliability.harness import dead_letters, index_counts, publish, record_figures, sink_args
from tests.unit.test_assembler import HIDDEN, LAYERS, forge, records

pytestmark = [pytest.mark.integration]


def _with(record: Record, value: bytes) -> Record:
    return Record(record.offset, record.key, value, record.headers)


def _flip(recs: list[Record]) -> list[Record]:
    value = bytearray(recs[1].value)
    value[-5] ^= 0xFF
    return [recs[0], _with(recs[1], bytes(value)), *recs[2:]]


def _manifest(change: Callable[[dict], dict]) -> Callable[[list[Record]], list[Record]]:  # type: ignore[type-arg]
    return lambda recs: [*recs[:-1], _with(recs[-1], orjson.dumps(change(orjson.loads(recs[-1].value))))]


MAX_SAMPLE_BYTES = 64 << 20
BOMB_HIDDEN = 1 << 25
"""4 tokens x LAYERS x 2**25 float32: 1 GiB of zeros in a record of a few dozen KiB."""


def _bomb(recs: list[Record]) -> list[Record]:
    """A zstd bomb that tells the truth: a block whose byte planes really decompress
    to the 1 GiB its header declares (so the payload check passes), and a manifest
    that agrees. Only the sink's --max-sample-bytes stands between it and a 1 GiB
    buffer."""
    tokens, plane_bytes = 4, 4 * LAYERS * BOMB_HIDDEN
    compressor, chunk = zstandard.ZstdCompressor(level=3).compressobj(size=plane_bytes), bytes(16 << 20)
    plane = b"".join(compressor.compress(chunk) for _ in range(plane_bytes // len(chunk))) + compressor.flush()
    crc = 0
    for _ in range(4 * plane_bytes // len(chunk)):
        crc = isal_zlib.crc32(chunk, crc)
    header = orjson.dumps({"codec": "byteplane-zstd", "dtype": "float32", "shape": [tokens, LAYERS, BOMB_HIDDEN],
                           "token_start": 0, "token_end": tokens, "checksum": f"crc32:{crc:08x}",
                           "segments": [{"encoding": "zstd", "nbytes": len(plane)}] * 4})
    block = FRAME_PREFIX.pack(MAGIC, len(header)) + header + plane * 4
    manifest = orjson.loads(recs[-1].value)
    manifest |= {"hidden_size": BOMB_HIDDEN, "num_tokens": tokens, "token_ids": [0] * tokens, "blocks": [
        manifest["blocks"][0] | {"token_end": tokens, "checksum": f"crc32:{crc:08x}", "compressed_nbytes": len(block)}]}
    return [_with(recs[0], block), _with(recs[-1], orjson.dumps(manifest))]


# (request id, how its records are damaged, the DLQ class expected)
DAMAGE: list[tuple[str, Callable[[list[Record]], list[Record]], str]] = [
    ("flipped-byte", _flip, "corrupt_block"),
    ("truncated-block", lambda r: [_with(r[0], r[0].value[:-10]), *r[1:]], "corrupt_block"),
    ("manifest-without-blocks", lambda r: [r[-1]], "incomplete_sample"),
    ("blocks-without-manifest", lambda r: r[:-1], "incomplete_sample"),
    ("missing-middle-block", lambda r: [r[0], *r[2:]], "incomplete_sample"),
    ("wrong-shape", _manifest(lambda m: {**m, "hidden_size": HIDDEN * 2}), "shape_mismatch"),
    ("wrong-token-count", _manifest(lambda m: {**m, "num_tokens": 99}), "invalid_manifest"),
    ("manifest-of-another-request", _manifest(lambda m: {**m, "request_id": "someone-else"}), "invalid_manifest"),
    ("path-traversal-id", _manifest(lambda m: {**m, "request_id": "../../etc"}), "invalid_manifest"),
    ("garbage-manifest", lambda r: [*r[:-1], _with(r[-1], b"\x00not json")], "invalid_manifest"),
    ("unreadable-headers", lambda r: [Record(0, r[0].key, r[0].value, [("kind", b"mystery")])], "invalid_record"),
    # Found by #35's held-out check: a sink sized its buffers from these headers (MemoryError, the sink stopped).
    ("forged-64-gib-shape", lambda r: forge(r, tokens=4, hidden=2**31), "sample_too_large"),
    ("forged-32-mib-shape", lambda r: forge(r, tokens=4, hidden=2**20), "corrupt_block"),  # within the limit
    ("zstd-bomb-of-1-gib", _bomb, "sample_too_large"),
]


def test_corrupt_records_never_reach_the_dataset(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    stream: list[Record] = []
    good = [f"good-{i}" for i in range(6)]
    for i, (request_id, damage, _) in enumerate(DAMAGE):
        stream += damage(records(request_id)[0])
        if i < len(good):
            stream += records(good[i])[0]
    publish(kafka, topics.blocks, stream)

    output = tmp_path / "dataset"
    sink = HsxService("sink", sink_args(kafka, topics, output, "s-corrupt") + [
        "--incomplete-timeout", "3", "--exit-when-idle", "8", "--max-sample-bytes", str(MAX_SAMPLE_BYTES)], tmp_path)
    with sink:
        assert sink.proc is not None
        peak_rss = _peak_rss(sink.proc)
        assert sink.proc.wait(120) == 0, sink.log_tail()
    assert peak_rss < 768 << 20, f"the sink's peak RSS was {peak_rss >> 20} MiB"  # 340 MiB seen; the bomb alone is 1 GiB

    assert index_counts(output) == {request_id: 1 for request_id in good}
    letters = dead_letters(kafka, topics.blocks_dlq, expected=len(DAMAGE))
    reported = {(r.key() or b"").decode(): h.error_class for h, r in letters}
    unreadable = next(r for h, r in letters if h.error_class == "invalid_record")
    assert unreadable.value() == next(r.value for r in stream if r.headers == [("kind", b"mystery")])  # kept whole
    assert len(letters) == len(DAMAGE)
    assert reported == {request_id: error_class for request_id, _, error_class in DAMAGE}
    record_figures("corrupt_records", {"kinds": len(DAMAGE), "reported": len(letters), "in_dataset": len(good),
                                       "sink_peak_rss_mib": peak_rss >> 20})


def _peak_rss(proc: subprocess.Popen[bytes]) -> int:
    """The process's high-water mark of resident memory (``VmHWM``), read until it exits."""
    peak = 0
    while proc.poll() is None:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            status = Path(f"/proc/{proc.pid}/status").read_text()
            # An exited process not yet reaped (a zombie) has no memory lines.
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        time.sleep(0.1)
    return peak
