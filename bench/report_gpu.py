"""The benchmarks page's section on the lent GPU host: ``bench.gpu_check`` (the
connector's CUDA gather and the codec on the host's cores) and
``bench.gpu_draft`` (speculators' EAGLE-3 training on hsx data), beside the CPU
run of the same training where there is one."""

from __future__ import annotations

from collections.abc import Iterator

from bench.report_blocks import Block, Cells, Results, Table, When, fmt


def _codec_rows(r: Results) -> Iterator[Cells]:
    for threads in (1, 4, 8, 16):
        if f"gpu_codec_threads_{threads}_encode_mb_s" in r:
            yield (str(threads), f"{{gpu_codec_threads_{threads}_encode_mb_s}}",
                   f"{{gpu_codec_threads_{threads}_decode_mb_s}}")


def _ratio(r: Results, key: str) -> str:
    return f"{fmt(r[key])}×" if key in r else "–"


def _draft_rows(r: Results) -> Iterator[Cells]:
    yield ("steps", "{gpu_draft_steps}", "{gpu_draft_cpu_steps}", "")
    yield ("wall time of `speculators train`, s", "{gpu_draft_train_s}", "{gpu_draft_cpu_train_s}", "")
    yield ("tokens/s over the whole run (train split × epochs ÷ wall time)", "{gpu_draft_tokens_per_s}",
           "{gpu_draft_cpu_tokens_per_s}", _ratio(r, "gpu_draft_speedup_vs_cpu"))
    yield ("tokens/s per step (speculators' own count, median)", "{gpu_draft_profile_tokens_per_s_median}",
           "{gpu_draft_cpu_profile_tokens_per_s_median}", _ratio(r, "gpu_draft_step_speedup_vs_cpu"))
    yield ("tokens/s between logged steps within an epoch", "{gpu_draft_steady_tokens_per_s}", "", "")
    steps, rate = r.get("gpu_draft_steps"), r.get("gpu_draft_steady_steps_per_s")
    yield ("of the wall time, s in steps at that rate", fmt(round(steps / rate, 1)) if steps and rate else "–", "", "")
    yield ("peak GPU memory allocated / reserved, GiB", "{gpu_draft_peak_memory_gib} / {gpu_draft_peak_reserved_gib}",
           "", "")


GPU: tuple[Block, ...] = (When("gpu_device", (
    "## On a GPU host",
    "`python -m bench.gpu_check` on {gpu_device!s} (torch {gpu_torch!s}), no vLLM: hsx's CUDA gather "
    "(`CudaGatherer`: side stream, pinned pool, event) against `gather_cpu` on {gpu_check_cases} random requests "
    "of 1 to 8,192 tokens, bit-exact: {gpu_gather_bit_exact!s}; its fp8 path against `hsx.codecs.fp8`, bit-exact: "
    "{gpu_fp8_bit_exact!s}. Gather + device-to-host copy of an 8,192-token request (4 layers × 4,096, bf16) into "
    "the pinned pool: {gpu_gather_d2h_bf16_gb_s} GB/s ({gpu_gather_d2h_bf16_tokens_per_s} tokens/s); quantized "
    "to fp8 on the device first: {gpu_gather_d2h_fp8_gb_s} GB/s of codes and scales "
    "({gpu_gather_d2h_fp8_tokens_per_s} tokens/s). The codec (`byteplane-zstd`) on the host's cores, over "
    "{gpu_codec_bytes} bytes of synthetic bf16 rows (ratio {gpu_codec_ratio}), against the "
    "{gpu_codec_target_mb_s} MB/s an H200 prefilling Qwen3-8B makes (4 layers): it keeps up from "
    "{gpu_codec_threads_to_keep_up!s} threads.",
    Table(("threads", "encode MB/s", "decode MB/s"), _codec_rows),
    When("gpu_draft_train_s", (
        "**Draft training.** `python -m bench.gpu_draft`: speculators' ({gpu_draft_speculators!s}) EAGLE-3 `train` "
        "with the acceptance benchmark's flags on {gpu_draft_device!s}, on the first {gpu_draft_rows_packed} rows "
        "of its export ({gpu_draft_bundle_hidden_states_mb} MB of hidden states in byteplane-zstd: the host takes "
        "64 MiB of files) repeated {gpu_draft_repeat} times ({gpu_draft_rows} rows, about the tokens of the "
        "export's {gpu_draft_export_rows}), and a slim verifier: the {gpu_draft_verifier_rows_kept} of its "
        "{gpu_draft_verifier_rows} vocabulary rows training reads, the others zero; every file rebuilt on the host "
        "matched its original ({gpu_draft_rebuilt_bit_exact!s}). speculators' defaults but the loss "
        "({gpu_draft_loss_implementation!s}: its fused Triton loss does not trace under the host's torch "
        "{gpu_draft_torch!s}). Beside it, the offline arm of the acceptance benchmark: the same flags on the whole "
        "export, two CPU cores.",
        Table(("", "GPU", "2 CPU cores", "GPU ÷ CPU"), _draft_rows),
        "Most of the GPU's wall time is starting and compiling (flex attention: the first step and the first "
        "validation); the steps run at {gpu_draft_steady_steps_per_s} per second, "
        "{gpu_draft_profile_step_ms_median} ms each, with one DataLoader worker (`--num-workers 1`). Its loss "
        "({gpu_draft_loss_first} to {gpu_draft_loss_last}) and validation accuracy ({gpu_draft_val_full_acc!s}) are "
        "on rows seen {gpu_draft_repeat} times, and its held-out rows are copies of them: they say nothing about a "
        "draft.",
    )),
)),)
