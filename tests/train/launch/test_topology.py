"""This host's place in a torchrun job: the ranks it runs, and the placements refused before anything starts (the
launcher's own test checks that nothing does)."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.train.launch.topology import SINGLE_NODE, Topology


def test_the_flag_overrides_the_configs_rank_count() -> None:
    assert SINGLE_NODE.check(1) == 1
    assert Topology(nproc_per_node=1).check(4096) == 1  # the config's 4096 would be refused; the flag's 1 is not


def test_a_second_node_needs_the_rendezvous_and_a_rank_below_nnodes() -> None:
    assert Topology(nnodes=2, node_rank=1, rdzv_endpoint="h:1").check(1) == 1
    with pytest.raises(PipelineError, match=r"^--node-rank: must be in \[0, 2\), got 2$"):
        Topology(nnodes=2, node_rank=2, rdzv_endpoint="h:1").check(1)
    with pytest.raises(PipelineError, match=r"^--nnodes: must be at least 1, got 0$"):
        Topology(nnodes=0).check(1)
