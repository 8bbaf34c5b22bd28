"""An S3 outage while the extractor stages hidden states by reference
(``--payload-store s3://...``): the S3 server is stopped (SIGSTOP) under a
running pipeline, then prompts published. While it is away no prompt is
committed, since none can be staged; once it is back every prompt arrives
exactly once, and no staged object is left."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hsx import models
from hsx.dataset.storage import open_storage
from hsx.local.s3service import S3Service
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas.manifest import STAGED_SUFFIX
from tests.reliability.harness import (
    as_records, check_exactly_once, committed, extract_args, publish, record_figures, sink_args, text_prompts,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

MODEL = "smollm2-135m-instruct"
PER_PHASE = 12
OUTAGE_S = 20.0


def test_an_s3_outage_while_staging_commits_nothing_and_everything_arrives_after(
        kafka: KafkaSettings, s3_server: S3Service, s3_dataset_url: str, tmp_path: Path) -> None:
    if not s3_server.can_pause:
        pytest.skip("HSX_TEST_S3_ENDPOINT names an S3 this test cannot stop")
    model = models.prepare(names=[MODEL])[MODEL]
    topics = fresh_topics(kafka, partitions=1)
    staging, output = f"{s3_dataset_url}-staging", tmp_path / "dataset"
    by_reference = ["--payload-store", staging]
    before, during = text_prompts(PER_PHASE, "before"), text_prompts(PER_PHASE, "during")
    group = f"x-{topics.prompts}"
    services = [HsxService("extractor", extract_args(kafka, topics, model, group) + by_reference, tmp_path),
                HsxService("sink", sink_args(kafka, topics, output, f"s-{topics.prompts}") + by_reference, tmp_path)]

    def alive() -> None:
        for service in services:
            assert service.exited() is None, f"{service.name} exited:\n{service.log_tail()}"

    def prompts_committed() -> int:
        return committed(kafka, topics.prompts, group, 1)[0]

    for service in services:
        service.start()
    try:
        publish(kafka, topics.prompts, as_records(before))
        wait_until(lambda: prompts_committed() == PER_PHASE, 600, "the first prompts extracted", tick=alive)

        s3_server.pause()
        try:
            publish(kafka, topics.prompts, as_records(during))
            ends = time.monotonic() + OUTAGE_S
            while time.monotonic() < ends:  # nothing can be staged, so nothing is committed
                assert prompts_committed() == PER_PHASE
                alive()
                time.sleep(1)
        finally:
            s3_server.resume()
        resumed = time.monotonic()
        wait_until(lambda: prompts_committed() == 2 * PER_PHASE, 600, "every prompt extracted after the outage",
                   tick=alive)
        caught_up_s = time.monotonic() - resumed
        for service in services:  # the extractor first: the sink then sees every manifest
            assert service.stop() == 0, service.log_tail()
    finally:
        for service in services:
            if service.proc is not None and service.exited() is None:
                service.kill()

    check_exactly_once(kafka, topics, output, {p["request_id"] for p in before + during})  # type: ignore[misc]
    # The uploads waited the outage out (the S3 client retries for minutes), so no
    # attempt failed, and the sink deleted every staged object once committed.
    left = open_storage(staging).stale(STAGED_SUFFIX, older_than=-3600)
    record_figures("staging_outage", {"outage_s": OUTAGE_S, "caught_up_s": round(caught_up_s, 1),
                                      "staged_left": len(left)})
    assert left == []
