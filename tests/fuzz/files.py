"""Fuzz targets for every parser of untrusted files: what a dataset holds (shards,
their indexes, the sink's key files and topic records), the files ``hsx produce``
reads (JSONL, JSON arrays, Parquet, Arrow, ``datasets`` folders) and what hsx
hands to trainers (``hsx_export.json``, a saved online loader state).

A target whose parser reads from a dataset writes the input into a fresh
directory (a :class:`~hsx.dataset.storage.LocalStorage`) at the path the product
reads, then calls the product's own function; one whose parser opens a file by
name writes it there under the right extension. Plain writes, not the storage's
``write_atomic``: an fsync per input would cost more than the parse.

Inputs made of several files are framed (:func:`split_parts`, :func:`join_parts`):
each part but the last is a 4-byte little-endian length and that many bytes,
the last part is the rest of the input. A length (or a part) cut short by the
end of the input takes what is there and leaves the later parts empty, so every
input splits into the parts its target needs, and the bytes of the last part (the largest file: a shard, an
Arrow file) keep their place whatever a mutation does to the others.

Seeds (:func:`seeds`) are real files: datasets written through the sink's own
write path (:func:`hsx.local.training_data.write_training_dataset`, which calls
:func:`hsx.dataset.shards.write_shard`), key files and topic records as the sink
writes them, input files as ``tests/unit/input_files.py`` writes every kind, an
export by ``hsx export`` and a loader state from ``ReadyStream.state_dict``.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from pydantic import ValidationError

from hsx.dataset.encoding import CorruptSample, read_hidden_states
from hsx.dataset.reader import MissingShard, open_dataset
from hsx.dataset.shard_reader import CorruptShard, RemoteShard, open_shard
from hsx.dataset.index import CorruptIndex, read_index
from hsx.dataset.shards import INDEX, KEYS, SHARDS, partition_prefix, shard_stem
from hsx.dataset.storage import LocalStorage
from hsx.producer.inputs import InputRows, InputSpec
from hsx.producer.publisher import InvalidLine, Mapping, parse_line
from hsx.producer.sources import DatasetFormat
from hsx.runtime.errors import UsageError
from hsx.schemas import HiddenStatesReady
from hsx.schemas.shard import ShardMetadata
from hsx.sink.partition import DatasetDamaged, PartitionState
from hsx.sink.partition_count import PartitionCountChanged, check_partition_count, record_path
from tests.fuzz.target import target

if TYPE_CHECKING:  # torch loads when a trainer target first runs, not when the targets are listed
    from hsx.trainer.online import ReadyStream

TOPIC = "hidden_states.blocks"
"""The blocks topic every dataset target's files belong to (partition 0)."""
STEM = shard_stem(TOPIC, 0, 0)
SHARD_PATH = f"{SHARDS}/{STEM}.safetensors"
INDEX_PATH = f"{INDEX}/{STEM}.json"
KEY_PATH = f"{KEYS}/{STEM}.keys"
PARTITIONS = 3
"""The partition count the ``partition_record`` target checks a record against."""
_LENGTH = struct.Struct("<I")
_MAPPINGS = (Mapping(), Mapping(DatasetFormat.SHAREGPT), Mapping(DatasetFormat.TEXT))
"""How ``hsx produce`` maps rows: the default (rows are prompt events), and the
ShareGPT and text shapes, so the mapping code meets every row too."""


def split_parts(data: bytes, count: int) -> list[bytes]:
    """``data`` as ``count`` parts (see the module's docstring for the layout)."""
    parts, at = [], 0
    for _ in range(count - 1):
        (length,) = _LENGTH.unpack_from(data, at) if len(data) - at >= _LENGTH.size else (0,)
        at = min(len(data), at + _LENGTH.size)
        parts.append(data[at:at + length])
        at = min(len(data), at + length)
    parts.append(data[at:])
    return parts


def join_parts(parts: Sequence[bytes]) -> bytes:
    """The input that :func:`split_parts` splits into ``parts``."""
    return b"".join(_LENGTH.pack(len(part)) + part for part in parts[:-1]) + parts[-1]


@contextmanager
def scratch() -> Iterator[LocalStorage]:
    """A fresh, empty dataset directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="hsx-fuzz-") as root:
        yield LocalStorage(Path(root))


def put(storage: LocalStorage, relative: str, data: bytes) -> None:
    """``data`` at ``relative`` in the dataset (not durably: see the module's docstring)."""
    path = storage.local_path(relative)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# -- the dataset ---------------------------------------------------------------------------


_SHARD_REFUSALS = (CorruptIndex, MissingShard, CorruptShard, CorruptSample)


@target("shard", *_SHARD_REFUSALS)
def shard(data: bytes) -> None:
    """A shard file (safetensors header, tensors, hsx metadata), beside its index, as every reader reads it.

    Input: ``[index JSON, shard bytes]`` framed. The shard is read memory-mapped
    (``open_dataset``, every sample; its metadata through ``ShardMetadata``,
    whose documented ``ValueError`` the target passes over), through ranged
    reads as from an object store (:class:`RemoteShard`, every sample through
    the trainer's ``read_sample``), and by the map-style training dataset
    (``HsxDataset``, every row, the layer subset path too). Expected: ``CorruptIndex`` (a damaged index),
    ``MissingShard`` (the index names another shard), ``CorruptShard`` (a header
    that is not what safetensors says it must be, a tensor the index names and
    the shard lacks), ``CorruptSample`` (a stored tensor that is not what its
    index entry says, hidden states that do not decode). All four are
    ``HsxError`` s: one line from ``hsx inspect`` and ``hsx export``. Each
    reader gets its turn whatever the others raised: safe_open refusing a
    header must not spare :class:`RemoteShard` its own checks.
    """
    index, shard_bytes = split_parts(data, 2)
    with scratch() as storage:
        put(storage, INDEX_PATH, index)
        put(storage, SHARD_PATH, shard_bytes)
        events = read_index(storage, INDEX_PATH).events
        for read in (_read_mapped, _read_remote, _read_for_training):
            try:
                read(storage, events)
            except _SHARD_REFUSALS:
                continue


def _read_mapped(storage: LocalStorage, events: list[HiddenStatesReady]) -> None:
    """Every sample through ``open_dataset``, memory-mapped; and the shard's
    metadata as ``ShardMetadata`` parses it."""
    metadata = open_shard(storage, SHARD_PATH).metadata()
    if metadata is not None:
        try:
            ShardMetadata.from_safetensors(metadata)
        except ValueError:
            pass  # its documented refusal: a value that is not what the contract says
    dataset = open_dataset(storage.root)
    for request_id in dataset.request_ids():
        dataset[request_id]


def _read_remote(storage: LocalStorage, events: list[HiddenStatesReady]) -> None:
    """Every sample through :class:`RemoteShard`, as an object-store dataset is read."""
    from hsx.trainer.samples import LayerLayout, read_sample

    opened: dict[str, RemoteShard] = {}
    for event in events:
        if not storage.local_path(event.shard).is_file():
            continue  # MissingShard, from the reader's handles (_read_mapped)
        if event.shard not in opened:
            opened[event.shard] = RemoteShard(storage, event.shard)
        remote = opened[event.shard]
        read_hidden_states(remote, event)
        stored = tuple(sorted(event.layer_ids))
        # What read_sample refuses in one line was refused when the dataset was opened for training.
        if len(stored) >= 2 and tuple(event.layer_ids) == stored and event.capture == "all":
            # The aux layers reversed: a raw sample's rows are picked out of the whole tensor.
            read_sample(remote, event, LayerLayout(stored, stored[-2::-1]), "all")


def _read_for_training(storage: LocalStorage, events: list[HiddenStatesReady]) -> None:
    """Every row of ``HsxDataset``, as a trainer or ``hsx export`` reads them:
    all layers, and a subset in another order (the raw slice path)."""
    from hsx.trainer.dataset import HsxDataset

    root = storage.root

    try:
        full = HsxDataset(root)
    except ValueError as exc:
        # Its documented refusals are plain ValueErrors in one line (no samples, a
        # layer set or capture no trainer can use; hsx export makes them usage
        # errors); a subclass (a damaged shard) is judged by the target.
        if type(exc) is not ValueError:
            raise
        return
    views = [full]
    stored = full.layout.stored
    if len(stored) >= 3:
        views.append(HsxDataset(root, layers=[stored[-2], stored[0]]))
    for view in views:
        for row in range(len(view)):
            view[row]
            view.tokens(row)


@cache
def _stored_dataset() -> dict[str, bytes]:
    """A real one-shard dataset's files by path (shard, key file, index)."""
    from hsx.local.training_data import TrainingDataSpec, write_training_dataset

    with scratch() as storage:
        write_training_dataset(storage, TrainingDataSpec(samples=3, per_shard=3, max_tokens=6, hidden_size=4,
                                                         layer_ids=(1, 2, 3)))
        return {path: storage.read(path) for path in (SHARD_PATH, KEY_PATH, INDEX_PATH)}


_INDEX_REFUSALS = (*_SHARD_REFUSALS, DatasetDamaged)


@target("shard_index", *_INDEX_REFUSALS)
def shard_index(data: bytes) -> None:
    """A shard's index JSON (``ShardIndex``), beside a real shard, as the reader and the sink's restart read it.

    Input: the index's bytes, at ``index/<stem>.json`` of a dataset whose shard
    is real and whose key file is absent (a dataset from before key files, or
    one whose key file was damaged), so the sink's restart
    (``PartitionState.load``) reads the index and the token ids it names, and
    then looks up every sample it lists (``stored_copy``, which reads the index
    again). The reader reads it through ``open_dataset`` and every sample.
    Expected: ``CorruptIndex`` (not a shard index), and the refusals of what the
    index points at (``MissingShard``, ``CorruptShard``, ``CorruptSample``), from
    the reader and the sink alike; ``DatasetDamaged`` from the sink, when the
    index's ``first_offset`` is not the one its name says (the keys built from
    it name an index that is not there). All are ``HsxError`` s: the sink stops
    in one line. The sink and the reader each get their turn.
    """
    with scratch() as storage:
        put(storage, SHARD_PATH, _stored_dataset()[SHARD_PATH])
        put(storage, INDEX_PATH, data)
        for read in (_restart_sink, _read_mapped):
            try:
                read(storage, [])
            except _INDEX_REFUSALS:
                continue


def _restart_sink(storage: LocalStorage, events: list[HiddenStatesReady]) -> None:
    """The sink's restart: the partition loaded (its keys built from the index
    and the shard's token ids), then every indexed sample looked up."""
    state = PartitionState.load(storage, TOPIC, 0, incomplete_timeout=600)
    for event in read_index(storage, INDEX_PATH).events:
        state.stored_copy(storage, event.request_id, [0])


@target("key_file", DatasetDamaged)
def key_file(data: bytes) -> None:
    """The sink's key files (``keys/<shard>.keys`` and the partition's roll-up) as its restart reads them.

    Input: ``[roll-up, the shard's key file]`` framed, an empty part standing
    for an absent file, beside a real shard and its index. The sink loads the
    partition (``PartitionState.load``: ``load_keys``; a damaged file is
    ignored or rebuilt from the index, as documented) and looks up every stored
    request. Expected: ``DatasetDamaged``, a key naming a shard whose index is
    not there.
    """
    rollup, keys = split_parts(data, 2)
    stored = _stored_dataset()
    with scratch() as storage:
        put(storage, SHARD_PATH, stored[SHARD_PATH])
        put(storage, INDEX_PATH, stored[INDEX_PATH])
        if rollup:
            put(storage, f"{KEYS}/{partition_prefix(TOPIC, 0)}rollup.keys", rollup)
        if keys:
            put(storage, KEY_PATH, keys)
        state = PartitionState.load(storage, TOPIC, 0, incomplete_timeout=600)
        for request_id in open_dataset(storage.root).request_ids():
            state.stored_copy(storage, request_id, [0])


@target("partition_record", PartitionCountChanged)
def partition_record(data: bytes) -> None:
    """``topics/<topic>.json`` (``TopicRecord``), the blocks topic's recorded partition count, as the sink checks it on start.

    Expected: ``PartitionCountChanged`` (not a topic record, or another count:
    the sink refuses to start, in one line).
    """
    with scratch() as storage:
        put(storage, record_path(TOPIC), data)
        check_partition_count(storage, TOPIC, PARTITIONS, str(storage.root))


# -- hsx produce's inputs ----------------------------------------------------------------------


def _produce(path: Path) -> None:
    """Read ``path`` as ``hsx produce`` does: checked when opened
    (``InputRows``), then row by row into prompt events (``parse_line``)."""
    for line in InputRows(InputSpec(str(path))):
        for mapping in _MAPPINGS:
            try:
                parse_line(line, mapping)
            except InvalidLine:
                pass  # one row: skipped, dead-lettered or fatal as --on-invalid says; the next row is read


def _produce_file(data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="hsx-fuzz-") as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        _produce(path)


@target("input_jsonl", UsageError)
def input_jsonl(data: bytes) -> None:
    """A JSONL input file (``hsx produce prompts.jsonl``), row by row into prompt events.

    Expected: ``UsageError`` (the file cannot be read: one line, nothing
    published); a bad row is an ``InvalidLine`` the target passes over, as the
    producer does with ``--on-invalid skip``.
    """
    _produce_file(data, "prompts.jsonl")


@target("input_json", UsageError)
def input_json(data: bytes) -> None:
    """A JSON array input file (ShareGPT files; ``hsx produce prompts.json``, parsed with ijson), row by row.

    Expected: ``UsageError`` (not one JSON array of rows, invalid JSON after
    row N, a row that cannot be written as JSON); bad rows as for ``input_jsonl``.
    """
    _produce_file(data, "prompts.json")


@target("input_parquet", UsageError)
def input_parquet(data: bytes) -> None:
    """A Parquet input file (``hsx produce prompts.parquet``), batch by batch, row by row.

    Expected: ``UsageError`` (pyarrow cannot read it, when opened or at a
    batch; a row that cannot be written as JSON); bad rows as for ``input_jsonl``.
    """
    _produce_file(data, "prompts.parquet")


@target("input_arrow", UsageError)
def input_arrow(data: bytes) -> None:
    """An Arrow IPC input file (file or stream format, Feather v2; ``hsx produce prompts.arrow``), row by row.

    Expected: as ``input_parquet``.
    """
    _produce_file(data, "prompts.arrow")


DATASETS_FILES = ("dataset_info.json", "state.json", "data-00000-of-00001.arrow")
"""The files of a one-file ``datasets.save_to_disk`` folder, in the order
``input_datasets`` frames them."""


@target("input_datasets", UsageError)
def input_datasets(data: bytes) -> None:
    """A ``datasets.save_to_disk`` folder (``hsx produce DIR``), row by row.

    Input: the folder's files framed in the order of :data:`DATASETS_FILES`; an
    empty part stands for an absent file. Expected: ``UsageError`` (not such a
    folder, or ``datasets`` cannot load it or read a batch); bad rows as for
    ``input_jsonl``.
    """
    with tempfile.TemporaryDirectory(prefix="hsx-fuzz-") as folder:
        root = Path(folder) / "prompts"
        root.mkdir()
        for name, content in zip(DATASETS_FILES, split_parts(data, len(DATASETS_FILES)), strict=True):
            if content:
                (root / name).write_bytes(content)
        _produce(root)


# -- what hsx hands to trainers ------------------------------------------------------------------


@target("export_metadata", ValidationError)
def export_metadata(data: bytes) -> None:
    """``hsx_export.json`` (``ExportMetadata``) beside a speculators export, as its schema reads it.

    No hsx code reads the file back: a training script checks a draft config
    against it with the model (or its JSON Schema, ``export_metadata``), and
    ``train_command`` turns it into the ``speculators train`` line.
    Expected: ``ValidationError``.
    """
    from hsx.schemas.training import ExportMetadata
    from hsx.trainer.export import train_command

    train_command(Path("out"), ExportMetadata.model_validate_json(data))


@cache
def _empty_dataset() -> tempfile.TemporaryDirectory[str]:
    """A directory for the stream's dataset, kept for the process (removed at exit)."""
    return tempfile.TemporaryDirectory(prefix="hsx-fuzz-")


@cache
def _stream() -> ReadyStream:
    """A ``ReadyStream`` that never connects: loading a state does not."""
    from hsx.trainer.online import ReadyStream

    return ReadyStream("localhost:9", _empty_dataset().name, group_id="g", topic="t")


@target("online_loader_state", ValueError)
def online_loader_state(data: bytes) -> None:
    """A saved online loader state (``OnlineLoaderState``, a checkpoint's ``stream.state_dict()`` as JSON), loaded back.

    The JSON object goes to ``ReadyStream.load_state_dict``; what it loaded
    then becomes the commits and resume points the stream hands Kafka
    (``TopicPartition`` s). Expected: ``ValueError``, the documented refusal of
    ``load_state_dict`` (``loader state: <field>: <rule>``, or another stream's
    topic and group); JSON that is no object is the trainer's own checkpoint
    format, not a state, and passed over.
    """
    try:
        state = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    if not isinstance(state, dict):
        return
    stream = _stream()
    stream.load_state_dict(state)
    progress = stream._progress
    progress.to_commit(stream.options.topic)  # what the next commit() sends
    for partition in stream.state_dict()["partitions"]:
        progress.start(partition["partition"])  # where a worker resumes it


# -- seeds ---------------------------------------------------------------------------------------


def seeds() -> dict[str, list[bytes]]:
    """Seed inputs of every target of this module, from files hsx (or, for
    input files, the tests' writers of every kind) wrote."""
    return {
        **_dataset_seeds(),
        **_input_seeds(),
        "export_metadata": [_export_seed()],
        "online_loader_state": [_loader_state_seed()],
    }


def _dataset_seeds() -> dict[str, list[bytes]]:
    from hsx.local.training_data import TrainingDataSpec, write_training_dataset
    from hsx.schemas import DType
    from hsx.schemas.dataset_codec import DatasetCodec
    from hsx.schemas.keys import KEYS_MAGIC
    from hsx.schemas.shard import TopicRecord
    from hsx.sink.keys import load_keys

    out: dict[str, list[bytes]] = {"shard": [], "shard_index": [], "key_file": [], "partition_record": []}
    for codec, dtype in ((DatasetCodec.RAW, DType.FLOAT32), (DatasetCodec.RAW, DType.BFLOAT16),
                         (DatasetCodec.BYTEPLANE_ZSTD, DType.BFLOAT16), (DatasetCodec.FP8, DType.FLOAT32),
                         (DatasetCodec.FP8_ZSTD, DType.BFLOAT16)):
        with scratch() as storage:
            write_training_dataset(storage, TrainingDataSpec(samples=3, per_shard=3, max_tokens=6, hidden_size=4,
                                                             layer_ids=(1, 2, 3), dtype=dtype, codec=codec))
            index = storage.read(INDEX_PATH)
            out["shard"].append(join_parts([index, storage.read(SHARD_PATH)]))
            out["shard_index"].append(index)
            if codec is DatasetCodec.RAW and dtype is DType.FLOAT32:
                keys = storage.read(KEY_PATH)
                # A roll-up as the sink writes it (load_keys writes one past ROLLUP_AFTER shards).
                prefix = partition_prefix(TOPIC, 0)
                rollup = (KEYS_MAGIC + load_keys(storage, prefix, [STEM]).records().tobytes())
                out["key_file"] += [join_parts([b"", keys]), join_parts([rollup, b""]), join_parts([rollup, keys])]
    with scratch() as storage:
        check_partition_count(storage, TOPIC, PARTITIONS, "seed")
        out["partition_record"].append(storage.read(record_path(TOPIC)))
    assert TopicRecord.model_validate_json(out["partition_record"][0]).partitions == PARTITIONS
    return out


def _input_seeds() -> dict[str, list[bytes]]:
    from tests.unit.input_files import (
        chat_rows, text_rows, write_arrow_file, write_arrow_stream, write_feather, write_hf_dataset, write_json,
        write_jsonl, write_parquet,
    )

    out: dict[str, list[bytes]] = {name: [] for name in (
        "input_jsonl", "input_json", "input_parquet", "input_arrow", "input_datasets")}
    writers = {"input_jsonl": [write_jsonl], "input_json": [write_json], "input_parquet": [write_parquet],
               "input_arrow": [write_arrow_file, write_arrow_stream, write_feather]}
    with tempfile.TemporaryDirectory(prefix="hsx-fuzz-") as folder:
        for rows in (text_rows(6), chat_rows(4)):
            for name, kinds in writers.items():
                for write in kinds:
                    out[name].append(write(rows, Path(folder) / "f").read_bytes())
            written = write_hf_dataset(rows, Path(folder) / f"hf-{len(out['input_datasets'])}")
            out["input_datasets"].append(join_parts([(written / name).read_bytes() for name in DATASETS_FILES]))
    return out


def _export_seed() -> bytes:
    from hsx.local.training_data import TrainingDataSpec, write_training_dataset
    from hsx.trainer.export import METADATA, export_speculators

    with tempfile.TemporaryDirectory(prefix="hsx-fuzz-") as folder:
        write_training_dataset(Path(folder) / "ds", TrainingDataSpec(samples=2, max_tokens=5, hidden_size=4,
                                                                     layer_ids=(1, 2, 3)))
        export_speculators(Path(folder) / "ds", Path(folder) / "out")
        return (Path(folder) / "out" / METADATA).read_bytes()


def _loader_state_seed() -> bytes:
    from hsx.trainer.offsets import Position

    stream = _stream()
    # Two batches as PackedCollate hands them: partition 0 out of order (a shuffle buffer), partition 2 in order.
    stream.mark({"positions": [Position(0, 0, 0, 4), Position(0, 0, 7, 9)]})
    stream.mark({"positions": [Position(2, 10, 10, 12)]})
    state = orjson.dumps(stream.state_dict())
    stream.load_state_dict({"topic": "t", "group_id": "g", "partitions": []})  # the target's stream starts bare
    return state
