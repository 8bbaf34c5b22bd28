"""What ``hsx run`` chooses for its services from its own arguments."""

from __future__ import annotations

from pathlib import Path

from hsx.running.plan import RunPlan
from hsx.schemas import Codec
from hsx.schemas.dataset_codec import DatasetCodec


def _plan(tmp_path: Path, **fields: object) -> RunPlan:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return RunPlan(model=model, output=str(tmp_path / "dataset"), lines=[], **fields)  # type: ignore[arg-type]


def test_hidden_states_are_staged_uncompressed_only_in_the_runs_own_folder_for_a_raw_dataset(tmp_path: Path) -> None:
    assert _plan(tmp_path).wire_codec is Codec.NONE  # the defaults: own staging folder, raw dataset
    # The sink keeps byteplane-zstd blocks as they come: compressed once, by the connector.
    assert _plan(tmp_path, dataset_codec=DatasetCodec.BYTEPLANE_ZSTD).wire_codec is None
    # Block records through Kafka, or a store others may read or bill by the byte: the extractor's default.
    assert _plan(tmp_path, inline=True).wire_codec is None
    assert _plan(tmp_path, payload_store=str(tmp_path / "shared")).wire_codec is None
