"""Warnings raised inside libraries reach the debug log, not the user's terminal; `--verbose` shows them.

Each case runs in a Python of its own: routing replaces process-wide state (`warnings.showwarning`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# A module named like a library, warning at import time as asyncssh does under cryptography 46 and newer.
LIBRARY = textwrap.dedent(
    """
    import types, warnings
    lib = types.ModuleType("somelib")
    exec("import warnings\\nwarnings.warn('somelib: old API', DeprecationWarning)", lib.__dict__)
    """
)

ROUTE = "from pipeline.library_warnings import route_library_warnings\nroute_library_warnings()\n"


def python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A new interpreter with every warning enabled (PYTHONWARNINGS=default), as a wary user might run it."""
    base = {k: v for k, v in os.environ.items() if k != "PIPELINE_VERBOSE"}
    env = {**base, "PYTHONWARNINGS": "default", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_without_routing_the_library_warning_is_printed() -> None:
    """The control: this is what users saw."""
    assert "somelib: old API" in python("-c", LIBRARY).stderr


def test_routed_warnings_are_held_and_printed_only_when_asked() -> None:
    code = (
        ROUTE
        + LIBRARY
        + textwrap.dedent(
            """
        import os, sys, warnings
        from pipeline.library_warnings import show_debug_log
        print("-- verbose --", file=sys.stderr, flush=True)
        show_debug_log()
        warnings.warn("later: another", UserWarning)
        print(os.environ["PIPELINE_VERBOSE"], file=sys.stderr)
        """
        )
    )
    before, after = python("-c", code).stderr.split("-- verbose --\n")
    assert before == ""
    held, later, child_env = after.strip().splitlines()
    assert "DeprecationWarning: somelib: old API" in held
    assert "UserWarning: later: another" in later
    assert child_env == "1"


def test_pipeline_verbose_in_the_environment_shows_them_from_the_start() -> None:
    code = ROUTE + LIBRARY
    assert "somelib: old API" in python("-c", code, env={"PIPELINE_VERBOSE": "1"}).stderr


def test_cli_verbose_prints_the_library_warnings_before_the_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml")
    cli = "import sys\nfrom pipeline.cli import main\nsys.argv = ['pipeline', *sys.argv[1:]]\nmain()\n"
    code = ROUTE + LIBRARY + cli
    for flags, shown in (([], False), (["--verbose"], True)):
        proc = python("-c", code, *flags, "deploy", "plan", "--inventory", str(bad))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines[-1].startswith(f"error: {bad}: "), proc.stderr
        assert ("somelib: old API" in proc.stderr) is shown, proc.stderr
        assert len(lines) == 1 or shown


def test_the_cli_over_asyncssh_prints_one_line_under_every_warning(tmp_path: Path) -> None:
    """`deploy status` imports asyncssh, which warns on import under cryptography 46+ (the lock's included)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml")
    proc = python("-m", "pipeline", "deploy", "status", "--inventory", str(bad))
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: {bad}: invalid TOML"), proc.stderr
