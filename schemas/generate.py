"""Generate the committed JSON Schema files: ``python -m hsx.schemas.generate``.

A test regenerates them in memory and fails when the committed files drift."""

from __future__ import annotations

from pathlib import Path

import orjson
from pydantic import BaseModel

from hsx.schemas import BlockHeader, BlockRecordHeaders, DlqHeaders, HiddenStatesReady, Manifest, PromptEvent, ShardIndex
from hsx.schemas.shard import TopicRecord
from hsx.schemas.training import ExportMetadata, OnlineLoaderState

JSON_DIR = Path(__file__).parent / "json"
MODELS: dict[str, type[BaseModel]] = {
    "prompt_event": PromptEvent,
    "block_header": BlockHeader,
    "block_record_headers": BlockRecordHeaders,
    "manifest": Manifest,
    "hidden_states_ready": HiddenStatesReady,
    "dlq_headers": DlqHeaders,
    "shard_index": ShardIndex,
    "topic_record": TopicRecord,
    "export_metadata": ExportMetadata,
    "online_loader_state": OnlineLoaderState,
}


def render() -> dict[str, bytes]:
    """File name → content of every schema file."""
    return {
        f"{name}.schema.json": orjson.dumps(
            model.model_json_schema(mode="validation"), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
        )
        + b"\n"
        for name, model in MODELS.items()
    }


def main() -> None:
    JSON_DIR.mkdir(exist_ok=True)
    for name, content in render().items():
        (JSON_DIR / name).write_bytes(content)
        print(f"wrote {JSON_DIR / name}")


if __name__ == "__main__":
    main()
