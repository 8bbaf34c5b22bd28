"""What hsx hands to trainers beyond the dataset itself: the metadata file of an
export (``hsx export``), and the resumable position of an online loader, which a
trainer saves in its checkpoints and loads back."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from hsx.schemas.blocks import DType, PositiveInt
from hsx.schemas.common import SCHEMA_VERSION, NonNegativeInt, StrictModel

LossMaskPolicy = Literal["all", "none"]
"""The loss mask of a sample stored without one (plain text, not a chat): train
on every token (``all``) or on none (``none``: such rows are dropped)."""

SpeculatorType = Literal["eagle3", "dflash", "peagle"]
"""The draft types hsx feeds: speculators' ``--speculator-type`` and a saved
draft's ``speculators_model_type`` (what each needs: :mod:`hsx.runtime.draft_types`)."""

SERVED_AUX_LAYERS = 3
"""Aux layers vLLM builds an EAGLE-3 draft's input for when the draft's model
config names no count, as speculators' checkpoints do not: the count a draft
trained on hsx data needs to be served there."""


class ExportMetadata(StrictModel):
    """``hsx_export.json`` beside a speculators export: what the hidden-state
    slots are, so a draft config can be checked against them."""

    schema_version: Literal[1] = SCHEMA_VERSION
    format: Literal["speculators"] = "speculators"
    model: str
    layer_ids: list[NonNegativeInt]
    """The layer id of each stored slot, in slot order: the aux layers, then the
    verifier's last layer (``hidden_states[:, -1]``)."""
    aux_layer_ids: list[NonNegativeInt]
    """``layer_ids[:-1]``: what speculators calls ``--target-layer-ids``."""
    verifier_layer_id: NonNegativeInt
    dtype: DType
    hidden_size: PositiveInt
    rows: NonNegativeInt
    dropped_unsupervised: NonNegativeInt
    """Samples left out because no token of theirs is supervised (loss mask all zero)."""
    loss_mask: LossMaskPolicy
    """The mask given to samples stored without one."""
    supervised_tokens: NonNegativeInt
    """Tokens under ``loss_mask == 1``: the total of ``token_freq.pt``."""
    speculator_type: SpeculatorType = "eagle3"
    """The draft type the printed train command trains (every type reads the same files)."""


KafkaPartition = Annotated[int, Field(ge=0, le=2**31 - 1)]
"""A partition number as Kafka has them (an int32)."""
KafkaOffset = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""An offset as Kafka has them (an int64)."""


class PartitionPosition(StrictModel):
    """How far a training job got in one partition of ``hidden_states.ready``.
    Numbers are bounded as Kafka's are: a loaded state becomes commits and
    resume points, which Kafka's client cannot hold beyond them."""

    partition: KafkaPartition
    next_offset: KafkaOffset
    """Every offset below this one was consumed (the Kafka commit)."""
    consumed: list[KafkaOffset] = Field(default_factory=list)
    """Offsets at or above ``next_offset`` consumed already (a shuffle buffer
    delivers out of order): skipped on resume, so they are not trained twice."""


class OnlineLoaderState(StrictModel):
    """``ReadyStream.state_dict()``: the consumed position of a training job, for
    its checkpoint; ``load_state_dict`` resumes exactly there."""

    schema_version: Literal[1] = SCHEMA_VERSION
    topic: str
    group_id: str
    partitions: list[PartitionPosition]
