"""``docs/benchmarks.md`` from ``bench/results.json``: nothing in that page is
typed by hand except the method and the profile notes below."""

from __future__ import annotations

from typing import Any

LENGTHS = [256, 512, 1024, 2048, 4096]

# (key, target, what) — ratios > 1 mean hsx is better unless stated.
TARGETS = [
    ("extraction_overhead_ratio", 0.90, "hsx engine ÷ plain vLLM prefill, same engine settings"),
    ("vs_hf_ratio", 1.0, "hsx ÷ HF transformers output_hidden_states"),
    ("vs_stock_files_ratio", 1.0, "hsx ÷ vLLM's one-safetensors-file-per-request connector"),
    ("codec_ratio_bf16", 1.45, "default codec ratio on bf16 SmolLM2 hidden states"),
    ("codec_mb_s_per_core", 250.0, "default codec MB/s on one core"),
    ("dataset_byteplane_zstd_vs_raw_bf16", 1.5, "lossless dataset codec: raw bf16 ÷ byteplane-zstd bytes per sample"),
    ("dataset_fp8_zstd_vs_raw_bf16", 2.5, "raw bf16 ÷ fp8-zstd bytes per sample"),
    ("dataset_byteplane_zstd_decode_mb_s", 1000.0, "byteplane-zstd decode MB/s of bf16 output on one core"),
    ("e2e_ratio", 0.85, "producer → Kafka → extractor → sink ÷ extraction alone"),
    ("rss_growth_10_to_100pct", 1.10, "RSS at 100% ÷ at 10% of a 2,000-prompt run (at most)"),
    ("sink_scale_rss_bytes_per_sample", 64.0, "sink RSS growth per stored sample once ready, 1 M samples (at most)"),
    ("sink_scale_load_s", 2.0, "seconds an assignment spends loading 1 M stored samples' dedupe keys (at most)"),
    ("one_pass_vs_two_pass_ratio", 1.2, "generate-and-capture ÷ generate, then prefill on a cold engine"),
    ("one_pass_vs_plain_generation_ratio", 0.90, "generate-and-capture ÷ plain vLLM generation"),
    ("object_store_s3_write_rss_mib", 80.0, "peak RSS a 1 GiB shard's S3 upload adds over the open shard, MiB: "
     "five 16 MiB parts (at most)"),
]

AT_MOST = {"rss_growth_10_to_100pct", "sink_scale_rss_bytes_per_sample", "sink_scale_load_s",
           "object_store_s3_write_rss_mib"}
"""Targets that are upper bounds; the others are lower bounds."""


def targets(r: dict[str, Any]) -> dict[str, Any]:
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


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _ms(seconds: Any) -> str:
    return f"{seconds * 1000:,.1f}" if isinstance(seconds, (int, float)) else "–"


def _getter(r: dict[str, Any]):  # type: ignore[no-untyped-def]
    """``r.get`` that shows a missing figure as a dash."""
    return lambda key: r.get(key, "–")


DATASET_CODECS = ["raw", "byteplane-zstd", "fp8", "fp8-zstd", "fp8-zstd-3"]


def _dataset_codecs(r: dict[str, Any]) -> list[str]:
    """The dataset codecs table (``bench.dataset_codecs``)."""
    g = _getter(r)
    lines = [
        "",
        "## Dataset codecs (SmolLM2 hidden states, one sample per prompt, one core)",
        "",
        "`python -m bench.dataset_codecs`: what a shard would hold per token under each codec of "
        "`schemas/dataset_codec.py`, on the *long* set "
        f"({g('dataset_long_samples')} prompts of real text, {_fmt(g('dataset_long_tokens'))} tokens) and the "
        f"*demo* set ({g('dataset_demo_samples')} chats, {_fmt(g('dataset_demo_tokens'))} tokens, "
        f"{g('dataset_long_shape')} per token). Ratios are raw bf16 bytes ÷ the codec's bytes; "
        "MB/s count the sample's own raw bytes (bf16 or float32).",
        "",
        "| source | codec | bytes/token (long) | × smaller than raw bf16 (long) | (demo) | encode MB/s | "
        "decode MB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in ("bf16", "f32"):
        for codec in DATASET_CODECS:
            long, demo = f"dataset_long_{dtype}_{codec}", f"dataset_demo_{dtype}_{codec}"
            lines.append(f"| {dtype} | {codec} | {_fmt(g(f'{long}_bytes_per_token'))} | "
                         f"{_fmt(g(f'{long}_vs_raw_bf16'))} | {_fmt(g(f'{demo}_vs_raw_bf16'))} | "
                         f"{_fmt(g(f'{long}_encode_mb_s'))} | {_fmt(g(f'{long}_decode_mb_s'))} |")
    errors = ", ".join(_fmt(r.get(f"dataset_long_bf16_fp8_rel_error_layer_{i}")) for i in range(4))
    lines += [
        "",
        f"- **Per-sample limit.** The order-0 entropy of each sample's bytes allows at most "
        f"{_fmt(g('dataset_long_bf16_byteplane_order0_bound_vs_raw_bf16'))}× for bf16's byte planes and "
        f"{_fmt(g('dataset_long_bf16_fp8_order0_bound_vs_raw_bf16'))}× for fp8 codes plus scales (long set; demo "
        f"{_fmt(g('dataset_demo_bf16_byteplane_order0_bound_vs_raw_bf16'))}× and "
        f"{_fmt(g('dataset_demo_bf16_fp8_order0_bound_vs_raw_bf16'))}×). zstd gets within 1 % of both. The codec "
        "table once reported 1.59× (and the README 1.55×) because its 1 MiB blocks spanned several demo prompts, "
        "whose shared system-prompt states repeat; it now cuts each request's blocks on their own, as the "
        f"connector does: {_fmt(g('codec_ratio_bf16'))}×. The 1.45× codec target and the 1.5× dataset target "
        "were set from that figure.",
        # Measured once by a scratch script, not by bench.dataset_codecs: the layouts were not adopted.
        "- **Other layouts, measured and not adopted** (long set, one core, 1 MiB blocks as the connector cuts "
        "them). Order-0 entropy is not the limit: channels keep their magnitude across tokens, and the sign and "
        "exponent byte needs 2.60 bits given its channel against 3.32 without (whole samples). An ideal per-channel "
        "coder would only just clear the targets, at no cost for learning each channel: 1.51× on bf16 (the "
        "mantissa byte stays at 7.97 bits) and 2.51× on fp8 (6.33 bits a code instead of 6.80). zstd gets "
        "part of it: byte planes reordered channel-major ([L·H, T]) 1.460× (encode 530, decode 1,514 MB/s); "
        "the same with zstd set for fewer, longer matches (hash log "
        "6, min match 7) 1.475× (715 / 1,713 MB/s); the best of any zstd setting 1.488× (btopt, 9 MB/s "
        "encode). Subtracting each channel's most common high byte: 1.454× token-major, 1.461× channel-major; "
        "delta or XOR against the previous token: 1.41×, worse; zstd long mode and a dictionary trained on the "
        "demo set: no gain. Whole samples channel-major: 1.485×, and 1.51× only at level 19 (2 MB/s), and "
        "decoding falls to about 400 MB/s (the transpose of a whole sample misses the cache). fp8 codes: "
        "channel-major 2.33×, minus each channel's mode 2.35×, both and zstd-3 on whole samples 2.38×, delta "
        "against the previous token 2.22×. float32: 0.584×, at best 0.598×. Nothing reaches 1.5× or 2.5× at "
        "usable speed, so the layout is unchanged. The tuned zstd setting (hash log 6, min match 7) is now the "
        "default level's (`schemas/codec.py`): on token-major planes zstd alone encodes 2.4× faster and decodes "
        "2.1× faster for 0.3 % more bytes, so byteplane-zstd as a whole encodes 1.7× and decodes 1.2× faster "
        "than before (long set, in the run that adopted it: 680 → 1,173 and 1,868 → 2,259 MB/s; 1.414× → 1.410×), with no format change. fp8 decodes in place since (one float32 array and one integer temporary, where it made about eight): 653 → 875 MB/s on the long set.",
        f"- **fp8 error** (bf16 states, long set): ‖x′ − x‖ / ‖x‖ per layer {errors}; worst element that is "
        f"normal after scaling {_fmt(g('dataset_long_bf16_fp8_max_rel_error_normal'))} (bound 2⁻⁴ = 0.0625); "
        f"every element within the documented bound: {g('dataset_long_bf16_fp8_within_bound')}.",
        f"- **fp8-zstd** is plain zstd of the codes: nibble planes compressed the codes "
        f"{_fmt(g('dataset_long_bf16_fp8_nibble-zstd-1_codes_ratio'))}×, no better.",
    ]
    return lines


def render(r: dict[str, Any]) -> str:
    g = _getter(r)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`python -m bench`) from `bench/results.json`; do not edit by hand.",
        "",
    ]
    if r.get("quick"):
        lines += ["**This is a `--quick` smoke run: tiny sizes, one round. Do not quote its numbers.**", ""]
    lines += [
        "## Machine and load",
        "",
        f"- CPU: {g('machine_cpu_model')}, {g('machine_cores')} cores, AVX-512: {g('machine_avx512')}, "
        f"{g('machine_memory_gb')} GiB memory; Python {g('machine_python')}",
        "- Versions: " + ", ".join(f"{k[8:]} {v}" for k, v in r.items() if k.startswith("version_")),
        f"- vLLM CPU threads: `VLLM_CPU_OMP_THREADS_BIND={g('vllm_cpu_omp_threads_bind')}` "
        f"({g('vllm_omp_threads')} OpenMP threads per engine); HF transformers: "
        f"`torch.set_num_threads({g('hf_torch_threads')})`; LD_PRELOAD for every process of every side: "
        f"`{g('ld_preload')}`",
        f"- Other work on the machine while this ran: {_fmt(g('machine_other_busy_cores_mean'))} cores busy on "
        f"average (max {_fmt(g('machine_other_busy_cores_max'))}) besides the benchmark's own processes; "
        f"load average {g('machine_loadavg_1m_start')} at start, {g('machine_loadavg_1m_end')} at the end. "
        "Absolute tokens/s on a shared 2-core machine are noise; the ratios, measured side by side in one run, "
        "are what count. Regenerate on a quiet machine before quoting absolute numbers.",
        f"- Wall time: {_fmt(g('total_s'))} s (stages {_fmt(g('section_stages_s'))} s, engines "
        f"{_fmt(g('section_extraction_s'))} s, pipeline {_fmt(g('section_pipeline_s'))} s)",
    ]
    per_section = [f"{s} {_fmt(r[f'section_{s}_machine_other_busy_cores_mean'])} (max "
                   f"{_fmt(r.get(f'section_{s}_machine_other_busy_cores_max'))})"
                   for s in ("stages", "extraction", "pipeline") if f"section_{s}_machine_other_busy_cores_mean" in r]
    if per_section:
        lines.append("- Other work per section, cores busy on average: " + ", ".join(per_section))
    if r.get("partial_runs"):
        lines.append(f"- Sections re-run on their own after the full run (`python -m bench --only ...`): "
                     f"{', '.join(r['partial_runs'])}; the machine figures above are from the last of those runs.")
    lines += [
        "",
        "## Targets",
        "",
        "| figure | value | target | met | what |",
        "|---|---|---|---|---|",
    ]
    for key, target, what in TARGETS:
        value = r.get(key)
        met = r.get(f"target_{key}_met")
        bound = "≤" if key in AT_MOST else "≥"
        lines.append(f"| `{key}` | {_fmt(value) if value is not None else '–'} | {bound} {target} | "
                     f"{'yes' if met else ('–' if met is None else '**no**')} | {what} |")
    lines += [
        "",
        "## Extraction side by side (one process, rounds interleaved)",
        "",
        f"Workload: {g('workload_prompts')} prompts, {_fmt(g('workload_tokens'))} tokens per round (the 64 "
        "bundled demo prompts, short chats and texts, plus prompts of 256–1,536 tokens made of real text); "
        f"{g('model')}, {g('dtype')}, layers {g('layers')}, {g('rounds')} rounds, the order of the sides rotating "
        "each round; ratios are the median over rounds of per-round ratios. Prefix caching is off in every "
        "engine (the rounds repeat the prompts), `enforce_eager` on.",
        "",
        "| side | tokens/s (median) | per round | stores |",
        "|---|---|---|---|",
        f"| plain vLLM, async scheduling off (the baseline) | {_fmt(g('plain_tokens_per_s'))} | "
        f"{g('plain_tokens_per_s_rounds')} | nothing |",
        f"| plain vLLM, defaults (async scheduling on) | {_fmt(g('plain_async_tokens_per_s'))} | "
        f"{g('plain_async_tokens_per_s_rounds')} | nothing |",
        f"| **hsx** (extract_hidden_states + HsxConnector, byteplane-zstd-1, Kafka acks awaited) | "
        f"{_fmt(g('hsx_tokens_per_s'))} | {g('hsx_tokens_per_s_rounds')} | {_fmt(g('hsx_kafka_bytes'))} B in "
        f"Kafka (raw {_fmt(g('hsx_raw_bytes'))} B) |",
        f"| vLLM stock files (ExampleHiddenStatesConnector, CPU copy; files written awaited) | "
        f"{_fmt(g('files_tokens_per_s'))} | {g('files_tokens_per_s_rounds')} | {_fmt(g('stock_files_bytes'))} B "
        "on disk |",
        f"| HF transformers `output_hidden_states=True`, one prompt per forward | {_fmt(g('hf_tokens_per_s'))} | "
        f"{g('hf_tokens_per_s_rounds')} | in memory only |",
        "",
        f"- `extraction_overhead_ratio` = {_fmt(g('extraction_overhead_ratio'))}; against vLLM's default "
        f"(async scheduling on): {_fmt(g('extraction_overhead_ratio_vs_async_default'))}; async on ÷ off for "
        f"plain vLLM: {_fmt(g('plain_async_vs_plain_ratio'))}.",
        f"- `vs_stock_files_ratio` = {_fmt(g('vs_stock_files_ratio'))}; stock files ÷ plain: "
        f"{_fmt(g('stock_files_overhead_ratio'))}. Bytes stored per round: hsx {_fmt(g('hsx_kafka_bytes'))} in "
        f"Kafka vs stock {_fmt(g('stock_files_bytes'))} on disk. (The hsx sink then writes the dataset "
        "uncompressed, as the stock files are, so the dataset on disk is about the raw size; the compression "
        "saves Kafka bytes, network and broker storage.)",
        f"- `vs_hf_ratio` = {_fmt(g('vs_hf_ratio'))} at {g('vllm_omp_threads')} vLLM threads vs "
        f"{g('hf_torch_threads')} torch threads.",
        "",
        "## Cost vs prompt length, per stage",
        "",
        "Prefill and hsx (prefill through Kafka ack) are one prompt alone on the engines above (best of 2); the "
        "other stages run hsx's own functions on one core with real SmolLM2 hidden states (float32, "
        "4 layers × 576) — see `bench/stages.py`.",
        "",
        "Single prompts are one measurement each on a loaded machine (best of 2); the stage columns say what "
        "hsx's own stages add per request (last column: their sum ÷ the prefill).",
        "",
        "| tokens | prefill (plain) ms | hsx prompt → acked ms | gather ms | codec ms | sink decode ms | "
        "sink write ms | codec+gather+sink ÷ prefill |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in LENGTHS:
        pre = r.get(f"length_{n}_prefill_s")
        stages = [r.get(f"length_{n}_{s}_s") for s in ("gather", "codec", "sink_decode", "sink_write")]
        if pre is None and all(s is None for s in stages):
            continue
        share = f"{sum(stages) / pre:.3f}" if pre and all(s is not None for s in stages) else "–"
        lines.append(f"| {n:,} | {_ms(pre)} | {_ms(g(f'length_{n}_hsx_s'))} | "
                     + " | ".join(_ms(s) for s in stages) + f" | {share} |")
    lines += [
        "",
        "## Codec (bf16 SmolLM2 hidden states, one core, 1 MiB blocks)",
        "",
        f"{_fmt(g('codec_tokens'))} tokens × {g('codec_shape')} cast to bfloat16, "
        f"{g('codec_block_tokens')} tokens per block.",
        "",
        "| codec | ratio | encode MB/s | decode MB/s |",
        "|---|---|---|---|",
    ]
    for name in ("byteplane-zstd-1", "byteplane-zstd-3", "zstd-1", "zstd-3", "none-0"):
        lines.append(f"| {name} | {_fmt(g(f'codec_bf16_{name}_ratio'))} | {_fmt(g(f'codec_bf16_{name}_encode_mb_s'))} | "
                     f"{_fmt(g(f'codec_bf16_{name}_decode_mb_s'))} |")
    lines.append(f"| byteplane-zstd-1 on float32 (what the CPU engine ships) | "
                 f"{_fmt(g('codec_f32_byteplane-zstd-1_ratio'))} | {_fmt(g('codec_f32_byteplane-zstd-1_encode_mb_s'))} | "
                 f"{_fmt(g('codec_f32_byteplane-zstd-1_decode_mb_s'))} |")
    lines += _dataset_codecs(r)
    lines += [
        "",
        "## Pipeline: producer → Kafka → extractor → sink (separate processes)",
        "",
        f"Workload: {g('pipeline_workload_prompts')} prompts, {_fmt(g('pipeline_workload_tokens'))} tokens per round "
        "(the demo prompts three times plus prompts of 256–768 tokens, each prompt distinct), published as token-id events by the project's "
        f"Publisher; {g('pipeline_rounds')} rounds of each kind, alternating, on one warm extractor "
        "(`--max-model-len 2048 --enforce-eager`, defaults otherwise). An *extract* round times until the "
        "extractor's acknowledged-prompts counter covers the round, no sink running; an *e2e* round starts a sink "
        "(`--max-shard-age 0.5 --max-shard-samples 64`), lets it catch up untimed, then times until its "
        "ready-events counter covers the round (shards fsynced, index written, ready events acked).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| extraction alone, tokens/s | {_fmt(g('pipeline_extract_tokens_per_s'))} "
        f"{g('pipeline_extract_tokens_per_s_rounds')} |",
        f"| whole pipeline, tokens/s | {_fmt(g('pipeline_e2e_tokens_per_s'))} {g('pipeline_e2e_tokens_per_s_rounds')} |",
        f"| `e2e_ratio` | {_fmt(g('e2e_ratio'))} |",
        f"| whole pipeline with the sink at nice {g('sink_nice')}, tokens/s | "
        f"{g('pipeline_e2e_sink_niced_tokens_per_s_rounds')} (÷ extraction alone: {_fmt(g('e2e_ratio_sink_niced'))}) |",
        f"| 1 extractor (OpenMP on cores 0-1), tokens/s | {_fmt(g('one_extractor_tokens_per_s'))} |",
        f"| 2 extractors (one core each), tokens/s | {_fmt(g('two_extractors_tokens_per_s'))} "
        f"(prompts per extractor {g('two_extractors_prompt_split')}) |",
        f"| 2 ÷ 1 extractors | {_fmt(g('two_vs_one_extractors_ratio'))} |",
        "",
        "Two extractors on 2 cores: each engine's OpenMP threads are bound to a core of their own "
        "(`VLLM_CPU_OMP_THREADS_BIND=0` / `=1`), so the two engines never put two compute threads on one core. "
        "But each extractor is a whole vLLM engine (service process, engine core, worker): its engine-core "
        "process busy-waits with `sched_yield` for the worker (23 % of the samples in the profile below) and "
        "now shares the worker's single core, and every Python and scheduling cost is paid twice on the same "
        "two cores. One extractor with two OpenMP threads therefore beats two with one each on this machine; "
        "scale out with cores (or GPUs) per extractor, one extractor per GPU, replicas bounded by partitions.",
        "",
        f"### Memory over a {_fmt(g('rss_run_prompts'))}-prompt run ({_fmt(g('rss_run_tokens'))} tokens, "
        f"{_fmt(g('rss_run_e2e_tokens_per_s'))} tokens/s end to end)",
        "",
        "RSS of the extractor's whole process tree (service, vLLM engine core and worker) and of the sink, "
        "sampled every 0.5 s, at the moment 10 %, 50 % and 100 % of the prompts were acknowledged:",
        "",
        "| process | 10 % | 50 % | 100 % | peak |",
        "|---|---|---|---|---|",
        f"| extractor tree, MiB | {_fmt(g('rss_extractor_mb_at_10pct'))} | {_fmt(g('rss_extractor_mb_at_50pct'))} | "
        f"{_fmt(g('rss_extractor_mb_at_100pct'))} | {_fmt(g('peak_rss_extractor_mb'))} |",
        f"| sink, MiB | {_fmt(g('rss_sink_mb_at_10pct'))} | {_fmt(g('rss_sink_mb_at_50pct'))} | "
        f"{_fmt(g('rss_sink_mb_at_100pct'))} | {_fmt(g('peak_rss_sink_mb'))} |",
        "",
        *generation_lines(r),
        *sink_scale_section(r),
        *loader_section(r),
        *object_store_section(r),
        profile_notes(r),
        "## Reproduce",
        "",
        "```bash",
        "make bench                      # everything, 15-25 min on 2 cores; writes bench/results.json + this page",
        ".venv/bin/python -m bench --quick   # smoke run, tiny sizes (a few minutes)",
        ".venv/bin/python -m bench --only extraction   # one section; the others' figures are kept",
        ".venv/bin/python -m bench --preload none      # without LD_PRELOAD of libiomp5.so",
        ".venv/bin/python -m bench.sink_scale [--quick]  # the sink at dataset scale alone; merges its figures",
        ".venv/bin/python -m bench.loader [--quick]      # the trainer loader alone; merges its figures",
        ".venv/bin/python -m bench --only object_store   # S3 (SeaweedFS on loopback) vs local disk",
        "```",
        "",
        "`make bench` sets `HSX_CACHE_DIR` like `make test`; the bench sets `VLLM_CPU_KVCACHE_SPACE=2` unless set, "
        "and the extractor binds `VLLM_CPU_OMP_THREADS_BIND` to all cores; the broker is the embedded one unless `HSX_KAFKA_BOOTSTRAP` names another. Nothing is "
        "downloaded at run time.",
        "",
    ]
    return "\n".join(lines)


def generation_lines(r: dict[str, Any]) -> list[str]:
    g = _getter(r)
    sides = [("one_pass", "**hsx, one pass**: generate and capture prompt + answer"),
             ("two_pass_cold", "two passes: plain vLLM generates, then hsx prefills prompt + answer (cold cache)"),
             ("two_pass_warm", "two passes on the hsx engine: generate, then prefill (prefix cache warm)"),
             ("plain", "plain vLLM generation, no extraction"),
             ("spec_only", "`extract_hidden_states` without a connector (the method's own cost)")]
    lines = [
        "## Generation: one pass vs two passes (`bench/generation.py`)",
        "",
        f"{g('generation_prompts')} demo prompts per round, each answered greedily with "
        f"{g('generation_max_tokens')} tokens (`ignore_eos`), {g('generation_model')} float32, "
        f"{g('generation_rounds')} rounds interleaved, each side's prompts new every round; tokens captured "
        f"per round: {_fmt(g('generation_captured_tokens'))} (prompt + answer - 1 per request, on every side).",
        "",
        "| side | tokens captured/s (median) |",
        "|---|---|",
        *(f"| {what} | {_fmt(g(f'generation_{s}_tokens_per_s'))} |" for s, what in sides),
        "",
        f"- One pass ÷ two passes: {_fmt(g('one_pass_vs_two_pass_ratio'))} (cold second prefill), "
        f"{_fmt(g('one_pass_vs_two_pass_warm_ratio'))} (second prefill on the same warm engine).",
        f"- One pass ÷ plain generation: {_fmt(g('one_pass_vs_plain_generation_ratio'))} = the extraction method "
        f"({_fmt(g('spec_only_vs_plain_generation_ratio'))}, `spec_only` ÷ plain) × hsx's connector "
        f"({_fmt(g('one_pass_vs_spec_only_ratio'))}, one pass ÷ `spec_only`).",
    ]
    if "generation_profile_plain_decode_step_ms" in r:
        lines += [
            "",
            "Profile: one more batch per engine under vLLM's torch profiler; decode steps are the engine steps "
            "with no prefill in them.",
            "",
            "| engine | decode steps | decode ms in total | ms per decode step | query tokens per request and step | matmul ms | "
            "forward ms | sample ms | draft ms |",
            "|---|---|---|---|---|---|---|---|---|",
            *(f"| {name} | {_fmt(g(f'generation_profile_{name}_decode_steps'))} | "
              f"{_fmt(g(f'generation_profile_{name}_decode_ms'))} | "
              f"{_fmt(g(f'generation_profile_{name}_decode_step_ms'))} | "
              f"{_fmt(g(f'generation_profile_{name}_decode_query_tokens_per_request'))} | "
              f"{_fmt(g(f'generation_profile_{name}_matmul_ms'))} | "
              f"{_fmt(g(f'generation_profile_{name}_phase_forward_ms'))} | "
              f"{_fmt(g(f'generation_profile_{name}_phase_sample_ms'))} | "
              f"{_fmt(g(f'generation_profile_{name}_phase_draft_ms'))} |" for name in ("plain", "spec_only", "one_pass")),
            "",
            *_generation_profile_notes(r),
        ]
    return [*lines, ""]


def loader_section(r: dict[str, Any]) -> list[str]:
    """``bench.loader``: trainer/'s map-style loader against a raw safetensors read."""
    if "loader_raw_gb_s" not in r:
        return []
    g = _getter(r)
    sides = [("raw", "raw safetensors read: `get_tensor` + copy of every tensor, one process"),
             ("file_read", "the shard files read whole into bytes (for scale, no tensors)"),
             ("w0", "`HsxDataset` + `PackedCollate`, DataLoader with 0 workers"),
             ("w1", "the same, 1 worker"), ("w2", "the same, 2 workers")]
    return [
        "## Trainer loader (`bench/loader.py`)",
        "",
        f"{g('loader_samples')} samples, {_fmt(g('loader_tokens'))} tokens, {g('loader_shape')} "
        f"({_fmt(g('loader_hidden_bytes'))} bytes of hidden states: a demo-sized dataset), written through the "
        "sink's write path to local disk and read once per epoch; the first epoch warms the page cache and "
        f"starts the (persistent) workers, then {g('loader_rounds')} epochs per side, interleaved, median. "
        "Batches are packed to 2,048 tokens without cutting a sample, float32 (no cast).",
        "",
        "| side | samples/s | GB/s | ÷ raw |",
        "|---|---|---|---|",
        *(f"| {what} | {_fmt(g(f'loader_{s}_samples_per_s'))} | {_fmt(g(f'loader_{s}_gb_s'))} | "
          f"{_fmt(r.get(f'loader_{s}_vs_raw_ratio', 1.0 if s == 'raw' else None))} |" for s, what in sides),
        "",
        "Both sides read from the page cache, so this is the loader's own cost per byte: the raw side copies "
        "each tensor once; the loader copies each sample once into its batch (the split into aux slots and "
        "the verifier slot happens in that copy). With workers, every batch also crosses to the trainer's "
        "process in shared memory, and each worker gets one thread: on this shared 2-core machine that "
        "hand-over costs more than reading a sample, so workers only pay off where reading does (cold disk, "
        "a cast to bf16, larger models on more cores). The absolute figures here swing by an order of "
        "magnitude from run to run with the machine's memory state and load (other sessions' tests): compare "
        "the ratios of one run, not runs.",
        "",
    ]


def sink_scale_section(r: dict[str, Any]) -> list[str]:
    """``bench.sink_scale``: the sink against a dataset that already holds many samples."""
    g = _getter(r)
    large = "100k" if r.get("sink_scale_quick") else "1m"
    rows = [("none", "empty"), ("10,000", "10k"), (_fmt(g("sink_scale_samples_large")), large)]
    lines = [
        "## Sink at dataset scale (`python -m bench.sink_scale`)",
        "",
        "A dataset of tiny samples (1 token × 1 layer × 8 hidden, "
        f"{_fmt(g('sink_scale_samples_per_shard'))} to a shard) built through the sink's own write path for one "
        "partition, then `hsx sink` started on it twice (a consumer group of its own each time): the first start "
        "reads each shard's key file and writes the partition's roll-up, the second reads the roll-up. *Load* is "
        "what the assignment spends on the dataset (`hsx_sink_partition_load_seconds`); *start → assigned* runs from "
        "the process's start to its first assignment (interpreter start and joining the group, the same with an "
        "empty dataset), *start → ready* to `/readyz` answering, which asks the consumer for its assignment and can "
        "lag it by many seconds on the embedded broker. RSS is the sink's once ready; growth is per stored sample "
        "over the empty dataset's (at 10,000 samples it is within the noise of RSS).",
        "",
        "| samples stored | build s | load s (1st / 2nd start) | start → assigned s (1st / 2nd) | "
        "start → ready s (1st / 2nd) | RSS MiB | RSS growth B/sample |",
        "|---|---|---|---|---|---|---|",
    ]
    for shown, label in rows:
        k = f"sink_scale_{label}_"
        lines.append(f"| {shown} | {_fmt(g(k + 'build_s'))} | {_fmt(g(k + 'first_load_s'))} / {_fmt(g(k + 'load_s'))} | "
                     f"{_fmt(g(k + 'first_assigned_s'))} / {_fmt(g(k + 'assigned_s'))} | "
                     f"{_fmt(g(k + 'first_ready_s'))} / {_fmt(g(k + 'ready_s'))} | {_fmt(g(k + 'rss_mb'))} | "
                     f"{_fmt(r.get(k + 'rss_bytes_per_sample'))} |")
    lines += [
        "",
        "Before the compact keys (issue 19) the sink held each stored sample's whole ready event (about 2.5 KB) "
        "and parsed every index of the partition on assignment (about 46 µs a sample): about 2.5 GB and 46 s at "
        "1 M samples.",
        "",
    ]
    return lines


def object_store_section(r: dict[str, Any]) -> list[str]:
    """``bench.object_store``: the dataset in an S3-compatible object store vs on local disk."""
    if "object_store_sink_s3_mb_s" not in r:
        return []
    g = _getter(r)
    shard = _fmt(round(r["object_store_shard_bytes"] / 2**20)) if "object_store_shard_bytes" in r else "–"
    before = r.get("object_store_shard_s3_rss_before_mib")
    return [
        "## Dataset on object storage (`python -m bench.object_store`)",
        "",
        f"S3 is {g('object_store_server')} (`hsx.local.s3server`), its data on the same disk as the local side's "
        "temp directory; both sides in one run, rounds interleaved. Hidden states are bfloat16, 4 layers × "
        "2,048 (16 KiB a token), random bytes.",
        "",
        f"**Sink throughput.** One blocks topic on the embedded broker holds {g('object_store_sink_samples')} "
        f"requests ({_fmt(round(r['object_store_sink_bytes'] / 2**20)) if 'object_store_sink_bytes' in r else '–'} "
        f"MiB of hidden states, {g('object_store_sink_sample_mib_min')}–{g('object_store_sink_sample_mib_max')} "
        "MiB a sample) as a connector produces them, without an engine: 1 MiB block records with codec `none` "
        "(the sink's own work per byte at its smallest, so the storage's share is largest), then the manifest. "
        "`hsx sink --output DIR` and `hsx sink --output s3://…` each consume all of it, a fresh consumer group "
        f"and dataset per round, {g('object_store_sink_samples_per_shard')} samples to a shard, "
        f"{g('object_store_sink_rounds')} rounds per side; timed from the sink's first assignment to its last "
        "ready event (`/metrics` polled every 50 ms).",
        "",
        "| output | MB/s of hidden states (median) | per round |",
        "|---|---|---|",
        f"| local disk (`--output DIR`) | {_fmt(g('object_store_sink_disk_mb_s'))} | "
        f"{g('object_store_sink_disk_mb_s_rounds')} |",
        f"| S3 (`--output s3://…`) | {_fmt(g('object_store_sink_s3_mb_s'))} | {g('object_store_sink_s3_mb_s_rounds')} |",
        f"| **S3 ÷ disk** (median of per-round ratios) | {_fmt(g('object_store_sink_s3_vs_disk_ratio'))} | |",
        "",
        f"**One random sample.** `open_dataset(...)[request_id]` on the two datasets the last round wrote, "
        f"{g('object_store_sample_picks')} random samples (mean {g('object_store_sample_mib_mean')} MiB), each "
        "read from both storages in turn; its hidden states copied once (a local shard is memory-mapped: "
        "this reads its pages; the page cache is warm on both sides). *Cold*: no shard open, so the read opens "
        "its handle (on S3: the header in one ranged GET, then the sample's tensors in one round of ranged GETs); "
        "*warm*: another sample of the shard just opened (one round of ranged GETs). Median ms:",
        "",
        "| | local disk | S3 | S3 ÷ disk |",
        "|---|---|---|---|",
        f"| cold shard handle | {_fmt(g('object_store_sample_disk_cold_ms'))} | "
        f"{_fmt(g('object_store_sample_s3_cold_ms'))} | {_fmt(g('object_store_sample_cold_s3_over_disk'))} |",
        f"| warm shard handle | {_fmt(g('object_store_sample_disk_warm_ms'))} | "
        f"{_fmt(g('object_store_sample_s3_warm_ms'))} | {_fmt(g('object_store_sample_warm_s3_over_disk'))} |",
        "",
        f"**A {shard} MiB shard** ({g('object_store_shard_samples')} samples of 1,024 tokens), in a process of its "
        "own per side: the open shard built in memory, then `hsx.dataset.shards.write_shard` (as the sink calls it, "
        f"upload parts of {g('object_store_upload_part_mib')} MiB, 4 in flight); peak RSS during the write "
        "(`VmHWM`, reset just before it) minus RSS before it. Then the shard read back in a fresh process, "
        "`open_dataset` iteration (S3: 64 MiB windows of coalesced ranged GETs; disk: memory-mapped), each "
        "sample copied once, beside one read of the whole object (one GET; the file read whole into bytes), "
        f"{g('object_store_read_rounds')} rounds interleaved, median.",
        "",
        "| | local disk | S3 | S3 ÷ disk |",
        "|---|---|---|---|",
        f"| `write_shard`, MB/s | {_fmt(g('object_store_shard_disk_write_mb_s'))} | "
        f"{_fmt(g('object_store_shard_s3_write_mb_s'))} | {_fmt(g('object_store_shard_write_s3_vs_disk_ratio'))} |",
        f"| peak RSS the write adds, MiB | {_fmt(g('object_store_shard_disk_write_rss_mib'))} | "
        f"{_fmt(g('object_store_shard_s3_write_rss_mib'))} | |",
        f"| sequential read (`open_dataset` iteration), GB/s | {_fmt(g('object_store_read_disk_gb_s'))} | "
        f"{_fmt(g('object_store_read_s3_gb_s'))} | {_fmt(g('object_store_read_s3_vs_disk_ratio'))} |",
        f"| whole-object read, GB/s | {_fmt(g('object_store_read_disk_whole_gb_s'))} | "
        f"{_fmt(g('object_store_read_s3_whole_gb_s'))} | |",
        f"| iteration ÷ whole-object read | {_fmt(g('object_store_read_disk_vs_whole_ratio'))} | "
        f"{_fmt(g('object_store_read_s3_vs_whole_ratio'))} | |",
        f"| peak RSS the iteration adds, MiB | {_fmt(g('object_store_read_disk_rss_mib'))} | "
        f"{_fmt(g('object_store_read_s3_rss_mib'))} | |",
        "",
        f"- **Memory of an S3 upload.** The write adds {_fmt(g('object_store_shard_s3_write_rss_mib'))} MiB to the "
        f"{_fmt(before)} MiB the process held with the open shard "
        f"({_fmt(g('object_store_s3_write_rss_over_shard'))} of the shard's size), far under the "
        f"{g('object_store_upload_bound_mib')} MiB (five parts) the sink's documentation allows for and nowhere "
        "near a second copy of the shard: obstore's writer keeps the buffers it is handed (the buffer protocol, "
        "no copy), so the parts in flight are views of the open shard's own bytes.",
        f"- **One sample** of this size is mostly transfer on S3: {g('object_store_sample_mib_mean')} MiB at the "
        f"whole-object GET's {_fmt(g('object_store_read_s3_whole_gb_s'))} GB/s is {_transfer_ms(r)} ms; a cold "
        "handle adds the header's GET (the first 256 KiB of the shard). Locally both are page-cache copies.",
        "- **Reading.** Iterating a shard on S3 reaches the object store's own bandwidth: in 64 MiB windows of "
        "coalesced ranged GETs it runs at about the speed of one GET of the whole object. A local shard is memory-mapped from "
        "a warm page cache, so iteration there only maps and copies pages (faster than reading the file whole "
        "into fresh memory); on a cold disk both sides would be bound by the device. The RSS the local "
        "iteration adds is mapped page-cache pages, not allocations; on S3 it is one 64 MiB window and its copies.",
        "- **The sink.** Writes are synchronous in the sink's loop, so its throughput is 1 / (consume + verify + "
        "write) per byte. The S3 side pays loopback HTTP and SeaweedFS storing the parts (master, volume "
        "server, filer and gateway in one process, on the same two cores as the sink and the broker); the disk "
        "side a file write and fsync. A remote S3 service is bounded by the network instead: measure there.",
        "",
    ]


def _transfer_ms(r: dict[str, Any]) -> str:
    """The mean random sample's bytes at the S3 whole-object read's speed, in ms."""
    mib, gb_s = r.get("object_store_sample_mib_mean"), r.get("object_store_read_s3_whole_gb_s")
    return f"{mib * 2**20 / (gb_s * 1e9) * 1000:.1f}" if mib and gb_s else "–"


def _over_plain(r: dict[str, Any], figure: str) -> str:
    """The extraction engines' ``figure`` as a multiple of plain generation's."""
    plain = r.get(f"generation_profile_plain_{figure}")
    ours = [r.get(f"generation_profile_{name}_{figure}") for name in ("spec_only", "one_pass")]
    if not plain or None in ours:
        return "–"
    return " / ".join(f"{x / plain:.2f}x" for x in ours)


def _generation_profile_notes(r: dict[str, Any]) -> list[str]:
    return [
        "Where the difference to plain generation goes (spec_only / one_pass as multiples of plain, same batch):",
        "",
        f"- A decode step costs {_over_plain(r, 'decode_step_ms')}: vLLM's extraction proposer puts the sampled "
        "token in the draft slot, so every decode step runs two query tokens per request instead of one.",
        f"- Matmul time {_over_plain(r, 'matmul_ms')}: on this CPU the projections are compute-bound even at "
        "decode batch sizes, so the second query token costs close to what the first does. On a GPU decode is "
        "memory-bound (the weights are read once per step, whatever the token count), so the second token is "
        "nearly free there; not measured here (the lent GPU machines have no vLLM).",
        f"- Sampling {_over_plain(r, 'phase_sample_ms')}: each request goes through spec decoding's rejection "
        "sampler. The hsx connector itself (gather, codec, produce) is the step from spec_only to one_pass in "
        "the table above.",
        "- So on CPU, one pass beats two passes only by the prefill it saves (prompt + answer once more, "
        "batched and cheap per token) minus the decode overhead it adds per generated token; the longer the "
        "answers relative to the prompts, the smaller the gain.",
    ]


def _ratios(r: dict[str, Any], a: str, b: str) -> str:
    """Per-round ratios of two sides' tokens/s (rounds pair up by index)."""
    xs, ys = r.get(f"{a}_tokens_per_s_rounds"), r.get(f"{b}_tokens_per_s_rounds")
    if not xs or not ys:
        return "–"
    return ", ".join(f"{x / y:.2f}" for x, y in zip(xs, ys))


def _saving(r: dict[str, Any]) -> str:
    raw, sent = r.get("hsx_raw_bytes"), r.get("hsx_kafka_bytes")
    return f"{1 - sent / raw:.0%}" if raw and sent else "–"


def profile_notes(r: dict[str, Any]) -> str:
    g = _getter(r)
    return f"""## Fairness, profiles and what changed

**Why plain vLLM looked slower than hsx before (ratio 1.12).** Two configuration differences between the
engines, both from vLLM itself, not from hsx, and a fixed order:

- `reserve_cpu_num` 2 vs 1 in vLLM's log: vLLM's CPU backend reserves one more core for a KV connector
  whenever `kv_transfer_config` is set (`vllm/utils/ompmultiprocessing.py`, meant for NIXL). It only decides
  which cores the OpenMP threads get under `VLLM_CPU_OMP_THREADS_BIND=auto`; with the explicit binding used
  here (`0-1`, as `make test`/`make bench` set) both engines run 2 OpenMP threads on cores 0-1 and the log shows
  `reserved_cpus=[]` for both, so it is cosmetic. Under `auto` on this 2-core machine it would not be: the plain
  engine would keep one core for its scheduler and compute on one. Always bind explicitly when comparing.
- Async scheduling: vLLM turns it on by default but off for the `extract_hidden_states` speculative method
  (`vllm/config/vllm.py`). The baseline here is plain vLLM with async scheduling **off**, the same scheduler
  as both extraction engines; vLLM's default is measured beside it (`plain_async_vs_plain_ratio` =
  {_fmt(g('plain_async_vs_plain_ratio'))}, hsx ÷ that default = {_fmt(g('extraction_overhead_ratio_vs_async_default'))}).
- The old `bench/extraction.py` also ran the two engines in a fixed order (plain, then hsx) every round; the
  order now rotates.
- What remains: both extraction engines, hsx and vLLM's own files connector, tend to come out level with or
  above plain vLLM (per round, hsx ÷ plain {_ratios(r, 'hsx', 'plain')}; stock files ÷ plain
  {_ratios(r, 'files', 'plain')}). The stock connector shares the engine configuration but none of hsx's
  code, so this comes with vLLM's `extract_hidden_states` mode (it runs the speculative-decoding sampler
  path; vLLM logs "min_p and logit_bias parameters won't work with speculative decoding"), not with hsx; it
  was not isolated further. Read `extraction_overhead_ratio` ≥ 1 as "no measurable overhead", not as a
  speed-up.

**Profiles** (`py-spy record --subprocesses --threads --format raw` of the extractor and the sink during an
e2e round: `python -m bench.pipeline --rounds 1 --skip-rss --skip-two --profile DIR`; measured while other
tests ran on the machine, shares of samples):

- Extractor process tree: 57 % in torch ops of vLLM's worker (the forward pass), 23 % in `sched_yield` of
  vLLM's engine-core process (its shared-memory ring buffer busy-waits for the worker's result, which is why
  vLLM reserves a core for it), hsx's own code about 2.4 % (`encode_block` 1.7 %, the gather 0.3 %,
  producing 0.2 %) plus the service's event loop 2.3 % (most of it vLLM's `AsyncLLM` client). There is no
  hsx hot spot left on the extraction side: the connector costs what the codec costs.
- Sink: it was idle most of the round (about 1.2 s of CPU in a 14 s round): `write_atomic` (fsync) 23 %,
  `checksum` 8 %, `decode_block` (incl. `np.stack`) 7 %, and about 30 % serving `/metrics` to the benchmark's
  own poller (a benchmark artifact: it now polls at 5 Hz instead of 10 Hz).
- Timing `decode_block`'s parts (the sink's per-record work) on a 2 MB bf16 block: zstd 9.5 ms, and 14 ms
  of 27.6 ms in `np.stack(planes).T.tobytes()`, which reads each plane with a plane-sized stride.
  **Changed** (schemas/codec.py, its own commit): stack along axis 1, which writes each element's bytes
  side by side. Before/after, interleaved in one process on 1 MiB
  blocks: bf16 decode 98 → 249 MB/s, float32 104 → 399 MB/s (the machine was loaded; the codec table above
  is the after figure). Bit-exact; unit and extractor tests pass.
- Left as they are (outside this change's scope, noted for the sink's owner): the sink copies each sample
  three more times after decoding (`b"".join` of the blocks, `bytearray(...)` in `write_shard`, and
  safetensors' `save` into one `bytes`), and computes a whole-sample CRC for the ready event after every
  block's CRC was already verified.

**hsx vs the stock files connector on CPU.** Per round, hsx ÷ stock files was {_ratios(r, 'hsx', 'files')}
(hsx ÷ plain: {_ratios(r, 'hsx', 'plain')}; stock files ÷ plain: {_ratios(r, 'files', 'plain')}). Both
connectors do one gather per request and hand the rest to threads; on CPU at this model size both are
bound by the prefill, and the round-to-round spread on this shared machine is larger than the difference
between them. The profile above puts all of hsx's connector work at about 2.4 % of the extractor's samples,
most of it the codec (byteplane-zstd-1 on float32, which saves {_saving(r)} of the bytes here; `--codec none`
would drop that cost and that saving). What would separate them: on GPUs the stock connector allocates
pinned host memory for every request (`torch.empty_like(..., pin_memory=True)`), which hsx avoids with a
pool of pinned buffers and a side stream; bf16 models (the codec saves about a third of the bytes there,
see the codec table); and a slow or shared filesystem, where the stock connector creates a file and a lock
file per request from inside the engine while hsx's sink, off the engine's machine, writes large shards. None of these exists on this CPU machine, so the
ratio here says "as fast as", not "faster than".

**e2e vs extraction alone.** CPU seconds per round show where the whole pipeline loses
on this machine: extractor tree {g('pipeline_extract_cpu_extractor_s')} s alone vs
{g('pipeline_e2e_cpu_extractor_s')} s with the sink running, sink {g('pipeline_e2e_cpu_sink_s')} s, broker
{g('pipeline_e2e_cpu_broker_s')} s; within an e2e round the extraction itself finished after
{g('pipeline_e2e_extraction_done_s')} s (vs {g('pipeline_extract_s')} s alone) and the remaining
{_fmt(g('pipeline_e2e_tail_s'))} s (median) are the sink closing the last shards (`--max-shard-age`),
writing them and publishing ready events. The sink needs little CPU, but on 2 cores every slice it takes
preempts one of the engine's two OpenMP threads, and the other waits at the next barrier: the extractor
then burns more CPU for the same work. With the sink on cores of its own (a pod of its own in production)
that interference goes away; a longer shard age only moves the tail, which steady streaming never sees.
Giving the sink a lower CPU priority (nice {g('sink_nice')}, a third kind of round interleaved with the other
two) gave {_fmt(g('e2e_ratio_sink_niced'))}. Extraction alone also varied from round to round here
({g('pipeline_extract_tokens_per_s_rounds')} tokens/s) as other work came and went, which is as large as the
gap to the 0.85 target.

**LD_PRELOAD.** Every process of every side runs with the same `LD_PRELOAD` (`{g('ld_preload')}`, the
Intel OpenMP runtime in the venv; vLLM's CPU backend then sets `KMP_AFFINITY`/`KMP_BLOCKTIME`). Without it
vLLM warns that speculative decoding on CPU "will cause significant performance loss", and it does: in two
development runs of `bench.extraction` (3 rounds each, same code, machine loaded by other tests, so compare
ratios within a run only) hsx ÷ plain was 0.998 with libiomp5 and 0.76 without (per round 0.76, 0.63, 1.05),
HF transformers ran at 320–353 tokens/s with it and 76–158 without, and plain vLLM (no speculative method)
changed little. Both extraction engines (hsx and the stock files connector) use the `extract_hidden_states`
speculative method, so a comparison without libiomp5 would mostly measure GNU OpenMP against Intel OpenMP;
`python -m bench --preload none` runs it that way. tcmalloc is not installed on these machines (no PyPI
wheel; `libgoogle-perftools4` is a system package), so it was not tried.

"""
