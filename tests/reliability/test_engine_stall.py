"""A stuck engine: vLLM's engine core (which runs the worker on CPU) stops making
progress (here: SIGSTOP) while prompts are in flight. The extractor notices within
--stall-timeout and exits 1 so that its orchestrator restarts it, instead of holding
its partitions forever; nothing unfinished was committed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from hsx import models
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from tests.reliability.harness import (
    as_records, committed, extract_args, publish, record_figures, text_prompts, wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

MODEL = "smollm2-135m-instruct"
STALL_S = 8


def test_a_stuck_engine_makes_the_extractor_exit(kafka: KafkaSettings, tmp_path: Path) -> None:
    model = models.prepare(names=[MODEL])[MODEL]
    topics = fresh_topics(kafka, partitions=1)
    prompts = text_prompts(400, "stall")
    publish(kafka, topics.prompts, as_records(prompts))
    extractor = HsxService("extractor", extract_args(kafka, topics, model, "x-stall") + [
        "--stall-timeout", str(STALL_S), "--max-inflight", "8"], tmp_path)
    with extractor:
        extractor.wait_ready()
        wait_until(lambda: extractor.metric("hsx_extractor_prompts_total") >= 8, 300, "the first prompts")
        os.kill(extractor.child("VLLM::EngineCore"), signal.SIGSTOP)
        stopped = time.monotonic()
        acked_at_stop = extractor.metric("hsx_extractor_prompts_total")
        assert extractor.proc is not None
        status = extractor.proc.wait(STALL_S + 120)
        noticed = time.monotonic() - stopped
    assert status == 1, extractor.log_tail()
    assert "the engine looks stuck" in extractor.logs()
    assert STALL_S <= noticed, noticed
    # Only finished prompts were committed: what was in flight comes back on restart.
    assert committed(kafka, topics.prompts, "x-stall", 1)[0] <= acked_at_stop
    record_figures("engine_stall", {"stall_timeout_s": STALL_S, "exited_after_s": round(noticed, 1)})
