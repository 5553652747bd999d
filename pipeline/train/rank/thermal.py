"""Heat- and memory-aware batching: fewer samples per micro-batch, more micro-batches, the same global batch.

Above `train.thermal_limit_c` the controller halves each rank's micro-batch and doubles gradient accumulation;
once the device is `HYSTERESIS_C` below the limit it steps back. A CUDA out-of-memory error does the same, and the
step is retried. Each rank decides for itself: accumulation only changes how many local backward passes precede
the one synchronising backward, so ranks need not agree, and no collective is spent on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline import host

HYSTERESIS_C = 5.0
"""Degrees below the limit before the micro-batch grows back: keeps it from flapping at the threshold."""
THERMAL_ZONES = Path("/sys/class/thermal")


def _read_celsius(path: Path) -> float | None:
    """A sysfs-style reading: millidegrees (Jetson zones) or degrees; None when unreadable."""
    try:
        value = float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return value / 1000.0 if value > 1000 else value


def _zones() -> float | None:
    readings = [_read_celsius(p) for p in sorted(THERMAL_ZONES.glob("thermal_zone*/temp"))]
    found = [r for r in readings if r is not None]
    return max(found, default=None)


def _nvidia_smi() -> float | None:
    try:
        return max((float(v) for v in host.nvidia_smi("temperature.gpu", timeout_s=5)), default=None)
    except ValueError:
        return None


def sensor(path: Path | None) -> Callable[[], float | None]:
    """The hottest reading, in °C, from `path` if given, else the thermal zones, else nvidia-smi (None if none)."""
    if path is not None:
        return lambda: _read_celsius(path)

    def hottest() -> float | None:
        zones = _zones()
        return zones if zones is not None else _nvidia_smi()

    return hottest


class Controller:
    """Decides each step's accumulation (micro-batches per rank): the configured one times 1 up to `max_factor`."""

    def __init__(
        self, base: int, limit_c: float | None, read: Callable[[], float | None], every: int, max_factor: int
    ) -> None:
        self.base, self.limit_c, self.read, self.every, self.max_factor = base, limit_c, read, every, max_factor
        self.factor = 1
        self.last_c: float | None = None

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step now."""
        return self.base * self.factor

    def check(self, step: int) -> str | None:
        """Read the sensor every `every` steps and adapt; returns why it changed, or None."""
        if self.limit_c is None or step % self.every:
            return None
        self.last_c = self.read()
        if self.last_c is None:
            return None
        if self.last_c > self.limit_c and self.factor < self.max_factor:
            self.factor *= 2
            return f"{self.last_c:.1f} °C > {self.limit_c:.1f} °C: accumulation {self.accumulation}"
        if self.last_c < self.limit_c - HYSTERESIS_C and self.factor > 1:
            self.factor //= 2
            return f"{self.last_c:.1f} °C, cool again: accumulation {self.accumulation}"
        return None

    def out_of_memory(self) -> str | None:
        """Halve the micro-batch after an OOM; None when it cannot shrink further (the error then stands)."""
        if self.factor >= self.max_factor:
            return None
        self.factor *= 2
        return f"out of memory: accumulation {self.accumulation}"
