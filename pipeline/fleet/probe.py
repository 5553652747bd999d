"""What a device is: board model, L4T release, JetPack and TensorRT versions, free space, temperature.

One remote shell script prints `key=value` lines (device tree, /etc/nv_tegra_release, dpkg-query, df, thermal
zones); `parse_facts` turns them into :class:`Facts`, from which `pipeline.fleet.classes.DeviceClass.probed` names
the engines the device can load.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from dataclasses import dataclass, field

from pipeline.layout import CURRENT, PREVIOUS, RELEASES

SOCS = {
    "nvidia,tegra264": ("thor", "sm110"),
    "nvidia,tegra234": ("orin", "sm87"),
    "nvidia,tegra194": ("xavier", "sm72"),
    "nvidia,tegra186": ("tx2", "sm62"),
    "nvidia,tegra210": ("nano", "sm53"),
}
"""Device-tree SoC → (family, CUDA compute capability)."""
_MODEL_FAMILIES = (("thor", "nvidia,tegra264"), ("orin", "nvidia,tegra234"), ("xavier", "nvidia,tegra194"))
_L4T = re.compile(r"# R(\d+) \(release\), REVISION: ([0-9.]+)")


def probe_script(root: str) -> str:
    """The read-only script run on the device; `root` is the deploy root (its nearest existing parent is measured)."""
    dt = "/sys/firmware/devicetree/base"
    return f"""
dt={dt}; [ -r $dt/model ] || dt=/proc/device-tree
echo "model=$(tr -d '\\0' < $dt/model 2>/dev/null)"
echo "compatible=$(tr '\\0' ' ' < $dt/compatible 2>/dev/null)"
echo "l4t=$(head -1 /etc/nv_tegra_release 2>/dev/null)"
dpkg-query -W -f='pkg=${{Package}} ${{Version}}\\n' nvidia-jetpack tensorrt libnvinfer10 libnvinfer8 2>/dev/null
d={shlex.quote(root)}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
echo "free_kb=$(df -Pk "$d" | awk 'NR==2 {{print $4}}')"
for z in /sys/class/thermal/thermal_zone*; do
  [ -r "$z/temp" ] && echo "thermal=$(cat "$z/type" 2>/dev/null) $(cat "$z/temp")"
done
echo "hostname=$(hostname)"
cd {shlex.quote(root)} 2>/dev/null && echo "current=$(readlink {CURRENT})" && echo "previous=$(readlink {PREVIOUS})"
true
"""


@dataclass
class Facts:
    """One device as probed."""

    model: str = ""
    soc: str = ""
    l4t: str = ""
    jetpack: str = ""
    tensorrt: str = ""
    free_bytes: int | None = None
    temperatures: dict[str, float] = field(default_factory=dict)
    hostname: str = ""
    current: str = ""
    previous: str = ""

    @property
    def max_temp_c(self) -> float | None:
        """Hottest thermal zone in °C, None without zones."""
        return max(self.temperatures.values()) if self.temperatures else None


def parse_facts(text: str) -> Facts:
    """Facts from the probe script's output; unknown lines are ignored, missing ones stay empty."""
    facts = Facts()
    for line in text.splitlines():
        key, _, value = line.partition("=")
        value = value.strip()
        if key == "model":
            facts.model = value
        elif key == "compatible":
            facts.soc = value.split()[-1] if value.split() else ""
        elif key == "l4t":
            facts.l4t = _l4t(value)
        elif key == "pkg":
            _package(facts, value)
        elif key == "free_kb" and value.isdigit():
            facts.free_bytes = int(value) * 1024
        elif key == "thermal":
            _thermal(facts, value)
        elif key in ("hostname", "current", "previous"):
            setattr(facts, key, value.removeprefix(f"{RELEASES}/"))
    if not facts.soc:
        facts.soc = next((soc for word, soc in _MODEL_FAMILIES if word in facts.model.lower()), "")
    return facts


def _l4t(line: str) -> str:
    """'# R36 (release), REVISION: 4.3, ...' → '36.4.3'."""
    match = _L4T.match(line)
    return f"{match[1]}.{match[2]}" if match else ""


def _package(facts: Facts, value: str) -> None:
    name, _, version = value.partition(" ")
    if name == "nvidia-jetpack":
        facts.jetpack = version.split("+")[0].split("-")[0]
    elif name in ("tensorrt", "libnvinfer10", "libnvinfer8") and not facts.tensorrt:
        facts.tensorrt = ".".join(version.split("-")[0].split(".")[:3])


def _thermal(facts: Facts, value: str) -> None:
    zone, _, milli = value.rpartition(" ")
    with contextlib.suppress(ValueError):
        facts.temperatures[zone or f"zone{len(facts.temperatures)}"] = int(milli) / 1000
