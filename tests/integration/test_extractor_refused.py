"""An extractor whose block records Kafka refuses has the outcome of a sink whose
ready events are refused: it exits 1, the prompts are neither retried nor
dead-lettered, and nothing is committed past them, so a restart extracts them
again. The refusal: the connector (in vLLM's engine process) cut off from the broker by a
fault proxy while prompts keep coming, with a 3 s delivery timeout. (Cut off, not
the whole broker frozen: a frozen broker also holds the extractor's commit, and
whether any record was still unacknowledged at that moment was a race.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hsx import models
from hsx.local.broker import EmbeddedBroker, free_port
from hsx.local.commands import extract_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from tests.drain import drain
from tests.reliability.harness import as_records, committed, publish, text_prompts, wait_until
from tests.reliability.netfaults import FaultProxy, is_connector

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

DELIVERY_TIMEOUT = json.dumps({"message.timeout.ms": "3000"})


def test_refused_block_records_stop_the_extractor_without_committing(tmp_path: Path) -> None:
    tiny = models.prepare(names=["tiny-llama"])["tiny-llama"]
    prompts = text_prompts(200, "refused")
    extractor: HsxService | None = None

    def connector(pid: int) -> str | None:
        if extractor is None or extractor.proc is None:
            return None
        return "connector" if is_connector(extractor.pid, pid) else None

    proxy_port, broker_port = free_port(), free_port()
    proxy = FaultProxy(proxy_port, broker_port, classify=connector).start()
    try:
        with EmbeddedBroker(broker_port, advertised_port=proxy_port):
            kafka = KafkaSettings(bootstrap=f"127.0.0.1:{proxy_port}")
            topics = fresh_topics(kafka, partitions=1)
            offsets = {str(p["request_id"]): i for i, p in enumerate(prompts)}
            publish(kafka, topics.prompts, as_records(prompts))
            group = f"x-{topics.prompts}"
            command = extract_command(kafka.bootstrap, topics, tiny, "--max-model-len", "512", "--max-inflight", "4",
                                      group=group)
            env = cpu_engine_env(HSX_KAFKA_CLIENT_PROPERTIES=DELIVERY_TIMEOUT)
            extractor = HsxService("extractor", command, tmp_path, env=env)
            with extractor:
                wait_until(lambda: extractor.counter("hsx_extractor_prompts_total") >= 3, 600, "the run to be under way")
                proxy.set("connector", partitioned=True)  # prompts keep coming; their records cannot leave
                assert extractor.wait(120) == 1, extractor.log_tail()
                log = extractor.logs()
            refused = set(re.findall(r"the connector could not send (\S+): ", log))
            assert refused and f"Kafka refused a record for {topics.blocks}" in log, log[-3000:]
            assert "retrying" not in log, "a refused record was retried"
            position = committed(kafka, topics.prompts, group, 1)[0]
            assert position <= min(offsets[r] for r in refused), "committed past a prompt whose records were refused"
            assert drain(kafka, topics.prompts_dlq, expected=0, timeout=5, settle=3) == []
    finally:
        proxy.stop()
