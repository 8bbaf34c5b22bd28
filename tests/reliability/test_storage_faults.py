"""Storage faults: the dataset's file system fills up, then turns read-only. The
sink commits nothing it could not store, retries with growing backoff, and
finishes by itself once storage is back; nothing is lost or doubled.

The output is a small tmpfs mounted for the test (needs root, as on the CI
machines); remounts change its size and mode under the running sink.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from tests.mounts import tmpfs
from tests.reliability.harness import committed, index_counts, publish, record_figures, sink_args, wait_until
from tests.unit.test_assembler import records

pytestmark = [pytest.mark.integration]

SAMPLES = 24
TOKENS = 1024  # x 2 layers x 16 x float32 = 128 KiB a sample, more than the full file system holds


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "fs").mkdir()
    with tmpfs(tmp_path / "fs", "size=64k") as mount:
        yield mount


def _remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


def test_full_then_read_only_storage_commits_nothing_and_recovers(kafka: KafkaSettings, tmp_path: Path,
                                                                   small_fs: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    ids = [f"s-{i}" for i in range(SAMPLES)]
    stream = [record for request_id in ids for record in records(request_id, tokens=TOKENS, per_block=256)[0]]
    publish(kafka, topics.blocks, stream)
    output = small_fs / "dataset"
    group = "s-storage"
    sink = HsxService("sink", sink_args(kafka, topics, output, group), tmp_path)
    phases: dict[str, float] = {}
    with sink:
        wait_until(lambda: "No space left on device" in sink.logs(), 60, "a full file system")
        started = time.monotonic()
        time.sleep(6)
        assert committed(kafka, topics.blocks, group, 1)[0] <= 0, "committed records that were never stored"
        phases["full_s"] = round(time.monotonic() - started, 1)

        _remount(small_fs, "size=64m,ro")
        wait_until(lambda: "Read-only file system" in sink.logs(), 60, "a read-only file system")
        started = time.monotonic()
        time.sleep(6)
        assert committed(kafka, topics.blocks, group, 1)[0] <= 0, "committed records that were never stored"
        assert index_counts(output) == {}
        phases["read_only_s"] = round(time.monotonic() - started, 1)

        _remount(small_fs, "rw")
        restored = time.monotonic()
        wait_until(lambda: len(index_counts(output)) == SAMPLES, 90, "the dataset after storage came back")
        phases["recovered_after_s"] = round(time.monotonic() - restored, 1)
        wait_until(lambda: committed(kafka, topics.blocks, group, 1)[0] == len(stream), 30, "the final commit")
        assert sink.stop() == 0, sink.log_tail()

    assert index_counts(output) == {request_id: 1 for request_id in ids}
    backoffs = [float(s) for s in re.findall(r"retrying in ([0-9.]+)s", sink.logs())]
    assert len(backoffs) >= 3 and backoffs[:3] == sorted(backoffs[:3]) and backoffs[2] > backoffs[0], backoffs
    assert sink.incarnations == 1
    record_figures("storage_faults", {**phases, "samples": SAMPLES, "write_retries": len(backoffs),
                                      "max_backoff_s": max(backoffs), "lost": 0, "duplicated": 0})
