"""Test-side tools for engine tests: run ``hsx extract`` as a real process,
reassemble block records, and compute reference hidden states with HF
transformers (the independent implementation we check vLLM against)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from confluent_kafka import Message

from schemas import BlockRecordHeaders, Manifest, RecordKind
from schemas.codec import decode_block

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["HF_HUB_OFFLINE"] = "1"
    return env


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
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(), timeout=timeout, check=False)


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


class HFReference:
    """Hidden states from HF transformers, with vLLM's layer-id convention:
    id L < num_layers is ``output_hidden_states[L]``; id num_layers is the input of
    the final norm (HF's last entry is after the norm)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        captured: dict[str, torch.Tensor] = {}
        hook = self.model.model.norm.register_forward_pre_hook(lambda _m, args: captured.update(pre_norm=args[0]))
        try:
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        finally:
            hook.remove()
        layers = [captured["pre_norm"][0] if i == self.num_layers else out.hidden_states[i][0] for i in layer_ids]
        return torch.stack(layers, dim=1)


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())
