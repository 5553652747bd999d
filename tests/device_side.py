"""The device side of training: the files a device imports to run `pipeline.train.rank.worker`, for `vermin`.

Found from the static import graph (grimp, which import-linter uses), so an import added to any of them is checked
too: these files must run on the oldest device Python (3.10, JetPack 6).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grimp

ENTRY = "pipeline.train.rank.worker"
CONTROLLER_ONLY = {"pipeline.train.cluster.rounds"}
"""Imported only inside the train stage's controller path (`pipeline/train/__init__.py`, for cluster training),
which a device never runs: the graph cannot tell a function's import from the module's, so it is cut here."""


def device_modules(entry: str = ENTRY) -> set[str]:
    """`entry`, every module it imports directly or not, and the packages whose `__init__` importing them runs."""
    graph = grimp.build_graph("pipeline", "models")
    found: set[str] = set()
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in found or module in CONTROLLER_ONLY:
            continue
        found.add(module)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += [*graph.find_upstream_modules(module), *parents]
    return found


def device_files(entry: str = ENTRY) -> list[Path]:
    """The source files of :func:`device_modules`, sorted."""
    files = []
    for module in device_modules(entry):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        files.append(Path(spec.origin).relative_to(Path.cwd()))
    return sorted(files)


if __name__ == "__main__":
    print(" ".join(str(path) for path in device_files()))
