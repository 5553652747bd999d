"""Rows for people and for scripts: tables that fit an 80-column terminal, `--wide`, and `--json`.

Every CLI command that prints rows goes through :func:`print_rows` with a list of :class:`Col`: the default view
shows the columns that matter most, `--wide` shows every column (and every other key of the rows) with nothing
shortened, `--json` prints the rows themselves and nothing else on stdout.

Only columns declared free text are ever shortened. When the default view is wider than the terminal, free text is
shortened first (with an ellipsis), then optional columns are left out, and when even that is not enough the table
is printed wider than the terminal rather than cutting a run id or release id someone has to copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.cells import cell_len
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

GAP = 2
"""Cells between two columns (no borders: one space of padding on each side, as kubectl and gh print)."""
MIN_TEXT = 12
"""A free-text column shrinks to this many cells (or its header, if longer), no fewer."""


def cell(value: Any) -> str:
    """How a value looks in a table: None as empty, everything else as `str`."""
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Col:
    """One column of a table over row dicts."""

    key: str
    """The row key the column shows (and the key in `--json`)."""
    header: str = ""
    """Column heading (default: the key)."""
    text: bool = False
    """Free text that may be shortened with an ellipsis to fit. Every other column is shown whole: identifiers,
    status words and numbers mean nothing when cut."""
    optional: bool = False
    """In the default view only when the table fits the terminal with it."""
    wide: bool = False
    """Shown only with --wide."""
    below: bool = False
    """Long free text (why a device failed): in the default view printed under the table as `<first column>:
    <value>` for each row that has one, instead of as a column no terminal is wide enough for."""
    fmt: Callable[[Any], str] = cell
    """Value (None where a row lacks the key) → cell text; the JSON keeps the value itself."""
    justify: Literal["left", "right"] = "left"

    @property
    def heading(self) -> str:
        """The header shown."""
        return self.header or self.key


def print_rows(
    console: Console,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[Col],
    *,
    wide: bool = False,
    as_json: bool = False,
    title: str | None = None,
) -> None:
    """Print `rows` as a table of `columns` (the default view, or with `wide` every column and every other key the
    rows have; a column no row has is left out), or as JSON: the rows as they are, a list of objects, on stdout and
    nothing else with it."""
    if as_json:
        # Straight to stdout: rich would wrap long lines and highlight; default=str covers paths.
        print(json.dumps(list(rows), indent=2, default=str))
        return
    name = columns[0].key  # what names a row in the lines under the table
    keys = list(dict.fromkeys(k for row in rows for k in row))
    if rows:  # rows of different shapes share a view (a local rollback has `health`, an SSH one `reason`)
        columns = [c for c in columns if c.key in keys]
    if wide:
        shown = [*columns, *(Col(key) for key in keys if key not in {c.key for c in columns})]
        widths = _natural(shown, rows)  # --wide is for wide terminals and `less -S`: nothing is shortened
    else:
        shown, widths = _fit([c for c in columns if not c.wide and not c.below], rows, console.width)
    total = sum(widths) + GAP * (len(widths) - 1)
    table = Table(
        *(
            Column(c.heading, width=w, no_wrap=True, overflow="ellipsis", justify=c.justify)
            for c, w in zip(shown, widths, strict=True)
        ),
        box=None,
        pad_edge=False,
        # Wider than the terminal only when whole values need it; the terminal then wraps the lines, uncut.
        width=total if total > console.width else None,
    )
    for row in rows:
        table.add_row(*(Text(c.fmt(row.get(c.key))) for c in shown))  # Text: `[deploy] ...` is not markup
    if title:
        console.print(title, markup=False, highlight=False, soft_wrap=True)
    console.print(table, crop=False)
    for col in (c for c in columns if c.below and not wide):
        for row in rows:
            if row.get(col.key):
                console.print(f"{cell(row.get(name))}: {col.fmt(row[col.key])}", markup=False)


def _natural(columns: Sequence[Col], rows: Sequence[dict[str, Any]]) -> list[int]:
    """Each column's width: its header or its widest cell."""
    return [max([cell_len(c.heading), *(cell_len(c.fmt(row.get(c.key))) for row in rows)]) for c in columns]


def _fit(columns: Sequence[Col], rows: Sequence[dict[str, Any]], width: int) -> tuple[list[Col], list[int]]:
    """The columns of the default view and their widths: free text shortened, then optional columns left out
    (rightmost first), until the table fits in `width`; whatever is left when it still does not."""
    shown = list(columns)
    while True:
        widths = _natural(shown, rows)
        floors = [
            min(w, max(MIN_TEXT, cell_len(c.heading))) if c.text else w for c, w in zip(shown, widths, strict=True)
        ]
        excess = sum(widths) + GAP * (len(widths) - 1) - width
        shrink = min(excess, sum(widths) - sum(floors))
        for _ in range(max(shrink, 0)):  # one cell at a time off the widest shortenable column
            widest = max((i for i in range(len(shown)) if widths[i] > floors[i]), key=lambda i: widths[i])
            widths[widest] -= 1
        optional = [i for i, c in enumerate(shown) if c.optional]
        if excess <= shrink or not optional:
            return shown, widths
        del shown[optional[-1]]
