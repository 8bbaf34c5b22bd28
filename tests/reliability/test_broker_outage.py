"""Broker outage: the broker is frozen (SIGSTOP) for 30 s in the middle of a run
while a producer publishes more prompts; after SIGCONT the extractor, the sink
and the producer carry on by themselves, and nothing is lost or doubled.

The test runs its own broker, since freezing a shared one would stall the rest
of the session (and a real cluster cannot be frozen).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from hsx import models
from hsx.dev.commands import produce_command
from hsx.dev.spawn import HsxService
from hsx.dev.topics import fresh_topics
from hsx.runtime.broker import EmbeddedBroker
from hsx.runtime.settings import KafkaSettings
from tests.reliability.harness import (
    as_records, check_exactly_once, extract_args, index_counts, publish, record_figures, sink_args, text_prompts,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine]

MODEL = "smollm2-135m-instruct"
OUTAGE_S = 30.0


def test_services_ride_out_a_30s_broker_outage(tmp_path: Path) -> None:
    model = models.prepare(names=[MODEL])[MODEL]
    before, during = text_prompts(120, "before"), text_prompts(60, "during")
    with EmbeddedBroker() as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topics = fresh_topics(kafka)
        publish(kafka, topics.prompts, as_records(before))
        late = tmp_path / "late.jsonl"
        late.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in during))
        output = tmp_path / "dataset"
        extractor = HsxService("extractor", extract_args(kafka, topics, model, "x-outage"), tmp_path)
        sink = HsxService("sink", sink_args(kafka, topics, output, "s-outage"), tmp_path)
        with extractor, sink:
            wait_until(lambda: len(index_counts(output)) >= 10, 300, "the run to be under way")
            os.kill(broker.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            samples_at_stop = len(index_counts(output))
            producer = HsxService("produce", produce_command(kafka.bootstrap, topics, late), tmp_path,
                                  health=False).start()
            ready_during = []
            while time.monotonic() - stopped < OUTAGE_S:
                ready_during.append(extractor.ready())
                time.sleep(2)
            os.kill(broker.pid, signal.SIGCONT)
            resumed = time.monotonic()
            outage = resumed - stopped

            assert producer.wait(300) == 0, (tmp_path / "produce.log").read_text()[-3000:]
            total = len(before) + len(during)
            wait_until(lambda: len(index_counts(output)) >= total, 600, "every prompt after the outage")
            recovered_after = time.monotonic() - resumed
            for service in (extractor, sink):
                assert service.exited() is None and service.incarnations == 1, f"{service.name} died:\n{service.log_tail()}"
                assert service.stop() == 0, service.log_tail()

        check_exactly_once(kafka, topics, output, {str(p["request_id"]) for p in before + during})
    record_figures("broker_outage", {
        "prompts": total, "outage_s": round(outage, 1), "samples_before_outage": samples_at_stop,
        "all_done_s_after_resume": round(recovered_after, 1), "service_restarts": 0, "lost": 0, "duplicated": 0,
        "extractor_ready_probes_during_outage": f"{sum(ready_during)}/{len(ready_during)} ready",
    })
