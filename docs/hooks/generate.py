"""MkDocs hook (mkdocs.yml `hooks:`): the generated parts of the docs, and the benchmark plots.

A page line that is exactly `<!-- generated: NAME -->` becomes the Markdown NAME's generator returns, when the site is
built: the reference pages from the code (reference.py), the benchmark tables from benchmarks/results/
(benchmark_tables.py). An unknown NAME stops the build. A `docs/<page>.md#anchor` a generated text mentions (the
config's docstrings cite the explanation pages so) becomes a link, which the build's validation then checks.

MkDocs imports this file with its own folder on `sys.path` (the siblings below import as top-level modules); the
tests import them the same way (pyproject's `pythonpath`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

from benchmark_tables import RESULTS, TABLES
from reference import cli_reference, compression_methods, config_reference, inventory_reference, layout_reference

GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference,
    "cli": cli_reference,
    "layout": layout_reference,
    "inventory": inventory_reference,
    "compression-methods": compression_methods,
    **{f"benchmark:{name}": table for name, table in TABLES.items()},
}
"""Every NAME a `<!-- generated: NAME -->` line may use."""
MARKER = re.compile(r"^<!-- generated: (\S+) -->$", re.MULTILINE)
DOCS_LINK = re.compile(r"(?<![\w/`\[])(?<!\]\()docs/([\w./-]+\.md)(#[\w-]+)?")
"""`docs/measurements.md#powersgd-rank` in running text (not in code, not already a link)."""
PLOTS = "benchmarks/results"
"""Where the pages find the benchmark plots: the same path as in the repository, served from the site's root."""


def expand(markdown: str, page_uri: str) -> str:
    """`markdown` with every marker line replaced by its generated text (a PluginError names an unknown one), and
    the docs pages that text mentions linked relative to the page at `page_uri`."""

    def generated(match: re.Match[str]) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise PluginError(f"{page_uri}: unknown generated block {name!r} (known: {', '.join(GENERATORS)})")
        return link_docs(GENERATORS[name](), page_uri)

    return MARKER.sub(generated, markdown)


def link_docs(text: str, page_uri: str) -> str:
    """Each `docs/<page>.md#anchor` in `text` as a link to that page, relative to the page at `page_uri`."""
    here = posixpath.dirname(page_uri)
    return DOCS_LINK.sub(lambda m: f"[{m[0]}]({posixpath.relpath(m[1], here or '.')}{m[2] or ''})", text)


def on_page_markdown(markdown: str, page: Page, **_: object) -> str:
    """MkDocs event: a page's Markdown, before it is rendered."""
    return expand(markdown, page.file.src_uri)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs event: the site's files. MkDocs serves only what is under docs_dir; the plots stay in
    benchmarks/results/, beside the JSON they are drawn from, and are added here under the same path."""
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{PLOTS}/{plot.name}", abs_src_path=str(plot)))
    return files
