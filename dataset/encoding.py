"""A sample's hidden states as a shard stores them (``hsx sink --dataset-codec``)
and back: the sink's one encoding step and every reader's one decoding step, so
``open_dataset``, ``follow``, ``inspect``, ``HsxDataset`` and the export all read
a shard of any codec the same way.

Layout in a shard: a ``raw`` sample is its ``[T, L, H]`` tensor of the model's
dtype, as before codecs existed, so any safetensors reader loads it. Any other
codec stores the encoded bytes (:mod:`hsx.codecs.dataset`) as one 1-D uint8
tensor under the same name; the codec, dtype and shape are in the sample's index
entry (``HiddenStatesReady``) and the codec also in the shard's metadata.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hsx.codecs.block import checksum, read_header
from hsx.codecs.framing import CorruptBlock
from hsx.codecs.dataset import decode_sample, encode_fp8_sample, encode_sample
from hsx.codecs.fp8 import from_fp8, narrow
from hsx.dataset.safetensors_io import safetensors_dtype
from hsx.dataset.sample import FileRange, Pieces, Sample
from hsx.runtime.errors import HsxError
from hsx.schemas import BlockHeader, Codec, HiddenStatesReady
from hsx.schemas.dataset_codec import DatasetCodec

if TYPE_CHECKING:  # torch is imported where tensors are made: `hsx.open_dataset` imports without it
    import torch

log = logging.getLogger(__name__)


class CorruptSample(HsxError, CorruptBlock):
    """A stored sample whose encoded hidden states do not decode or fail their
    checksum; the message names the shard and the sample."""


def encode(sample: Sample, codec: DatasetCodec) -> Sample:
    """``sample`` with ``hidden_states`` in the form ``codec`` stores, its
    block records dropped. ``byteplane-zstd`` keeps the block records as they
    arrived (the assembler verified each one's CRC) when they are all
    byte-plane coded and tile the sample from its first row; otherwise (another
    wire codec, a ``capture: last`` sample whose one block starts at its final
    token) the raw bytes are encoded once. A sample fp8 cannot hold (non-finite
    values) is kept raw rather than lost: its shard then says raw.

    A sample sent as fp8 (``sample.fp8``) keeps its codes and scales as they came
    under ``fp8`` and ``fp8-zstd``, with no dequantize and quantize again; the
    other codecs get it dequantized to the manifest's dtype, within the bound of
    :mod:`hsx.codecs.fp8`. Its checksum is of what the shard's codec decodes to:
    the dequantized bytes under ``raw`` and ``byteplane-zstd``; under ``fp8`` and
    ``fp8-zstd`` the scales then codes the extractor sent, the frame's own CRC."""
    if sample.codec is codec and not sample.records and sample.fp8 is None:  # already as stored
        return sample
    if sample.fp8 is not None:
        return _encode_fp8(sample, codec)
    kept = replace(sample, records=[])
    if codec is DatasetCodec.RAW:
        return kept
    m = sample.manifest
    shape = (m.captured_tokens, len(m.layer_ids), m.hidden_size)
    raw = sample.hidden_states
    if codec is DatasetCodec.BYTEPLANE_ZSTD and records_fit([read_header(r)[0] for r in sample.records]):
        payload = b"".join(sample.records)
    else:
        try:
            payload = encode_sample(raw, shape=shape, dtype=m.dtype, codec=codec)
        except ValueError as exc:
            log.warning("%s stored raw, not %s: %s", m.request_id, codec.value, exc)
            return kept
    return replace(kept, hidden_states=payload, codec=codec, checksum=sample.checksum or checksum(raw))


def _encode_fp8(sample: Sample, codec: DatasetCodec) -> Sample:
    assert sample.fp8 is not None
    codes, scales = sample.fp8
    m = sample.manifest
    kept = replace(sample, records=[], fp8=None, codec=codec)
    if codec in (DatasetCodec.FP8, DatasetCodec.FP8_ZSTD):
        return replace(kept, hidden_states=encode_fp8_sample(codes, scales, dtype=m.dtype, codec=codec),
                       checksum=checksum(np.ascontiguousarray(scales, dtype="<f4"), codes))
    raw = narrow(from_fp8(codes, scales), m.dtype).tobytes()
    stored = raw if codec is DatasetCodec.RAW else encode_sample(raw, shape=codes.shape, dtype=m.dtype, codec=codec)
    return replace(kept, hidden_states=stored, checksum=checksum(raw))


def records_fit(headers: Sequence[BlockHeader]) -> bool:
    """Whether records with these headers, back to back, are a ``byteplane-zstd``
    sample as they are: every one byte-plane coded, the first starting at row 0
    (the assembler checked that they tile the rest in order)."""
    return bool(headers) and headers[0].token_start == 0 and all(
        h.codec is Codec.BYTEPLANE_ZSTD and h.quantization is None for h in headers)


def stored_tensor(sample: Sample) -> torch.Tensor | Pieces | FileRange:
    """The tensor ``write_shard`` saves for ``sample``: ``[T, L, H]`` of its dtype
    when raw, else the encoded bytes as 1-D uint8. A view, not a copy; bytes kept
    in pieces or in a file stay so (:class:`Pieces`, :class:`FileRange`: written
    as 1-D uint8)."""
    import torch

    from hsx.runtime.tensors import TORCH_DTYPES

    m = sample.manifest
    if isinstance(sample.hidden_states, (FileRange, Pieces)):
        return sample.hidden_states
    if sample.codec is DatasetCodec.RAW:
        return _read_only_view(sample.hidden_states, TORCH_DTYPES[m.dtype]).view(
            m.captured_tokens, len(m.layer_ids), m.hidden_size)
    return _read_only_view(sample.hidden_states, torch.uint8)


def read_hidden_states(shard: Any, event: HiddenStatesReady) -> torch.Tensor:
    """A sample's ``[T, L, H]`` hidden states of ``event.dtype``, from its open
    shard, whatever its codec: the stored tensor itself for raw (memory-mapped
    from a local shard), else decoded (bit-exact for the lossless codecs,
    dequantized for fp8). Raises :class:`CorruptSample` when the stored tensor is
    not what the index entry says or its bytes are damaged."""
    import torch

    from hsx.runtime.tensors import TORCH_DTYPES

    name = event.tensors.hidden_states
    if event.codec is DatasetCodec.RAW:
        check_raw(shard, event)
        return shard.get_tensor(name)
    dtype, dims = shard.describe(name)
    if event.shape is None or dtype != "U8" or len(dims) != 1:
        raise CorruptSample(f"{_where(event)}: a {event.codec.value} sample needs a 1-D uint8 tensor and a shape in "
                            f"its index entry, found {dtype} {dims} and shape {event.shape}")
    shape = sample_shape(event)
    try:
        raw = decode_sample(shard.get_tensor(name).numpy(), shape=shape, dtype=event.dtype, codec=event.codec)
    except CorruptBlock as exc:
        raise CorruptSample(f"{_where(event)}: {event.codec.value} hidden states are corrupt: {exc}") from exc
    # A copy the caller owns and may write to; decode_sample's bytes are immutable.
    return torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[event.dtype]).view(shape)


def sample_shape(event: HiddenStatesReady) -> tuple[int, int, int]:
    """A sample's ``[T, L, H]`` as its index entry says it: its rows (every token,
    or the last), layers and width, which its ``shape`` (absent in entries
    written before dataset codecs) must repeat; :class:`CorruptSample` if not."""
    expected = (1 if event.capture == "last" else event.num_tokens, len(event.layer_ids), event.hidden_size)
    if event.shape is not None and tuple(event.shape) != expected:
        raise CorruptSample(f"{_where(event)}: its index entry gives shape {list(event.shape)}, but its tokens, "
                            f"capture, layers and hidden size make {list(expected)}")
    return expected


def check_raw(shard: Any, event: HiddenStatesReady) -> None:
    """Refuse (:class:`CorruptSample`) a raw sample whose stored hidden states are
    not the ``[T, L, H]`` tensor of ``event.dtype`` its index entry says, before
    anything is read or sliced from them."""
    from hsx.runtime.tensors import TORCH_DTYPES

    _check_stored(shard, event, event.tensors.hidden_states, safetensors_dtype(TORCH_DTYPES[event.dtype]),
                  sample_shape(event))


def read_token_ids(shard: Any, event: HiddenStatesReady) -> torch.Tensor:
    """A sample's token ids, int64 ``[num_tokens]``; :class:`CorruptSample` if the
    shard holds anything else under their name."""
    _check_stored(shard, event, event.tensors.token_ids, "I64", (event.num_tokens,))
    return shard.get_tensor(event.tensors.token_ids)


def read_loss_mask(shard: Any, event: HiddenStatesReady) -> torch.Tensor | None:
    """A sample's stored loss mask, bool ``[num_tokens]``, or None for a sample
    stored without one; :class:`CorruptSample` if the shard holds anything else."""
    name = event.tensors.loss_mask
    if name is None:
        return None
    _check_stored(shard, event, name, "BOOL", (event.num_tokens,))
    return shard.get_tensor(name)


def _check_stored(shard: Any, event: HiddenStatesReady, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    found = shard.describe(name)
    if found != (dtype, shape):
        raise CorruptSample(f"{_where(event)}: {name} is {found[0]} {list(found[1])} in the shard, its index "
                            f"entry says {dtype} {list(shape)}")


def _where(event: HiddenStatesReady) -> str:
    return f"shard {event.shard}, sample {event.request_id}"


def _read_only_view(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data`` without copying it. torch warns that the buffer is
    not writable; the view is only read (serialized), so that is fine."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)
