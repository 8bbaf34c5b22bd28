"""The figures ``make bench`` holds hsx to: each a key of ``bench/results.json``,
its target and what it measures; :func:`targets` says which are met."""

from __future__ import annotations

from typing import Any

from bench.report_blocks import Results

# (key, target, what) — ratios > 1 mean hsx is better unless stated.
TARGETS = [
    ("extraction_overhead_ratio", 0.90, "hsx engine ÷ plain vLLM prefill, same engine settings"),
    ("vs_hf_ratio", 1.0, "hsx ÷ HF transformers output_hidden_states"),
    ("vs_stock_files_ratio", 1.0, "the same file per request: HsxConnector's writer ÷ vLLM's stock connector's"),
    ("codec_ratio_bf16", 1.45, "default codec ratio on bf16 SmolLM2 hidden states"),
    ("codec_mb_s_per_core", 250.0, "default codec MB/s on one core"),
    ("dataset_byteplane_zstd_vs_raw_bf16", 1.5, "lossless dataset codec: raw bf16 ÷ byteplane-zstd bytes per sample"),
    ("dataset_fp8_zstd_vs_raw_bf16", 2.5, "raw bf16 ÷ fp8-zstd bytes per sample"),
    ("dataset_byteplane_zstd_decode_mb_s", 1000.0, "byteplane-zstd decode MB/s of bf16 output on one core"),
    ("e2e_ratio", 0.85, "producer → Kafka → extractor → sink ÷ extraction alone"),
    ("e2e_ratio_by_reference", 0.90, "the same with hidden states by reference (a staging directory)"),
    ("rss_growth_10_to_100pct", 1.10, "RSS at 100% ÷ at 10% of a 2,000-prompt run (at most)"),
    ("sink_scale_rss_bytes_per_sample", 64.0, "sink RSS growth per stored sample once ready, 1 M samples (at most)"),
    ("sink_scale_load_s", 2.0, "seconds an assignment spends loading 1 M stored samples' dedupe keys (at most)"),
    ("one_pass_vs_two_pass_ratio", 1.2, "generate-and-capture ÷ generate, then prefill on a cold engine"),
    ("one_pass_vs_plain_generation_ratio", 0.90, "generate-and-capture ÷ plain vLLM generation"),
    ("object_store_s3_write_rss_mib", 80.0, "peak RSS a 1 GiB shard's S3 upload adds over the open shard, MiB: "
     "five 16 MiB parts (at most)"),
    ("datapath_s3_kafka_bytes_ratio", 0.01, "Kafka bytes per hidden-state byte, by reference on S3 (at most)"),
    ("datapath_s3_cpu_s_per_gb_sink", 1.0, "sink CPU-s per GB of hidden states, byteplane-zstd shards by reference "
     "on S3 (at most)"),
    ("datapath_s3_cpu_s_per_gb_path", 2.0, "connector side + sink CPU-s per GB, by reference on S3 (at most)"),
    ("serve_capture_vs_plain_min", 0.95, "vLLM's server with capture ÷ plain vLLM's server, requests/s, the worst of "
     "c = 1/8/32, files and Kafka"),
    ("serve_long_kafka_c8_vs_plain", 0.95, "the same at c = 8, files + Kafka + sink, bursts ten times longer "
     "(`--burst-scale 10`, 8 passes)"),
    ("serve_rerun_kafka_c8_vs_plain", 0.95, "the same on a later machine of the same kind, bursts three times longer "
     "(`--burst-scale 3`, 5 passes)"),
    ("serve_sink_c8_running_vs_stopped", 0.95, "one server at c = 8, its sink running ÷ stopped (`bench.serve_sink`, "
     "6 pairs): what the sink beside it costs"),
    ("serve_files_vs_stock_min", 1.0, "served requests/s, HsxConnector's files ÷ vLLM's stock connector's, the worst "
     "concurrency"),
    ("serve_capture_lag_p99_c8_s", 2.0, "capture lag p99 at concurrency 8, s: response → file complete or sample "
     "acknowledged by Kafka (at most)"),
]

AT_MOST = {"rss_growth_10_to_100pct", "sink_scale_rss_bytes_per_sample", "sink_scale_load_s",
           "object_store_s3_write_rss_mib", "datapath_s3_kafka_bytes_ratio", "datapath_s3_cpu_s_per_gb_sink",
           "datapath_s3_cpu_s_per_gb_path", "serve_capture_lag_p99_c8_s"}
"""Targets that are upper bounds; the others are lower bounds."""


def targets(r: Results) -> dict[str, Any]:
    """Flat ``target_<key>_met`` entries (and the RSS growth they need)."""
    out: dict[str, Any] = {}
    base = sum(r.get(f"rss_{s}_mb_at_10pct", 0) for s in ("extractor", "sink"))
    end = sum(r.get(f"rss_{s}_mb_at_100pct", 0) for s in ("extractor", "sink"))
    if base:
        out["rss_growth_10_to_100pct"] = round(end / base, 3)
    for key, target, _ in TARGETS:
        value = out.get(key, r.get(key))
        if value is None:
            continue
        out[f"target_{key}_met"] = bool(value <= target if key in AT_MOST else value >= target)
    return out
