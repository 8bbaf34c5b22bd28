"""The learning loop's part of ``docs/benchmarks.md`` (``bench.loop``)."""

from __future__ import annotations

from collections.abc import Iterator

from bench.report_blocks import Block, Cells, Results, Table, When, fmt


def _loop_rows(r: Results) -> Iterator[Cells]:
    """One row per arm ``bench.loop`` ran."""
    names = {"static": "static draft", "loop": "the loop (`--learn`), from the static draft",
             "untrained": "the loop from an untrained draft"}
    for arm, title in names.items():
        windows = r.get(f"loop_{arm}_windows")
        if not windows:
            continue
        gate = r.get(f"loop_{arm}_gate")
        yield (title, fmt(windows[0]["acceptance_length"]), fmt(windows[-1]["acceptance_length"]),
               ", ".join(fmt(p) for p in r[f"loop_{arm}_last_per_position"]),
               fmt(r[f"loop_{arm}_mean_output_tokens_per_s"]), fmt(r[f"loop_{arm}_failed"]),
               ", ".join(str(v) for v in r[f"loop_{arm}_versions"]),
               "–" if gate is None else f"{gate['promoted']} / {gate['kept']} / {gate['refused']}",
               fmt(r.get(f"loop_{arm}_trainer_steps")))


LOOP: tuple[Block, ...] = (When("loop_stream", (
    "## The learning loop (`python -m bench.loop`)",
    "{loop_model!s}, CPU, 3 speculative tokens, greedy. The draft both arms start from was trained offline on chat "
    "({loop_static_draft!s}; acceptance length {loop_static_chat_acceptance_length} on held-out chat). The stream: "
    "{loop_stream} requests for code (Python standard-library functions, then methods, by signature and docstring, "
    "`bench/loop_prompts.py`, sha256 {loop_stream_sha256!s}), a shift the draft never saw, sent in windows of "
    "{loop_window} at concurrency {loop_concurrency}, `max_tokens` {loop_max_tokens}, the same prompts in the same "
    "order to each arm: `hsx serve --draft` static, and with `--learn` (a checkpoint every {loop_checkpoint_every} "
    "steps, judged by the gate, promoted ones swapped in). Acceptance length from vLLM's own counters per window; "
    "the trainer shares the server's two cores (its own pod in production), which the loop's tokens/s carry, and "
    "trains about one sample for five served: between windows the loop waits until it has trained on what was "
    "served and the gate judged its latest checkpoint (waited {loop_loop_catch_up_s} s in all), as a trainer on "
    "hardware of its own keeps up.",
    Table(("arm", "first window", "last window", "last window by position", "output tokens/s (mean)",
           "failed requests", "draft versions served", "gate: promoted / kept / refused", "trainer steps"),
          _loop_rows),
    "Last window, the loop ÷ static: {loop_last_vs_static} ({loop_last_minus_static} tokens); over the "
    "{loop_swapped_windows} windows a promoted draft served: {loop_swapped_vs_static} "
    "({loop_swapped_minus_static} tokens). From an untrained "
    "draft, requests until a window reaches the static draft's on the same prompts: "
    "{loop_untrained_requests_to_static}. Capture while speculating ÷ speculating alone (vLLM's server with the same "
    "draft and flags, no connector; output tokens/s, paired bursts of code requests): c = 1 "
    "{loop_capture_c1_vs_speculating} (rounds {loop_capture_c1_vs_speculating_rounds!s}), c = 8 "
    "{loop_capture_c8_vs_speculating} (rounds {loop_capture_c8_vs_speculating_rounds!s}). The picture: "
    "`docs/learning.md`.",
)),)

