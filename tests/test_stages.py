"""The stage table: every stage declares what it reads, and what it reads an earlier stage declares it writes."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.stages import STAGES, stage_named


def test_each_stage_record_is_under_its_cheap_name():
    assert [stage_named(name).name for name in STAGES] == list(STAGES)


def test_every_input_is_an_earlier_stages_output():
    written: set[str] = set()
    for stage in map(stage_named, STAGES):
        assert set(stage.inputs) <= written, f"{stage.name} reads {set(stage.inputs) - written}, written by no one"
        written |= set(stage.outputs.values())


def test_an_unknown_stage_is_one_line_naming_the_known_ones():
    with pytest.raises(PipelineError, match=r"unknown stage 'bulid' \(known: train, consolidate, export, build"):
        stage_named("bulid")
