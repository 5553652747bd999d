"""Markdown tables for the generated parts of the docs (reference.py and benchmark_tables.py both write them)."""

from __future__ import annotations

import re

PIPE_OUTSIDE_CODE = re.compile(r"(`[^`]*`)|\|")
"""A code span (kept: Python-Markdown's tables do not split a cell at a pipe inside backticks) or a bare pipe."""


def cell(text: str) -> str:
    """Text fit for one Markdown table cell: one line, pipes outside code escaped."""
    return PIPE_OUTSIDE_CODE.sub(lambda m: m[1] or "\\|", " ".join(text.split()))


def table(header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """A Markdown table; the columns numbered in `right` (numbers) are right-aligned."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
