"""Warnings raised inside third-party libraries go to the debug log, never to the user's terminal.

Python's `warnings` are how libraries (cryptography, asyncssh, torch, onnx, Prefect) tell the code that calls them
about deprecations and odd calls: news for this project's maintainers, not for a user, who can do nothing about them
and whose one-line errors they would bury (cryptography 46+ warns five times whenever asyncssh is imported). The
project speaks to users in its own printed lines (`warning: ...`, `error: ...`), which this does not touch.

Every entry point (the CLI, each training rank, the flows) calls `route_library_warnings` before importing the
libraries, since several warn at import time. Until `show_debug_log` is called (`pipeline --verbose`), the routed
warnings are held in memory; then they, and every later one, are printed to stderr. `PIPELINE_VERBOSE=1` in the
environment shows them from the start, and is how `--verbose` reaches the processes the CLI starts (torchrun's ranks).
See docs/install.md#library-warnings.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import warnings
from typing import Any

VERBOSE_ENV = "PIPELINE_VERBOSE"
"""Set to 1 to print library warnings (and the project's debug log) to stderr; `--verbose` sets it for children."""

LOG = logging.getLogger("pipeline.library_warnings")
# Until --verbose, the last records wait here; a full buffer is dropped (into the NullHandler), so memory stays bounded.
_held = logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL + 1, target=logging.NullHandler())


def _to_debug_log(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """`warnings.showwarning`'s signature; the text is what Python would have printed, on one record."""
    LOG.debug("%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())


def route_library_warnings() -> None:
    """Send every warning from now on to the debug log instead of stderr (held until `show_debug_log`)."""
    warnings.showwarning = _to_debug_log
    LOG.setLevel(logging.DEBUG)
    LOG.propagate = False  # Prefect's and the root logger's handlers would print them at WARNING level
    if _held not in LOG.handlers:
        LOG.addHandler(_held)
    if os.environ.get(VERBOSE_ENV) == "1":
        show_debug_log()


def show_debug_log() -> None:
    """Print the held library warnings and every later one to stderr, here and in the processes started from here."""
    os.environ[VERBOSE_ENV] = "1"
    _held.setTarget(logging.StreamHandler(sys.stderr))
    _held.flushLevel = logging.DEBUG
    _held.flush()
