"""Test-side tools for engine tests: run ``hsx extract`` as a real process and
reassemble block records."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from confluent_kafka import Message

from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, extract_command
from hsx.local.spawn import HsxService
from hsx.runtime.settings import TopicSettings
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import Manifest
from hsx.dataset.storage import Storage
from hsx.sink.assembler import Assembler, Record, RejectedRecords, Staged
from hsx.sink.payloads import PayloadReader


def run_extractor(bootstrap: str, topics: TopicSettings, group: str, model: Path, log_path: Path, *extra: str,
                  timeout: float = 900) -> int:
    """``hsx extract`` until idle, as a user would run it; output goes to
    ``log_path``. Returns the exit status."""
    command = extract_command(bootstrap, topics, model, "--exit-when-idle", "8", *extra, group=group,
                              session_timeout_ms=STEADY_SESSION_TIMEOUT_MS)
    with HsxService(log_path.stem, command, log_path.parent) as extractor:
        return extractor.wait(timeout)


@dataclass
class Sample:
    manifest: Manifest
    hidden_states: torch.Tensor  # [T, L, H]


def reassemble(records: list[Message], payloads: Storage | None = None) -> dict[str, list[Sample]]:
    """Every complete attempt on the blocks topic, by request id, reassembled and
    verified the way the sink does it (by reference: read from ``payloads``);
    any rejection fails the test."""
    assemblers: dict[int, Assembler] = defaultdict(Assembler)  # records of a request share a partition
    samples: dict[str, list[Sample]] = defaultdict(list)
    for record in records:
        result = assemblers[record.partition()].add(
            Record(record.offset(), record.key(), record.value(), record.headers()))
        if isinstance(result, Staged):
            # fetch() itself raises NoPayloadStore when ``payloads`` is None; ``fail`` serves the sink's loop only.
            result = PayloadReader(payloads, fail=lambda error: None).fetch(result, assemblers[record.partition()])
        assert not isinstance(result, RejectedRecords), result
        if result is not None:
            m = result.manifest
            hidden = torch.frombuffer(bytearray(result.hidden_states), dtype=TORCH_DTYPES[m.dtype])
            samples[m.request_id].append(Sample(m, hidden.view(m.captured_tokens, len(m.layer_ids), m.hidden_size)))
    return samples
