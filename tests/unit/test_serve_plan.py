"""``hsx serve``'s arguments, checked before anything starts, and the vLLM
server command they become: the seed's flags, HsxConnector, nothing secret."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx.cli import build_parser
from hsx.runtime.errors import UsageError
from hsx.serving.command import server_argv
from hsx.serving.plan import plan_from_args
from tests.unit.test_draft_checkpoint import write_draft


@pytest.fixture
def model(tmp_path: Path) -> Path:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                       "num_hidden_layers": 4, "hidden_size": 128}))
    (directory / "model.safetensors").write_bytes(b"")  # only its name is checked before the start
    return directory


def _plan(*argv: str) -> object:
    return plan_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(("argv", "message"), [
    ([], "give --shared-storage-path DIR"),
    (["--no-sink", "--output", "o"], "--no-sink sends to the cluster's sinks"),
    (["--no-sink"], "--no-sink needs the cluster"),
])
def test_where_captures_go_is_checked_first(model: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                            message: str) -> None:
    monkeypatch.delenv("HSX_KAFKA_BOOTSTRAP", raising=False)
    with pytest.raises(UsageError, match=message):
        _plan("--model", str(model), *argv)


def test_the_server_gets_the_seeds_flags_and_hsx_connector(model: Path, tmp_path: Path) -> None:
    plan = _plan("--model", str(model), "--layers", "3,1", "--shared-storage-path", str(tmp_path / "f"),
                 "--api-key", "s3cret", "--engine-arg", "gpu_memory_utilization=0.5")
    argv = server_argv(plan, {"shared_storage_path": "/x"})  # type: ignore[arg-type]
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "HsxConnector"
    assert transfer["kv_connector_module_path"] == "hsx.extractor.connector"
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": "/x"}
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "s3cret" not in argv  # the key goes through the environment, not the process list


def test_a_draft_is_served_with_eagle3_and_its_layers_captured(model: Path, tmp_path: Path) -> None:
    """``--draft``: vLLM's eagle3 method with the draft, K draft tokens a step, and
    the captured layers the draft's aux layers plus the verifier's last (4)."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    draft = write_draft(tmp_path / "draft", aux=[1, 2, 3])
    plan = _plan("--model", str(model), "--draft", str(draft), "--num-speculative-tokens", "2",
                 "--shared-storage-path", str(tmp_path / "f"))
    assert plan.engine.layer_ids == [1, 2, 3, 4]  # type: ignore[attr-defined]
    argv = server_argv(plan, {})  # type: ignore[arg-type]
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    assert speculative == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 2}


@pytest.mark.parametrize(("draft_kwargs", "argv", "message"), [
    ({}, ["--layers", "1,4"], "--layers and --draft"),
    ({"vocab": 999}, [], "is not a draft for this model"),
    ({"kind": "dflash"}, [], "this takes EAGLE-3 checkpoints"),
])
def test_a_draft_that_does_not_fit_is_refused_before_the_start(model: Path, tmp_path: Path,
                                                                draft_kwargs: dict[str, object], argv: list[str],
                                                                message: str) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    draft = write_draft(tmp_path / "draft", **draft_kwargs)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=message):
        _plan("--model", str(model), "--draft", str(draft), "--shared-storage-path", str(tmp_path / "f"), *argv)


@pytest.mark.parametrize(("argv", "message"), [
    (["--learn"], "--learn trains the draft the server serves"),
    (["--learn", "--save-path", "s", "--drafts", "d"], "drop --drafts"),
    (["--learn", "--save-path", "s", "--trainer-python", "/nonexistent/python"], "/nonexistent/python does not exist"),
])
def test_learning_needs_a_draft_a_dataset_and_a_trainer(model: Path, tmp_path: Path, argv: list[str],
                                                        message: str) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    draft = write_draft(tmp_path / "draft")
    argv = [str(tmp_path / a) if a in ("s", "d") else a for a in argv]
    with pytest.raises(UsageError, match=message):
        _plan("--model", str(model), "--draft", str(draft), "--output", str(tmp_path / "o"), *argv)


def test_promoted_drafts_need_a_draft_to_replace(model: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="give --draft too"):
        _plan("--model", str(model), "--drafts", str(tmp_path / "d"), "--output", str(tmp_path / "o"))
