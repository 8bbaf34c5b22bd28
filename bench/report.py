"""``docs/benchmarks.md`` from ``bench/results.json``: nothing in that page is
typed by hand except the method and the profile notes.

The page is a typed description (:mod:`bench.report_page`) made of the blocks of
:mod:`bench.report_blocks`; the targets it checks are :mod:`bench.report_targets`.
"""

from __future__ import annotations

from bench.report_blocks import Figures, Results
from bench.report_page import PAGE, derived
from bench.report_targets import targets

__all__ = ["render", "targets"]


def render(r: Results) -> str:
    """The whole page: its blocks, a blank line between each two."""
    figures = Figures({**r, **derived(r)})
    return "\n\n".join("\n".join(figures.lines(block)) for block in figures.present(PAGE)) + "\n"
