"""The device side of training: the files a device imports to run `pipeline.train.rank.worker` (a rank) or
`pipeline.train.rank.federated` (a federated client), for `vermin`.

Found from the static import graph (grimp, which import-linter uses), so an import added to any of them is checked
too: these files must run on the oldest device Python (3.10, JetPack 6). `make test` passes them to vermin. Imports
under `if TYPE_CHECKING:` are left out: they never run (`pipeline.train` names the controller's `Topology` so).

Every import of a module the rank imports is followed, those inside its functions too (the rank may call them). A
package whose `__init__` runs only because it holds such a module (`pipeline.train`, the stage's controller, is the
parent of `pipeline.train.rank`) is listed, since its module body runs on the device, but only the imports in that
body are followed: its functions run on the controller, never on a device. A rank that imports the package itself,
`from pipeline.train import run`, makes it a module the rank imports: then all its imports are followed, and
pyproject.toml's contract "Training ranks import no controller code" breaks as well.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp

ENTRIES = ("pipeline.train.rank.worker", "pipeline.train.rank.federated", "pipeline.train.rank.selftest")


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def _imports_on_import(graph: grimp.ImportGraph, module: str) -> set[str]:
    """The modules `module` imports when it is imported: its imports outside function bodies."""
    tree = ast.parse(_source(module).read_text())
    in_functions = {
        node.lineno
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for node in ast.walk(function)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    return {
        imported
        for imported in graph.find_modules_directly_imported_by(module)
        for line in graph.get_import_details(importer=module, imported=imported)
        if line["line_number"] not in in_functions
    }


def device_modules(entries: tuple[str, ...] = ENTRIES) -> set[str]:
    """`entries`, every module they import directly or not, and the packages whose `__init__` importing them runs."""
    graph = grimp.build_graph("pipeline", "models", exclude_type_checking_imports=True)
    whole: set[str] = set()  # imported by the rank: all their imports followed
    body: set[str] = set()  # parents only: the imports their module body runs followed
    todo = [(entry, True) for entry in entries]
    while todo:
        module, imported = todo.pop()
        if module in whole or (module in body and not imported):
            continue
        (whole if imported else body).add(module)
        found = graph.find_modules_directly_imported_by(module) if imported else _imports_on_import(graph, module)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += [(m, True) for m in found] + [(p, False) for p in parents]
    return whole | body


def device_files(entries: tuple[str, ...] = ENTRIES) -> list[Path]:
    """The source files of :func:`device_modules`, sorted."""
    return sorted(_source(module).relative_to(Path.cwd()) for module in device_modules(entries))


if __name__ == "__main__":
    print(" ".join(str(path) for path in device_files()))
