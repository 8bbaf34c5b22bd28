"""``hsx train-draft`` as a user runs it: ``.venv-speculators/bin/hsx`` (speculators
0.9.0 with hsx beside it: ``make speculators``) training speculators' EAGLE-3
draft for the tiny Llama from ready events on a real broker, over a dataset
written through the sink's own write path (no engine), then resuming."""

from __future__ import annotations

import json
import math
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from confluent_kafka import Consumer, Producer, TopicPartition

from hsx import cli, models
from hsx.local.topics import fresh_topic_settings
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.runtime.kafka import consumer_config, ensure_topics, producer_config
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady
from hsx.trainer import HsxDataset
from hsx.trainer.export import token_frequencies

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_BIN = ROOT / ".venv-speculators" / "bin"
SAMPLES = 4
REPEATS = 12  # the same samples again and again: a draft that learns fits them, so its loss falls
VOCAB = 24  # --draft-vocab-size: the draft's vocabulary counted from the first --vocab-samples samples
CHECKPOINT_FILES = {"config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt",
                    "training_state.json", "hsx_stream.json"}
LOAD = """
import json, sys, torch
from speculators.models.eagle3 import Eagle3DraftModel
model = Eagle3DraftModel.from_pretrained(sys.argv[1])
print(json.dumps({"aux": model.config.eagle_aux_hidden_state_layer_ids,
                  "verifier": model.config.speculators_config.verifier.name_or_path,
                  "fc": list(model.fc.weight.shape), "lm_head": list(model.lm_head.weight.shape),
                  "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                  "d2t": model.d2t.tolist()}))
"""


@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> Path:
    return models.prepare(cache_dir, names=["tiny-llama"])["tiny-llama"]


@pytest.fixture
def speculators_hsx() -> Path:
    """hsx in speculators' environment, as a user runs it."""
    if not (SPECULATORS_BIN / "hsx").exists():
        pytest.fail(f"{SPECULATORS_BIN / 'hsx'} is missing: run `make speculators`")
    return SPECULATORS_BIN / "hsx"


def publish_ready(kafka: KafkaSettings, events: list[HiddenStatesReady]) -> str:
    """A fresh ready topic holding each event ``REPEATS`` times under event ids of
    their own (a re-announced event id would be delivered once). One partition,
    read in order: the first samples, whose tokens make the draft vocabulary,
    are the dataset's."""
    settings = fresh_topic_settings(partitions=1)
    ensure_topics(kafka, settings, [settings.ready])
    producer = Producer(producer_config(kafka))
    for repeat in range(REPEATS):
        for i, event in enumerate(events):
            again = event.model_copy(update={"event_id": f"{repeat:016x}{i:016x}"})
            producer.produce(settings.ready, again.model_dump_json().encode(), key=event.request_id.encode())
    assert producer.flush(60) == 0
    return settings.ready


def train_draft(hsx: Path, kafka: KafkaSettings, topic: str, group: str, dataset: Path, tiny: Path, save: Path,
                *extra: str, vocab: int | None = VOCAB) -> tuple[list[dict[str, Any]], str]:
    """Run ``hsx train-draft``; its step lines (``--log-format json``) and its summary line."""
    argv = [str(hsx), "--log-format", "json", "train-draft", "--bootstrap", kafka.bootstrap,
            "--ready-topic", topic, "--group", group, "--dataset", str(dataset), "--model", str(tiny),
            "--save-path", str(save), "--checkpoint-every", "3", "--total-seq-len", "96", "--exit-when-idle", "5",
            "--hidden-states-dtype", "float32", "--num-workers", "1", "--lr", "3e-3", *extra]
    if vocab is not None:
        argv += ["--draft-vocab-size", str(vocab), "--vocab-samples", str(SAMPLES)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [line for line in map(_json, run.stderr.splitlines()) if line and "loss" in line]
    return steps, run.stdout.strip().splitlines()[-1]


def _json(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except ValueError:
        return None


def _committed(kafka: KafkaSettings, topic: str, group: str) -> int:
    """The offset the group committed (the first not consumed)."""
    consumer = Consumer(consumer_config(kafka, group))
    try:
        (committed,) = consumer.committed([TopicPartition(topic, 0)], timeout=30)
    finally:
        consumer.close()
    return max(committed.offset, 0)


def _load(python: Path, checkpoint: Path) -> dict[str, Any]:
    """The checkpoint as speculators' own loader reads it."""
    run = subprocess.run([str(python), "-c", LOAD, str(checkpoint)], capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_trains_speculators_draft_online_commits_what_it_trained_and_resumes(
        tmp_path: Path, kafka: KafkaSettings, tiny: Path, speculators_hsx: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    layers = (1, 2, config["num_hidden_layers"])  # as hsx extract stores them: aux layers, then the last
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(
        samples=SAMPLES, min_tokens=16, max_tokens=30, layer_ids=layers, hidden_size=config["hidden_size"],
        vocab=config["vocab_size"], model=str(tiny)), partitions=1)
    topic = publish_ready(kafka, events)
    group, save = f"draft-{uuid.uuid4().hex}", tmp_path / "draft"

    steps, summary = train_draft(speculators_hsx, kafka, topic, group, tmp_path / "ds", tiny, save, "--steps", "6")
    assert [s["step"] for s in steps] == list(range(1, 7)), summary
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    trained = steps[-1]["samples"]
    assert "6 steps" in summary and f"on {trained} samples" in summary and "--steps reached" in summary
    # Committed: exactly the samples of the trained steps, in the checkpoint and in Kafka; the rest wait.
    assert _committed(kafka, topic, group) == trained < SAMPLES * REPEATS
    stream = json.loads((save / "1" / "hsx_stream.json").read_text())
    assert sum(p["next_offset"] for p in stream["partitions"]) == trained and stream["group_id"] == group

    # speculators' checkpoint, for the verifier and the layers hsx extracted, with the counted vocabulary.
    assert CHECKPOINT_FILES <= {p.name for p in (save / "1").iterdir()}
    assert {"run.yaml", "token_freq.pt", f"d2t-{VOCAB}.npy", f"t2d-{VOCAB}.npy"} <= {p.name for p in save.iterdir()}
    draft = json.loads((save / "1" / "config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 2] and draft["draft_vocab_size"] == VOCAB
    assert draft["speculators_config"]["verifier"]["name_or_path"] == str(tiny.resolve())
    decoder = draft["transformer_layer_config"]
    assert (decoder["hidden_size"], decoder["vocab_size"]) == (config["hidden_size"], config["vocab_size"])
    dataset = HsxDataset(tmp_path / "ds")  # the stream's first SAMPLES samples are the dataset's, in order
    counted = token_frequencies(dataset.tokens(row) for row in range(len(dataset)))
    assert torch.load(save / "token_freq.pt", weights_only=True) == counted
    loaded = _load(speculators_hsx.with_name("python"), save / "1")
    assert loaded["aux"] == [1, 2] and loaded["verifier"] == str(tiny.resolve()) and loaded["finite"]
    assert loaded["fc"] == [config["hidden_size"], 2 * config["hidden_size"]]
    assert loaded["lm_head"] == [VOCAB, config["hidden_size"]]
    most_frequent = sorted(counted, key=lambda t: (-counted[t], t))[:VOCAB]
    assert sorted(i + offset for i, offset in enumerate(loaded["d2t"])) == sorted(most_frequent)

    # Resumed: step 7 on, from the trained weights and the stream's position, new samples only.
    resumed, summary = train_draft(speculators_hsx, kafka, topic, group, tmp_path / "ds", tiny, save, "--steps", "9")
    assert [s["step"] for s in resumed] == [7, 8, 9], summary
    assert resumed[0]["loss"] < (losses[0] + losses[-1]) / 2  # nearer the trained draft's than a new one's
    assert all(math.isfinite(s["loss"]) for s in resumed)
    assert _committed(kafka, topic, group) == trained + resumed[-1]["samples"] < SAMPLES * REPEATS
    assert json.loads((save / "2" / "training_state.json").read_text())["global_step"] == 9


def test_a_draft_warm_started_from_a_served_one_stays_a_drop_in_for_it(
        tmp_path: Path, kafka: KafkaSettings, tiny: Path, speculators_hsx: Path, cache_dir: Path) -> None:
    """``--init-from`` the draft a server serves (``hsx serve --draft``), saved in
    bfloat16 as speculators saves its checkpoints, trained on float32 hidden
    states: the checkpoints keep its config, vocabulary and tensors (the checks a
    server runs before it swaps a draft in pass), and start from its weights."""
    from hsx.runtime.draft_files import DraftRefused, checked_tensors, read_config, tensor_shapes

    built = models.prepare(cache_dir, names=["tiny-llama-eagle3"])["tiny-llama-eagle3"]
    served = tmp_path / "served"
    served.mkdir()
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(built / "model.safetensors").items()},
              str(served / "model.safetensors"))
    (served / "config.json").write_text(json.dumps({**read_config(built), "dtype": "bfloat16"}))
    config = json.loads((tiny / "config.json").read_text())
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(
        samples=SAMPLES, min_tokens=16, max_tokens=30, layer_ids=(1, 2, 3, config["num_hidden_layers"]),
        hidden_size=config["hidden_size"], vocab=config["vocab_size"], model=str(tiny)), partitions=1)
    topic = publish_ready(kafka, events)
    save = tmp_path / "draft"
    steps, summary = train_draft(speculators_hsx, kafka, topic, f"draft-{uuid.uuid4().hex}", tmp_path / "ds", tiny,
                                 save, "--steps", "3", "--init-from", str(served), vocab=None)
    assert [s["step"] for s in steps] == [1, 2, 3], summary
    checkpoint = save / "0"
    tensors = checked_tensors(checkpoint, read_config(served), tensor_shapes(served))  # DraftRefused if not
    initial = load_file(served / "model.safetensors")
    assert set(tensors) == set(initial)
    moved = {n: float((tensors[n] - initial[n]).abs().max() / initial[n].abs().max()) for n in initial
             if initial[n].abs().max() > 0}
    assert 0 < moved["fc.weight"] < 0.5, moved  # trained, from the served draft's weights, not new ones
    with pytest.raises(DraftRefused, match="eagle_aux_hidden_state_layer_ids"):  # what a server would refuse
        checked_tensors(checkpoint, {**read_config(served), "eagle_aux_hidden_state_layer_ids": [1, 2]},
                        tensor_shapes(served))


@pytest.mark.parametrize("flags, message", [
    (["--draft-vocab-size", "5000"], "--draft-vocab-size 5000: more than the verifier's vocabulary (1000)"),
    (["--layers", "1,7"], "--layers 1,7: the verifier has 4 layers, so aux layer ids are 0..3"),
    ([], "needs speculators beside hsx"),  # hsx's own environment (vLLM), where this test runs, lacks it
    (["--dataset", "/nonexistent/ds"], "--dataset /nonexistent/ds: no such directory, nor its parent"),
    (["--init-from", "/nonexistent/draft"], "--init-from /nonexistent/draft: no such directory"),
    (["--speculator-type", "mtp"], "--speculator-type mtp: refused: MTP drafts are trained on the verifier's own"),
    (["--speculator-type", "dflash", "--promote-to", "/nonexistent/drafts"],
     "--promote-to with --speculator-type dflash: the gate scores EAGLE-3 drafts only"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path: Path, tiny: Path, restore_root_logging: None,
                                                      capsys: pytest.CaptureFixture[str], flags: list[str],
                                                      message: str) -> None:
    (tmp_path / "ds").mkdir()
    code = cli.main(["train-draft", "--bootstrap", "127.0.0.1:1", "--group", "g", "--dataset", str(tmp_path / "ds"),
                     "--model", str(tiny), "--save-path", str(tmp_path / "draft"), "--steps", "1", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "draft").exists()


def test_a_job_may_start_before_the_sink_makes_its_dataset(tmp_path: Path, tiny: Path, restore_root_logging: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset folder the sink has not made yet passes the checks (the next one,
    speculators' absence from this environment, is the one that answers)."""
    code = cli.main(["train-draft", "--bootstrap", "127.0.0.1:1", "--group", "g", "--dataset",
                     str(tmp_path / "made-by-the-sink"), "--model", str(tiny), "--save-path", str(tmp_path / "draft"),
                     "--steps", "1"])
    assert code == 2 and "needs speculators beside hsx" in capsys.readouterr().err
