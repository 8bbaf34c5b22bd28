"""``hsx sink --flush-when-idle``: the last samples of a job get their shard and
ready events once blocks stop coming, not when the shard's age runs out."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx.local.commands import sink_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from tests.drain import drain
from hsx.runtime.settings import KafkaSettings
from tests.reliability.harness import index_counts, publish
from tests.unit.test_assembler import records

pytestmark = [pytest.mark.integration]


def test_an_idle_partition_closes_its_shard(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    ids = [f"idle-{i}" for i in range(3)]
    publish(kafka, topics.blocks, [record for request_id in ids for record in records(request_id)[0]])
    output = tmp_path / "dataset"
    # An hour of shard age and a large shard: only the idle flush can close it.
    command = sink_command(kafka.bootstrap, topics, output, "--max-shard-age", "3600", "--flush-when-idle", "1")
    with HsxService("sink", command, tmp_path) as sink:
        ready = drain(kafka, topics.ready, expected=len(ids), timeout=60)
        assert sink.exited() is None, sink.log_tail()  # still running: no idle exit, no drain
        assert sorted(r.key().decode() for r in ready) == ids
        assert index_counts(output) == {request_id: 1 for request_id in ids}
        assert sink.stop() == 0
