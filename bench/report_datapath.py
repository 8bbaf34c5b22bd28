"""The benchmarks page's section on the data path at GPU rates
(:mod:`bench.datapath`): three transports side by side, then what each needs
for one H200 and an 8-GPU node, with the arithmetic."""

from __future__ import annotations

from collections.abc import Iterator

from bench.report_blocks import Block, Bullets, Cells, Results, Table, When

TRANSPORTS = ("inline", "s3", "directory")
PROCESSES = (("connector", "connector side"), ("sink", "sink"), ("broker", "broker (tansu)"),
             ("s3", "S3 server (SeaweedFS)"))
HEADER = ("", "inline (block records)", "by reference, S3", "by reference, directory")


def _row(label: str, figure: str, conversion: str = "") -> Cells:
    return (label, *(f"{{datapath_{t}_{figure}{conversion}}}" for t in TRANSPORTS))


def _measured(_r: Results) -> Iterator[Cells]:
    yield _row("hidden-state MB/s (median)", "mb_s")
    yield _row("per round", "mb_s_rounds", "!s")
    for name, what in PROCESSES:
        yield _row(f"CPU-s per GB: {what}", f"cpu_s_per_gb_{name}")
        yield _row("of which in the kernel", f"cpu_s_per_gb_{name}_kernel")
    yield _row("CPU-s per GB: **path** (connector side + sink)", "cpu_s_per_gb_path")
    yield _row("Kafka bytes per hidden-state byte", "kafka_bytes_ratio")
    yield _row("Kafka bytes per token", "kafka_bytes_per_token")
    yield _row("Kafka records", "kafka_records")
    yield _row("hidden-state bytes ÷ bytes sent (codec)", "codec_ratio")
    yield _row("connector side's RSS growth, MiB", "connector_rss_growth_mib")
    yield _row("sink's peak RSS, MiB", "sink_rss_peak_mib")
    yield _row("broker's RSS growth (the round's retention), MiB", "broker_rss_growth_mib")
    yield _row("S3 server's peak RSS, MiB", "s3_rss_peak_mib")
    yield _row("staged objects left after the finish", "staged_left")


def _extrapolated(_r: Results) -> Iterator[Cells]:
    yield _row("connector-side cores = CPU-s/GB × 0.885 GB/s", "h200_cores_connector")
    yield _row("sink cores", "h200_cores_sink")
    yield _row("path cores (connector side + sink)", "h200_cores_path")
    yield _row("broker cores (tansu, not Kafka: indicative)", "h200_cores_broker")
    yield _row("S3 server cores", "h200_cores_s3")
    yield _row("broker in, MB/s = Kafka bytes per byte × 885", "h200_broker_mb_s")
    yield _row("**node**: path cores (× 8)", "node_cores_path")
    yield _row("**node**: broker in, MB/s (× 8)", "node_broker_mb_s")
    yield _row("**node**: broker writes with 3 replicas, MB/s", "node_broker_write_mb_s")
    yield _row("**node**: one hour's retention × 3 replicas, TB", "node_retention_tb")


DATAPATH: tuple[Block, ...] = (When("datapath_inline_mb_s", (
    "## The data path at GPU rates (`python -m bench.datapath`)",
    "No engine: SmolLM2-135M's hidden states (HF transformers on the demo prompts, the EAGLE-3 default layers, "
    "bfloat16, {datapath_row_bytes} bytes a token) replayed as {datapath_requests} requests of 256–2,048 tokens "
    "({datapath_gb_per_round} GB a round) through the connector's real send path in a process of its own "
    "(`BlockSender`, fed whenever its in-flight budget has room, as vLLM's worker does; the connector's defaults: "
    "byteplane-zstd level 1, 1 MiB blocks inline and 8 MiB by reference, 2 compression threads, 512 MiB in flight), into a real `hsx sink` writing "
    "`--dataset-codec byteplane-zstd` shards to local disk. Three transports, {datapath_rounds} rounds interleaved "
    "(each goes first once in three), each round with a new broker and S3 server (reused, they cost more with every round) and fresh topics, dataset and staging place: **inline** (block "
    "records on the embedded broker), **by reference on S3** (`--payload-store s3://…`, SeaweedFS on loopback) and "
    "**by reference on a directory** (`--payload-store DIR`). Every process is a new one each round, so each round "
    "first sends {datapath_warm_up_gb} GB of requests of its own the whole way (about the connector's in-flight "
    "budget: each process grows its heap to hold what is in flight, a one-off a long-running service pays once; "
    "`--warm-up-gib 0` measures from cold). Timed from the first measured request submitted to the sink's "
    "last ready event; CPU is each process's user + system time over that window; Kafka bytes are every record on "
    "the blocks and ready topics (key, value, headers) of the measured requests, read back after the round. "
    "Medians over rounds.",
    Table(HEADER, _measured),
    "**At GPU rates.** One H200 prefilling Qwen3-8B at 27,000 tokens/s with 4 layers × 4,096 bfloat16 (32 KiB a "
    "token) makes {datapath_h200_mb_s} MB/s of hidden states; a node has {datapath_gpus_per_node} of them. Cores "
    "are CPU-seconds per GB × 0.885 GB/s; the broker's bandwidth is Kafka bytes per hidden-state byte × 885 MB/s "
    "(by reference an upper bound: a manifest's token ids weigh 7× less against Qwen3-8B's 32 KiB rows than "
    "against SmolLM2's 4.5 KiB), replicated 3 times, kept one hour.",
    Table(("one H200 at 885 MB/s", *HEADER[1:]), _extrapolated),
    Bullets((
        "Inline, the brokers carry every compressed hidden-state byte three times and keep an hour of it: "
        "{datapath_inline_node_retention_tb} TB per node. By reference they carry manifests: "
        "{datapath_s3_node_retention_tb} TB per node, and the sink's lag is no longer bounded by Kafka's retention "
        "(staged objects wait in the object store, swept after `--staged-max-age`).",
        "**Where the CPU goes, and what changed (#37).** A `perf record -g -p <sink>` of a 0.5 GiB directory "
        "round before these changes put 24 % of the sink's samples in `clear_page_erms` and 6 % more in page-fault "
        "handling (each staged object read into a fresh buffer, each inline sample's records joined into one), 22 % "
        "in `copy_folio_from_iter_atomic` (the shard's write into the page cache), about 15 % in decoding every "
        "block to verify its CRC of the raw bytes, 3.5 % in CRC32. Since: block records carry a CRC of their "
        "payload as sent, which the sink checks instead of decoding (readers check both); an inline sample kept "
        "as its records came is written record by record, never joined; a by-reference sample from a directory "
        "is read once into a reused buffer to be verified and then copied into its shard from the staged file "
        "by the kernel (`copy_file_range`; since, read into the direct writer's buffer: below), so the sink "
        "holds none of its bytes; the connector splits byte planes by word shifts into a reused buffer (encode "
        "2.20 -> 1.04 CPU-s/GB alone). Side by side on this "
        "machine (`python -m bench.datapath --rounds 2`, the tree before in a fresh clone, then after): sink "
        "CPU-s/GB inline 2.87 -> 1.35, S3 2.56 -> 2.17, directory 1.71 -> 0.65 (its RSS peak 896 -> 303 MiB); "
        "connector 2.26 / 2.42 / 1.77 -> 2.05 / 2.40 / 1.70; path 5.13 / 4.98 / 3.48 -> 3.40 / 4.58 / 2.34. "
        "Then a profile of the connector side (`perf record -g -p <connector side>`, the data window only) put "
        "31-41 % of its CPU in `gc_collect_main` and 8-13 % more in `visit_decref`/`visit_reachable`: Python's "
        "collector making full passes over torch's objects, set off by the sender's per-block objects. vLLM's "
        "EngineCore freezes its heap after startup, but a tensor-parallel rank in a process of its own is never "
        "frozen: the connector's sending rank now calls vLLM's `freeze_gc_heap()` once its sender exists, and this "
        "benchmark's connector side does the same. Connector CPU-s/GB in the published run before, 2.67 / 2.73 / "
        "1.86 (inline / S3 / directory), in this one {datapath_inline_cpu_s_per_gb_connector} / "
        "{datapath_s3_cpu_s_per_gb_connector} / {datapath_directory_cpu_s_per_gb_connector}. "
        "What is left: encoding alone is 0.75-0.9 CPU-s/GB here (zstd's Huffman coder on the exponent plane 0.49, "
        "the plane split 0.14), so the connector's target needs the rest of the send path near zero (inline, 20 % "
        "of the connector side is the kernel zeroing fresh heap pages for the records in flight); by reference on "
        "S3 each staged object is fetched into fresh memory and held until its shard is written (since, on a "
        "directory dataset, streamed into its shard's file at once: below). The connector's target of "
        "at most 1 CPU-second per GB, and so the path's of 2, are not met on this machine: compare the "
        "transports here, not the absolute figures.",
    )),
)), When("direct_write_direct_cpu_s_per_gb", (
    "**Shards around the page cache** (`python -m bench.direct_write`). After the changes above, a "
    "`perf record -g -p <sink>` of an S3 round put 57 % of the sink's samples in `copy_folio_from_iter_atomic`: "
    "the shard's buffered write copying into page-cache pages the kernel must find for the new file. On these "
    "virtual machines a fresh page is dear (freed guest memory seems to go back to the host), so the same "
    "write cost 0.26 to 12.8 CPU-s per GB from one run to the next. A local shard is now written with "
    "`O_DIRECT` from one reused 8 MiB aligned buffer (`hsx.dataset.storage.direct_file`; a file system that "
    "refuses it is written through the cache), and a sample left in its staged file is read straight into that "
    "buffer. Interleaved runs of `bench.datapath --rounds 3 --gib 0.25`, two each, before -> after: sink CPU-s "
    "per GB by reference on S3 5.71 / 5.64 -> 1.07 / 1.11, on a directory 0.66 / 0.74 -> 0.48 / 0.48, inline "
    "0.96 / 1.03 -> 0.88 / 0.88; S3 MB/s 56 / 57 -> 76 / 77; the sink's peak RSS +3-8 MiB. One process per way "
    "writes {direct_write_gb_per_round} GB through `LocalStorage.open_atomic` in 1 MiB writes, "
    "{direct_write_rounds} rounds interleaved: through the page cache {direct_write_cached_cpu_s_per_gb} CPU-s "
    "per GB ({direct_write_cached_mb_s} MB/s, the fsync included), around it {direct_write_direct_cpu_s_per_gb} "
    "({direct_write_direct_mb_s} MB/s). A reader on the same machine reads a fresh shard from the disk once.",
    "**Open shards streamed to their file** (`hsx.dataset.spool`). A sample used to wait in its open shard "
    "until the shard closed (here: 1 s idle, so a round's samples were one shard), so a new sink grew its heap "
    "by the round's bytes, and on this virtual machine a fresh page costs several times more in some rounds "
    "than in others (`perf record -a -g` over four inline rounds of 0.75 GiB: in a slow round 370 of the "
    "sink's 825 samples were `clear_page_erms`, in a fast one none were in the top). On a directory dataset a "
    "shard whose samples hold more than `--spool-after-bytes` (64 MiB) of memory now streams to its temp file "
    "around the page cache as its samples join, from an offset that keeps room for the header and token ids written when it closes "
    "(safetensors allows a header padded with spaces); a sample leaves memory once its bytes are in the file, "
    "so a disk error loses nothing (the shard is then written the held way, reading back what was streamed). "
    "Interleaved runs of `bench.datapath --rounds 3 --gib 0.5`, two each, before -> after, medians of 3 "
    "rounds: sink CPU-s per GB inline 2.44 / 1.01 -> 0.79 / 0.84 (its rounds 0.95, 6.62, 2.44 and 1.01, 0.99, "
    "2.71 -> 0.75, 0.79, 1.69 and 0.83, 0.84, 0.90), S3 1.12 / 1.19 -> 1.01 / 0.99, directory 0.50 / 0.50 -> "
    "0.51 / 0.61; sink peak RSS inline 686 / 692 -> 463 / 471 MiB, S3 678 / 678 -> 443 / 453 (the rest is the "
    "process itself, about 320 MiB with torch, then librdkafka's prefetch or obstore's buffers); inline MB/s "
    "85 / 154 -> 138 / 138; the connector side unchanged (2.38 / 2.13 -> 2.37 / 2.31 inline). Capping the "
    "sink's librdkafka prefetch at its 64 MiB default (it is a quarter of `--max-buffer-bytes`, 512 MiB) "
    "changed neither its RSS nor its CPU beyond noise (inline 1.17 / 1.08 -> 2.51 / 2.02 in a noisier hour): "
    "not kept. Samples by reference from a directory stay in their staged files and hold no memory, so "
    "their shards are written when they close, as before: streaming them too cost the sink a little (three "
    "interleaved pairs, directory only: 0.62 / 0.62 / 0.68 -> 0.64 / 0.77 / 0.72 CPU-s per GB). "
    "In the table's run the sink's rounds were, inline {datapath_inline_cpu_s_per_gb_sink_rounds!s}, "
    "S3 {datapath_s3_cpu_s_per_gb_sink_rounds!s}, directory {datapath_directory_cpu_s_per_gb_sink_rounds!s}; "
    "the connector side's {datapath_inline_cpu_s_per_gb_connector_rounds!s} / "
    "{datapath_s3_cpu_s_per_gb_connector_rounds!s} / {datapath_directory_cpu_s_per_gb_connector_rounds!s}. "
    "Each round now has a broker and an S3 server of its own, and its rounds agree. Reused, they cost more with "
    "every round (two whole runs at the same code, minutes apart: the broker 2.7 CPU-s per GB of the first "
    "inline round, 12-13 of the later ones, at 82-92 MB/s instead of 212; SeaweedFS 13.1 -> 14.2 -> 15.5, the "
    "connector side staging to it 2.76 -> 4.56 -> 5.21): what earlier pages put down to dear hours on this "
    "machine, the S3 sink's 2.5-3.5 in whole runs against 0.9 in S3-only ones among them, was mostly the round's "
    "place in the run. Still, compare transports and side-by-side figures, not runs of different hours.",
    "**The connector side's CPU.** `perf record -a -g` over an inline round of 2 GiB "
    "(connector side 2.72 CPU-s per GB, 0.53 of it system time): of its user-space samples, Python's interpreter "
    "32 %, zstd 29 % (Huffman coding and histograms of the planes' literals), numpy 13 % (the plane split), "
    "librdkafka 8 % (its copy and CRC-32C of each record), ISA-L's CRC-32 6 %, pydantic 5 %; in the kernel, "
    "zeroing fresh pages (`clear_page_erms`). Those pages are the process growing once to hold the records its "
    "in-flight budget allows (512 MiB raw, librdkafka's copies of about 370 MB of records): 110,399 minor faults "
    "(431 MiB) against an RSS growth of 458 MiB, so no buffer is faulted in twice. A long-running connector pays "
    "that once; this benchmark's connector side is a new process every round, so every round pays it. Keeping "
    "freed memory (the sink's malloc policy) in the connector changed nothing (three interleaved pairs of "
    "`--transports inline --gib 2`: 2.22 / 2.31 / 2.16 -> 2.37 / 2.18 / 2.07): not applied. A block record now "
    "stays in the pieces it was encoded in (its framing, then each segment as zstd returned it) until it is "
    "sent: by reference the staged object is written piece by piece instead of joined first, inline it is "
    "joined on the compression pool, and the manifest's block entry comes from the header just built instead "
    "of being parsed back out of the record: encoding a by-reference block, one thread, SmolLM2's demo "
    "samples cut as the connector cuts them, 1.064 -> 0.970 CPU-s per GB (medians of five interleaved runs); "
    "in `bench.datapath` within its noise (inline 2.04 / 2.10 -> 2.11 / 2.02, S3 2.71 / 2.51 -> 2.86 / 2.77). "
    "On a directory store the staged object is written through the page cache, and in the hours when this "
    "machine's fresh pages are dear the connector side's directory figure rose to 4-9 CPU-s per GB, half of its "
    "samples in `copy_folio_from_iter_atomic`. Written around the cache (`O_DIRECT`, as shards are), three "
    "interleaved pairs of `--transports directory --gib 1` in a quiet hour: connector side 1.71 / 1.77 / 1.78 "
    "-> 1.71 / 1.72 / 1.67 (system 0.44 -> 0.32), but the sink, which then read each staged object from the "
    "disk through the cache, 0.40 / 0.40 / 0.45 -> 0.57 / 0.58 / 0.54. So the sink now reads a staged object "
    "around the cache too: to verify it, into a reused page-aligned buffer; into its shard, through a second "
    "aligned buffer (`DirectFile.fill_from`). Both together, three interleaved pairs of the same: connector side "
    "6.90 / 1.99 / 1.80 -> 1.73 / 1.86 / 1.75 (the first pair's before fell in a dear hour), sink 0.75 / 0.46 / "
    "0.45 -> 0.40 / 0.42 / 0.41 (system 0.53 / 0.27 / 0.28 -> 0.11 / 0.12 / 0.11), MB/s 145 / 283 / 290 -> 272 / "
    "233 / 242 (each staged byte now read from the disk twice). By reference on S3 the sink's figure depended on "
    "what ran before it: in runs of S3 rounds alone (`--transports s3 --gib 1`, six in a row) it was 0.86-0.94 "
    "CPU-s per GB (system 0.22-0.34), in two runs of the whole benchmark the same hour 2.0-3.0 (system 1.9-2.2, "
    "SeaweedFS's system time doubled too): the broker and S3 server were shared by all of a run's rounds (now "
    "each round has its own: above). What encoding is made of (one thread, SmolLM2's demo samples, 1 MiB blocks): the split 0.1-0.2 "
    "CPU-s per GB, zstd on the exponent plane 0.45-0.56 (to 42-54 % of its size), the two CRC-32s 0.12, and "
    "zstd on the low byte plane 0.21 for nothing: that plane is noise, zstd (tuned for planes) leaves it at "
    "99.98 % of its size in the blocks of this benchmark and at 100.02 % in blocks cut per sample (so it was "
    "stored raw, after the work; an earlier note here said 89.8 %, a measurement error). Now zstd first tries a "
    "plane's first 64 KiB and stores the plane raw unless that saves 5 % (`hsx.codecs.segments.MIN_SAVING`), "
    "the split writes each plane straight from the shift (no word-sized temporary: 0.14 -> 0.07 CPU-s per GB "
    "in cache), and an inline block is framed straight into its record (its raw planes were copied into pieces "
    "first, then joined). Encoding a block, one thread, minimum of seven: 1.210 / 1.216 -> 1.078 / 1.128 CPU-s "
    "per GB, 0.7100 -> 0.7101 of the raw bytes. In `bench.datapath`, three interleaved pairs of all transports "
    "at 0.75 GiB, connector side inline 2.40 / 2.87 / 2.86 -> 2.44 / 2.38 / 2.70, S3 2.90 / 3.23 / 3.32 -> 2.75 "
    "/ 2.96 / 3.07, directory 2.06 / 2.22 / 2.26 -> 2.01 / 2.16 / 2.11. What the connector side spends beside "
    "encoding: with the codec `none` (no split, no zstd) it was still 1.23 CPU-s per GB on a directory and 1.65 "
    "inline (one round, this hour), in copies (`memmove` 17 % of its samples), the kernel's thread switches "
    "(`finish_task_switch` and wake-ups, 19 %: compression pool, stager, poller, GIL hand-offs) and Python (22 "
    "%). One compression thread instead of two, two pairs: inline 2.38 -> 2.09 / 2.25, directory 1.86 -> 1.79 "
    "/ 1.79; 4 MiB blocks instead of 1 MiB, two pairs: directory 1.81 -> 1.67 / 1.72, S3 2.54 -> 2.62 / 2.46: "
    "neither is the missing CPU-second. Blosc2 (4.15, one thread) on the same blocks: shuffle + zstd 1 1.83 "
    "CPU-s per GB to 71.6 %, bitshuffle + LZ4 0.57 to 84.0 %, against hsx's 1.00 to 71.0 %: no better codec "
    "there.",
)), When("encode_floor_byteplane_zstd_1_threads_cpu_s_per_gb", (
    "**The connector side's floor** (`python -m bench.encode_floor`). The least the connector side can spend with "
    "its codec: the hidden states above as requests of 1,024 tokens in 8 MiB blocks, "
    "each request's blocks encoded and written in order, around the page cache, by the stager's own writer to a "
    "directory store, by one or two threads that each do all of their own requests' work, and nothing else (no "
    "Kafka, no manifest, no completion report, no hand-off between threads); {encode_floor_gb_per_round} GB a "
    "round, {encode_floor_rounds} rounds interleaved: byteplane-zstd "
    "{encode_floor_byteplane_zstd_1_threads_cpu_s_per_gb} CPU-s per GB on one thread, "
    "{encode_floor_byteplane_zstd_2_threads_cpu_s_per_gb} on two; codec `none` "
    "{encode_floor_none_1_threads_cpu_s_per_gb} / {encode_floor_none_2_threads_cpu_s_per_gb}. So on this machine "
    "the connector side's target (at most 1.0 CPU-s per GB) is below what encoding and writing alone cost with "
    "byteplane-zstd: in perf of that floor (one thread, 1 MiB blocks) zstd's Huffman coding of the exponent plane "
    "and its histograms were 36 % of the samples, the plane split 13 % (most of it the first read of the rows from "
    "memory: in cache the split costs 0.09 CPU-s per GB), copies 8 %, CRC-32 4 %, the kernel 10 %, Python 15 %. "
    "Sending raw instead (codec `none` on the wire, the sink compressing into the byteplane-zstd dataset), one "
    "round each with 1 MiB blocks: connector side 1.06 (directory) / 1.97 (S3) CPU-s per GB, but sink 2.62 / "
    "2.54 and path 3.67 / 4.51, against 2.2 / 3.2 with byteplane-zstd on the wire: the bytes are compressed "
    "cheapest where they are first read, in the connector, and the wire codec stays. Blocks by reference are "
    "8 MiB since (`hsx.schemas.connector.STAGED_BLOCK_BYTES`; inline they stay 1 MiB, a Kafka record each): every "
    "block is a piece of work handed from the compression pool to the stager, with its own header, checksums and "
    "zstd frames. One round each, connector side with 1 MiB blocks 1.88 / 1.83 (directory) and 2.59 / 2.40 (S3), "
    "with 8 MiB 1.63 / 1.52 and 2.38 / 2.24; 4, 16 and 32 MiB within the noise of 8. perf of the connector side "
    "over a directory round's measured window, 1 MiB -> 8 MiB blocks: zstd 25.6 -> 29.3 % of the samples, the "
    "kernel's thread switches (`finish_task_switch` and the wake-ups' unlocks) 13.3 -> 9.0 %, Python's "
    "interpreter 17.5 -> 13.1 %, libc (`memmove`) 12.2 -> 11.4 %, numpy 10.4 -> 11.4 %. Since these figures, by "
    "reference the stager's thread encodes each block of its attempt where it writes it (no compression pool and "
    "no hand-off; a transfer holds one encoded block at a time): two interleaved pairs of directory and S3 "
    "rounds, connector side 1.425 / 1.523 -> 1.413 / 1.474 (directory) and 2.149 / 2.211 -> 2.113 / 2.199 (S3) "
    "CPU-s per GB, within the noise. For a raw dataset (the sink's default) the sink decompresses what the "
    "connector compressed; with `--codec none` on the wire instead (one round each, `--dataset-codec raw`): "
    "directory connector side 1.28 -> 0.80, sink 1.49 -> 1.00, path 2.76 -> 1.79 CPU-s per GB; S3 path 3.91 -> "
    "3.10 at 106 -> 91 MB/s. `hsx run` stages so in its own folder (docs/operations.md says when services should).",
)), When("upload_signing_signed_cpu_s_per_gb", (
    "**Signing uploads** (`python -m bench.upload_signing`). SigV4 hashes a request's body (SHA-256) unless it "
    "says `UNSIGNED-PAYLOAD`. hsx sends unsigned payloads over TLS, which protects them in transit, with its own "
    "CRCs end to end, and signed ones over plain HTTP (`AWS_UNSIGNED_PAYLOAD` decides where set). One process "
    "uploading the same random bytes through `S3Storage.open_atomic` in 1 MiB writes (as the connector stages and "
    "the sink writes shards) to the local SeaweedFS, {upload_signing_gb_per_round} GB a round, "
    "{upload_signing_rounds} rounds interleaved: signed {upload_signing_signed_cpu_s_per_gb} CPU-s per GB uploaded, "
    "unsigned {upload_signing_unsigned_cpu_s_per_gb}. The rounds above run over loopback HTTP, so they pay the "
    "signing: over TLS the connector side saves about {upload_signing_saved_cpu_s_per_gb} CPU-s per GB it stages "
    "(and pays TLS's encryption instead), as does a sink writing its dataset to S3.",
)), When("memory_policy_keep_cpu_s_per_gb", (
    "**Fresh pages** (`python -m bench.memory_policy`). The kernel faulting in and zeroing fresh pages "
    "(`clear_page_erms`, page faults) is the largest kernel item in the profiles above: glibc maps each buffer "
    "past its mmap threshold on its own and trims freed memory back, so each record, staged object or decoded "
    "sample lands on fresh pages. The sink now keeps freed memory for reuse "
    "(`hsx.runtime.memory.keep_freed_memory`: buffers up to 32 MiB from the heap, trimmed only past its "
    "`--max-buffer-bytes`; resident memory stays at its high-water mark, which the budget bounds) instead of "
    "mapping each buffer over 128 KiB on its own. Interleaved pairs of `bench.datapath --rounds 1 --gib 0.25` "
    "(after a warm-up round, 3 pairs): sink CPU-s/GB inline 1.14 / 1.22 / 1.18 -> 0.96 / 0.85 / 0.99 (kernel "
    "0.88 / 0.85 / 0.77 -> 0.63 / 0.63 / 0.59), S3 and directory unchanged within noise, sink RSS peak +8-10 MiB. "
    "The same policy in the connector's sending process did not pay in rounds this short (connector inline "
    "2.43 / 2.10 / 2.25 -> 2.58 / 2.39 / 2.47: it grew its heap to a higher mark, 240 MiB against 105-235): "
    "not applied. One process per policy copies 1 MiB buffers through a 64 MiB window, "
    "{memory_policy_gb_per_round} GB a round, {memory_policy_rounds} rounds interleaved, CPU-s per GB (of which "
    "system; page faults per GB): glibc's defaults {memory_policy_default_cpu_s_per_gb} "
    "({memory_policy_default_system_s_per_gb}; {memory_policy_default_faults_per_gb}), each buffer mapped on "
    "its own (the sink's policy before) {memory_policy_mapped_cpu_s_per_gb} ({memory_policy_mapped_system_s_per_gb}; "
    "{memory_policy_mapped_faults_per_gb}), reused {memory_policy_keep_cpu_s_per_gb} "
    "({memory_policy_keep_system_s_per_gb}; {memory_policy_keep_faults_per_gb}). Since, the policy also keeps "
    "every thread on glibc's main arena (`M_ARENA_MAX` 1), set before the sink's clients start their threads: a "
    "thread's own arena is made of 64 MiB heaps that glibc unmaps as soon as they are empty, whatever the trim "
    "threshold, so an object store client's thread taking 8 buffers of 20 MiB, freed by another thread, faulted "
    "in 100 MiB afresh every round (25,602 faults; 0 on the main arena: `tests/unit/test_memory_policy.py`). Two "
    "interleaved pairs of the whole `bench.datapath --rounds 1 --gib 0.75`, in a quiet hour: sink S3 0.91 / 0.93 "
    "-> 0.99 / 0.90, inline 0.71 / 0.75 -> 0.75 / 0.76, directory 0.43 / 0.44 -> 0.42 / 0.41 CPU-s per GB, RSS "
    "and MB/s unchanged: no cost, and the fresh pages it removes are the dear ones of the other hours.",
)),)
