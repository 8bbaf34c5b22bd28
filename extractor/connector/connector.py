"""``HsxConnector``: vLLM KV connector that hands on the hidden states stored by
``extract_hidden_states``'s dummy draft model: into Kafka (hsx's pipeline), as
one safetensors file per request (vLLM's stock hidden-states connector's file
contract, :mod:`hsx.extractor.connector.files`), or both.

vLLM creates one instance per role, in different processes:

* **Scheduler side** (EngineCore process): when a request finishes,
  ``request_finished`` records a :class:`SendJob` (block ids, prompt tokens, the
  app's parameters) and returns ``delay_free=True`` so vLLM keeps the request's
  cache blocks; the next ``build_connector_meta`` hands the job to the worker.
* **Worker side** (the model-runner process: with one rank inside EngineCore (on
  CPU hsx sets that up, :mod:`hsx.extractor.cpu_defaults`), with more a process
  per rank): ``bind_connector_metadata``, before each step's forward pass,
  has :class:`~hsx.extractor.connector.captures.Captures` gather each job's hidden
  states with one indexing op (only while the in-flight budgets allow; otherwise
  the blocks simply stay pinned, which is the backpressure) and hand them to the
  :class:`BlockSender` and the file writer; ``get_finished`` reports the requests
  whose every output has its rows (Kafka: acknowledged), so vLLM frees their
  blocks only then.

Serving with an EAGLE-3 draft (vLLM's ``eagle3`` method) instead of
``extract_hidden_states``, the rows come from a store the verifier's own forward
passes fill (:mod:`hsx.extractor.connector.verifier_states`), and promoted drafts
are swapped in between steps (:mod:`hsx.extractor.connector.draft_swap`).

For files, the scheduler side also picks each request's file when it is first
scheduled (:mod:`hsx.extractor.connector.request_options`), the worker side
takes its lock before that step's forward pass, and ``request_finished`` names
the file in the response's ``kv_transfer_params``.

Loaded by vLLM through ``kv_transfer_config={"kv_connector": "HsxConnector",
"kv_connector_module_path": "hsx.extractor.connector", "kv_role": "kv_producer",
"kv_connector_extra_config": {...}}`` with ``"hsx": ConnectorConfig(...)`` for
Kafka, the stock connector's ``"shared_storage_path": DIR`` for files
(:func:`hsx.schemas.connector.read_extra_config`). The Kafka settings come from
the file the config names (:mod:`hsx.extractor.connector.kafka_settings`), never
from the environment the engine processes inherit.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.utils.gc_utils import freeze_gc_heap

from hsx.extractor.completion import CompletionSender
from hsx.extractor.connector.captures import Captures
from hsx.extractor.connector.draft_swap import DraftSwapper, DraftWorkerMeta, SwapPlan
from hsx.extractor.connector.kafka_settings import read_kafka_settings
from hsx.extractor.connector.request_options import Asked, read_request, served_params
from hsx.extractor.connector.files import FileWriter
from hsx.extractor.connector.metadata import HsxConnectorMetadata, SendJob, send_job
from hsx.extractor.connector.sender import BlockSender
from hsx.extractor.connector.verifier_states import STATES, captured_layer_ids, captures_while_speculating
from hsx.schemas.connector import (
    CAPTURE_ERROR_KEY,
    DISCARD_KEY,
    DRAFT_VERSION_KEY,
    HIDDEN_STATES_PATH_KEY,
    INCLUDE_OUTPUT_KEY,
    PARAMS_KEY,
    SAMPLE_ID_KEY,
    ConnectorConfig,
    read_extra_config,
    request_bytes_bound,
)
from hsx.runtime.settings import KafkaSettings, overrides
from hsx.schemas.drafts import Speculation
from hsx.schemas.reports import PromiseReport, SpeculationReport

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group holding the hidden states: its own group for
    hybrid models, the only group when every layer is full attention."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    matches = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(matches) == 1:
        return matches[0]
    if not matches and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell which of {len(groups)} KV cache groups holds the hidden states")


class HsxConnector(KVConnectorBase_V1, SupportsHMA):
    """Streams hidden states to Kafka; see the module docstring for the protocol."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = read_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._files_config = extra.files
        self._report_address = extra.report_address
        self._hsx_serve = extra.reports is not None  # it is also told each promise and the Kafka side's state
        self._speculating = captures_while_speculating(vllm_config)
        """With an EAGLE-3 draft the verifier's forward passes fill a cache-only layer
        hsx adds (:mod:`hsx.extractor.connector.verifier_states`) instead of the
        dummy draft's: the same kind of cache, in a group of its own."""
        self._group = _hidden_state_group(kv_cache_config)
        self._block_size = (
            kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
            if kv_cache_config is not None
            else vllm_config.cache_config.block_size
        )
        requested = (captured_layer_ids(vllm_config) if self._speculating
                     else list(vllm_config.speculative_config.draft_model_config.hf_config
                               .eagle_aux_hidden_state_layer_ids))
        # vLLM stores the layers in sorted order (models/interfaces.py): cache row j holds sorted(layer_ids)[j].
        self._layer_ids = sorted(set(requested))
        if len(self._layer_ids) != len(requested):
            raise ValueError(f"duplicate hidden-state layer ids {requested}")
        self._config = None if extra.kafka is None else _completed(extra.kafka, vllm_config, len(self._layer_ids))
        self._served = self._config is None or self._config.requests == "served"
        self._server = uuid.uuid4().hex[:16]
        """This engine's name in its served samples' ids: new at every start, so
        ids stay unique across restarts and replicas."""
        self._samples = 0

        # Scheduler side: jobs created by request_finished, shipped by the next
        # build_connector_meta; files chosen when a request is first scheduled.
        self._outbox: list[SendJob] = []
        self._asked: dict[str, Asked] = {}
        """What each scheduled request asked for, until it finishes."""
        self._drops: list[str] = []
        self._promises = CompletionSender(extra.reports) if self._hsx_serve else None
        """Each file and sample a response names: one the engine dies before completing is lost."""
        self._swaps = (SwapPlan(extra.drafts, self._promises.send if self._promises else lambda _: None)
                       if self._speculating else None)
        """Which draft the engine serves, and the promoted drafts it takes up (:mod:`.draft_swap`)."""
        # Worker side, created in register_kv_caches (the captures on the sending rank, the swapper on every one).
        self._captures: Captures | None = None
        self._swapper: DraftSwapper | None = None

    # ==== scheduler side ===============================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # we never load anything into the cache

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HsxConnectorMetadata(sends=self._outbox, drops=self._drops)
        self._outbox, self._drops = [], []
        if self._swaps is not None:
            meta.prepare, meta.swap_to = self._swaps.step()
        if self._files_config is not None or self._served:
            for new in scheduler_output.scheduled_new_reqs:
                extra_args = new.sampling_params.extra_args if new.sampling_params else None
                asked = read_request(new.req_id, (extra_args or {}).get("kv_transfer_params") or {},
                                     files=self._files_config, served=self._served)
                self._asked[new.req_id] = asked
                if asked.file is not None:
                    meta.holds.append(asked.file)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' word on the drafts they prepared, refused and serve."""
        meta = connector_output.kv_connector_worker_meta
        if self._swaps is not None and isinstance(meta, DraftWorkerMeta):
            self._swaps.worker_said(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """1. Take what the request asked for (read when it was first scheduled);
        2. nothing to send (aborted, an earlier turn, opted out): its file's lock
        is dropped and its blocks go back at once; 3. otherwise a
        :class:`SendJob` for the next step keeps its blocks until every output
        has its rows. The response names the file and the sample (or says why
        there are none). Serving with a draft, the answer is captured with the
        prompt unless the request says ``include_output_tokens: false``: a
        draft learns from the verifier's answers."""
        from vllm.v1.request import RequestStatus

        asked = self._asked.pop(request.request_id, None)
        response: dict[str, Any] = {CAPTURE_ERROR_KEY: asked.error} if asked and asked.error else {}
        if self._swaps is not None:
            response[DRAFT_VERSION_KEY] = self._swaps.serving
        transfer = request.kv_transfer_params or {}
        # An earlier turn (its blocks go back to the prefix cache at once) or aborted /
        # never scheduled: nothing complete to send; the extractor sees no completion
        # and treats the attempt as not done.
        complete = not transfer.get(DISCARD_KEY) and request.status != RequestStatus.FINISHED_ABORTED and block_ids
        speculation = self._speculation(request) if complete else None
        if self._promises is not None and speculation is not None:  # hsx serve's live acceptance per version
            self._promises.send(SpeculationReport(draft_version=speculation.draft_version,
                                                  verify_steps=speculation.verify_steps,
                                                  accepted_per_position=speculation.accepted_per_position))
        file = asked.file if asked else None
        if file is not None and not complete:
            self._drops.append(file)
            file = None
        params = self._sample_params(request, asked, transfer, speculation) if complete else None
        if params is None and file is None:
            return False, response or None
        capture = params.get("capture", "all") if params is not None else asked.capture if asked else "all"
        self._outbox.append(send_job(request, block_ids, params, capture, file,
                                     bool(transfer.get(INCLUDE_OUTPUT_KEY, self._speculating))))
        if file is not None:
            response[HIDDEN_STATES_PATH_KEY] = file
        if params is not None and self._served:
            response[SAMPLE_ID_KEY] = params["request_id"]
        if self._promises is not None and (file is not None or SAMPLE_ID_KEY in response):
            self._promises.send(PromiseReport(path=file, sample_id=response.get(SAMPLE_ID_KEY)))
        return True, response or None

    def _sample_params(self, request: Request, asked: Asked | None, transfer: dict[str, Any],
                       speculation: Speculation | None) -> dict[str, Any] | None:
        """The Kafka side's ``RequestParams`` of a finished request: the
        extractor's own, or for a served request a new sample's; ``None`` when
        it sends nothing to Kafka."""
        if self._config is None:
            return None
        if not self._served:
            params = transfer.get(PARAMS_KEY)
            if params is None:
                log.warning("request %s carries no hsx parameters; its hidden states are not sent", request.request_id)
            return params  # type: ignore[no-any-return]
        if asked is None or asked.capture is None:
            return None
        self._samples += 1
        return served_params(self._server, f"{self._server}-{self._samples}", request.request_id, asked,
                             speculation)

    def _speculation(self, request: Request) -> Speculation | None:
        """What vLLM counted of the request's drafts (``--per-request-spec-decode-metrics``)."""
        if self._swaps is None:
            return None
        counted = request.spec_decode_metrics
        histogram = list(counted.histogram) if counted is not None else []
        positions = self._vllm_config.speculative_config.num_speculative_tokens
        accepted = [sum(histogram[i:]) for i in range(1, positions + 1)]
        return Speculation(draft_version=self._swaps.serving, verify_steps=sum(histogram),
                           draft_tokens=counted.num_draft_tokens if counted is not None else 0,
                           accepted_per_position=accepted)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[self._group])

    # ==== worker side ==================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._speculating:
            self._swapper = DraftSwapper(self._vllm_config.speculative_config.model, STATES.runner)
        if not self._is_sending_rank():
            return
        if self._speculating and STATES.layer_ids != self._layer_ids:
            raise ValueError(f"the runner captures layers {STATES.layer_ids}, the connector expects {self._layer_ids}")
        cache = self._hidden_state_cache(kv_caches)
        if cache.dim() != 4 or cache.shape[1] != len(self._layer_ids) or cache.shape[2] != self._block_size:
            raise ValueError(
                f"hidden-state cache {tuple(cache.shape)} is not [blocks, {len(self._layer_ids)} layers, "
                f"{self._block_size} slots, hidden]"
            )
        reports = CompletionSender(self._report_address)
        sender = None
        if self._config is not None:
            kafka = (read_kafka_settings(self._config.kafka_settings_file) if self._config.kafka_settings_file
                     else KafkaSettings(**overrides(bootstrap=self._config.bootstrap)))
            sender = BlockSender(self._config, kafka, self._layer_ids, reports,
                                 state=reports.send if self._hsx_serve else None)
        writer = FileWriter(self._files_config, reports.send) if self._files_config is not None else None
        self._captures = Captures(cache, self._block_size, sender, writer,
                                  fp8_to_kafka=self._config is not None and self._config.wire_dtype == "fp8")
        # The model and its caches exist now: out of the collector's way. EngineCore freezes its heap too,
        # but a rank in a process of its own (tensor parallel) is never frozen by vLLM, and the sender's
        # per-block objects would make the collector's full passes walk the whole model (half of the
        # sending process's CPU in bench.datapath before it froze its heap).
        freeze_gc_heap()

    def _hidden_state_cache(self, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """The cache-only layer's cache: the dummy draft's (``extract_hidden_states``),
        or the one the runner gained to capture while speculating."""
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {names}")
        return kv_caches[names[0]]

    def _is_sending_rank(self) -> bool:
        """Only tensor-parallel rank 0 produces: every rank holds the same hidden states."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            return get_tensor_model_parallel_rank() == 0
        except AssertionError:  # no TP group initialised: a single worker
            return True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the dummy draft model already wrote the cache; we read it when a request ends

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward pass: the locks of new files, and the
        captures of the requests that finished (:meth:`Captures.bind`)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HsxConnectorMetadata)
        if self._swapper is not None:
            if connector_metadata.prepare is not None:
                self._swapper.prepare(connector_metadata.prepare)
            if connector_metadata.swap_to is not None:
                self._swapper.swap(connector_metadata.swap_to)
        if self._captures is not None:
            self._captures.bind(connector_metadata)

    def build_connector_worker_meta(self) -> DraftWorkerMeta | None:
        return self._swapper.meta() if self._swapper is not None else None

    def wait_for_save(self) -> None:
        pass  # the captures run on threads of their own; nothing is saved within a step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._captures is None:
            return None, None
        return self._captures.finished() or None, None

    def get_finished_count(self) -> int | None:
        return 1  # only rank 0 reports sends

    def shutdown(self) -> None:
        if self._promises is not None:
            self._promises.close()
        if self._captures is not None:
            self._captures.close()
        if self._swapper is not None:
            self._swapper.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # as vLLM's own hidden-states connector


def _completed(config: ConnectorConfig, vllm_config: VllmConfig, num_layers: int) -> ConnectorConfig:
    """``config`` with what vLLM's own configuration tells where it is unset: the
    model's name, and the largest request's bytes (checked against the budget)."""
    model_config = vllm_config.model_config
    largest = request_bytes_bound(model_config.max_model_len, num_layers, model_config.get_hidden_size())
    filled = {"model": config.model or model_config.served_model_name or model_config.model,
              "max_request_bytes": config.max_request_bytes or largest}
    return ConnectorConfig.model_validate({**config.model_dump(), **filled})
