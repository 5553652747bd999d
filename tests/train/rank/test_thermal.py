"""The heat controller against a real temperature file."""

from __future__ import annotations

from pathlib import Path

from pipeline.train.rank import thermal


def test_controller_halves_the_micro_batch_when_hot_and_restores_it_when_cool(tmp_path: Path) -> None:
    temp = tmp_path / "temp"
    ctl = thermal.Controller(base=1, limit_c=70.0, read=thermal.sensor(temp), every=2, max_factor=4)
    temp.write_text("60000\n")
    assert ctl.check(0) is None and ctl.accumulation == 1
    temp.write_text("75500\n")
    assert ctl.check(1) is None  # not a reading step
    assert "75.5 °C > 70.0 °C: accumulation 2" in (ctl.check(2) or "")
    assert ctl.check(4) is not None and ctl.accumulation == 4
    assert ctl.check(6) is None and ctl.accumulation == 4  # at the most it may split
    temp.write_text("67000\n")
    assert ctl.check(8) is None and ctl.accumulation == 4  # within the hysteresis band
    temp.write_text("64\n")  # plain degrees are read too
    assert "cool again: accumulation 2" in (ctl.check(10) or "")
    assert ctl.check(12) is not None and ctl.accumulation == 1


def test_out_of_memory_halves_until_it_cannot() -> None:
    ctl = thermal.Controller(base=2, limit_c=None, read=lambda: None, every=1, max_factor=2)
    assert ctl.check(0) is None  # no limit: never reads
    assert ctl.out_of_memory() == "out of memory: accumulation 4"
    assert ctl.out_of_memory() is None


def test_unreadable_sensor_changes_nothing(tmp_path: Path) -> None:
    ctl = thermal.Controller(base=1, limit_c=50.0, read=thermal.sensor(tmp_path / "absent"), every=1, max_factor=8)
    assert ctl.check(0) is None and ctl.accumulation == 1 and ctl.last_c is None


def test_ranks_that_must_split_alike_follow_the_hottest_and_do_not_retry_alone() -> None:
    """FSDP's case (its `agree` is an all-reduce MAX; tests/train/rank/test_strategy.py runs it on two ranks)."""
    wanted: list[int] = []

    def agree(factor: int) -> int:
        wanted.append(factor)
        return max(factor, 4)  # another rank is hotter

    ctl = thermal.Controller(base=1, limit_c=70.0, read=lambda: 40.0, every=1, max_factor=8, agree=agree)
    assert ctl.check(0) == "another rank's heat: accumulation 4" and wanted == [1]
    assert ctl.check(1) is None and wanted == [1, 2]  # this rank is cool: it asks for half, the other holds 4
    assert ctl.out_of_memory() is None and ctl.accumulation == 4
