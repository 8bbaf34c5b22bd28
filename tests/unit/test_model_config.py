"""What the extractor reads from a model's config before any engine: whether a
vision-language model can load here (torchvision imports), decided without vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hsx.extractor.model_config import hf_config, torchvision_problem, vision_language_blocker

TEXT = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
VISION = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
          "vision_config": {"depth": 1}, "text_config": {"model_type": "qwen2_5_vl_text"}}


def _config(folder: Path, config: dict[str, object]) -> object:
    """``config`` as transformers reads it from a model directory."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return hf_config(str(folder))


def test_only_a_vision_language_model_can_be_blocked(tmp_path: Path) -> None:
    assert vision_language_blocker(_config(tmp_path / "text", TEXT)) is None
    blocker, problem = vision_language_blocker(_config(tmp_path / "vision", VISION)), torchvision_problem()
    if problem is None:  # a machine with a working torchvision
        assert blocker is None
    else:  # make install removes it on CPU: this is what make test sees
        assert blocker == ("Qwen2_5_VLForConditionalGeneration is a vision-language model: the engine needs "
                           f"torchvision to load one, and it does not import here ({problem}); install the "
                           "torchvision built for this torch")


@pytest.mark.parametrize(("torchvision", "problem"), [
    ("importable", None),
    ("missing", "ModuleNotFoundError: import of torchvision halted; None in sys.modules"),
    ("broken", "RuntimeError: operator torchvision::nms does not exist"),  # a build for another torch
])
def test_torchvision_problem_says_why_it_does_not_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         torchvision: str, problem: str | None) -> None:
    # Undone last, this removes the module the import below adds: later tests see none.
    monkeypatch.setitem(sys.modules, "torchvision", None)
    if torchvision != "missing":
        package = tmp_path / "torchvision"
        package.mkdir()
        (package / "__init__.py").write_text(
            'raise RuntimeError("operator torchvision::nms does not exist")\n' if torchvision == "broken" else "")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "torchvision")
    assert torchvision_problem() == problem

