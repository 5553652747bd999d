"""pytest glue: skip where stand-in devices cannot run, and a fleet factory fixture that always cleans up."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .jetsons import JetsonFleet, harness_unavailable
from .specs import TargetSpec


def skip_unless_available(network: bool = False) -> None:
    """pytest.skip (with the reason) where this machine cannot run stand-in devices (with private links)."""
    reason = harness_unavailable(network)
    if reason:
        pytest.skip(reason)


@pytest.fixture
def jetson_fleet(tmp_path: Path) -> Iterator[Callable[..., JetsonFleet]]:
    """Factory of started fleets: `fleet = jetson_fleet(3)` or `jetson_fleet([TargetSpec(...), ...])`.

    It skips the test (with the reason) where the fleet cannot run. Every fleet it started is stopped at teardown,
    also when the test failed.
    """
    fleets: list[JetsonFleet] = []

    def start(targets: int | Sequence[TargetSpec] = 3, **options: Any) -> JetsonFleet:
        skip_unless_available(network=not isinstance(targets, int) and any(spec.network for spec in targets))
        fleet = JetsonFleet(tmp_path / f"fleet-{len(fleets)}", targets, **options)
        fleets.append(fleet)
        return fleet.start()

    yield start
    for fleet in fleets:
        fleet.close()
