"""Heat- and memory-aware batching: fewer samples per micro-batch, more micro-batches, the same global batch.

Above `train.thermal_limit_c` the controller halves each rank's micro-batch and doubles gradient accumulation;
once the device is `HYSTERESIS_C` below the limit it steps back. A CUDA out-of-memory error does the same, and the
step is retried.

Under DDP each rank decides for itself: accumulation only changes how many local backward passes precede the one
synchronising backward, so ranks need not agree, and no collective is spent on it. Under FSDP every micro-batch's
forward and backward gather parameters with every rank, so all must run as many: the ranks agree at each check (one
all-reduce of what each wants; the hottest rank's wins), and an out-of-memory error is not retried (one rank alone
cannot change its count; its error stops the run rather than leaving the others waiting in a collective).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

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
    """Decides each step's accumulation (micro-batches per rank): the configured one times 1 up to `max_factor`.

    `agree`, where the ranks must run as many micro-batches (FSDP): takes the factor this rank wants and returns the
    one every rank runs, the largest; a collective, called on every rank at the same steps."""

    def __init__(
        self,
        base: int,
        limit_c: float | None,
        read: Callable[[], float | None],
        every: int,
        max_factor: int,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        self.base, self.limit_c, self.read, self.every, self.max_factor = base, limit_c, read, every, max_factor
        self.agree = agree
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
        wanted = self._wanted(self.last_c, self.limit_c)
        factor = wanted if self.agree is None else self.agree(wanted)
        if factor == self.factor:
            return None
        grew, self.factor = factor > self.factor, factor
        if factor != wanted or self.last_c is None:
            return f"another rank's heat: accumulation {self.accumulation}"
        if grew:
            return f"{self.last_c:.1f} °C > {self.limit_c:.1f} °C: accumulation {self.accumulation}"
        return f"{self.last_c:.1f} °C, cool again: accumulation {self.accumulation}"

    def _wanted(self, celsius: float | None, limit_c: float) -> int:
        if celsius is not None and celsius > limit_c and self.factor < self.max_factor:
            return self.factor * 2
        if celsius is not None and celsius < limit_c - HYSTERESIS_C and self.factor > 1:
            return self.factor // 2
        return self.factor

    def out_of_memory(self) -> str | None:
        """Halve the micro-batch after an OOM; None when it cannot shrink further, or the ranks must agree (`agree`):
        the error then stands."""
        if self.factor >= self.max_factor or self.agree is not None:
            return None
        self.factor *= 2
        return f"out of memory: accumulation {self.accumulation}"


def agree_max(device: torch.device) -> Callable[[int], int]:
    """:class:`Controller`'s `agree` over the default process group: the largest factor any rank wants."""

    def agree(wanted: int) -> int:
        most = torch.tensor([wanted], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    return agree
