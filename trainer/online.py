"""Online training from ``hidden_states.ready``: an ``IterableDataset`` that
yields each sample as the sink makes it durable.

    stream = ReadyStream("kafka:9092", "/data/hs", group_id="eagle3-run-7", shuffle_buffer=1024)
    loader = DataLoader(stream, batch_size=8, num_workers=2, collate_fn=PackedCollate(8192, torch.bfloat16))
    for batch in loader:
        loss = step(batch); optimizer.step()
        stream.commit(batch)                    # after the step: these samples are trained on
        if time_to_checkpoint: save({"model": ..., "stream": stream.state_dict()})

The dataset may be a directory or ``s3://bucket/prefix``; over S3, start the
workers with ``multiprocessing_context="forkserver"`` (the object-store client
does not survive ``fork()``).

**One consumer group per training job** (``group_id``): its commits are the
job's position. Partitions are split statically across ranks × DataLoader
workers (partition ``p`` to slot ``p % (world_size × num_workers)``; slots
beyond the partition count stay idle), so no rebalance moves a partition while
a worker buffers its samples; partitions added to the topic later are not read
until the job restarts.

**What holds on kill and restart** (at least once):
- ``commit(batch)`` commits, per partition, the first offset not consumed yet.
  Samples still in a shuffle buffer or prefetched by the DataLoader were never
  consumed: they are delivered after a restart, none is lost.
- Restarted from the Kafka commit, the samples of batches consumed after the
  last ``commit`` come again; with a shuffle buffer, so do samples consumed out
  of order above a partition's commit (at most the buffer plus the prefetched
  batches). Without a shuffle buffer, a partition is delivered in order and only
  the uncommitted batches repeat.
- Restarted from ``state_dict()`` (``load_state_dict`` before iterating), the
  offsets consumed above the commit are skipped too: only the batches consumed
  after that state was taken repeat.
- A ready event the sink re-announced (same ``event_id``) is delivered once per
  worker within the last ``dedupe_window`` events.
- Each epoch (``iter(loader)``) starts where the job is: the trainer's progress
  or the group's commit, whichever is further, so persistent workers, whose copy
  of the stream is as old as they are, go on from the last ``commit``.
Memory is bounded by the shuffle buffer (events and masks, not hidden states)
and the DataLoader's prefetch, never by the stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed
import torch.utils.data
from confluent_kafka import Consumer, KafkaException
from pydantic import ValidationError

from hsx.dataset.reader import ShardHandles
from hsx.dataset.storage import open_storage
from hsx.runtime.kafka import consumer_config
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import format_validation_error
from hsx.schemas.topics import READY
from hsx.schemas.training import LossMaskPolicy, OnlineLoaderState
from hsx.trainer.consume import ConsumeOptions, consume
from hsx.trainer.offsets import Position, Progress
from hsx.trainer.samples import TrainingSample


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class ReadyStream(torch.utils.data.IterableDataset[TrainingSample]):
    """Samples of ``hidden_states.ready``, read from the dataset the sink writes.

    ``rank``/``world_size`` default to ``torch.distributed``'s, else ``RANK`` and
    ``WORLD_SIZE``. An epoch ends after ``idle_timeout`` seconds without a
    record, or with ``until_end`` once it has caught up with every partition's
    end; else it follows the topic forever. ``layers``, ``loss_mask``: as
    :class:`hsx.trainer.dataset.HsxDataset`. ``holdout``: the share of sample
    ids never yielded (:mod:`hsx.trainer.holdout`), kept for judging drafts.
    """

    def __init__(self, bootstrap: str, dataset: str | Path, group_id: str, *, topic: str = READY,
                 layers: list[int] | None = None, loss_mask: LossMaskPolicy = "all", shuffle_buffer: int = 0,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 idle_timeout: float | None = None, until_end: bool = False, dedupe_window: int = 100_000,
                 holdout: float = 0.0, kafka: KafkaSettings | None = None) -> None:
        if not group_id:
            raise ValueError("group_id: give each training job a consumer group of its own")
        if shuffle_buffer < 0 or dedupe_window < 0:
            raise ValueError("shuffle_buffer and dedupe_window must be >= 0")
        default_rank, default_world = _rank()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank}: must be in [0, world_size={self.world_size})")
        settings = (kafka or KafkaSettings()).model_copy(update={"bootstrap": bootstrap})
        self.options = ConsumeOptions(kafka=settings, topic=topic, group_id=group_id, layers=layers,
                                      policy=loss_mask, shuffle_buffer=shuffle_buffer, seed=seed,
                                      idle_timeout=idle_timeout, dedupe_window=dedupe_window, until_end=until_end,
                                      holdout=holdout)
        self._shards = ShardHandles(open_storage(dataset))
        self._progress = Progress()
        self._committer: Consumer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker gets the options and the progress, never the trainer's Kafka client.
        return {**self.__dict__, "_committer": None}

    def __iter__(self) -> Iterator[TrainingSample]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return consume(self.options, self._shards, self._progress, slot=self.rank * workers + worker,
                       slots=self.world_size * workers)

    def mark(self, batch: Mapping[str, Any] | Iterable[TrainingSample]) -> None:
        """Record a batch (a collated dict with ``positions``, or samples) as
        consumed, without telling Kafka yet."""
        positions: Iterable[Position] = (batch["positions"] if isinstance(batch, Mapping)
                                         else (s.position for s in batch))
        self._progress.consume(p for p in positions if p is not None)

    def commit(self, batch: Mapping[str, Any] | Iterable[TrainingSample] | None = None) -> None:
        """Mark ``batch`` consumed (if given), then commit every partition's
        consumed prefix to the job's group, synchronously. Call it after the
        optimizer step that used the batch."""
        if batch is not None:
            self.mark(batch)
        offsets = self._progress.to_commit(self.options.topic)
        if not offsets:
            return
        if self._committer is None:
            self._committer = Consumer(consumer_config(self.options.kafka, self.options.group_id))
        try:
            self._committer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise ConnectionError(f"commit to group {self.options.group_id}: {exc.args[0]}") from None
        self._progress.committed(offsets)

    def state_dict(self) -> dict[str, Any]:
        """The consumed position (JSON-able), for the trainer's checkpoint."""
        return self._progress.state(self.options.topic, self.options.group_id).model_dump(mode="json")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); call before iterating."""
        try:
            loaded = OnlineLoaderState.model_validate(dict(state), strict=False)
        except ValidationError as exc:
            raise ValueError(f"loader state: {format_validation_error(exc)}") from None
        if (loaded.topic, loaded.group_id) != (self.options.topic, self.options.group_id):
            raise ValueError(f"loader state is of topic {loaded.topic}, group {loaded.group_id}; this stream reads "
                             f"{self.options.topic} as {self.options.group_id}")
        self._progress = Progress.from_state(loaded)

    def close(self) -> None:
        """Close the trainer-side Kafka client (the workers close their own)."""
        if self._committer is not None:
            self._committer.close()
            self._committer = None
