"""What travels in federated training: the global model down in 32-bit floats, each device's change since it up,
in 8 bits (one scale per tensor, with error feedback) or in 32 bits. Arrays are in the order of the model's
`state_dict()`, BatchNorm's running statistics and counters included, as Flower's ndarrays.

Shared by the device (:mod:`pipeline.train.rank.federated`) and the server (:mod:`pipeline.train.cluster.federated`).
A change that does not fit the global model (its count, a shape, a type) is refused with ValueError: it comes from
a device, and is that device's failure, not the server's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.train.compression.localsgd import quantise_int8

INT8 = "int8-delta"
FP32 = "fp32-delta"
KINDS = {"int8": INT8, "fp32": FP32}
"""`train.federated.delta` → the tensor type a device's change travels as."""


def state_arrays(model: nn.Module) -> list[np.ndarray]:
    """The model's whole state as arrays (copies), in `state_dict()` order."""
    return [t.detach().cpu().numpy().copy() for t in model.state_dict().values()]


def load_arrays(model: nn.Module, arrays: list[np.ndarray]) -> None:
    """Load arrays in `state_dict()` order into the model, in place; ValueError when they do not fit it."""
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ValueError(f"{len(arrays)} arrays for a model of {len(state)} tensors")
    with torch.no_grad():
        for (name, tensor), array in zip(state.items(), arrays, strict=True):
            if tuple(array.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {list(array.shape)}, the model's is {list(tensor.shape)}")
            tensor.copy_(torch.from_numpy(np.asarray(array)))


class DeltaEncoder:
    """A device's change since the global model, as it is sent; in 8 bits, what rounding left out of one round is
    added to the next round's change (error feedback, as `localsgd_int8` does between ranks)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.residual: list[torch.Tensor] = []

    def encode(self, before: list[np.ndarray], after: list[np.ndarray]) -> list[np.ndarray]:
        """The change from `before` to `after`: float tensors as int8 (then one fp32 array of their scales, last) or
        as fp32; integer tensors (BatchNorm's batch counters) as exact differences."""
        floats = [i for i, a in enumerate(before) if a.dtype.kind == "f"]
        out = [(b - a) for a, b in zip(before, after, strict=True)]
        if self.kind == FP32:
            return [o.astype(np.float32) if i in floats else o for i, o in enumerate(out)]
        changes = [torch.from_numpy(out[i].astype(np.float32)) for i in floats]
        quantised, scales, self.residual = quantise_int8(changes, self.residual)
        for i, q in zip(floats, quantised, strict=True):
            out[i] = q.numpy()
        return [*out, scales.numpy()]


def decode(global_arrays: list[np.ndarray], sent: list[np.ndarray], kind: str) -> list[np.ndarray]:
    """The device's model: the global model plus the change it sent (`kind`: INT8 or FP32)."""
    if kind not in (INT8, FP32):
        raise ValueError(f"unknown change type {kind!r}")
    floats = [i for i, a in enumerate(global_arrays) if a.dtype.kind == "f"]
    scale_of = {i: k for k, i in enumerate(floats)}
    expected = len(global_arrays) + (kind == INT8)
    if len(sent) != expected:
        raise ValueError(f"{len(sent)} arrays, expected {expected}")
    scales = sent[-1] if kind == INT8 else None
    if scales is not None and (scales.dtype != np.float32 or scales.shape != (len(floats),)):
        raise ValueError(f"scales: {scales.dtype} {list(scales.shape)}, expected float32 [{len(floats)}]")
    model = []
    for i, (base, change) in enumerate(zip(global_arrays, sent, strict=False)):
        if change.shape != base.shape:
            raise ValueError(f"tensor {i}: shape {list(change.shape)}, the model's is {list(base.shape)}")
        if scales is not None and i in scale_of:
            if change.dtype != np.int8:
                raise ValueError(f"tensor {i}: {change.dtype}, expected int8")
            change = change.astype(np.float32) * scales[scale_of[i]]
        elif change.dtype.kind != base.dtype.kind:
            raise ValueError(f"tensor {i}: {change.dtype}, expected {base.dtype}")
        model.append((base + change).astype(base.dtype))
    return model
