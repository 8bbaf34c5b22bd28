"""The numerics of hsx's formats, apart from the contracts in :mod:`hsx.schemas`
(which keep the format constants, the headers and the codec enums):

- :mod:`.block`: a block record's value, byte planes + zstd, bit-exact, CRC-checked;
- :mod:`.framing`: ``magic | header length | JSON header | payload``, shared by every
  record, and :class:`~.framing.CorruptBlock`;
- :mod:`.planes`: byte planes cut and put back together in reused per-thread buffers;
- :mod:`.segments`: one payload segment, zstd or raw, with zstd's per-thread contexts;
- :mod:`.fp8`: E4M3 with a float32 scale per token and layer, and its error bound;
- :mod:`.fp8_blocks`: block records carrying fp8 rows (``hsx extract --wire-dtype fp8``);
- :mod:`.dataset`: how a sample is stored in a shard (``hsx sink --dataset-codec``).

numpy and zstandard only: no torch, no Kafka.
"""
