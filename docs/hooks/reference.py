"""The reference pages' generated parts, read from the code: the config, the CLI, the run directory, the inventory.

Each public function returns Markdown for one `<!-- generated: NAME -->` line (docs/hooks/generate.py maps the names).
What a page says about a key, a command or a file is the docstring or help text the code carries, so changing one
changes the page and nothing else needs editing.
"""

from __future__ import annotations

import ast
import inspect
import io
import itertools
import json
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from markdown_table import table
from pipeline import layout, manifest
from pipeline.cli import app
from pipeline.config import Config, toml_value
from pipeline.fleet import inventory
from pipeline.train.compression import registry

BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
"""annotated-types' constraint attributes (what `Field(ge=...)` leaves in a field's metadata), as symbols."""
NAMES = {int: "integer", float: "float", str: "string", bool: "boolean", Path: "path"}
"""How a TOML user calls Python's scalar types."""


def constraints(metadata: list[Any]) -> list[str]:
    """A field's bounds and pattern (pydantic keeps `Field(ge=1, pattern=...)` as metadata objects), as text."""
    found = []
    for item in metadata:
        for attr, symbol in BOUNDS.items():
            if getattr(item, attr, None) is not None:
                found.append(f"{symbol} {getattr(item, attr)}")
        if getattr(item, "pattern", None):
            found.append(f"matching `{item.pattern}`")
    return found


def kinds(annotation: Any, metadata: list[Any]) -> list[str]:
    """What a value of `annotation` may be, one alternative per union member, bounds included."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return [k for arg in args for k in kinds(arg, metadata)]
    if origin is typing.Annotated:  # a union member with its own Field(...): its bounds are in that FieldInfo
        inner = [m for info in args[1:] if isinstance(info, FieldInfo) for m in info.metadata]
        return kinds(args[0], metadata + inner)
    if origin is Literal:
        return [f"`{json.dumps(a)}`" for a in args]
    if annotation is type(None):
        return ["unset"]
    if origin is list:
        return ["list of " + " or ".join(kinds(args[0], []))]
    if origin is dict:
        return [f"table of {' or '.join(kinds(args[1], []))} values"]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ["table"]
    name = NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return [" ".join([name, ", ".join(constraints(metadata))]).strip()]


def toml(value: Any) -> str:
    """A default as it would be written in TOML (a nested section, also inside a list, as its inline table)."""
    return toml_value(to_jsonable_python(value))


def default(field: FieldInfo) -> str:
    """The field's default as a table cell: TOML, "unset" for None, "required" when there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{toml(value)}`"


def nested(annotation: Any) -> type[BaseModel] | None:
    """The model of a `list[Model]` field (an array of TOML tables), else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def model_tables(model: type[BaseModel], key: str, heading: str, intro: str = "", level: int = 2) -> Iterator[str]:
    """One heading and table per TOML table: `model`'s fields under the dotted `key` (after `intro`, else the
    model's docstring), then a heading and table for each of its arrays of tables."""
    rows, arrays = [], []
    for name, field in model.model_fields.items():
        dotted = f"{key}.{name}" if key else name
        item = nested(field.annotation)
        if item is None:
            kind = " or ".join(kinds(field.annotation, field.metadata))
        else:
            arrays.append((item, f"{dotted}[]", f"[[{dotted}]]"))
            kind = f"array of tables (`[[{dotted}]]`, below)"
        rows.append([f"`{dotted}`", kind, default(field), field.description or ""])
    yield f"{'#' * level} `{heading}`\n\n{intro or model.__doc__ or ''}\n"
    yield table(["key", "type", "default", "description"], rows)
    for item, dotted, title in arrays:
        yield from model_tables(item, dotted, title, level=level + 1)


def config_reference(config: type[BaseModel] = Config) -> str:
    """Every section of the pipeline config: one heading per TOML table, one row per key, from the pydantic models
    (type and bounds from the annotations and `Field` constraints, the description from each field's docstring)."""
    parts = []
    for name, section in config.model_fields.items():
        model = section.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), f"Config.{name} is not a table"
        parts += model_tables(model, name, f"[{name}]", intro=section.description or "")
    return "\n".join(parts)


def commands(command: Any, ctx: Any) -> Iterator[tuple[Any, Any]]:
    """Every command under `command` (itself first), with its context, groups walked depth-first in their order."""
    yield command, ctx
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if not sub.hidden:
                yield from commands(sub, type(ctx)(sub, info_name=name, parent=ctx))


def cli_reference() -> str:
    """Every command and subcommand of `pipeline`: usage, help text, and each argument and option as `--help` shows
    it (names, metavar, help, default)."""
    root = typer.main.get_command(app)
    parts = []
    for command, ctx in commands(root, root.context_class(root, info_name="pipeline")):
        usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
        parts.append(f"## `{ctx.command_path}`\n\n```\n{usage}\n```\n\n{inspect.cleandoc(command.help or '')}\n")
        params = [p for p in command.get_params(ctx) if p is not command.get_help_option(ctx)]
        records = [record for p in params if (record := p.get_help_record(ctx))]
        if records:
            parts.append(table(["argument or option", "description"], [[f"`{n}`", h] for n, h in records]))
    return "\n".join(parts)


def comments(source: str) -> dict[int, str]:
    """Each line's comment (`# ...`, without the hash), by line number."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a class (a dataclass, a TypedDict: runtime keeps none of them), by name."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    docs = {}
    for field, after in itertools.pairwise(node.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[field.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def layout_groups() -> list[tuple[str, list[list[str]]]]:
    """pipeline/layout.py's names with their values, grouped as the module groups them: a comment line above a
    name opens a group."""
    source = inspect.getsource(layout)
    notes = comments(source)
    groups: list[tuple[str, list[list[str]]]] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.lineno - 1 in notes:
                groups.append((notes[node.lineno - 1], []))
            groups[-1][1].append([f"`{getattr(layout, node.targets[0].id)}`", f"`layout.{node.targets[0].id}`"])
    return groups


def layout_reference() -> str:
    """The run directory's names as pipeline/layout.py declares them, the paths made from a name, and what the
    manifest records for each stage (pipeline/manifest.py: `StageResult` and `Lineage`)."""
    parts = []
    for note, rows in layout_groups():
        title, _, rest = note.partition(": ")
        parts.append(f"### {title}\n\n{rest[:1].upper()}{rest[1:]}\n")
        parts.append(table(["path", "in code"], rows))
    functions = [f for _, f in inspect.getmembers(layout, inspect.isfunction) if f.__module__ == layout.__name__]
    rows = []
    for function in functions:
        names = list(inspect.signature(function).parameters)
        call = f"layout.{function.__name__}({', '.join(names)})"
        rows.append([f"`{function(*(f'<{n}>' for n in names))}`", f"`{call}`", inspect.getdoc(function) or ""])
    parts.append("### Paths made from a name\n")
    parts.append(table(["path", "in code", "note"], rows))
    stage, lineage = attribute_docs(manifest.StageResult), attribute_docs(manifest.Lineage)
    entry = [[f"`{k}`", stage.get(k, "")] for k in manifest.StageResult.__dataclass_fields__]
    entry += [[f"`{k}`", lineage.get(k, "")] for k in manifest.Lineage.__annotations__]
    parts.append(f"### A stage's entry in `{layout.MANIFEST}`\n\n`stages.<name>` holds:\n")
    parts.append(table(["key", "what it holds"], entry))
    return "\n".join(parts)


def inventory_reference() -> str:
    """The fleet inventory's tables, `[[targets]]` and `[policy]`, from pipeline/fleet/inventory.py's models; which
    target keys `[defaults]` may set comes from the module too."""
    only = " and ".join(f"`{k}`" for k in inventory.SshTarget.model_fields if k not in inventory.DEFAULT_KEYS)
    defaults = f"Every key but {only} may also be set once for all targets in `[defaults]`; a target's own value wins."
    targets = model_tables(inventory.SshTarget, "", "[[targets]]", intro=f"{inventory.SshTarget.__doc__} {defaults}")
    return "\n".join([*targets, *model_tables(inventory.Policy, "", "[policy]")])


def compression_methods() -> str:
    """The table of gradient compression methods, as the registry renders it."""
    return registry.table()
