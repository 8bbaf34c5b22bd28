"""Attempts and retries: one prompt through the engine until the connector reports
that Kafka acknowledged all of its records.

Each attempt gets a fresh attempt id, so the sink can tell the records of a
failed or killed attempt from those of the one that completed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from extractor.completion import CompletionReceiver
from extractor.engine import Engine
from extractor.prompts import PreparedPrompt
from extractor.stats import ExtractorStats
from runtime.errors import Rejection, ServiceFailed
from runtime.logs import record_fields
from schemas import ErrorClass, PromptEvent, SourceRef
from schemas.connector import RequestParams

log = logging.getLogger(__name__)


class Attempts:
    """Runs prompts through the engine, retrying failed attempts."""

    def __init__(self, engine: Engine, completions: CompletionReceiver, stats: ExtractorStats,
                 max_attempts: int, completion_timeout: float) -> None:
        self._engine = engine
        self._completions = completions
        self._stats = stats
        self._max_attempts = max_attempts
        self._timeout = completion_timeout

    async def extract(self, event: PromptEvent, prepared: PreparedPrompt, source: SourceRef) -> Rejection | None:
        """Run attempts until one is acknowledged; returns ``None`` on success or
        the rejection to dead-letter the prompt with. Raises when the engine is
        dead: no later prompt could succeed either."""
        from vllm.v1.engine.exceptions import EngineDeadError

        reason = "no attempt made"
        for attempt in range(1, self._max_attempts + 1):
            params = RequestParams(
                request_id=event.request_id,
                attempt_id=uuid.uuid4().hex,
                source=source,
                loss_mask_spans=prepared.loss_mask_spans,
                metadata=event.metadata,
                generation=event.generation,
            )
            future = self._completions.expect(params.attempt_id)
            try:
                await self._engine.prefill(prepared.token_ids, params)
                report = await asyncio.wait_for(future, self._timeout)
            except (EngineDeadError, ServiceFailed):
                raise
            except ValueError as exc:  # vLLM's input validation: retrying cannot help
                self._completions.forget(params.attempt_id)
                return Rejection(ErrorClass.ENGINE_REJECTED, f"vLLM rejected the prompt: {exc}")
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - retried, then dead-lettered
                self._completions.forget(params.attempt_id)
                reason = f"attempt {attempt}: {exc!r}"
            else:
                if report.ok:
                    self._stats.extracted(report)
                    return None
                reason = f"attempt {attempt}: {report.error}"
            retrying = attempt < self._max_attempts
            log.warning("extraction of %s failed (%s)%s", event.request_id, reason, "; retrying" if retrying else "",
                        extra=record_fields(event.request_id, source.topic, source.partition, source.offset))
            if retrying:
                self._stats.add("retries")
        return Rejection(ErrorClass.EXTRACTION_FAILED, reason)
