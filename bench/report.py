"""``docs/benchmarks.md`` from ``bench/results.json``: nothing in that page is
typed by hand except the method and the profile notes.

The page is a typed description (:mod:`bench.report_page`): a sequence of blocks,
each a paragraph template, a :class:`Table`, a :class:`Bullets` list, or a block
shown only :class:`When` a figure exists. Templates name figures: ``{key}`` is
the figure formatted (thousands separators, 3 or 1 decimals), ``{key!s}`` the
figure as stored (a list of rounds, a model name); a missing figure reads "–".
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

Results = Mapping[str, Any]

LENGTHS = [256, 512, 1024, 2048, 4096]
DATASET_CODECS = ["raw", "byteplane-zstd", "fp8", "fp8-zstd", "fp8-zstd-3"]

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


def fmt(value: Any) -> str:
    """A figure for the page: "–" when missing, floats to 3 decimals under 10 and
    to 1 above, integers with thousands separators."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


# -- the page's building blocks -------------------------------------------------------------

Cells = tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A markdown table: a header and rows of cell templates, or a function of the
    results that returns the rows."""

    header: Cells
    rows: tuple[Cells, ...] | Callable[[Results], Iterable[Cells]]


@dataclass(frozen=True)
class Bullets:
    """A list, one template per item (or a :class:`When` of items)."""

    items: tuple[Union[str, When], ...]


@dataclass(frozen=True)
class When:
    """``blocks`` only where the results hold ``key``."""

    key: str
    blocks: tuple[Block, ...]


Block = Union[str, Table, Bullets, When]
"""A paragraph (or heading) template, a table, a list, or blocks shown on a condition."""


class _Figures(string.Formatter):
    """Fills a template from the results (see the module docstring)."""

    def __init__(self, results: Results) -> None:
        self.results = results

    def get_value(self, key: int | str, args: Any, kwargs: Any) -> Any:
        return self.results.get(str(key))

    def convert_field(self, value: Any, conversion: str | None) -> str:
        if value is None:
            return "–"
        return str(value) if conversion == "s" else fmt(value)

    def present(self, blocks: Iterable[Block]) -> Iterator[str | Table | Bullets]:
        """``blocks`` with each :class:`When` replaced by its blocks, or by none."""
        for block in blocks:
            if isinstance(block, When):
                if block.key in self.results:
                    yield from self.present(block.blocks)
            else:
                yield block

    def lines(self, block: str | Table | Bullets) -> list[str]:
        if isinstance(block, Table):
            rows = block.rows(self.results) if callable(block.rows) else block.rows
            return [_row(block.header), "|" + "---|" * len(block.header),
                    *(_row(self.format(cell) for cell in row) for row in rows)]
        if isinstance(block, Bullets):
            return ["- " + self.format(item) for item in self.present(block.items)]  # type: ignore[arg-type]
        return [self.format(block)]


def _row(cells: Iterable[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def render(r: Results) -> str:
    """The whole page: its blocks, a blank line between each two."""
    from bench.report_page import PAGE, derived

    figures = _Figures({**r, **derived(r)})
    return "\n\n".join("\n".join(figures.lines(block)) for block in figures.present(PAGE)) + "\n"
