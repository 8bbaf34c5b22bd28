"""The in-process vLLM engine: ``AsyncLLM`` configured for ``extract_hidden_states``
with the hsx connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsx.extractor import no_draft_tokens
from hsx.runtime.errors import UsageError
from hsx.schemas import Generation
from hsx.schemas.connector import DISCARD_KEY, EXTRA_CONFIG_KEY, PARAMS_KEY, ConnectorConfig, RequestParams


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's choice: a low, a middle and a high layer, plus the last layer's
    output (id ``num_hidden_layers``, before the final norm)."""
    n = num_hidden_layers
    return sorted({min(2, n - 1), n // 2, max(n - 3, 0), n})


@dataclass(frozen=True)
class EngineOptions:
    """vLLM settings the extractor exposes; ``engine_args`` passes anything else
    (e.g. ``gpu_memory_utilization``) straight to ``AsyncEngineArgs``."""

    model: str
    layer_ids: list[int]
    dtype: str = "auto"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)
    draft: str | None = None
    """An EAGLE-3 draft to speculate with (``hsx serve --draft``): the verifier's
    states are then captured from its own forward passes
    (:mod:`hsx.extractor.connector.verifier_states`), ``layer_ids`` being the
    draft's aux layers and the last."""
    num_speculative_tokens: int = 3


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for ``extract_hidden_states`` of ``layer_ids``
    (for ``AsyncEngineArgs`` and ``vllm serve`` alike): the seed's, scheduling no
    draft token a step (:mod:`hsx.extractor.no_draft_tokens`)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "num_speculative_tokens_per_batch_size": no_draft_tokens.SCHEDULE,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def eagle3_config(draft: str, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for serving with the EAGLE-3 ``draft``."""
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": num_speculative_tokens}


def engine_speculative_config(options: EngineOptions) -> dict[str, Any]:
    """The draft's when ``options`` has one, else extraction of ``options.layer_ids``."""
    if options.draft is not None:
        return eagle3_config(options.draft, options.num_speculative_tokens)
    return speculative_config(options.layer_ids)


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` loading :class:`HsxConnector` with
    ``extra`` as its ``kv_connector_extra_config``."""
    return {"kv_connector": "HsxConnector", "kv_connector_module_path": "hsx.extractor.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": extra}


def engine_args(options: EngineOptions, connector: ConnectorConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=options.model,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        tensor_parallel_size=options.tensor_parallel_size,
        data_parallel_size=options.data_parallel_size,
        enforce_eager=options.enforce_eager,
        # Prefix caching stays on: a cached prefix carries its hidden states with it.
        enable_prefix_caching=True,
        # hsx sends text only (a chat with images is dead-lettered, images_unsupported):
        # a vision-language verifier runs as its language model, without loading and
        # profiling its encoders or building its processor (whose video part needs
        # torchvision). No effect on a text-only model.
        language_model_only=True,
        speculative_config=speculative_config(options.layer_ids),
        # This engine's requests always carry the extractor's RequestParams, whoever built the config.
        kv_transfer_config=kv_transfer_config({EXTRA_CONFIG_KEY: {**connector.model_dump(mode="json"),
                                                                  "requests": "extractor"}}),
    )
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = options.max_num_seqs
    if options.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    kwargs.update(options.engine_args)  # the user's explicit choices win
    return AsyncEngineArgs(**kwargs)


class Engine:
    """One ``AsyncLLM``; must live on a single event loop for its lifetime."""

    def __init__(self, options: EngineOptions, connector: ConnectorConfig) -> None:
        """Start vLLM. On CPU, first set the ``VLLM_CPU_*`` defaults the user did not
        (engine processes inherit ``os.environ``); a start that fails for lack of
        memory becomes a one-line :class:`UsageError` naming what to change."""
        from vllm.v1.engine.async_llm import AsyncLLM

        from hsx.extractor.cpu_defaults import apply_cpu_defaults
        from hsx.extractor.cpu_start import explain_start_failure, worker_in_engine_core

        defaults = apply_cpu_defaults(options)
        args = engine_args(options, connector)
        try:
            with worker_in_engine_core(defaults, args):
                self._llm = AsyncLLM.from_engine_args(args)
        except (RuntimeError, ValueError) as exc:  # the worker's own error stays in its process
            reason = explain_start_failure(options, exc)
            if reason is None:
                raise
            raise UsageError(reason) from exc

    async def prefill(self, token_ids: list[int], params: RequestParams) -> None:
        """Run one request: a prefill (``max_tokens=1``), or the verifier's answer
        with ``params.generation``'s sampling parameters. Returns when vLLM's output
        is back: the hidden states are in the cache, *not yet* in Kafka."""
        from vllm import SamplingParams, TokensPrompt

        generation = params.generation.sampling_kwargs() if params.generation else {"max_tokens": 1, "temperature": 0.0}
        sampling = SamplingParams(
            **generation,  # type: ignore[arg-type]
            extra_args={"kv_transfer_params": {PARAMS_KEY: params.model_dump(mode="json")}},
        )
        async for _ in self._llm.generate(TokensPrompt(prompt_token_ids=token_ids), sampling, request_id=params.attempt_id):
            pass

    async def answer(self, token_ids: list[int], generation: Generation, request_id: str) -> tuple[list[int], str]:
        """Generate without capturing (an earlier turn of a chat regenerated turn by
        turn): nothing is sent, and the blocks go back to the prefix cache, where the
        final pass finds them, hidden states included. Returns the answer's token
        ids and its finish reason (``stop`` or ``length``)."""
        from vllm import SamplingParams, TokensPrompt

        sampling = SamplingParams(**generation.sampling_kwargs(),  # type: ignore[arg-type]
                                  extra_args={"kv_transfer_params": {DISCARD_KEY: True}})
        final = None
        async for final in self._llm.generate(TokensPrompt(prompt_token_ids=token_ids), sampling, request_id=request_id):
            pass
        completion = final.outputs[0] if final is not None else None
        if completion is None or completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"generation ended with {completion.finish_reason if completion else 'no output'}")
        return list(completion.token_ids), completion.finish_reason

    @staticmethod
    def sampling_problem(generation: Generation | None) -> str | None:
        """Why this engine cannot honour ``generation``'s sampling, or None.

        On vLLM 0.32's CPU backend, spec decoding's rejection sampler (which the
        extraction method runs every request through) mishandles sampled requests:
        measured here, two requests with the same seed and prompt got different
        answers, and greedy requests batched with them got answers full of token 0.
        Greedy decoding alone is exact (checked against HF transformers)."""
        from vllm.platforms import current_platform

        if generation is None or generation.temperature == 0.0 or not current_platform.is_cpu():
            return None
        return ("sampling with temperature > 0 is not reliable with vLLM 0.32's extract_hidden_states on CPU (it "
                "also corrupts greedy requests batched with it); use temperature 0 there, or a GPU")

    @property
    def dead(self) -> bool:
        """The engine core died; nothing in flight will complete."""
        return bool(self._llm.errored)

    def shutdown(self) -> None:
        self._llm.shutdown()
