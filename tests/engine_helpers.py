"""Test-side tools for engine tests: run ``hsx extract`` as a real process and
reassemble block records."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from confluent_kafka import Message

from hsx.demo import cpu_engine_env
from schemas import BlockRecordHeaders, Manifest, RecordKind
from schemas.codec import decode_block

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_extractor(bootstrap: str, topics: dict[str, str], model: Path, log_path: Path, *extra: str,
                  timeout: float = 900) -> subprocess.CompletedProcess[bytes]:
    """``hsx extract`` until idle, as a user would run it; output goes to ``log_path``."""
    cmd = [
        sys.executable, "-m", "hsx.cli", "extract", "--bootstrap", bootstrap,
        "--topic", topics["prompts"], "--blocks-topic", topics["blocks"], "--dlq-topic", topics["prompts_dlq"],
        "--group", topics["group"], "--model", str(model), "--dtype", "float32", "--enforce-eager",
        "--session-timeout-ms", "6000", "--exit-when-idle", "8", *extra,
    ]
    with log_path.open("wb") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_engine_env(), timeout=timeout, check=False)


@dataclass
class Sample:
    manifest: Manifest
    hidden_states: torch.Tensor  # [T, L, H]


def reassemble(records: list[Message]) -> dict[str, list[Sample]]:
    """Decode every complete attempt on the blocks topic, by request id."""
    blocks: dict[tuple[str, str], dict[int, bytes]] = defaultdict(dict)
    samples: dict[str, list[Sample]] = defaultdict(list)
    for record in records:
        headers = BlockRecordHeaders.from_kafka(record.headers())
        request_id = record.key().decode()
        if headers.kind is RecordKind.BLOCK:
            assert headers.block_index is not None
            blocks[(request_id, headers.attempt_id)][headers.block_index] = record.value()
            continue
        manifest = Manifest.model_validate(orjson.loads(record.value()), strict=False)
        assert manifest.request_id == request_id and manifest.attempt_id == headers.attempt_id
        got = blocks.pop((request_id, headers.attempt_id))
        assert sorted(got) == [b.index for b in manifest.blocks], "blocks missing before their manifest"
        parts = []
        for ref in manifest.blocks:
            header, raw = decode_block(got[ref.index])
            assert (header.token_start, header.token_end, header.checksum) == (ref.token_start, ref.token_end, ref.checksum)
            parts.append(torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[header.dtype.value]).view(header.shape))
        samples[request_id].append(Sample(manifest, torch.cat(parts)))
    return samples
