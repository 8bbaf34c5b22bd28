"""bench/acceptance_corpus.py: the acceptance benchmark's prompt sets, built from
the text this environment ships."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import acceptance_corpus
from bench.acceptance_corpus import MAX_PASSAGE_CHARS, MIN_PASSAGE_CHARS, TASKS, CorpusTooSmall, Document, build
from hsx.schemas import PromptEvent

ROOT = Path(__file__).resolve().parents[2]
TRAIN, EVAL = 2400, 120


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default build twice at once: here, and by the command in another
    process under another hash seed (so set order cannot leak into the files)."""
    here, there = tmp_path_factory.mktemp("here"), tmp_path_factory.mktemp("there")
    other = subprocess.Popen([sys.executable, "-m", "bench.acceptance_corpus", str(there)], cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    summary = build(here)
    out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err.decode()
    return {"summary": summary, "here": here, "there_summary": json.loads(out), "there": there}


def lines(built: dict[str, Any], split: str) -> list[bytes]:
    return (built["here"] / f"{split}.jsonl").read_bytes().splitlines()


def passage(row: dict[str, Any]) -> str:
    """The passage a prompt quotes: its content without the request's template."""
    before, after = TASKS[row["metadata"]["task"]].split("{passage}")
    content = row["messages"][0]["content"]
    assert content.startswith(before) and content.endswith(after)
    return content[len(before):len(content) - len(after)]


def word_runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_sizes_are_as_asked(built: dict[str, Any]) -> None:
    assert [len(lines(built, "train")), len(lines(built, "eval"))] == [TRAIN, EVAL]
    assert [built["summary"][s]["rows"] for s in ("train", "eval")] == [TRAIN, EVAL]


def test_every_row_is_a_prompt_event_of_one_user_turn(built: dict[str, Any]) -> None:
    for line in lines(built, "train") + lines(built, "eval"):
        event = PromptEvent.model_validate_json(line)
        # The verifier writes the answer (hsx run --generate): a row carries none.
        assert event.kind == "messages" and [m.role for m in event.messages or []] == ["user"]
        assert event.generation is None


def test_request_ids_are_unique(built: dict[str, Any]) -> None:
    ids = [json.loads(line)["request_id"] for line in lines(built, "train") + lines(built, "eval")]
    assert len(set(ids)) == len(ids) == TRAIN + EVAL


def test_passages_are_short_and_distinct(built: dict[str, Any]) -> None:
    for split in ("train", "eval"):
        texts = [passage(json.loads(line)) for line in lines(built, split)]
        assert len(set(texts)) == len(texts)
        assert all(MIN_PASSAGE_CHARS <= len(t) <= MAX_PASSAGE_CHARS for t in texts)


def test_training_shares_no_text_with_the_evaluation_source(built: dict[str, Any]) -> None:
    train = [passage(json.loads(line)) for line in lines(built, "train")]
    evaluation = [passage(json.loads(line)) for line in lines(built, "eval")]
    assert not set(train) & set(evaluation)
    # Not only the chosen evaluation passages: the whole help-topic text.
    source = set().union(*(word_runs(d.text) for d in acceptance_corpus.python_help_documents()))
    assert not [t for t in train if word_runs(t) & source]


def test_sources_are_disjoint(built: dict[str, Any]) -> None:
    meta = {split: [json.loads(line)["metadata"] for line in lines(built, split)] for split in ("train", "eval")}
    assert {m["source"] for m in meta["eval"]} == {"pydoc_data.topics"}
    assert not {m["source"] for m in meta["train"]} & {m["source"] for m in meta["eval"]}
    assert not {m["document"] for m in meta["train"]} & {m["document"] for m in meta["eval"]}
    assert len({m["source"] for m in meta["train"]}) > 50  # many packages, not a few long READMEs


def test_builds_are_deterministic(built: dict[str, Any]) -> None:
    for split in ("train", "eval"):
        assert (built["here"] / f"{split}.jsonl").read_bytes() == (built["there"] / f"{split}.jsonl").read_bytes()
        assert built["summary"][split]["sha256"] == built["there_summary"][split]["sha256"]


def test_too_few_passages_fail_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "The quick brown fox jumps over the lazy dog, and then it runs off into the woods to find its friends."
    monkeypatch.setattr(acceptance_corpus, "package_documents",
                        lambda: [Document("fox", "fox/METADATA", f"{text}\n\n{text} Again.", markup=True)])
    with pytest.raises(CorpusTooSmall, match="train: 2 rows asked, but .* give only 1 distinct passages"):
        build(tmp_path / "out", train_size=2, eval_size=1)
    assert not (tmp_path / "out").exists()


def test_only_prose_of_a_readme_becomes_passages() -> None:
    readme = """# fastthing

[![PyPI](https://img.shields.io/pypi/v/fastthing.svg)](https://pypi.org/project/fastthing)

Fastthing parses the files your services write and turns them into tables that
you can query, **without** loading a whole file into memory at once.

```python
import fastthing
fastthing.parse("log.txt")
```

    $ pip install fastthing

Permission is hereby granted, free of charge, to any person obtaining a copy of
this software, subject to the conditions of the MIT license written above.

Fastthing est une bibliothèque écrite en français pour des raisons de démonstration,
élégante et très rapide à écrire.
"""
    found = acceptance_corpus.passages(Document("fastthing", "fastthing/METADATA", readme, markup=True))
    assert [p.text for p in found] == [
        "Fastthing parses the files your services write and turns them into tables that you can query, "
        "without loading a whole file into memory at once."]


def test_what_the_process_imported_does_not_change_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing setuptools' vendored packages puts a folder of distributions on
    # sys.path: a build in a test worker that imported it differed from the command's.
    dist_info = tmp_path / "planted-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted\nVersion: 1.0\n\n"
                                        "A planted package whose long description must never reach the corpus. " * 3)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "planted" not in {d.source for d in acceptance_corpus.package_documents()}
