"""Crash anywhere: the extractor and the sink are each SIGKILLed (with vLLM's
engine processes) at random moments and restarted; the dataset still holds every
prompt exactly once, with the hidden states of an uninterrupted run (and, for the
prompts the verifier answers, the same answers: a retry regenerates them). The
killed run sends its hidden states by reference (``--payload-store`` on the
session's S3 server: kills land between uploads and manifests, and between
shards and the staged objects' deletion), its sink writes to S3 and stores
byteplane-zstd, so all of these paths live through the kills too; the
uninterrupted run sends inline and writes raw shards to local disk. After the
killed run, the only staged objects left are killed attempts' (no manifest names
them), and a sweep removes those.

``HSX_RELIABILITY_PROMPTS`` / ``HSX_RELIABILITY_KILLS`` scale it up for soak runs
(defaults 160 prompts, 3 kills of each service).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.dataset.storage import open_storage
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.reference import max_relative_error
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import Manifest, staged_key
from hsx.schemas.manifest import STAGED_SUFFIX
from hsx.sink.payloads import StagedObjects
from tests.drain import drain
from tests.reliability.harness import (
    as_records, check_exactly_once, extract_args, index_counts, publish, record_figures, sink_args, text_prompts,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

MODEL = "smollm2-135m-instruct"
PROMPTS = int(os.environ.get("HSX_RELIABILITY_PROMPTS", "160"))
KILLS = int(os.environ.get("HSX_RELIABILITY_KILLS", "3"))
SEED = int(os.environ.get("HSX_RELIABILITY_SEED", str(time.time_ns() % 10_000)))
# Time limits scale with the workload. The uninterrupted run gets a generous
# bound from the prompt count; the killed run, a multiple of what the
# uninterrupted run took plus the cost of every restart (a SmolLM2 engine loads
# in about a minute here).
RESTART_S = 120.0
UNINTERRUPTED_S = 300.0 + 2.0 * PROMPTS
KILLED_FACTOR = 3.0


def killed_run_limit(uninterrupted_s: float) -> float:
    return KILLED_FACTOR * uninterrupted_s + 2 * KILLS * RESTART_S


def _run(kafka: KafkaSettings, model: Path, prompts: list[dict[str, object]], workdir: Path,
         kills: int, rng: random.Random, limit: float, codec: str = "raw",
         output: str | None = None, payload_store: str | None = None) -> tuple[str | Path, list[dict[str, object]], float]:
    """One pipeline run within ``limit`` seconds; each service is killed ``kills``
    times, each time at a random moment 0.5-4 s after it became ready. Returns the
    dataset, where the kills landed and how long the run took."""
    topics = fresh_topics(kafka)
    publish(kafka, topics.prompts, as_records(prompts))
    dataset: str | Path = output or workdir / "dataset"
    workdir.mkdir()
    by_reference = ["--payload-store", payload_store] if payload_store else []
    services = [HsxService("extractor", extract_args(kafka, topics, model, f"x-{topics.prompts}") + [
                    "--max-inflight", "16", *by_reference], workdir),
                HsxService("sink", sink_args(kafka, topics, dataset, f"s-{topics.prompts}") + [
                    "--dataset-codec", codec, *by_reference], workdir)]
    left = {s.name: kills for s in services}
    kill_at: dict[str, float] = {}
    landed: list[dict[str, object]] = []
    started = time.monotonic()

    def chaos() -> None:
        for service in services:
            assert service.exited() is None, f"{service.name} exited by itself:\n{service.log_tail()}"
            # The sink's kills wait until samples flow, so that they land among shard writes.
            waiting = service.name == "sink" and not index_counts(dataset)
            if not left[service.name] or waiting or not service.ready():
                continue
            now = time.monotonic()
            if service.name not in kill_at:
                kill_at[service.name] = now + rng.uniform(0.5, 4.0)
            elif now >= kill_at[service.name]:
                del kill_at[service.name]
                landed.append(_landing(service, dataset, time.monotonic() - started))
                service.kill()
                left[service.name] -= 1
                service.start()

    try:
        for service in services:
            service.start()
        wait_until(lambda: len(index_counts(dataset)) >= len(prompts) and not any(left.values()), limit,
                   "every prompt in the dataset", tick=chaos)
        took = time.monotonic() - started
        for service in services:
            service.wait_ready()  # a last restart may still be loading
            assert service.stop() == 0, service.log_tail()
    finally:
        for service in services:
            if service.exited() is None:
                service.kill()
    check_exactly_once(kafka, topics, dataset, {str(p['request_id']) for p in prompts})
    if payload_store:
        _check_staged_objects(kafka, topics, payload_store)
    return dataset, landed, took


def _check_staged_objects(kafka: KafkaSettings, topics: TopicSettings, payload_store: str) -> None:
    """Every staged object a manifest names was deleted (all are committed); what
    is left are attempts whose manifest never went out (killed between upload and
    manifest), and the sinks' sweep deletes those."""
    store = open_storage(payload_store)
    left = set(store.stale(STAGED_SUFFIX, older_than=-3600))  # every one, however new
    named = {staged_key(m.request_id, m.attempt_id) for m in (
        Manifest.model_validate_json(r.value()) for r in drain(kafka, topics.blocks, expected=10**9, timeout=10))}
    assert not left & named, f"staged objects of committed manifests were not deleted: {sorted(left & named)}"
    time.sleep(1.5)  # S3 keeps modification times in whole seconds
    StagedObjects(store, max_age=1.0).sweep(time.monotonic())
    assert store.stale(STAGED_SUFFIX, older_than=-3600) == []


def _landing(service: HsxService, output: str | Path, elapsed: float) -> dict[str, object]:
    """What the process was doing when it died, from its own metrics."""
    where: dict[str, object] = {"service": service.name, "incarnation": service.incarnations,
                                "at_s": round(elapsed, 1), "dataset_samples": len(index_counts(output))}
    if service.name == "extractor":
        where["prompts_acked_by_it"] = service.metric("hsx_extractor_prompts_total")
        where["prompts_in_flight"] = service.metric("hsx_extractor_prompts_in_flight")
    else:
        where["samples_written_by_it"] = service.metric("hsx_sink_samples_total")
        where["bytes_buffered"] = service.metric("hsx_sink_buffered_bytes")
    return where


@pytest.mark.timeout(UNINTERRUPTED_S + killed_run_limit(UNINTERRUPTED_S) + 600)
def test_sigkill_extractor_and_sink_anywhere(kafka: KafkaSettings, tmp_path: Path, s3_dataset_url: str) -> None:
    model = models.prepare(names=[MODEL])[MODEL]
    prompts = text_prompts(PROMPTS, "crash")
    # Every 8th prompt is answered by the verifier (greedy): a retry after a kill
    # must regenerate the same answer, so its sample equals the uninterrupted one.
    for prompt in prompts[::8]:
        prompt["generation"] = {"max_tokens": 8, "ignore_eos": True}
    rng = random.Random(SEED)
    reference, _, uninterrupted_s = _run(kafka, model, prompts, tmp_path / "uninterrupted", kills=0, rng=rng,
                                         limit=UNINTERRUPTED_S)
    # The killed run sends by reference and writes to S3, keeping its hidden states
    # compressed (byteplane-zstd, lossless): kills must not disturb any of these
    # paths, and it must read back as the inline, raw, local run's.
    output, landed, killed_s = _run(kafka, model, prompts, tmp_path / "killed", kills=KILLS, rng=rng,
                                    limit=killed_run_limit(uninterrupted_s), codec="byteplane-zstd",
                                    output=s3_dataset_url, payload_store=f"{s3_dataset_url}-staging")

    assert Counter(k["service"] for k in landed) == {"extractor": KILLS, "sink": KILLS}
    expected, actual = open_dataset(reference), open_dataset(output)
    errors, identical = [], 0
    for request_id in expected.request_ids():
        want, got = expected[request_id], actual[request_id]
        assert want["token_ids"].tolist() == got["token_ids"].tolist(), request_id  # answers included
        errors.append(max_relative_error(got["hidden_states"], want["hidden_states"]))
        identical += bool((got["hidden_states"] == want["hidden_states"]).all())
    # Batches differ between the runs, so float32 sums may round differently.
    assert max(errors) <= 1e-5, max(errors)
    mid_work = [k for k in landed if k["service"] == "extractor" and k["prompts_in_flight"] > 0]
    record_figures("crash_anywhere", {
        "seed": SEED, "prompts": PROMPTS, "generating_prompts": len(prompts[::8]), "kills": landed,
        "uninterrupted_s": round(uninterrupted_s), "killed_s": round(killed_s), "extractor_kills_with_prompts_in_flight": len(mid_work),
        "lost": 0, "duplicated": 0, "max_relative_error_vs_uninterrupted": max(errors),
        "bit_identical_samples": identical,
    })
    assert mid_work, f"no extractor kill landed mid-work (seed {SEED}): {landed}"
