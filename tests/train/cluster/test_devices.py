"""`train.devices`: how many of the inventory's devices the SSH job needs, checked against the inventory."""

import pytest

from pipeline.errors import PipelineError
from pipeline.train.cluster import bounds


def test_devices_bounds_against_the_inventory():
    """What the pattern cannot say (min <= max, enough devices) is checked against the inventory before the SSH job
    starts anything (`run_on_devices` calls `bounds` first)."""
    assert bounds(None, 3) == (3, 3) and bounds("2", 3) == (2, 2) and bounds("2:5", 3) == (2, 3)
    with pytest.raises(PipelineError, match=r"^train\.devices: '3:2': needs 1 <= min <= max$"):
        bounds("3:2", 4)
    with pytest.raises(PipelineError, match=r"^train\.devices: '4' needs at least 4 devices; the inventory lists 3$"):
        bounds("4", 3)
