"""What each stand-in device is: its board (model, L4T release, JetPack packages) and its harness options."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
SIZE_RE = re.compile(r"[1-9][0-9]*[kmg]?")
SYSTEM_DIRS = frozenset(
    f"/{d}" for d in ("bin", "dev", "etc", "lib", "lib64", "proc", "root", "run", "sbin", "sys", "tmp", "usr", "var")
)


@dataclass(frozen=True)
class Board:
    """What a stand-in device says about itself. Values follow real JetPack installs; GCIDs and dates are examples."""

    model: str
    """Device-tree model, e.g. "NVIDIA Jetson AGX Orin Developer Kit" (NUL-terminated on the device)."""
    compatible: tuple[str, ...]
    """Device-tree compatible list; the last entry names the SoC (nvidia,tegra234 = Orin, tegra194 = Xavier)."""
    l4t: str
    """First line of /etc/nv_tegra_release."""
    packages: Mapping[str, str]
    """What `dpkg-query -W` reports: package -> version."""

    @property
    def tensorrt(self) -> str:
        """TensorRT version the stand-in trtexec claims, from the `tensorrt` package ("10.3.0.30-1+cuda12.5")."""
        return self.packages.get("tensorrt", "10.3.0.30").split("-")[0]


AGX_ORIN_JP62 = Board(
    model="NVIDIA Jetson AGX Orin Developer Kit",
    compatible=("nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"),
    l4t="# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025",
    packages={"nvidia-jetpack": "6.2+b77", "tensorrt": "10.3.0.30-1+cuda12.5"},
)
ORIN_NANO_JP62 = Board(
    model="NVIDIA Jetson Orin Nano Developer Kit",
    compatible=("nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"),
    l4t=AGX_ORIN_JP62.l4t,
    packages=AGX_ORIN_JP62.packages,
)
XAVIER_NX_JP513 = Board(
    model="NVIDIA Jetson Xavier NX Developer Kit",
    compatible=("nvidia,p3509-0000+p3668-0001", "nvidia,p3668-0001", "nvidia,tegra194"),
    l4t="# R35 (release), REVISION: 5.0, GCID: 35550185, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Feb 20 04:46:31 UTC 2024",
    packages={"nvidia-jetpack": "5.1.3-b29", "tensorrt": "8.5.2.2-1+cuda11.4"},
)


@dataclass(frozen=True)
class TargetSpec:
    """One stand-in device to start."""

    name: str
    """Inventory name; also the hostname unless `hostname` is set."""
    board: Board = AGX_ORIN_JP62
    hostname: str = ""
    disk_size: str = "64m"
    """Size of the deploy-root tmpfs (tmpfs `size=` syntax: 512k, 64m, 1g); small values make disk-full tests."""
    deploy_root: str = "/opt/edge"
    """Deploy root on the device. Its parent must exist on the host; the device sees an empty tmpfs there."""
    thermal_c: Mapping[str, float] = field(default_factory=lambda: {"cpu-thermal": 45.0, "gpu-thermal": 44.5})
    """Thermal zones in order (thermal_zone0, 1, ...): type -> degrees Celsius."""
    in_known_hosts: bool = True
    """False leaves this device's host key out of the fleet's known_hosts (unknown-host-key tests)."""
    host_dirs: tuple[str, ...] = ()
    """Host directories the device sees read-only although its fresh /root, /tmp, ... would hide them: e.g. the
    prefix of an interpreter under /root (pyenv), so that the device can run the controller's Python."""
    network: bool = False
    """True: the device gets its own network namespace and a veth link to the host (see :mod:`.network`), and is
    reached at a 10.213.x.y address on port 22; its link can then be shaped and cut. False: 127.0.0.1:<free port>."""

    def __post_init__(self) -> None:
        root = PurePosixPath(self.deploy_root)
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"target name {self.name!r}: use letters, digits, '.', '_', '-'")
        if not SIZE_RE.fullmatch(self.disk_size):
            raise ValueError(f"{self.name}: disk_size {self.disk_size!r} is not a tmpfs size such as 64m")
        if not root.is_absolute() or ".." in root.parts or len(root.parts) < 3 or str(root.parent) in SYSTEM_DIRS:
            raise ValueError(
                f"{self.name}: deploy_root {self.deploy_root!r} must be absolute, two levels deep or more, "
                "and not directly in a system directory (its parent is covered by an empty tmpfs)"
            )


def default_specs(count: int, prefix: str = "orin", board: Board = AGX_ORIN_JP62) -> list[TargetSpec]:
    """`count` specs named orin-01, orin-02, ... on the same board."""
    return [TargetSpec(f"{prefix}-{i:02d}", board=board) for i in range(1, count + 1)]
