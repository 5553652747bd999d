"""Reading DCP checkpoints without unpickling what a user could have planted: for consolidate and for resume.

DCP reads a checkpoint's `.metadata` with bare `pickle.load` and its non-tensor items (optimizer hyperparameters,
step counters) with `torch.load(weights_only=False)`: a crafted file runs code on every rank that loads it. Here
the metadata goes through an unpickler that resolves only DCP's own record types, and non-tensor items through
`torch.load(weights_only=True)`. Whatever either refuses is a one-line PipelineError naming the file.
"""

from __future__ import annotations

import enum
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from pipeline.errors import PipelineError
from pipeline.files import first_line

METADATA = ".metadata"
_RECORDS = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_SAFE_MODULES = {module for module, _ in _SAFE_GLOBALS} | {_RECORDS}


def _enum_member(cls: object, name: str) -> enum.Enum:
    """`getattr` as Python 3.11.0-3.11.3 pickle an enum member (by name), allowed for nothing but enum members.

    Debian 12's python3 is 3.11.2: its DCP metadata holds `builtins.getattr(_MEM_FORMAT_ENCODING, "TORCH_...")`
    where later Pythons write the member's value (docs/torch-distributed.md#enum-pickles-by-python-version).
    """
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"refusing to load getattr({cls!r}, {name!r})")


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the plain record types a DCP `.metadata` file is made of."""

    def find_class(self, module: str, name: str) -> Any:
        """Return an allowed global; refuse everything else without importing it."""
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module in _SAFE_MODULES:
            found = super().find_class(module, name)
            record = module == _RECORDS and isinstance(found, type) and found.__module__ == module
            if record or (module, name) in _SAFE_GLOBALS or isinstance(found, torch.dtype):
                return found
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_metadata(step_dir: Path) -> Metadata:
    """The checkpoint's metadata, read through the guarded unpickler; a one-line error when missing or refused."""
    path = step_dir / METADATA
    try:
        with path.open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise PipelineError(f"{step_dir}: not a complete DCP checkpoint ({METADATA} is missing)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, OSError) as err:
        raise PipelineError(f"{path}: corrupt checkpoint metadata: {err}") from None
    if not isinstance(metadata, Metadata):
        raise PipelineError(f"{path}: corrupt checkpoint metadata: holds a {type(metadata).__name__}")
    return metadata


class _Reader(FileSystemReader):
    """FileSystemReader whose metadata comes from :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The guarded metadata (per-rank metadata files are not used by this project's checkpoints)."""
        return read_metadata(Path(self.path))


class _Planner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode one non-tensor item (floats, ints, strings, lists, dicts: all `weights_only` allows)."""
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise PipelineError(f"refusing checkpoint item {read_item.dest_index.fqn}: {first_line(err)}") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def load(state: dict[str, Any], step_dir: Path, no_dist: bool = False) -> None:
    """`dcp.load(state, checkpoint_id=step_dir)`, in place, with the guarded metadata and non-tensor items;
    `no_dist` reads without a process group (consolidate). Unreadable data is a one-line PipelineError."""
    with warnings.catch_warnings():
        # Loading without a process group is the point of `no_dist`; DCP warns about it anyway.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=_Reader(step_dir), planner=_Planner(), no_dist=no_dist)
        except dcp.CheckpointException as err:
            causes = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
            cause = causes[0] if causes else err
            detail = str(cause) if isinstance(cause, PipelineError) else first_line(cause, typed=True)
            raise PipelineError(f"{step_dir}: cannot read checkpoint: {detail}") from None
