"""`topk`: the largest `topk_fraction` of each bucket's entries (values fp32, indices int32), with error feedback.

One asynchronous all_gather per bucket (:mod:`.sparse`), which overlaps the backward pass like DDP's own all-reduce.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import math

import torch

from pipeline.train.compression import sparse
from pipeline.train.compression.method import Bucket, Knobs

MIN_ENTRIES = 2048
"""Fewest entries `topk` sends by default: fewer lost a small CNN's accuracy
(docs/measurements.md#top-k-how-many-entries)."""
FRACTIONS = (0.01, 0.1)
"""Range of the default `topk_fraction`: 1% for large models, 10% at most (docs/measurements.md, as above)."""
SAMPLE_STRIDE = 100
"""`topk` sets its selection threshold from every 100th entry of a bucket (112 k of resnet18's 11.2 M gradients)."""
OVERSELECT = 2.0
"""The threshold is aimed at keeping twice the k entries sent, so sampling noise rarely leaves fewer than k."""


def default_fraction(numel: int) -> float:
    """1% of the gradients, but at least :data:`MIN_ENTRIES` of them and at most 10%."""
    low, high = FRACTIONS
    return min(high, max(low, MIN_ENTRIES / numel))


def fraction(knobs: Knobs) -> float:
    """The `topk_fraction` set, else the default for the model's size."""
    set_ = knobs.train.topk_fraction
    return set_ if set_ is not None else default_fraction(knobs.numel)


def size(numel: int, fraction: float) -> int:
    """Entries top-k sends for a bucket of `numel` gradients: at least one."""
    return max(1, math.ceil(numel * fraction))


def largest(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest entries of the 1-D `magnitude`: the same set as `magnitude.topk(k)`, found faster.

    On a CPU, `topk` over a whole bucket dominated top-k's encoding (docs/measurements.md#top-k-selection-on-a-cpu).
    A threshold read off every :data:`SAMPLE_STRIDE`-th entry keeps about :data:`OVERSELECT` times k candidates, a
    superset of the k largest whenever it keeps at least k, and `topk` runs on those alone; a threshold that keeps
    fewer falls back to the full `topk`. Setting the threshold from a sample is Deep Gradient Compression's (Lin et
    al., ICLR 2018, system performance analysis); here it only narrows the search, so the result is exact. On a GPU
    `topk` is fast already, and the candidates' count would make the hook wait for the device, so there it runs on
    the whole bucket.
    """
    n = magnitude.numel()
    sample = magnitude[::SAMPLE_STRIDE]
    above = math.ceil(OVERSELECT * k * sample.numel() / n)
    # A threshold narrows nothing when k is a large share of the bucket.
    if magnitude.device.type != "cpu" or above >= sample.numel():
        return magnitude.topk(k, sorted=False).indices
    threshold = sample.topk(above, sorted=False).values.min()
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def _compress(state: sparse.SparseState, bucket: Bucket, knobs: Knobs) -> torch.futures.Future[torch.Tensor]:
    corrected = state.corrected(bucket)
    k = size(corrected.numel(), fraction(knobs))
    index = largest(corrected.abs(), k)
    values = corrected[index]
    corrected[index] = 0.0
    state.residuals[bucket.index()] = corrected
    # One collective: the int32 indices travel bit-for-bit inside the fp32 payload.
    payload = torch.cat([values.float(), index.to(torch.int32).view(torch.float32)])

    def decode(parts: list[torch.Tensor]) -> torch.Tensor:
        dense = torch.zeros_like(corrected)
        for part in parts:
            dense.index_add_(0, part[k:].view(torch.int32).long(), part[:k].to(dense.dtype))
        return dense.div_(len(parts))

    return state.gather(payload, decode)


METHOD = sparse.method(
    "topk",
    "The largest `topk_fraction` of each bucket's entries (default scaled to the model), with error feedback.",
    _compress,
    lambda params, knobs: 8 * size(sum(p.numel() for p in params), fraction(knobs)),
)
