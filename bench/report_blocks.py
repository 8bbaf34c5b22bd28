"""The building blocks of ``docs/benchmarks.md`` (:mod:`bench.report`): a page
is a sequence of blocks, each a paragraph template, a :class:`Table`, a
:class:`Bullets` list, or a block shown only :class:`When` a figure exists.
Templates name figures: ``{key}`` is the figure formatted (thousands separators,
3 or 1 decimals), ``{key!s}`` the figure as stored (a list of rounds, a model
name); a missing figure reads "–"."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

Results = Mapping[str, Any]


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


class Figures(string.Formatter):
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
