"""``hsx sink --output s3://…`` against a real S3 server: an outage under a
running sink (the server SIGSTOPped for 20 s) commits nothing meanwhile, does not
stop the sink reading on (its shard writer waits, its loop does not), and loses
nothing after; a wrong key or a missing bucket stops the sink at start, in one
line, with nothing committed."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from hsx.local.commands import sink_command
from hsx.local.s3service import S3Service
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from tests.drain import drain
from hsx.dataset.reader import open_dataset
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady
from tests.reliability.harness import committed, index_counts, publish, wait_until
from tests.unit.test_assembler import HIDDEN, LAYERS, records

pytestmark = [pytest.mark.integration]

OUTAGE_S = 20.0
TOKENS = 12
SAMPLE_BYTES = TOKENS * LAYERS * HIDDEN * 4  # float32


def _samples(prefix: str, count: int, first_offset: int) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(count):
        recs, _ = records(f"{prefix}-{i}", tokens=TOKENS, first_offset=first_offset + len(out))
        out += recs
    return out


def test_an_s3_outage_under_a_running_sink_commits_nothing_and_loses_nothing(
        kafka: KafkaSettings, s3_server: S3Service, s3_dataset_url: str, tmp_path: Path) -> None:
    if not s3_server.can_pause:
        pytest.skip("HSX_TEST_S3_ENDPOINT names an S3 this test cannot stop")
    topics = fresh_topics(kafka, partitions=1)
    group = f"s-{topics.blocks}"
    before = _samples("before", 4, 0)
    publish(kafka, topics.blocks, before)
    command = sink_command(kafka.bootstrap, topics, s3_dataset_url, "--max-shard-samples", "2",
                           "--flush-when-idle", "0.5", group=group)
    with HsxService("sink", command, tmp_path) as sink:
        wait_until(lambda: committed(kafka, topics.blocks, group, 1)[0] == len(before), 120,
                   "the first samples stored and committed", tick=lambda: _alive(sink))
        assert len(index_counts(s3_dataset_url)) == 4

        s3_server.pause()
        try:
            during = _samples("during", 4, len(before))
            publish(kafka, topics.blocks, during)
            ends, held = time.monotonic() + OUTAGE_S, 0.0
            while time.monotonic() < ends:  # the sink holds the new samples: none of their records is committed
                assert committed(kafka, topics.blocks, group, 1)[0] == len(before)
                held = max(held, sink.metric("hsx_sink_buffered_bytes"))
                _alive(sink)
                time.sleep(1)
        finally:
            s3_server.resume()
        # All four samples, two shards' worth (--max-shard-samples 2): it read on past the shard it could not write.
        assert held >= 4 * SAMPLE_BYTES, f"{held:.0f} bytes held"
        total = len(before) + len(during)
        wait_until(lambda: committed(kafka, topics.blocks, group, 1)[0] == total, 180,
                   "every sample stored after the outage", tick=lambda: _alive(sink))
        sink.signal(signal.SIGTERM)
        assert sink.wait(120) == 0, sink.log_tail()

    counts = index_counts(s3_dataset_url)
    expected = {f"{p}-{i}" for p in ("before", "during") for i in range(4)}
    assert set(counts) == expected and max(counts.values()) == 1
    ready = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(kafka, topics.ready, expected=8)]
    assert {e.request_id for e in ready} == expected
    dataset = open_dataset(s3_dataset_url)
    assert all(dataset[r]["hidden_states"].shape == (12, 2, dataset.event(r).hidden_size) for r in expected)


def _alive(sink: HsxService) -> None:
    assert sink.exited() is None, f"the sink exited:\n{sink.log_tail()}"


@pytest.mark.parametrize("fault", ["wrong secret key", "missing bucket"])
def test_a_refused_store_stops_the_sink_at_start_with_nothing_committed(
        kafka: KafkaSettings, s3_server: S3Service, s3_dataset_url: str, tmp_path: Path, fault: str) -> None:
    topics = fresh_topics(kafka, partitions=1)
    group = f"s-{topics.blocks}"
    publish(kafka, topics.blocks, _samples("r", 2, 0))
    secret = "wrong-secret-that-must-not-be-logged"
    if fault == "missing bucket":
        service, output, expected = s3_server, "s3://hsx-missing-bucket/ds", "bucket 'hsx-missing-bucket' does not exist"
    else:
        service, output, expected = s3_server.with_keys(secret_key=secret), s3_dataset_url, "write refused|list refused"
    sink = HsxService("sink", sink_command(kafka.bootstrap, topics, output, "--exit-when-idle", "5", group=group),
                      tmp_path, env=cpu_engine_env(**service.environ()))
    with sink:
        returncode = sink.wait(120)
    logs = sink.logs()
    assert returncode == 1, logs
    assert re.search(expected, logs), logs
    assert secret not in logs
    assert committed(kafka, topics.blocks, group, 1)[0] < 0  # no offset ever committed
