"""Every wire contract of hsx: events, record headers, topic names, the block
codec. Nothing outside this package defines a field that crosses a process
boundary."""

from hsx.schemas.blocks import BlockHeader, BlockRecordHeaders, Codec, DType, RecordKind, Segment
from hsx.schemas.manifest import BlockRef, Manifest, PayloadRef, ServedRef, SourceRef, staged_key
from hsx.schemas.common import SCHEMA_VERSION, RequestId, StrictModel, format_validation_error, sample_id
from hsx.schemas.dlq import DlqHeaders, ErrorClass
from hsx.schemas.generation import FinishReason, GeneratedTurn, Generation, GenerationRecord
from hsx.schemas.limits import DEFAULT_LIMITS, PromptLimits
from hsx.schemas.prompt import Message, PromptEvent, PromptKind
from hsx.schemas.ready import HiddenStatesReady, ShardIndex, TensorNames, ready_event_id
from hsx.schemas.topics import Topics

__all__ = [
    "SCHEMA_VERSION",
    "BlockHeader",
    "BlockRecordHeaders",
    "BlockRef",
    "Codec",
    "DEFAULT_LIMITS",
    "DType",
    "DlqHeaders",
    "ErrorClass",
    "FinishReason",
    "GeneratedTurn",
    "Generation",
    "GenerationRecord",
    "HiddenStatesReady",
    "Manifest",
    "Message",
    "PayloadRef",
    "PromptEvent",
    "PromptKind",
    "PromptLimits",
    "RecordKind",
    "RequestId",
    "Segment",
    "ShardIndex",
    "ServedRef",
    "SourceRef",
    "StrictModel",
    "TensorNames",
    "Topics",
    "format_validation_error",
    "ready_event_id",
    "sample_id",
    "staged_key",
]
