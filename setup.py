"""Build hooks: record the git revision a wheel or sdist is built from, for `pipeline --version`.

The package itself is described in pyproject.toml; this file only adds these two commands.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
RECORD = Path("pipeline/_revision.py")


def record_revision(base: Path) -> None:
    """Write the checkout's revision to `base`/pipeline/_revision.py; without git nothing is written (building from
    an sdist, whose own record then ships as it is)."""
    # Loaded by path: the package's dependencies need not be installed at build time.
    spec = importlib.util.spec_from_file_location("_pipeline_version", ROOT / "pipeline" / "version.py")
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    revision = version.git_revision(ROOT)
    if revision is None:
        return
    path = base / RECORD
    path.unlink(missing_ok=True)  # in an sdist's tree it may be a hard link to a source file
    path.write_text(f'"""Written by setup.py at build time."""\n\nREVISION = {revision!r}\n')


class BuildPy(build_py):
    """build_py that also records the revision in the built package."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install asks git at run time, so it follows new commits
            record_revision(Path(self.build_lib))


class Sdist(sdist):
    """sdist that also records the revision, so wheels built from it (no .git there) know it."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        record_revision(Path(base_dir))


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
