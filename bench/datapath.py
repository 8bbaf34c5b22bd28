"""``python -m bench.datapath [--quick] [--rounds N]``: the data path at GPU
rates without an engine (issue 26): hidden states pushed through the
connector's real send path as fast as it takes them, a real ``hsx sink``
writing the shards, for each transport, rounds interleaved in one run.

* **Transports**: ``inline`` (block records on the embedded broker),
  ``s3`` (``--payload-store s3://...`` on the local SeaweedFS) and
  ``directory`` (``--payload-store DIR``, a local directory), each round
  with a new broker and S3 server (:func:`services`); every other setting
  alike: the connector's defaults (byteplane-zstd level 1, 1 MiB
  blocks inline and 8 MiB by reference, 2 compression threads, 512 MiB in flight), the sink writing
  ``--dataset-codec byteplane-zstd`` shards to local disk.
* **Load**: SmolLM2-135M's hidden states (HF transformers on the demo prompts,
  the EAGLE-3 default layers, bfloat16), replayed as requests of 256-2,048
  tokens, from a process of their own (the *connector side*): the gather's
  output handed to :class:`~hsx.extractor.connector.sender.BlockSender`
  whenever its in-flight budget has room, as vLLM's worker does.
* **Warmed up** first (``--warm-up-gib``, default 0.5: about the connector's
  in-flight budget): requests of their own go the whole way, and the round
  starts once the sink has made their ready events. Every process is a new one
  each round, and growing its heap to hold what is in flight is a one-off a
  long-running service pays once; ``--warm-up-gib 0`` measures from cold.
* **Timed** from the first request submitted to the sink's last ready event
  (read from the ready topic; polling the sink's ``/metrics`` would cost it
  CPU): hidden-state MB/s (raw bfloat16).
* **CPU-seconds per GB** of hidden states for each process over that window
  (user + system): connector side, broker (tansu), S3 server (SeaweedFS),
  sink. **Bytes through the broker**: every record on the blocks and ready
  topics (key, value, headers), read back after the round, per hidden-state
  byte and per token. **RSS**: the connector side's growth over its start
  (``VmHWM`` reset), the sink's and the S3 server's peak, the broker's growth
  (tansu keeps topics in memory: the round's retention).
* **Extrapolated** to one H200 (885 MB/s of hidden states, 27,000 tokens/s of
  Qwen3-8B with 4 layers x 4,096 bfloat16) and an 8 x H200 node, in
  ``docs/benchmarks.md`` with the arithmetic.

Figures merge into ``bench/results.json`` as ``datapath_*`` keys.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench.object_store import proc_status, warm_up
from bench.section import emit, parser

TRANSPORTS = ("inline", "s3", "directory")
LENGTHS = (256, 2048)
"""Tokens per request, uniformly at random."""
MODEL = "smollm2-135m-instruct"
BUCKET = "hsx-bench-datapath"
REBALANCES = "hsx_sink_rebalances_total"
H200_MB_S = 885.0
GPUS_PER_NODE = 8
REPLICATION = 3
RETENTION_H = 1.0


# -- the connector side (a process of its own) ---------------------------------------------------


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """Send the requests of ``spec["warm_up"]`` through a ``BlockSender``, say
    so (a ``warm`` file), and once the round's parent says go (a ``go`` file)
    every request of ``spec["plan"]``; returns the connector side's figures over
    the latter."""
    import safetensors.torch
    import zmq

    from bench.object_store import Peak
    from hsx.extractor.completion import CompletionSender
    from hsx.extractor.connector.sender import BlockSender
    from hsx.runtime.settings import KafkaSettings
    from hsx.schemas.connector import ConnectorConfig

    rows = safetensors.torch.load_file(spec["states"])["rows"]
    tokens, layers, hidden = rows.shape
    socket = zmq.Context.instance().socket(zmq.PULL)
    address = f"ipc://{spec['work']}/completions.sock"
    socket.bind(address)
    config = ConnectorConfig(completion_address=address, kafka_settings_file="unused", blocks_topic=spec["topic"],
                             model="bench-datapath", payload_store=spec["store"],
                             max_request_bytes=LENGTHS[1] * layers * hidden * 4)
    sender = BlockSender(config, KafkaSettings(bootstrap=spec["bootstrap"]), spec["layer_ids"],
                         CompletionSender(address))
    row_bytes = layers * hidden * rows.element_size()
    # As the connector does once its sender exists (HsxConnector.register_kv_caches, vLLM's freeze_gc_heap): the
    # collector's full passes skip torch's objects. Unfrozen, they were 40 % of this process's CPU.
    gc.collect()
    gc.freeze()
    me = psutil.Process()
    work = Path(spec["work"])
    with Peak() as peak:
        send_all(sender, socket, rows, spec["warm_up"], "wu", row_bytes)
        (work / "warm").touch()
        while not (work / "go").exists():
            time.sleep(0.01)
        started = time.time()
        before = me.cpu_times()
        compressed = send_all(sender, socket, rows, spec["plan"], "dp", row_bytes)
        after = me.cpu_times()
    sender.close()
    socket.close(linger=0)
    return {"started": started, "cpu_s": after.user + after.system - before.user - before.system,
            "cpu_kernel_s": after.system - before.system, "rss_growth": peak.growth, "compressed_bytes": compressed}


def send_all(sender: Any, socket: Any, rows: Any, plan: list[tuple[int, int]], prefix: str, row_bytes: int) -> int:
    """Send every request of ``plan`` (ids ``prefix-NNNNNN``) whenever the
    sender has room, until each one's completion report came; returns the
    compressed bytes they reported."""
    from hsx.extractor.connector.gather import Gathered
    from hsx.extractor.connector.metadata import SendJob
    from hsx.schemas.connector import RequestParams
    from hsx.schemas.reports import CompletionReport

    submitted = done = compressed = 0
    while done < len(plan):
        while submitted < len(plan) and sender.has_room(plan[submitted][1] * row_bytes):
            offset, length = plan[submitted]
            request_id = f"{prefix}-{submitted:06d}"
            params = RequestParams(request_id=request_id, attempt_id=uuid.uuid4().hex,
                                   source={"topic": "bench", "partition": 0, "offset": submitted})  # type: ignore[arg-type]
            job = SendJob(f"{request_id}-0", [], [(offset + k) % 49_152 for k in range(length)],
                          params.model_dump(mode="json"))
            sender.submit(job, Gathered(tensor=rows[offset:offset + length]))
            submitted += 1
        if socket.poll(10):
            report = CompletionReport.model_validate_json(socket.recv())
            if not report.ok:
                raise RuntimeError(f"{report.request_id} failed: {report.error}")
            done += 1
            compressed += report.compressed_bytes
        sender.take_finished()
    return compressed


# -- the round's services ------------------------------------------------------------------------


def prepare_states(path: Path, quick: bool) -> tuple[list[int], tuple[int, int, int]]:
    """SmolLM2's hidden states on the demo prompts, one ``[tokens, layers, hidden]``
    bfloat16 tensor (at least ``2 * LENGTHS[1]`` tokens) in ``path``; returns the
    layer ids and the tensor's shape."""
    import safetensors.torch
    import torch
    from transformers import AutoConfig

    from bench.codec import smollm2_samples
    from hsx import models
    from hsx.extractor.engine import default_layer_ids

    samples = smollm2_samples()
    rows = torch.cat([s.to(torch.bfloat16) for s in (samples[:4] if quick else samples)])
    while rows.shape[0] < LENGTHS[1] * 2:
        rows = torch.cat([rows, rows])
    safetensors.torch.save_file({"rows": rows.contiguous()}, str(path))
    layers = AutoConfig.from_pretrained(models.prepare(names=[MODEL])[MODEL]).num_hidden_layers
    return default_layer_ids(layers), tuple(rows.shape)  # type: ignore[return-value]


def plan(total_bytes: int, row_bytes: int, available: int, seed: int) -> list[tuple[int, int]]:
    """Requests (first row, tokens) of ``LENGTHS`` tokens until ``total_bytes``."""
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    sent = 0
    while sent < total_bytes:
        length = rng.randint(*LENGTHS)
        out.append((rng.randrange(available - length), length))
        sent += length * row_bytes
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system (kernel) CPU seconds of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


def reader(bootstrap: str, topic: str, since: dict[int, int] | None = None) -> tuple[Any, list[int]]:
    """A consumer of a throw-away group assigned every partition of ``topic``
    from its first offset (or its offset in ``since``), and the partitions."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    consumer.assign([TopicPartition(topic, p, (since or {}).get(p, 0)) for p in partitions])
    return consumer, partitions


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition's next offset: where the records written from now on start."""
    from confluent_kafka import TopicPartition

    consumer, partitions = reader(bootstrap, topic)
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
    finally:
        consumer.close()


class ReadyEvents:
    """Counts the ready events on a topic from its start: the round's end, seen
    without asking the sink (scraping its ``/metrics`` would cost it CPU)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer, _ = reader(bootstrap, topic)
        self._seen = 0

    def count(self, timeout: float) -> int:
        """Ready events so far, after waiting up to ``timeout`` for more."""
        self._seen += sum(1 for m in self._consumer.consume(1000, timeout) if not m.error())
        return self._seen

    def __enter__(self) -> ReadyEvents:
        return self

    def __exit__(self, *_: object) -> None:
        self._consumer.close()


def topic_bytes(bootstrap: str, topic: str, since: dict[int, int]) -> tuple[int, int]:
    """(records, bytes) on ``topic`` from the offsets in ``since``: keys, values
    and headers, read back whole."""
    from confluent_kafka import TopicPartition

    consumer, partitions = reader(bootstrap, topic, since)
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        records = size = 0
        remaining = {p for p, end in ends.items() if end > since.get(p, 0)}
        while remaining:
            msg = consumer.poll(10)
            if msg is None:
                raise RuntimeError(f"reading {topic} back stalled with partitions {remaining} unfinished")
            if msg.error():
                continue
            records += 1
            size += len(msg.key() or b"") + len(msg.value() or b"")
            size += sum(len(k) + len(v or b"") for k, v in msg.headers() or [])
            if msg.offset() + 1 >= ends[msg.partition()]:
                remaining.discard(msg.partition())
        return records, size
    finally:
        consumer.close()


@contextlib.contextmanager
def services(folder: Path):  # type: ignore[no-untyped-def]
    """A new embedded broker and local SeaweedFS (its data in ``folder``) for one
    round, both ours (their CPU is measured), with the bucket made and warmed;
    yields them and the environment of the round's processes.

    Why new each round: reused, each round cost them more than the one before
    (two whole runs: the broker 2.7 CPU-s per GB of an inline round, then 12-13;
    SeaweedFS 13 -> 14 -> 15.5, and the connector side staging to it 2.8 -> 4.6
    -> 5.2), so the figures depended on the round's place in the run."""
    from hsx.local.broker import EmbeddedBroker
    from hsx.local.s3server import LocalS3
    from hsx.local.spawn import cpu_engine_env

    with EmbeddedBroker() as broker, LocalS3(folder) as s3:
        os.environ.update(s3.environ())  # this process lists and warms the bucket
        s3.create_bucket(BUCKET)
        warm_up(f"s3://{BUCKET}/warm-up")
        yield broker, s3, s3.child_environ(cpu_engine_env())
    shutil.rmtree(folder, ignore_errors=True)


def staged_left(store: str | None) -> int:
    """Staged objects still in the store after a clean finish (expected: none)."""
    from hsx.dataset.storage import open_storage
    from hsx.schemas.manifest import STAGED_SUFFIX

    return 0 if store is None else len(open_storage(store).stale(STAGED_SUFFIX, older_than=0.0))


def run_round(transport: str, work: Path, broker: Any, s3: Any, env: dict[str, str], states: Path,
              layer_ids: list[int], warming: list[tuple[int, int]], requests: list[tuple[int, int]],
              row_bytes: int) -> dict[str, float]:
    """One transport's round: a fresh topic set, dataset and staging place; the
    figures of :func:`summarize`'s inputs, over ``requests`` once ``warming``
    went the whole way."""
    from hsx.local.commands import sink_command
    from hsx.local.spawn import HsxService
    from hsx.local.topics import fresh_topics
    from hsx.runtime.settings import KafkaSettings

    here = work / f"{transport}-{uuid.uuid4().hex[:6]}"
    here.mkdir()
    topics = fresh_topics(KafkaSettings(bootstrap=broker.bootstrap), prefix="bench-datapath.")
    store = {"inline": None, "directory": str(here / "staging"), "s3": f"s3://{BUCKET}/{here.name}"}[transport]
    spec = {"bootstrap": broker.bootstrap, "topic": topics.blocks, "store": store, "states": str(states),
            "layer_ids": layer_ids, "warm_up": warming, "plan": requests, "work": str(here),
            "out": str(here / "load.json")}
    (here / "spec.json").write_text(json.dumps(spec))
    extra = ["--dataset-codec", "byteplane-zstd", "--flush-when-idle", "1"]
    command = sink_command(broker.bootstrap, topics, here / "dataset", *extra,
                           *(["--payload-store", store] if store else []), group=f"bench-{topics.blocks}")
    pids = {"broker": broker.pid, "s3": s3.pid}
    with HsxService("sink", command, here, env=env) as sink:
        deadline = time.monotonic() + 120
        while not sink.metric(REBALANCES, labelled=True) >= 1:
            if sink.exited() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sink never got its partitions:\n{sink.log_tail()}")
            time.sleep(0.05)
        pids["sink"] = sink.pid
        loader = subprocess.Popen([sys.executable, "-m", "bench.datapath", "--load", str(here / "spec.json")], env=env)
        deadline = time.monotonic() + 1800
        with ReadyEvents(broker.bootstrap, topics.ready) as ready_events:
            def wait_for(count: int, loaded: Path | None = None) -> None:
                while ready_events.count(0.05) < count or (loaded is not None and not loaded.exists()):
                    if loader.poll() not in (None, 0) or sink.exited() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{transport}: load exited {loader.poll()}, sink {sink.exited()}:\n"
                                           f"{sink.log_tail()}")

            wait_for(len(warming), here / "warm")
            since = {topic: end_offsets(broker.bootstrap, topic) for topic in (topics.blocks, topics.ready)}
            cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
            broker_rss = psutil.Process(broker.pid).memory_info().rss
            (here / "go").touch()
            wait_for(len(warming) + len(requests))
        ended = time.time()
        cpu = {name: tuple(now - then for now, then in zip(cpu_seconds(pid), before))
               for (name, pid), before in zip(pids.items(), cpu.values())}
        figures = {"broker_rss_growth": psutil.Process(broker.pid).memory_info().rss - broker_rss,
                   "sink_rss_peak": proc_status("VmHWM", sink.pid), "s3_rss_peak": proc_status("VmHWM", s3.pid)}
        if loader.wait(120) != 0 or sink.stop() != 0:
            raise RuntimeError(f"{transport}: load exited {loader.returncode}, sink {sink.exited()}")
    loaded = json.loads((here / "load.json").read_text())
    raw = sum(length for _, length in requests) * row_bytes
    blocks, ready = (topic_bytes(broker.bootstrap, topic, since[topic]) for topic in (topics.blocks, topics.ready))
    figures |= {
        "seconds": ended - loaded["started"], "raw_bytes": raw, "compressed_bytes": loaded["compressed_bytes"],
        "cpu_connector": loaded["cpu_s"], "cpu_connector_kernel": loaded["cpu_kernel_s"],
        **{f"cpu_{name}": sum(seconds) for name, seconds in cpu.items()},
        **{f"cpu_{name}_kernel": seconds[1] for name, seconds in cpu.items()},
        "connector_rss_growth": loaded["rss_growth"], "kafka_records": blocks[0] + ready[0],
        "kafka_bytes": blocks[1] + ready[1], "staged_left": staged_left(store),
    }
    shutil.rmtree(here, ignore_errors=True)
    return figures


def summarize(transport: str, rounds: list[dict[str, float]], tokens: int) -> dict[str, Any]:
    """Median figures of a transport's rounds, and their extrapolation to an
    H200 and an 8-GPU node."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    gb = rounds[0]["raw_bytes"] / 1e9
    p = f"datapath_{transport}"
    out: dict[str, Any] = {
        f"{p}_mb_s": round(median("raw_bytes") / median("seconds") / 1e6, 1),
        f"{p}_mb_s_rounds": [round(r["raw_bytes"] / r["seconds"] / 1e6, 1) for r in rounds],
        f"{p}_kafka_bytes_ratio": round(median("kafka_bytes") / median("raw_bytes"), 5),
        f"{p}_kafka_bytes_per_token": round(median("kafka_bytes") / tokens, 1),
        f"{p}_kafka_records": int(median("kafka_records")),
        f"{p}_codec_ratio": round(median("raw_bytes") / median("compressed_bytes"), 3),
        f"{p}_staged_left": int(max(r["staged_left"] for r in rounds)),
        f"{p}_connector_rss_growth_mib": round(median("connector_rss_growth") / 2**20, 1),
        f"{p}_sink_rss_peak_mib": round(median("sink_rss_peak") / 2**20, 1),
        f"{p}_broker_rss_growth_mib": round(median("broker_rss_growth") / 2**20, 1),
    }
    if transport == "s3":
        out[f"{p}_s3_rss_peak_mib"] = round(median("s3_rss_peak") / 2**20, 1)
    processes = ("connector", "broker", "sink", *(("s3",) if transport == "s3" else ()))
    for name in processes:
        per_gb = median(f"cpu_{name}") / gb
        out[f"{p}_cpu_s_per_gb_{name}"] = round(per_gb, 3)
        out[f"{p}_cpu_s_per_gb_{name}_kernel"] = round(median(f"cpu_{name}_kernel") / gb, 3)
        out[f"{p}_cpu_s_per_gb_{name}_rounds"] = [round(r[f"cpu_{name}"] / gb, 3) for r in rounds]
        out[f"{p}_h200_cores_{name}"] = round(per_gb * H200_MB_S / 1e3, 2)
    out[f"{p}_cpu_s_per_gb_path"] = round(out[f"{p}_cpu_s_per_gb_connector"] + out[f"{p}_cpu_s_per_gb_sink"], 3)
    broker_mb_s = out[f"{p}_kafka_bytes_ratio"] * H200_MB_S
    out |= {
        f"{p}_h200_cores_path": round(out[f"{p}_cpu_s_per_gb_path"] * H200_MB_S / 1e3, 2),
        f"{p}_h200_broker_mb_s": round(broker_mb_s, 2),
        f"{p}_node_broker_mb_s": round(broker_mb_s * GPUS_PER_NODE, 1),
        f"{p}_node_broker_write_mb_s": round(broker_mb_s * GPUS_PER_NODE * REPLICATION, 1),
        f"{p}_node_retention_tb": round(broker_mb_s * GPUS_PER_NODE * REPLICATION * RETENTION_H * 3600 / 1e6, 3),
        f"{p}_node_cores_path": round(out[f"{p}_cpu_s_per_gb_path"] * H200_MB_S * GPUS_PER_NODE / 1e3, 1),
    }
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--load", type=Path, help="(internal) run the connector side of one round from this spec")
    p.add_argument("--gib", type=float, default=0.75, help="hidden states per round, GiB (default %(default)s)")
    p.add_argument("--warm-up-gib", type=float, default=0.5,
                   help="hidden states sent the whole way before each round is measured, GiB (default %(default)s; "
                        "0: measured from cold)")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help="the transports to measure, comma-separated (default: all; one alone for a quick A/B)")
    args = p.parse_args()
    if args.load:
        spec = json.loads(args.load.read_text())
        Path(spec["out"]).write_text(json.dumps(load(spec)))
        return
    rounds = 1 if args.quick else args.rounds
    transports = tuple(t for t in TRANSPORTS if t in args.transports.split(","))
    if not transports:
        p.error(f"--transports: none of {args.transports!r} is one of {', '.join(TRANSPORTS)}")
    total = int((1 / 16 if args.quick else args.gib) * 2**30)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-datapath-") as tmp:
        work = Path(tmp)
        states = work / "states.safetensors"
        layer_ids, (available, layers, hidden) = prepare_states(states, args.quick)
        row_bytes = layers * hidden * 2  # bfloat16
        requests = plan(total, row_bytes, available, seed=0)
        warming = plan(int((1 / 32 if args.quick else args.warm_up_gib) * 2**30), row_bytes, available, seed=1)
        tokens = sum(length for _, length in requests)
        measured: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
        for r in range(rounds):
            n = len(transports)
            for transport in transports[r % n:] + transports[:r % n]:  # each goes first once in n
                print(f"[datapath] round {r + 1}: {transport}", flush=True)
                with services(work / f"s3-{r}-{transport}") as (broker, s3, env):
                    measured[transport].append(run_round(transport, work, broker, s3, env, states, layer_ids,
                                                         warming, requests, row_bytes))
    results: dict[str, Any] = {"datapath_quick": args.quick, "datapath_rounds": rounds,
                               "datapath_requests": len(requests), "datapath_tokens": tokens,
                               "datapath_row_bytes": row_bytes, "datapath_gb_per_round": round(tokens * row_bytes / 1e9, 3),
                               "datapath_warm_up_gb": round(sum(n for _, n in warming) * row_bytes / 1e9, 3),
                               "datapath_h200_mb_s": H200_MB_S, "datapath_gpus_per_node": GPUS_PER_NODE}
    for transport, figures in measured.items():
        results |= summarize(transport, figures, tokens)
    emit(results, args.out)


if __name__ == "__main__":
    main()
