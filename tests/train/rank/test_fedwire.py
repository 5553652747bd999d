"""What federated devices send: their change in 8 bits with error feedback, rebuilt on the server; a change that
does not fit the model is refused, not averaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import build_model
from pipeline.train.rank import fedwire


def models_pair() -> tuple[list[np.ndarray], list[np.ndarray]]:
    torch.manual_seed(0)
    net = build_model("small_cnn", 10, 1)
    before = fedwire.state_arrays(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        net(torch.randn(4, 1, 8, 8))  # BatchNorm's running statistics and batch counters move too
    return before, fedwire.state_arrays(net)


def test_an_int8_change_rebuilds_the_model_within_its_rounding_and_is_a_quarter_the_size() -> None:
    before, after = models_pair()
    enc = fedwire.DeltaEncoder(fedwire.INT8)
    sent = enc.encode(before, after)
    rebuilt = fedwire.decode(before, sent, fedwire.INT8)
    for b, a, r in zip(before, after, rebuilt, strict=True):
        assert r.dtype == b.dtype
        if b.dtype.kind == "f":
            step = np.abs(a - b).max() / 127
            assert np.abs(r - a).max() <= step / 2 + 1e-7
        else:
            assert np.array_equal(r, a)  # batch counters exactly
    float_bytes = sum(a.nbytes for a in after if a.dtype.kind == "f")
    assert sum(s.nbytes for s in sent if s.dtype == np.int8) * 4 == float_bytes


def test_error_feedback_carries_what_rounding_left_out_into_the_next_round() -> None:
    before, after = models_pair()
    enc = fedwire.DeltaEncoder(fedwire.INT8)
    first = fedwire.decode(before, enc.encode(before, after), fedwire.INT8)
    # No further change: the second message carries what the first one's rounding left out.
    second = fedwire.decode(first, enc.encode(before, before), fedwire.INT8)
    floats = [i for i, b in enumerate(before) if b.dtype.kind == "f"]
    lost_once = max(np.abs(first[i] - after[i]).max() for i in floats)
    lost_twice = max(np.abs(second[i] - after[i]).max() for i in floats)
    assert lost_once > 0 and lost_twice < lost_once


def test_fp32_changes_are_exact() -> None:
    before, after = models_pair()
    rebuilt = fedwire.decode(before, fedwire.DeltaEncoder(fedwire.FP32).encode(before, after), fedwire.FP32)
    assert all(np.allclose(r, a, atol=1e-6) for r, a in zip(rebuilt, after, strict=True))


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda s: s[:-2], "arrays, expected"),
        (lambda s: [np.zeros((3, 3), np.int8), *s[1:]], "shape"),
        (lambda s: [s[0].astype(np.float32), *s[1:]], "expected int8"),
        (lambda s: [*s[:-1], s[-1][:-1]], "scales"),
    ],
)
def test_a_change_that_does_not_fit_the_model_is_refused(spoil, words: str) -> None:
    before, after = models_pair()
    sent = fedwire.DeltaEncoder(fedwire.INT8).encode(before, after)
    with pytest.raises(ValueError, match=words):
        fedwire.decode(before, spoil(sent), fedwire.INT8)
    with pytest.raises(ValueError, match="unknown change type"):
        fedwire.decode(before, sent, "pickle")
