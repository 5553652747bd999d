"""`sign`: 1 bit per gradient entry and an fp32 scale per output channel, with error feedback; small tensors whole.

One asynchronous all_gather per bucket (:mod:`.sparse`), which overlaps the backward pass like DDP's own all-reduce.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import math

import torch

from pipeline.train.compression import sparse
from pipeline.train.compression.method import Bucket, Knobs

WHOLE_BELOW = 1024
"""`sign` sends tensors of fewer entries whole, besides vectors: a small model's stem and head as signs cost the
quickstart accuracy (docs/measurements.md#sign-what-goes-whole-and-one-scale-per-channel)."""

_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
_SIGNS_OF_BYTE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _BIT_SHIFTS) & 1).float() * 2 - 1
"""The eight ±1.0 a packed byte stands for: unpacking is one lookup per byte (twice as fast as shifting bits)."""


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """1 bit per element (1 for >= 0), 8 to a byte, most significant first; padded with ones."""
    bits = tensor.flatten() >= 0
    bits = torch.cat([bits, bits.new_ones((-bits.numel()) % 8)]).view(-1, 8).view(torch.uint8)
    return (bits << _BIT_SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """±1.0 per element from :func:`pack_signs` output."""
    return _SIGNS_OF_BYTE.to(packed.device).index_select(0, packed.long()).flatten()[:numel]


def row_scales(segments: list[torch.Tensor], shapes: list[torch.Size]) -> torch.Tensor:
    """The mean magnitude of each row (output channel: the first dimension) of each tensor, in fp32."""
    rows = [seg.view(shape[0], -1).abs().mean(1) for seg, shape in zip(segments, shapes, strict=True)]
    return torch.cat(rows).float()


def scaled_signs(packed: torch.Tensor, scales: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
    """Each tensor's unpacked signs times its rows' scales (:func:`row_scales`), multiplied in place tensor by tensor
    (a `repeat_interleave` of the scales cost as much as the rest of sign's arithmetic on resnet18)."""
    sizes = [shape.numel() for shape in shapes]
    signs = unpack_signs(packed, sum(sizes))
    for segment, shape, scale in zip(signs.split(sizes), shapes, scales.split([s[0] for s in shapes]), strict=True):
        segment.view(shape[0], -1).mul_(scale.unsqueeze(1))
    return signs


def sends_whole(param: torch.Tensor) -> bool:
    """Whether `sign` sends this parameter's gradient as it is rather than as signs: vectors (biases, norm scales
    and shifts, which torch's PowerSGD hook leaves uncompressed too:
    docs/torch-distributed.md#vectors-and-rows-in-compression) and tensors of fewer than :data:`WHOLE_BELOW`
    entries."""
    return param.dim() <= 1 or param.numel() < WHOLE_BELOW


def size(params: list[torch.Tensor]) -> int:
    """Bytes sign sends for a bucket of these parameters: the packed bits and an fp32 scale per row of each signed
    tensor, and the tensors it sends whole at their own dtype."""
    signed = [p for p in params if not sends_whole(p)]
    whole = sum(p.numel() * p.element_size() for p in params if sends_whole(p))
    return math.ceil(sum(p.numel() for p in signed) / 8) + 4 * sum(p.shape[0] for p in signed) + whole


def _partition(segments: tuple[torch.Tensor, ...], whole: list[bool]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A bucket's per-tensor segments split into those sent as signs and those sent whole, each in bucket order."""
    pairs = list(zip(segments, whole, strict=True))
    return [seg for seg, w in pairs if not w], [seg for seg, w in pairs if w]


def _compress(state: sparse.SparseState, bucket: Bucket, knobs: Knobs) -> torch.futures.Future[torch.Tensor]:
    corrected = state.corrected(bucket)
    params = bucket.parameters()
    whole = [sends_whole(p) for p in params]
    segments = corrected.split([p.numel() for p in params])
    signed, kept = _partition(segments, whole)
    shapes = [p.shape for p, w in zip(params, whole, strict=True) if not w]
    sizes, kept_sizes = [seg.numel() for seg in signed], [seg.numel() for seg in kept]
    exact = torch.cat(kept) if kept else corrected.new_empty(0)
    # A scale per output channel (PowerSGD's rows: docs/torch-distributed.md#vectors-and-rows-in-compression).
    # Gradients differ by orders of magnitude between layers and between a layer's channels, so one scale per tensor
    # loses accuracy (docs/measurements.md#sign-what-goes-whole-and-one-scale-per-channel).
    scales = row_scales(signed, shapes) if signed else corrected.new_empty(0).float()
    packed = pack_signs(torch.cat(signed) if signed else corrected.new_empty(0))
    for seg, sent in zip(signed, scaled_signs(packed, scales, shapes).split(sizes), strict=True):
        seg.sub_(sent)
    for seg in kept:
        seg.zero_()
    state.residuals[bucket.index()] = corrected  # what the signs did not carry
    lengths = [packed.numel(), 4 * scales.numel(), exact.numel() * exact.element_size()]

    def decode(parts: list[torch.Tensor]) -> torch.Tensor:
        mean = torch.zeros_like(corrected)
        out_signed, out_kept = _partition(mean.split([seg.numel() for seg in segments]), whole)
        for part in parts:
            bits, their_scales, their_exact = part.split(lengths)
            got = scaled_signs(bits, their_scales.clone().view(torch.float32), shapes).split(sizes)
            got_kept = their_exact.clone().view(corrected.dtype).split(kept_sizes)
            for seg, value in zip(out_signed + out_kept, got + got_kept, strict=True):
                seg.add_(value)
        return mean.div_(len(parts))

    payload = torch.cat([packed, scales.view(torch.uint8), exact.view(torch.uint8)])
    return state.gather(payload, decode)


METHOD = sparse.method(
    "sign",
    "1 bit per entry and an fp32 scale per output channel (vectors and small tensors whole), error feedback.",
    _compress,
    lambda params, knobs: size(params),
)
