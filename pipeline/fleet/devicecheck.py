"""What a device can train with: run there as ``python3 - ROOT`` with this file on stdin; prints one JSON object.

It reports the interpreter, torch, CUDA and the GPU, free memory and disk, the power mode and clocks where they
are readable, the Python packages the device side of training needs but lacks, and the version of the `pipeline`
code the interpreter would import (found on its path without importing it). The controller imports the same file
for :func:`code_version`, so both sides compute the version by one rule.

Standard library only, and no syntax newer than Python 3.6 (checked by vermin in `make test`): it must run, and say
what is wrong, on the interpreter it is judging, however old.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

CODE_PACKAGES = ("pipeline", "models")
"""The packages whose files make up the code version, and what is shipped to a device."""
CODE_SUFFIXES = (".py", ".sh", ".toml")
SKIPPED = ("_revision.py",)
"""Written by a wheel build (the git revision): not code, and absent from a checkout."""
REQUIREMENTS = (
    ("torch", "torch>=2.5"),
    ("torchvision", "torchvision"),
    ("numpy", "numpy>=1.26"),
    ("pydantic", "pydantic>=2.7"),
    ("sklearn", "scikit-learn>=1.4"),
    ("tqdm", "tqdm>=4.66"),
    ("safetensors", "safetensors>=0.4.3"),
)
"""(import name, pip requirement) of what the device side of training imports; docs/how-to/install-on-device.md
lists them."""
FEDERATED = ("flwr", "flwr>=1.30")
"""What federated training's client imports besides (`train.mode = "federated"`): Flower, whose last release for
Python 3.10 (JetPack 6) is 1.30."""
TOMLI = ("tomli", "tomli>=2.0")
"""Python 3.10 has no tomllib: `pipeline.config` falls back to tomli there."""


def is_code_file(relpath):
    """True for a file that belongs to the code version (`relpath` uses '/' and starts with the package)."""
    parts = relpath.split("/")
    return (
        parts[0] in CODE_PACKAGES
        and "__pycache__" not in parts
        and parts[-1] not in SKIPPED
        and parts[-1].endswith(CODE_SUFFIXES)
    )


def code_version(entries):
    """sha256 (first 16 hex digits) over `(relpath, sha256 hex)` pairs: the same files give the same version."""
    digest = hashlib.sha256()
    for relpath, file_sha in sorted(entries):
        digest.update("{}\0{}\n".format(relpath, file_sha).encode())
    return digest.hexdigest()[:16]


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _entries_in_dir(base):
    """(relpath, sha256) of the code files under directory `base`, which holds the packages."""
    found = []
    for package in CODE_PACKAGES:
        for top, dirs, files in os.walk(os.path.join(base, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                path = os.path.join(top, name)
                rel = os.path.relpath(path, base).replace(os.sep, "/")
                if is_code_file(rel):
                    with open(path, "rb") as fh:
                        found.append((rel, _sha(fh.read())))
    return found


def _entries_in_zip(archive):
    with zipfile.ZipFile(archive) as zf:
        return [(name, _sha(zf.read(name))) for name in zf.namelist() if is_code_file(name)]


def code_on_path():
    """(where `pipeline` would be imported from, its code version), or ("", "") when it is not importable."""
    spec = importlib.util.find_spec("pipeline")
    if spec is None or not spec.submodule_search_locations:
        return "", ""
    base = os.path.dirname(list(spec.submodule_search_locations)[0])
    if zipfile.is_zipfile(base):
        return base, code_version(_entries_in_zip(base))
    return base, code_version(_entries_in_dir(base))


def missing_packages():
    """pip requirements of the packages that cannot be imported here."""
    needed = list(REQUIREMENTS) + ([TOMLI] if sys.version_info < (3, 11) else [])
    return [req for name, req in needed if importlib.util.find_spec(name) is None]


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _mem_available():
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _disk_free(root):
    path = root
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _power_mode():
    """`nvpmodel -q`'s mode line on a Jetson ("NV Power Mode: MAXN"), "" elsewhere."""
    if shutil.which("nvpmodel") is None:
        return ""
    try:
        out = subprocess.run(["nvpmodel", "-q"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [line for line in out.stdout.decode(errors="replace").splitlines() if "Power Mode" in line]
    return lines[0].split(":", 1)[-1].strip() if lines else ""


def _clocks():
    """Current GPU and CPU0 frequencies in MHz where sysfs shows them (Jetson: the GPU's devfreq node)."""
    clocks = {}
    devfreq = "/sys/class/devfreq"
    for name in sorted(os.listdir(devfreq)) if os.path.isdir(devfreq) else []:
        value = _read(os.path.join(devfreq, name, "cur_freq"))
        if value.isdigit() and ("gpu" in name or "gv11b" in name or "ga10b" in name):
            clocks["gpu_mhz"] = int(value) // 1000000
    cpu = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    if cpu.isdigit():
        clocks["cpu0_mhz"] = int(cpu) // 1000
    return clocks


def _torch():
    """torch's version, CUDA version, GPU name and the torch.distributed backends it was built with (NVIDIA's torch
    for JetPack has no NCCL); importing torch takes seconds, so only when it is there."""
    if importlib.util.find_spec("torch") is None:
        return {"torch": "", "cuda": "", "gpu": "", "backends": []}
    try:
        import torch
    except Exception as err:  # a broken install is a finding, not a crash of the check
        return {"torch": "", "cuda": "", "gpu": "", "backends": [], "torch_error": str(err).splitlines()[0]}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "", "gpu": gpu, "backends": _backends(torch)}


def _backends(torch):
    """The process-group backends compiled into this torch; none when it has no torch.distributed at all."""
    dist = torch.distributed
    if not dist.is_available():
        return []
    found = (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available), ("mpi", dist.is_mpi_available))
    return [name for name, available in found if available()]


def report(root):
    """Everything above as one dict."""
    where, version = code_on_path()
    facts = {
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "executable": sys.executable,
        "missing": missing_packages(),
        "federated_missing": [req for name, req in [FEDERATED] if importlib.util.find_spec(name) is None],
        "code_path": where,
        "code_version": version,
        "mem_free": _mem_available(),
        "disk_free": _disk_free(root),
        "power_mode": _power_mode(),
    }
    facts.update(_clocks())
    facts.update(_torch())
    return facts


if __name__ == "__main__":
    print("DEVICECHECK " + json.dumps(report(sys.argv[1] if len(sys.argv) > 1 else "/")))
