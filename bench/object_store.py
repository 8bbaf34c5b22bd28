"""``python -m bench.object_store [--quick]``: a dataset in an S3-compatible
object store against the same dataset on local disk (issue 15), every figure a
ratio of two sides measured in one run.

The object store is SeaweedFS on loopback (:func:`hsx.local.s3server.dev_s3`, or
the service ``HSX_TEST_S3_ENDPOINT`` names), its data on the same disk as the
local side's temp directory. Hidden states are bfloat16, 4 layers x 2,048
(16 KiB a token), random bytes (nothing compresses them).

* **Sink throughput**: one blocks topic on the embedded broker (or
  ``HSX_KAFKA_BOOTSTRAP``) holds the workload once, the block records a
  connector would produce without an engine (1 MiB blocks, codec ``none``, so
  that the sink's own work per byte is smallest and the storage's share
  largest); samples of 256-1,024 tokens (4-16 MiB). ``hsx sink --output DIR``
  and ``hsx sink --output s3://...`` each consume all of it, a fresh consumer
  group and a fresh dataset per round, sides alternating first, 8 samples to
  a shard; timed from the sink's first assignment to its last ready event
  (``/metrics`` polled every 50 ms). MB/s of hidden states, median round.
* **One random sample**: ``open_dataset(...)[request_id]`` on the datasets the
  last round wrote, random samples, both storages in turn: *cold*, a shard
  handle opened for the sample (an object store: its header, then the
  sample's tensors in one round of ranged reads), and *warm*, another sample
  of a shard already open (one round of ranged reads). The sample's hidden
  states are copied once (a local shard is memory-mapped: this reads its
  pages); the page cache is warm on both sides. Median of many.
* **A 1 GiB shard** (``--quick``: 128 MiB), in a process of its own per side:
  the open shard (64 samples of 1,024 tokens) built in memory, then
  :func:`hsx.dataset.shards.write_shard` to S3 (``--upload-part-bytes`` default
  16 MiB) and to disk; peak RSS during the write (``VmHWM``, reset just before
  it) minus RSS before it, and the write's MB/s. Then the shard read back
  sequentially in a fresh process, ``open_dataset`` iteration (64 MiB windows
  of coalesced ranged reads on S3, memory-mapped on disk, each sample copied
  once), beside one whole-object read of the same shard (a GET; the file read
  whole): GB/s, rounds interleaved.

Figures merge into ``bench/results.json`` as flat ``object_store_*`` keys, and
``docs/benchmarks.md`` is rendered again.

    python -m bench.object_store [--quick] [--out F] [--doc F]
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.sink_scale import standalone
from hsx.codecs.block import encode_block, read_header
from hsx.dataset.storage.s3 import UPLOAD_CONCURRENCY, DEFAULT_PART_BYTES as PART_BYTES
from hsx.local.broker import dev_bootstrap
from hsx.local.commands import sink_command
from hsx.local.s3server import LocalS3, dev_s3
from hsx.local.s3service import S3Service
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka import make_producer
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import BlockRef, Codec, DType, Manifest, SourceRef
from hsx.schemas.blocks import BlockRecordHeaders, RecordKind

LAYERS = 4
HIDDEN = 2048
ROW = LAYERS * HIDDEN * 2  # bytes of one token's hidden states (bfloat16)
BLOCK_TOKENS = (1 << 20) // ROW  # 1 MiB blocks, as the connector cuts them
PER_SHARD = 8
READY = "hsx_sink_ready_events_total"
REBALANCES = "hsx_sink_rebalances_total"
BUCKET_PREFIX = "hsx-bench-"


# -- the workload ------------------------------------------------------------------------------


def manifest(request_id: str, tokens: int, refs: list[BlockRef], offset: int, attempt: str) -> Manifest:
    return Manifest(request_id=request_id, attempt_id=attempt, model="bench-object-store",
                    layer_ids=list(range(LAYERS)), dtype=DType.BFLOAT16, hidden_size=HIDDEN, num_tokens=tokens,
                    token_ids=[(offset + k) % 50_000 for k in range(tokens)], codec=Codec.NONE, blocks=refs,
                    source=SourceRef(topic="bench", partition=0, offset=offset))


def publish_workload(kafka: KafkaSettings, topic: str, samples: int, seed: int = 0) -> tuple[int, list[int]]:
    """Block records and manifests of ``samples`` requests on ``topic``; returns
    the hidden-state bytes and each sample's token count. Block ``i`` of every
    request holds the same random bytes (one pool), encoded once."""
    rng = random.Random(seed)
    lengths = [BLOCK_TOKENS * rng.randint(4, 16) for _ in range(samples)]
    pool = memoryview(np.random.default_rng(seed).bytes(max(lengths) * ROW))
    encoded: dict[int, tuple[bytes, BlockRef]] = {}
    producer = make_producer(kafka)
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    def produce(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered)
                return
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.2)

    for i, tokens in enumerate(lengths):
        request_id = f"os-{i:05d}"
        refs = []
        attempt = uuid.uuid4().hex
        for index, start in enumerate(range(0, tokens, BLOCK_TOKENS)):
            if start not in encoded:
                value = encode_block(pool[start * ROW:(start + BLOCK_TOKENS) * ROW], shape=(BLOCK_TOKENS, LAYERS, HIDDEN),
                                     dtype=DType.BFLOAT16, token_start=start, codec=Codec.NONE)
                header, _ = read_header(value)
                encoded[start] = value, BlockRef(index=index, token_start=start, token_end=header.token_end,
                                                 checksum=header.checksum, compressed_nbytes=len(value))
            value, ref = encoded[start]
            refs.append(ref)
            produce(request_id.encode(), value, BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=attempt,
                                                                    block_index=index, codec=Codec.NONE).to_kafka())
        produce(request_id.encode(), manifest(request_id, tokens, refs, i, attempt).model_dump_json().encode(),
                BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=attempt).to_kafka())
        producer.poll(0)
    if producer.flush(300) != 0 or failed:
        raise RuntimeError(f"publishing the workload failed: {failed[:3]} ({len(failed)} records)")
    return sum(lengths) * ROW, lengths


# -- 1. sink throughput ------------------------------------------------------------------------


def sink_round(kafka: KafkaSettings, topics: TopicSettings, output: str, samples: int, env: dict[str, str],
               work: Path, name: str) -> float:
    """One ``hsx sink`` over the whole topic into ``output``: seconds from its
    first assignment to its last ready event."""
    command = sink_command(kafka.bootstrap, topics, output, "--max-shard-samples", str(PER_SHARD),  # type: ignore[arg-type]
                           "--flush-when-idle", "1", group=f"{name}-{topics.blocks}")
    sink = HsxService(name, command, work, env=env)
    deadline = time.monotonic() + 600
    with sink:
        assigned = None
        while True:
            if sink.exited() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} exited or stalled ({sink.exited()}):\n{sink.log_tail()}")
            if assigned is None:
                if sink.metric(REBALANCES, labelled=True) >= 1:
                    assigned = time.perf_counter()
                else:
                    time.sleep(0.01)
                continue
            if sink.metric(READY) >= samples:
                done = time.perf_counter()
                break
            time.sleep(0.05)
        if sink.stop() != 0:
            raise RuntimeError(f"{name} did not stop cleanly:\n{sink.log_tail()}")
    return done - assigned


def warm_up(url: str) -> None:
    """An untimed 64 MiB object written and deleted: a SeaweedFS bucket takes its
    volumes at the first write, which the first timed round would otherwise pay."""
    from hsx.dataset.storage import open_storage

    storage = open_storage(url, create=True)
    with storage.open_atomic("warm-up") as out:
        for _ in range(4):
            out.write(os.urandom(16 << 20))
    storage.delete("warm-up")


# -- 2. one random sample ----------------------------------------------------------------------


def touch(sample: dict[str, Any], into: torch.Tensor) -> int:
    """Copy the sample's hidden states into ``into`` (reading a memory-mapped
    shard's pages); returns the bytes."""
    flat = sample["hidden_states"].reshape(-1).view(torch.uint8)
    into[:flat.numel()].copy_(flat)
    return int(flat.numel())


def random_samples(datasets: dict[str, str], picks: int, seed: int = 1) -> dict[str, dict[str, list[float]]]:
    """Seconds of ``open_dataset(...)[request_id]`` (plus the copy), cold and warm,
    per side; both sides read the same samples, in alternating order."""
    from hsx.dataset.reader import ShardHandles, open_dataset

    opened = {side: open_dataset(url) for side, url in datasets.items()}
    ids = opened["disk"].request_ids()
    if sorted(opened["s3"].request_ids()) != sorted(ids):
        raise RuntimeError(f"the S3 dataset holds {len(opened['s3'])} samples, the disk one {len(ids)}")
    by_shard: dict[str, list[str]] = {}
    for rid in ids:
        by_shard.setdefault(opened["disk"].event(rid).shard, []).append(rid)
    rng = random.Random(seed)
    buffer = torch.empty(max(opened["disk"].event(r).num_tokens for r in ids) * ROW, dtype=torch.uint8)
    times: dict[str, dict[str, list[float]]] = {side: {"cold": [], "warm": []} for side in datasets}
    sides = list(datasets)
    for k in range(picks):
        first = rng.choice(ids)
        second = rng.choice(by_shard[opened["disk"].event(first).shard])
        for side in sides if k % 2 == 0 else sides[::-1]:
            ds = opened[side]
            ds.shards = ShardHandles(ds.storage)  # no shard open: the first read opens its handle
            for kind, rid in (("cold", first), ("warm", second)):
                start = time.perf_counter()
                touch(ds[rid], buffer)
                times[side][kind].append(time.perf_counter() - start)
    return times


# -- 3. a 1 GiB shard, in processes of their own -----------------------------------------------


def proc_status(key: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` memory figure (``VmRSS``, ``VmHWM``...) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peak:
    """Peak RSS over a block, minus RSS at its start: ``VmHWM`` reset just before
    (``/proc/self/clear_refs``), or RSS sampled every 2 ms where that is refused."""

    def __enter__(self) -> Peak:
        gc.collect()
        self.before = proc_status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm = proc_status("VmHWM") <= self.before + (1 << 20)
        except OSError:
            self.hwm = False
        self._stop = threading.Event()
        self._sampled = self.before
        # Only where the kernel keeps no peak: reading /proc every 2 ms costs the
        # measured process CPU (12 % of the connector side's Python time in bench.datapath).
        self._thread = None if self.hwm else threading.Thread(target=self._sample, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, proc_status("VmRSS"))

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        peak = proc_status("VmHWM") if self.hwm else self._sampled
        self.growth = max(0, peak - self.before)


def child_write(url: str, shard_bytes: int) -> dict[str, Any]:
    """Build an open shard of ``shard_bytes`` of hidden states (1,024-token
    samples), then ``write_shard`` it to ``url`` as the sink does."""
    from hsx.dataset.sample import Sample
    from hsx.dataset.shards import OpenShard, write_shard
    from hsx.dataset.storage import open_storage
    from hsx.runtime.memory import keep_freed_memory
    from hsx.sink.options import SinkOptions

    keep_freed_memory(SinkOptions.max_buffer_bytes)  # as the sink does at its start
    storage = open_storage(url, create=True)
    tokens = 1024
    rng = np.random.default_rng(2)
    shard = OpenShard("bench.hidden_states.blocks", 0)
    for i in range(max(1, shard_bytes // (tokens * ROW))):
        # The checksum in the one block ref is not checked here; write_shard computes the sample's own.
        ref = BlockRef(index=0, token_start=0, token_end=tokens, checksum="crc32:00000000",
                       compressed_nbytes=tokens * ROW)
        m = manifest(f"big-{i:05d}", tokens, [ref], i, uuid.uuid4().hex)
        shard.add(Sample(m, rng.bytes(tokens * ROW), [i]))
    with Peak() as peak:
        start = time.perf_counter()
        write_shard(storage, "bench", shard)
        seconds = time.perf_counter() - start
    return {"shard_bytes": shard.nbytes, "rss_before": peak.before, "rss_growth": peak.growth, "write_s": seconds,
            "hwm": peak.hwm, "samples": len(shard.samples)}


def child_read(url: str) -> dict[str, Any]:
    """The dataset's shard read sequentially by ``open_dataset`` iteration, then
    the shard object read whole."""
    from hsx.dataset.reader import open_dataset

    ds = open_dataset(url)
    buffer = torch.empty(max(ds.event(r).num_tokens for r in ds.request_ids()) * ROW, dtype=torch.uint8)
    with Peak() as peak:
        start = time.perf_counter()
        nbytes = sum(touch(sample, buffer) for sample in ds)
        iterate_s = time.perf_counter() - start
    (shard,) = {ds.event(r).shard for r in ds.request_ids()}
    start = time.perf_counter()
    whole = len(ds.storage.read(shard))
    whole_s = time.perf_counter() - start
    return {"bytes": nbytes, "iterate_s": iterate_s, "rss_growth": peak.growth, "whole_bytes": whole,
            "whole_s": whole_s}


def in_child(kind: str, url: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.object_store", "--child", kind, url, *extra], env=env,
                         capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"bench.object_store --child {kind} {url} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the section -------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _remove_objects(service: S3Service, bucket: str) -> None:
    """Delete what this run wrote to an external S3 service (a local server's
    data directory goes with it)."""
    import obstore

    store = service.store(bucket)
    for page in obstore.list(store, None, chunk_size=1000):
        obstore.delete(store, [meta["path"] for meta in page])


def run(quick: bool) -> dict[str, object]:
    samples = 16 if quick else 48
    rounds = 1 if quick else 3
    picks = 30 if quick else 150
    shard_bytes = (128 if quick else 1024) << 20
    read_rounds = 1 if quick else 2
    results: dict[str, object] = {"object_store_quick": quick}
    started = time.monotonic()
    with dev_s3() as s3, dev_bootstrap() as bootstrap, tempfile.TemporaryDirectory(prefix="hsx-os-") as tmp:
        work = Path(tmp)
        bucket = f"{BUCKET_PREFIX}{uuid.uuid4().hex[:8]}"
        s3.create_bucket(bucket)
        os.environ.update(s3.environ())  # this process reads s3:// datasets too
        env = s3.child_environ(cpu_engine_env())
        results["object_store_server"] = "SeaweedFS (weed server -s3) on loopback" if isinstance(s3, LocalS3) \
            else f"{s3.endpoint} ({'HSX_TEST_S3_ENDPOINT'})"
        try:
            warm_up(f"s3://{bucket}/warm")

            # 1. the sink, both outputs, rounds interleaved
            kafka = KafkaSettings(bootstrap=bootstrap)
            topics = fresh_topics(kafka, partitions=1, prefix="bench.")
            t0 = time.monotonic()
            raw_bytes, lengths = publish_workload(kafka, topics.blocks, samples)
            print(f"[object_store] published {samples} samples, {raw_bytes / 2**20:.0f} MiB, in "
                  f"{time.monotonic() - t0:.1f}s", flush=True)
            seconds: dict[str, list[float]] = {"disk": [], "s3": []}
            outputs: dict[str, str] = {}
            for r in range(rounds):
                for side in ("disk", "s3") if r % 2 == 0 else ("s3", "disk"):
                    if side in outputs and side == "disk":
                        shutil.rmtree(outputs["disk"], ignore_errors=True)
                    outputs[side] = f"s3://{bucket}/sink-{r}" if side == "s3" else str(work / f"sink-{r}")
                    s = sink_round(kafka, topics, outputs[side], samples, env, work, f"sink-{side}-{r}")
                    seconds[side].append(s)
                    print(f"[object_store] round {r} {side}: {raw_bytes / s / 1e6:.0f} MB/s ({s:.2f}s)", flush=True)
            results.update({
                "object_store_sink_samples": samples, "object_store_sink_bytes": raw_bytes,
                "object_store_sink_rounds": rounds, "object_store_sink_samples_per_shard": PER_SHARD,
                "object_store_sink_sample_mib_min": round(min(lengths) * ROW / 2**20, 1),
                "object_store_sink_sample_mib_max": round(max(lengths) * ROW / 2**20, 1),
            })
            for side, values in seconds.items():
                results[f"object_store_sink_{side}_mb_s"] = round(raw_bytes / _median(values) / 1e6, 1)
                results[f"object_store_sink_{side}_mb_s_rounds"] = [round(raw_bytes / s / 1e6, 1) for s in values]
            results["object_store_sink_s3_vs_disk_ratio"] = round(
                _median([d / s for d, s in zip(seconds["disk"], seconds["s3"])]), 3)

            # 2. one random sample, from the datasets of the last round
            times = random_samples({"disk": outputs["disk"], "s3": outputs["s3"]}, picks)
            results["object_store_sample_picks"] = picks
            results["object_store_sample_mib_mean"] = round(statistics.mean(lengths) * ROW / 2**20, 2)
            for side, kinds in times.items():
                for kind, values in kinds.items():
                    results[f"object_store_sample_{side}_{kind}_ms"] = round(_median(values) * 1000, 2)
            for kind in ("cold", "warm"):
                results[f"object_store_sample_{kind}_s3_over_disk"] = round(
                    results[f"object_store_sample_s3_{kind}_ms"] / results[f"object_store_sample_disk_{kind}_ms"], 2)  # type: ignore[operator]
            print("[object_store] one sample, ms: " + ", ".join(
                f"{k.removeprefix('object_store_sample_')} {v}" for k, v in results.items()
                if k.startswith("object_store_sample_") and k.endswith("_ms")), flush=True)
            shutil.rmtree(outputs["disk"], ignore_errors=True)

            # 3. a 1 GiB shard: RSS of its write, then reading it back
            big = {"s3": f"s3://{bucket}/big", "disk": str(work / "big")}
            for side in ("s3", "disk"):
                w = in_child("write", big[side], env, str(shard_bytes))
                results[f"object_store_shard_{side}_write_rss_mib"] = round(w["rss_growth"] / 2**20, 1)
                results[f"object_store_shard_{side}_rss_before_mib"] = round(w["rss_before"] / 2**20, 1)
                results[f"object_store_shard_{side}_write_mb_s"] = round(w["shard_bytes"] / w["write_s"] / 1e6, 1)
                results[f"object_store_shard_{side}_peak_hwm"] = w["hwm"]
                results["object_store_shard_bytes"] = w["shard_bytes"]
                results["object_store_shard_samples"] = w["samples"]
                print(f"[object_store] {side}: write_shard of {w['shard_bytes'] / 2**20:.0f} MiB: peak RSS +"
                      f"{w['rss_growth'] / 2**20:.1f} MiB, {w['shard_bytes'] / w['write_s'] / 1e6:.0f} MB/s", flush=True)
            results["object_store_shard_write_s3_vs_disk_ratio"] = round(
                results["object_store_shard_s3_write_mb_s"] / results["object_store_shard_disk_write_mb_s"], 3)  # type: ignore[operator]
            results["object_store_s3_write_rss_mib"] = results["object_store_shard_s3_write_rss_mib"]
            results["object_store_s3_write_rss_over_shard"] = round(
                results["object_store_shard_s3_write_rss_mib"] / (shard_bytes / 2**20), 4)  # type: ignore[operator]
            results["object_store_upload_part_mib"] = PART_BYTES >> 20
            results["object_store_upload_bound_mib"] = (UPLOAD_CONCURRENCY + 1) * PART_BYTES >> 20
            reads: dict[str, list[dict[str, Any]]] = {"s3": [], "disk": []}
            for r in range(read_rounds):
                for side in ("s3", "disk") if r % 2 == 0 else ("disk", "s3"):
                    reads[side].append(in_child("read", big[side], env))
            for side, values in reads.items():
                results[f"object_store_read_{side}_gb_s"] = round(
                    _median([v["bytes"] / v["iterate_s"] / 1e9 for v in values]), 3)
                results[f"object_store_read_{side}_whole_gb_s"] = round(
                    _median([v["whole_bytes"] / v["whole_s"] / 1e9 for v in values]), 3)
                results[f"object_store_read_{side}_rss_mib"] = round(max(v["rss_growth"] for v in values) / 2**20, 1)
                results[f"object_store_read_{side}_vs_whole_ratio"] = round(
                    results[f"object_store_read_{side}_gb_s"] / results[f"object_store_read_{side}_whole_gb_s"], 3)  # type: ignore[operator]
            results["object_store_read_s3_vs_disk_ratio"] = round(
                results["object_store_read_s3_gb_s"] / results["object_store_read_disk_gb_s"], 3)  # type: ignore[operator]
            results["object_store_read_rounds"] = read_rounds
            print(f"[object_store] sequential read GB/s: s3 {results['object_store_read_s3_gb_s']} (whole GET "
                  f"{results['object_store_read_s3_whole_gb_s']}), disk {results['object_store_read_disk_gb_s']} "
                  f"(file read whole {results['object_store_read_disk_whole_gb_s']})", flush=True)
        finally:
            if not isinstance(s3, LocalS3):
                _remove_objects(s3, bucket)
    results["object_store_wall_s"] = round(time.monotonic() - started, 1)
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, url, *extra = sys.argv[2:]
        figures = child_write(url, int(extra[0])) if kind == "write" else child_read(url)
        print(json.dumps(figures))
        return
    out = standalone(__doc__, "smaller sizes, one round: a smoke check", run)
    figures = {k: v for k, v in json.loads(out.read_text()).items() if k.startswith("object_store_")}
    print("\n".join(f"{key:48} {value}" for key, value in figures.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
