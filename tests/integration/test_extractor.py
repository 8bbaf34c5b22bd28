"""The extractor end to end: a real broker, a real vLLM engine (``hsx extract``
as a process), block records decoded and compared with HF transformers. The
tiny model's run sends its hidden states by reference (``--payload-store``, a
directory), SmolLM2's inline, so every check holds for both transports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from hsx import models
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from hsx.runtime.settings import KafkaSettings
from hsx.dataset.storage import Storage, open_storage
from hsx.schemas import BlockRecordHeaders, DlqHeaders, RecordKind
from tests.engine_helpers import Sample, reassemble, run_extractor
from tests.drain import drain

pytestmark = [pytest.mark.integration, pytest.mark.engine]

WORDS = ("the quick brown fox jumps over a lazy dog while streaming hidden states through kafka "
         "into a sharded dataset for training speculative decoding draft models").split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


def good_prompts() -> list[dict]:
    prompts: list[dict] = []
    for i, n in enumerate([1, 5, 12, 30, 60, 120, 200, 8]):
        prompts.append({"request_id": f"text-{i}", "prompt": text(n, i), "metadata": {"kind": "text", "i": i}})
    for i, n in enumerate([1, 2, 9, 40, 77, 150]):
        prompts.append({"request_id": f"ids-{i}", "token_ids": [(i * 31 + k * 17) % 400 + 3 for k in range(n)]})
    chats = [
        [("user", "Hi"), ("assistant", "Hello there")],
        [("system", "Be brief."), ("user", text(6, 1)), ("assistant", text(9, 2))],
        [("user", text(4, 3)), ("assistant", text(5, 4)), ("user", text(3, 5)), ("assistant", text(20, 6))],
        [("system", ""), ("user", "question"), ("assistant", "answer"), ("tool", "{\"ok\": true}"), ("assistant", "done")],
        [("user", text(50, 7))],
        [("user", "a"), ("assistant", "b"), ("user", "c")],
        [("system", text(10, 8)), ("user", text(10, 9)), ("assistant", text(40, 10))],
        [("user", "long answer please"), ("assistant", text(90, 11))],
    ]
    for i, chat in enumerate(chats):
        prompts.append({"request_id": f"chat-{i}", "messages": [{"role": r, "content": c} for r, c in chat],
                        "metadata": {"kind": "chat"}})
    return prompts


GREEDY = {"max_tokens": 8, "ignore_eos": True}


def generating_prompts() -> list[dict]:
    """The verifier answers: a text continued, and a chat whose every assistant turn it regenerates."""
    chat = [{"role": "user", "content": text(6, 12)}, {"role": "assistant", "content": "to be replaced"},
            {"role": "user", "content": text(4, 13)}]
    return [{"request_id": "gen-text", "prompt": text(12, 14), "generation": GREEDY},
            {"request_id": "gen-chat", "messages": chat, "generation": GREEDY}]


BAD = {  # request id → (raw record, expected DLQ error class)
    "bad-vocab": (orjson.dumps({"request_id": "bad-vocab", "token_ids": [5, 6, 10**6]}), "token_out_of_vocabulary"),
    "bad-long": (orjson.dumps({"request_id": "bad-long", "prompt": text(900, 1)}), "prompt_too_long"),
    "bad-json": (b"{\"request_id\": \"bad-json\", ", "invalid_event"),
    "bad-role": (orjson.dumps({"request_id": "bad-role", "messages": [{"role": "bot", "content": "x"}]}), "invalid_event"),
}


@dataclass
class Run:
    model_dir: Path
    tokenizer: object
    prompts: list[dict]
    generating: list[dict]
    samples: dict[str, list[Sample]]
    dead: list
    layer_ids: list[int]
    committed: dict[int, int]
    end_offsets: dict[int, int]
    prompts_topic: str
    payloads: Storage | None
    block_records: int
    """Records on the blocks topic that are not manifests."""


def _publish(kafka: KafkaSettings, topic: str, prompts: list[dict]) -> None:
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True})
    records = [(p["request_id"], orjson.dumps(p)) for p in prompts] + [(k, raw) for k, (raw, _) in BAD.items()]
    for i, (key, value) in enumerate(records):
        producer.produce(topic, value=value, key=key.encode())
        if i % 5 == 0:  # interleave bad records with good ones in every partition
            producer.poll(0)
    assert producer.flush(30) == 0


def _offsets(kafka: KafkaSettings, topic: str, group: str, partitions: int) -> tuple[dict[int, int], dict[int, int]]:
    """The group's committed offsets, and the end of each partition. The end is
    read from the records themselves: tansu 0.6 reports the high watermark of an
    idempotent producer's batch as its base offset + 1."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group})
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()
    ends = dict.fromkeys(range(partitions), 0)
    for record in drain(kafka, topic, expected=10**9, timeout=10):
        ends[record.partition()] = max(ends[record.partition()], record.offset() + 1)
    return committed, ends


@pytest.fixture(scope="module", params=[("tiny-llama", "0,2,4", True), ("smollm2-135m-instruct", None, False)],
                ids=["tiny-by-reference", "smollm2"])
def run(request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    from transformers import AutoTokenizer

    name, layers, by_reference = request.param
    model_dir = models.prepare(names=[name])[name]
    kafka = KafkaSettings(bootstrap=kafka_bootstrap)
    topics = fresh_topics(kafka, partitions=3)
    prompts, generating = good_prompts(), generating_prompts()
    _publish(kafka, topics.prompts, prompts + generating)

    log = tmp_path_factory.mktemp("extract") / "extract.log"
    args = ["--max-model-len", "512", "--block-bytes", "16384"] + (["--layers", layers] if layers else [])
    payloads = open_storage(log.parent / "staging", create=True) if by_reference else None
    if payloads is not None:
        args += ["--payload-store", str(log.parent / "staging")]
    group = f"g-{topics.prompts}"
    result = run_extractor(kafka.bootstrap, topics, group, model_dir, log, *args)
    assert result == 0, log.read_text()[-5000:]

    records = drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0)
    samples = reassemble(records, payloads)
    blocks = sum(BlockRecordHeaders.from_kafka(r.headers()).kind is RecordKind.BLOCK for r in records)
    dead = drain(kafka, topics.prompts_dlq, expected=len(BAD), timeout=30)
    committed, ends = _offsets(kafka, topics.prompts, group, 3)
    first = next(iter(samples.values()))[0]
    return Run(model_dir, AutoTokenizer.from_pretrained(model_dir), prompts, generating, samples, dead,
               first.manifest.layer_ids, committed, ends, topics.prompts, payloads, blocks)


def test_every_prompt_has_exactly_one_manifest(run: Run) -> None:
    expected = Counter({p["request_id"]: 1 for p in run.prompts + run.generating})
    assert Counter({k: len(v) for k, v in run.samples.items()}) == expected


def test_by_reference_only_manifests_cross_kafka(run: Run) -> None:
    """Inline, every sample's blocks are records; by reference, none are, and each
    manifest names a staged object of exactly its size."""
    manifests = [sample.manifest for (sample,) in run.samples.values()]
    if run.payloads is None:
        assert run.block_records == sum(len(m.blocks) for m in manifests)
        assert all(m.payload is None for m in manifests)
        return
    assert run.block_records == 0
    for manifest in manifests:
        assert manifest.payload is not None
        assert run.payloads.size(manifest.payload.key) == manifest.payload.nbytes


def test_hidden_states_match_hf_transformers(run: Run) -> None:
    reference = HFReference(run.model_dir)
    assert run.layer_ids[-1] == reference.num_layers  # the last-layer id (pre-final-norm) is always checked
    worst = {}
    for request_id, (sample,) in run.samples.items():
        expected = reference.hidden_states(sample.manifest.token_ids, run.layer_ids)
        assert sample.hidden_states.shape == expected.shape, request_id
        for j, layer in enumerate(run.layer_ids):
            error = max_relative_error(sample.hidden_states[:, j], expected[:, j])
            worst[layer] = max(worst.get(layer, 0.0), error)
    assert all(error <= 1e-4 for error in worst.values()), worst


def test_greedy_answers_are_hf_greedy_turn_by_turn(run: Run) -> None:
    """Every generated turn equals HF's greedy continuation of the sequence before
    it (the verifier's earlier answer included); the prompt is the tokenizer's."""
    reference = HFReference(run.model_dir)
    for prompt in run.generating:
        (sample,) = run.samples[prompt["request_id"]]
        m = sample.manifest
        assert m.generation is not None
        sequence = m.token_ids + [m.generation.final_token_id]
        turns = m.generation.turns
        assert len(turns) == (2 if "messages" in prompt else 1)
        for turn in turns:
            assert sequence[turn.token_start:turn.token_end] == reference.greedy(sequence[:turn.token_start], 8)
        if "prompt" in prompt:
            assert sequence[:turns[0].token_start] == run.tokenizer(prompt["prompt"])["input_ids"]
        else:
            assert "to be replaced" not in run.tokenizer.decode(sequence)


def test_token_ids_are_the_tokenizers(run: Run) -> None:
    tok = run.tokenizer
    for prompt in run.prompts:
        (sample,) = run.samples[prompt["request_id"]]
        if "prompt" in prompt:
            expected = tok(prompt["prompt"])["input_ids"]
        elif "token_ids" in prompt:
            expected = prompt["token_ids"]
        else:
            expected = tok.apply_chat_template(prompt["messages"], tokenize=True, return_dict=False)
        assert sample.manifest.token_ids == expected, prompt["request_id"]
        assert sample.manifest.num_tokens == len(expected) == sample.hidden_states.shape[0]


def test_loss_masks_cover_exactly_the_assistant_turns(run: Run) -> None:
    tok = run.tokenizer
    for prompt in run.prompts:
        (sample,) = run.samples[prompt["request_id"]]
        spans = sample.manifest.loss_mask_spans
        if "messages" not in prompt:
            assert spans is None
            continue
        # Both models use ChatML: an assistant turn renders as its content, then
        # "<|im_end|>\n". The masked tokens must decode to exactly those turns.
        masked = "".join(tok.decode(sample.manifest.token_ids[s:e]) for s, e in spans or [])
        expected = "".join(m["content"] + "<|im_end|>\n" for m in prompt["messages"] if m["role"] == "assistant")
        assert masked == expected, prompt["request_id"]


def test_metadata_and_source_travel_with_the_sample(run: Run) -> None:
    for prompt in run.prompts:
        (sample,) = run.samples[prompt["request_id"]]
        assert sample.manifest.metadata == prompt.get("metadata")
        assert sample.manifest.source.topic == run.prompts_topic


def test_bad_prompts_are_dead_lettered_with_reasons(run: Run) -> None:
    by_key = {r.key().decode(): r for r in run.dead}
    assert set(by_key) == set(BAD)
    for key, (raw, error_class) in BAD.items():
        headers = DlqHeaders.from_kafka(by_key[key].headers())
        assert by_key[key].value() == raw
        assert headers.error_class == error_class, headers
        assert headers.service == "extractor" and headers.source_offset is not None


def test_committed_offsets_reach_the_end(run: Run) -> None:
    assert run.committed == run.end_offsets
