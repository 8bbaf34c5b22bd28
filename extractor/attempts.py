"""Attempts and retries: one prompt through the engine until the connector reports
that Kafka acknowledged all of its records.

Each attempt gets a fresh attempt id, so the sink can tell the records of a
failed or killed attempt from those of the one that completed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from hsx.extractor import regeneration
from hsx.extractor.completion import CompletionReceiver
from hsx.extractor.engine import Engine
from hsx.extractor.prompts import PreparedPrompt
from hsx.extractor.stats import ExtractorStats
from hsx.runtime.errors import InvalidInput, ServiceFailed
from hsx.runtime.logs import record_fields
from hsx.schemas import ErrorClass, GeneratedTurn, PromptEvent, SourceRef, sample_id
from hsx.schemas.connector import RequestParams

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

    async def extract(self, event: PromptEvent, prepared: PreparedPrompt, source: SourceRef) -> InvalidInput | None:
        """Run attempts until one is acknowledged; returns ``None`` on success or
        the rejection to dead-letter the prompt with. Raises when the engine is
        dead, or :class:`ServiceFailed` when Kafka refused one of the attempt's
        records: no later prompt could succeed either."""
        from vllm.v1.engine.exceptions import EngineDeadError

        problem = self._engine.sampling_problem(event.generation)
        if problem is not None:
            return InvalidInput(ErrorClass.ENGINE_REJECTED, problem)
        failure = InvalidInput(ErrorClass.EXTRACTION_FAILED, "no attempt made")
        for attempt in range(1, self._max_attempts + 1):
            attempt_id = uuid.uuid4().hex
            try:
                outcome = await self._attempt(event, prepared, source, attempt_id)
            except (EngineDeadError, ServiceFailed):
                raise
            except ValueError as exc:  # vLLM's input validation: retrying cannot help
                self._completions.forget(attempt_id)
                return InvalidInput(ErrorClass.ENGINE_REJECTED, f"vLLM rejected the prompt: {exc}")
            except _EarlierTurnFailed as exc:
                outcome = InvalidInput(ErrorClass.GENERATION_FAILED, f"attempt {attempt}: {exc}")
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - retried, then dead-lettered
                self._completions.forget(attempt_id)
                outcome = InvalidInput(ErrorClass.EXTRACTION_FAILED, f"attempt {attempt}: {exc!r}")
            if outcome is None:
                return None
            failure = outcome
            retrying = attempt < self._max_attempts
            log.warning("extraction of %s failed (%s)%s", event.request_id, failure.reason,
                        "; retrying" if retrying else "",
                        extra=record_fields(event.request_id, source.topic, source.partition, source.offset))
            if retrying:
                self._stats.add("retries")
        return failure

    async def _attempt(self, event: PromptEvent, prepared: PreparedPrompt, source: SourceRef,
                       attempt_id: str) -> InvalidInput | None:
        """One attempt: the earlier turns of a chat regenerated turn by turn (if
        any), then the final pass, whose records the connector sends."""
        tokens, spans, turns = await self._earlier_turns(event, prepared, attempt_id)
        key = sample_id(event.request_id)
        if key != event.request_id:
            source = source.model_copy(update={"request_id": event.request_id})
        params = RequestParams(request_id=key, attempt_id=attempt_id, source=source,
                               loss_mask_spans=spans, metadata=event.metadata, generation=event.generation,
                               capture=event.capture or "all",
                               earlier_turns=turns or None)
        future = self._completions.expect(attempt_id)
        await self._engine.prefill(tokens, params)
        report = await asyncio.wait_for(future, self._timeout)
        if report.refused:  # fatal: no retry, no dead letter, nothing committed past the prompt
            raise ServiceFailed(f"the connector could not send {event.request_id}: {report.error}")
        if not report.ok:
            return InvalidInput(ErrorClass.EXTRACTION_FAILED, f"{report.error}")
        self._stats.extracted(report)
        return None

    async def _earlier_turns(self, event: PromptEvent, prepared: PreparedPrompt,
                             attempt_id: str) -> tuple[list[int], list[tuple[int, int]] | None, list[GeneratedTurn]]:
        """The final pass's prompt: for turn-by-turn regeneration, each answer but
        the last is generated (conditioned on the earlier ones) and followed by the
        template's next piece. Returns the tokens, the loss mask spans so far and
        the earlier turns."""
        tokens, spans = list(prepared.token_ids), prepared.loss_mask_spans
        turns: list[GeneratedTurn] = []
        for k, piece in enumerate(prepared.followups):
            assert event.generation is not None and spans is not None
            try:
                answer, reason = await self._engine.answer(tokens, event.generation, f"{attempt_id}-turn{k}")
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - the attempt fails; retried
                raise _EarlierTurnFailed(f"turn {k}: {exc!r}") from exc
            turns.append(GeneratedTurn(token_start=len(tokens), token_end=len(tokens) + len(answer),
                                       finish_reason=reason))  # type: ignore[arg-type]
            spans = [*spans, (len(tokens), len(tokens) + len(answer))]
            tokens += answer + regeneration.tokens_after_answer(answer, piece)
        return tokens, spans, turns


class _EarlierTurnFailed(Exception):
    """Generating an earlier turn of a chat failed (dead-lettered as generation_failed)."""
