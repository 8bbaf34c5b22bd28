"""Backpressure: a sink far slower than the extractor keeps its memory within
its budget while the backlog on Kafka grows; once it may run freely it catches
up, nothing lost. The sink is held stopped (SIGSTOP) until the extractor has
acknowledged more than twice its budget and prefetch, then runs 10 ms of every
second: the backlog it faces is large by construction, however fast or slow
the engine runs beside other tests (a sink merely throttled kept up in a CI run,
its 10 ms slices stretched by a loaded scheduler)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hsx import models
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from tests.reliability.harness import (
    as_records, check_exactly_once, extract_args, index_counts, publish, record_figures, sink_args, text_prompts,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

MODEL = "smollm2-135m-instruct"
PROMPTS = 200
BUDGET = 32 << 20  # --max-buffer-bytes
PREFETCH = 2 * (16 << 20)  # librdkafka's queue and one fetch response, 16 MiB each (their floor)
SLACK = 128 << 20  # decode and shard-write temporaries, allocator fragmentation
MiB = 1 << 20
HOLD = 5 * (BUDGET + PREFETCH) // 2  # the sink stays stopped until this much is acknowledged (the check: twice)


class Throttle(threading.Thread):
    """Keeps a process stopped while ``hold()``, then lets it run ``run_s`` of
    every ``period_s``."""

    def __init__(self, service: HsxService, hold: Callable[[], bool], run_s: float = 0.01,
                 period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.service, self.hold, self.run_s, self.period_s = service, hold, run_s, period_s
        self.done = threading.Event()

    def run(self) -> None:
        self.service.signal(signal.SIGSTOP)
        while self.hold() and not self.done.wait(0.2):
            pass
        while not self.done.is_set():
            self.service.signal(signal.SIGSTOP)
            self.done.wait(self.period_s - self.run_s)
            self.service.signal(signal.SIGCONT)
            time.sleep(self.run_s)
        self.service.signal(signal.SIGCONT)


def test_slow_sink_keeps_memory_bounded_while_lag_grows(kafka: KafkaSettings, tmp_path: Path) -> None:
    model = models.prepare(names=[MODEL])[MODEL]
    prompts = [{**p, "prompt": " ".join([str(p["prompt"])] * 3)} for p in text_prompts(PROMPTS, "bp")]
    topics = fresh_topics(kafka)
    publish(kafka, topics.prompts, as_records(prompts))
    output = tmp_path / "dataset"
    sink = HsxService("sink", sink_args(kafka, topics, output, "s-bp") + ["--max-buffer-bytes", str(BUDGET)], tmp_path)
    extractor = HsxService("extractor", extract_args(kafka, topics, model, "x-bp"), tmp_path)
    samples: list[tuple[float, int, int, float]] = []  # (t, sink RSS, extractor RSS, prompts acked - stored)
    lag: list[float] = []  # the extractor's consumer-lag gauge
    with sink, extractor:
        sink.wait_ready()
        baseline = sink.rss_bytes()
        extractor.wait_ready()
        def hold() -> bool:  # NaN (no answer yet) holds too
            return not (extractor.metric("hsx_extractor_block_raw_bytes_total") >= HOLD
                        or extractor.metric("hsx_extractor_prompts_total") >= PROMPTS)

        throttle = Throttle(sink, hold)
        throttle.start()
        started = time.monotonic()
        try:
            def sample() -> None:
                acked = extractor.metric("hsx_extractor_prompts_total")
                lag.append(extractor.metric("hsx_extractor_consumer_lag", labelled=True))
                samples.append((time.monotonic() - started, sink.rss_bytes(), extractor.rss_bytes(),
                                acked - len(index_counts(output))))

            wait_until(lambda: extractor.metric("hsx_extractor_prompts_total") >= PROMPTS, 600,
                       "the extractor to finish", tick=sample)
        finally:
            throttle.done.set()
            throttle.join()
        wait_until(lambda: len(index_counts(output)) >= PROMPTS, 300, "the sink to catch up", tick=lambda: samples.append(
            (time.monotonic() - started, sink.rss_bytes(), extractor.rss_bytes(), PROMPTS - len(index_counts(output)))))
        time.sleep(2)  # the gauge is refreshed with each commit (every second)
        final_lag = extractor.metric("hsx_extractor_consumer_lag", labelled=True)
        for service in (extractor, sink):
            assert service.stop() == 0, service.log_tail()

    check_exactly_once(kafka, topics, output, {str(p["request_id"]) for p in prompts})
    bytes_per_prompt = sum(p.stat().st_size for p in (output / "shards").iterdir()) / PROMPTS
    peak_rss = max(s[1] for s in samples)
    peak_backlog = max(s[3] for s in samples) * bytes_per_prompt
    growth = peak_rss - baseline
    record_figures("backpressure", {
        "prompts": PROMPTS, "extractor_lag_gauge_peak": max((x for x in lag if x == x), default=0.0),
        "sink_budget_mib": BUDGET // MiB, "sink_rss_baseline_mib": round(baseline / MiB),
        "sink_rss_peak_mib": round(peak_rss / MiB), "peak_backlog_mib": round(peak_backlog / MiB),
        "extractor_rss_mib_min_max": [round(min(s[2] for s in samples) / MiB), round(max(s[2] for s in samples) / MiB)],
        "sink_rss_mib_over_time": [[round(t), round(r / MiB)] for t, r, _, _ in samples[:: max(1, len(samples) // 12)]],
    })
    peak_lag = max((x for x in lag if x == x), default=0.0)  # NaN: the probe went unanswered
    assert peak_lag > 0 and final_lag == 0, (lag, final_lag)  # the lag gauge moves, and reaches 0
    assert growth <= BUDGET + PREFETCH + SLACK, f"sink RSS grew by {growth / MiB:.0f} MiB"
    assert peak_backlog >= 2 * (BUDGET + PREFETCH), "the sink kept up: the test proved nothing"
