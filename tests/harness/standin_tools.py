"""STAND-IN device tools for the test Jetsons: `trtexec`, `systemctl` and `dpkg-query` in one stdlib-only script.

This is not NVIDIA's or systemd's code: it imitates just enough of their command lines and output for deploy and
on-device build tests, and its behaviour is set by the test. The harness copies this file into each stand-in device
under the three tool names (busybox style: the name it is called by picks the tool). Every call appends its argv to
``calls.jsonl`` in the control directory; the knobs are JSON files there (see :mod:`tests.harness.standins`).

The control directory is ``/run/standin`` inside a device (a bind mount of a per-target host directory), or
``$JETSON_STANDIN_CONTROL`` when set.

Engine files written by the stand-in ``trtexec`` start like real TensorRT plans (tag ``ftrt``, serialization word 0,
version bytes at offset 24, the layout trtexec's ``--getPlanVersionOnly`` reads) followed by a JSON description, so a
test can tell which ONNX, device and TensorRT version an engine came from.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

PLAN_TAG = b"ftrt"
PLAN_HEADER = 28
PLAN_MARK = b"\nSTAND-IN TensorRT engine\n"
SOCS = {"nvidia,tegra234": "8.7", "nvidia,tegra194": "7.2", "nvidia,tegra210": "5.3"}
"""Device-tree SoC -> CUDA compute capability, for the "incompatible device" message."""
DEVICE_TREE = Path("/sys/firmware/devicetree/base")
TRTEXEC_DEFAULTS: dict[str, Any] = {
    "version": "10.3.0.30",
    "build_exit": 0,
    "load_exit": 0,
    "delay_s": 0.0,
    "engine_bytes": 4096,
    "error": "",
    "outputs": {},
}
"""Knobs of the stand-in trtexec (``trtexec.json``): TensorRT version it claims, exit codes of a build
(``--onnx``) and of a load (``--loadEngine``), seconds to sleep before either, size of the engines it writes, the
error line printed when a forced exit code is non-zero, and the tensors a load writes to ``--exportOutput`` (name ->
nested list; none: no file, as the stand-in runs no model)."""


def control_dir() -> Path:
    """Where this stand-in reads its knobs and logs its calls."""
    return Path(os.environ.get("JETSON_STANDIN_CONTROL", "/run/standin"))


def read_knobs(name: str) -> dict[str, Any]:
    """One knob file as a dict; a missing file means defaults."""
    try:
        return json.loads((control_dir() / name).read_text())
    except FileNotFoundError:
        return {}


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace a JSON file in one rename so a concurrent reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def log_call(tool: str, argv: list[str]) -> None:
    """Append one call to calls.jsonl; a single short O_APPEND write keeps parallel calls from interleaving."""
    line = json.dumps({"tool": tool, "argv": argv, "time": time.time()}) + "\n"
    fd = os.open(control_dir() / "calls.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# --- trtexec -------------------------------------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, ...]:
    """'10.3.0.30-1+cuda12.5' -> (10, 3, 0, 30); missing parts are 0."""
    parts = [int(p) for p in version.split("-")[0].split(".")[:4]]
    return tuple(parts + [0] * (4 - len(parts)))


def version_code(version: str) -> str:
    """The number trtexec prints in its banner: v100300 for 10.3.0, v8502 for 8.5.2 (NV_TENSORRT_VERSION)."""
    major, minor, patch, _ = version_tuple(version)
    return str(major * (10000 if major >= 10 else 1000) + minor * 100 + patch)


OPTIONS_SINCE = {
    "memPoolSize": (8, 4),
    "builderOptimizationLevel": (8, 6),
    "skipInference": (8, 6),
    "getPlanVersionOnly": (9, 1),
    "stronglyTyped": (9, 1),
}
"""First TensorRT (major, minor) whose trtexec has the option (docs/tensorrt.md#summary-table)."""
OPTIONS_UNTIL = {"workspace": (10, 0), "buildOnly": (10, 0)} | dict.fromkeys(
    ("fp16", "int8", "bf16", "fp8", "int4", "best"), (11, 0)
)
"""First TensorRT (major, minor) whose trtexec no longer has the option (docs/tensorrt.md#summary-table)."""
DLA_GAP = ((10, 8, 0), (11, 4, 1))
"""Releases without DLA (docs/tensorrt.md#dla-cores)."""


def refusal(options: dict[str, str], version: str) -> str | None:
    """The error trtexec `version` stops with for these options (an option it lacks, a DLA core it has none of, a
    workspace suffix it would misread); None when it takes them all."""
    have = version_tuple(version)
    for key in options:
        if have[:2] < OPTIONS_SINCE.get(key, (0, 0)) or have[:2] >= OPTIONS_UNTIL.get(key, (999, 0)):
            return f"Unknown option: --{key}"
    pool = options.get("memPoolSize", "")
    if pool[-1:].isalpha() and have[:2] < (10, 1):
        # STAND-IN check: before 10.1 a suffix is ignored (8.x, 9.x) or applied twice (10.0.x), never meant.
        return f"STAND-IN: --memPoolSize={pool}: TensorRT {version} misreads a unit suffix"
    if "useDLACore" in options and DLA_GAP[0] <= have[:3] < DLA_GAP[1]:
        return f"Cannot create DLA engine, {options['useDLACore']} not available"
    return None


def make_plan(version: str, meta: dict[str, Any], size: int) -> bytes:
    """Bytes of a stand-in engine: a plan-like header (with the plan's whole length, which a load checks as
    TensorRT's deserializer checks the size its header records), a marker, JSON metadata, zero padding up to `size`."""
    tail = PLAN_MARK + json.dumps(meta, sort_keys=True).encode() + b"\n"
    length = max(size, PLAN_HEADER + len(tail))
    header = PLAN_TAG + struct.pack("<IQ", 0, length) + bytes(8) + bytes(version_tuple(version))
    return header + tail + bytes(length - PLAN_HEADER - len(tail))


def read_plan(data: bytes) -> tuple[str, dict[str, Any]] | None:
    """(TensorRT version, metadata) of a stand-in engine, or None when `data` is not one."""
    if len(data) < PLAN_HEADER or data[:4] != PLAN_TAG or data[4:8] != bytes(4):
        return None
    version = ".".join(str(b) for b in data[24:28])
    if not data[PLAN_HEADER:].startswith(PLAN_MARK):
        return version, {}
    end = data.find(b"\n", PLAN_HEADER + len(PLAN_MARK))
    try:
        return version, json.loads(data[PLAN_HEADER + len(PLAN_MARK) : end])
    except ValueError:
        return version, {}


def device_soc() -> str:
    """Last entry of the device tree's `compatible` (e.g. nvidia,tegra234), or '' when there is none."""
    try:
        entries = (DEVICE_TREE / "compatible").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((e.decode() for e in reversed(entries) if e), "")


def parse_options(args: list[str]) -> dict[str, str]:
    """trtexec's `--key=value` / `--flag` options as a dict (flags map to '')."""
    options = {}
    for arg in args:
        key, _, value = arg.partition("=")
        options[key.lstrip("-")] = value
    return options


def say(level: str, text: str) -> None:
    """One trtexec-style log line: `[MM/DD/YYYY-HH:MM:SS] [I] text`."""
    stamp = dt.datetime.now().strftime("%m/%d/%Y-%H:%M:%S")
    stream = sys.stderr if level == "E" else sys.stdout
    print(f"[{stamp}] [{level}] {text}", file=stream, flush=True)


def trtexec(argv: list[str]) -> int:
    """Stand-in trtexec: `--onnx=F --saveEngine=E`, `--loadEngine=E`, `--getPlanVersionOnly`; an option its version
    lacks fails as trtexec does."""
    knobs = {**TRTEXEC_DEFAULTS, **read_knobs("trtexec.json")}
    version = str(knobs["version"])
    banner = f"TensorRT.trtexec [TensorRT v{version_code(version)}] # {' '.join(argv)}"
    print(f"&&&& RUNNING {banner}", flush=True)
    options = parse_options(argv[1:])
    refused = refusal(options, version)
    if refused:
        say("E", refused)
        rc = 1
    elif "loadEngine" in options and "saveEngine" in options:
        say("E", "Incompatible load and save engine options selected")
        rc = 1
    elif "loadEngine" in options:
        rc = _load(options, knobs)
    elif "onnx" in options:
        rc = _build(argv, options, knobs)
    else:
        say("E", "Model missing or format not recognized")
        rc = 1
    print(f"&&&& {'PASSED' if rc == 0 else 'FAILED'} {banner}", flush=True)
    return rc


def _load(options: dict[str, str], knobs: dict[str, Any]) -> int:
    try:
        data = Path(options["loadEngine"]).read_bytes()
    except OSError:
        say("E", f"Error opening engine file: {options['loadEngine']}")
        return 1
    plan = read_plan(data)
    if plan is None:
        say("E", "Failed to verify a plan tag.")
        return 1
    built_with, meta = plan
    if "getPlanVersionOnly" in options:
        say("I", f"Plan was created with TensorRT version {built_with}")
        return 0
    recorded = struct.unpack_from("<Q", data, 8)[0]
    if recorded != len(data):
        say("E", f"STAND-IN: Serialization failed: the plan is {len(data)} bytes, its header says {recorded}")
        return 1
    time.sleep(float(knobs["delay_s"]))
    if version_tuple(built_with)[:3] != version_tuple(str(knobs["version"]))[:3]:
        say(
            "E",
            "Error[1]: [stdArchiveReader.cpp::StdArchiveReaderInitCommon::46] Error Code 1: Serialization "
            f"(Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed.Version tag does not match. "
            f"Note: Current Version: {knobs['version']}, Serialized Engine Version: {built_with})",
        )
        return 1
    here, there = device_soc(), meta.get("soc", "")
    if here and there and here != there:
        say(
            "E",
            "Error[6]: The engine plan file is generated on an incompatible device, expecting compute "
            f"{SOCS.get(here, here)} got compute {SOCS.get(there, there)}, please rebuild.",
        )
        return 1
    if int(knobs["load_exit"]):
        say("E", str(knobs["error"]) or "Engine deserialization failed")
        return int(knobs["load_exit"])
    say("I", "Engine deserialized in 0.0123 sec.")
    if "exportOutput" in options and knobs["outputs"]:
        _export(Path(options["exportOutput"]), knobs["outputs"])
    say("I", "Throughput: 812.4 qps")
    say("I", "Latency: min = 1.19 ms, max = 1.41 ms, mean = 1.23 ms, median = 1.22 ms")
    return 0


def _export(path: Path, outputs: dict[str, Any]) -> None:
    """Write `outputs` as trtexec's `--exportOutput` does: a list of {"name", "dimensions", "values"}."""

    def shape(value: Any) -> list[int]:
        return [len(value), *shape(value[0])] if isinstance(value, list) else []

    def flat(value: Any) -> list[Any]:
        return [x for item in value for x in flat(item)] if isinstance(value, list) else [value]

    tensors = [
        {"name": name, "dimensions": "x".join(map(str, shape(v))), "values": flat(v)} for name, v in outputs.items()
    ]
    path.write_text(json.dumps(tensors))


def _build(argv: list[str], options: dict[str, str], knobs: dict[str, Any]) -> int:
    try:
        onnx = Path(options["onnx"]).read_bytes()
    except OSError:
        say("E", f"Could not open file {options['onnx']}")
        say("E", "Failed to parse onnx file")
        return 1
    say("I", f"Start parsing network model. [ONNX: {len(onnx)} bytes]")
    time.sleep(float(knobs["delay_s"]))
    if int(knobs["build_exit"]):
        say("E", str(knobs["error"]) or "Engine could not be created from network")
        say("E", "Building engine failed")
        return int(knobs["build_exit"])
    meta = {
        "onnx_sha256": hashlib.sha256(onnx).hexdigest(),
        "soc": device_soc(),
        "hostname": os.uname().nodename,
        "argv": argv[1:],
    }
    try:
        if "timingCacheFile" in options:
            cache = Path(options["timingCacheFile"])
            cache.write_bytes(cache.read_bytes() + b"." if cache.exists() else b"stand-in timing cache\n")
        if "saveEngine" in options:
            Path(options["saveEngine"]).write_bytes(make_plan(str(knobs["version"]), meta, int(knobs["engine_bytes"])))
    except OSError as err:
        say("E", f"Saving engine to file failed: {err}")
        return 1
    say("I", "Engine built in 0.42 sec.")
    if "saveEngine" in options:
        say("I", f"Saved engine to {options['saveEngine']}")
    return 0


# --- systemctl -----------------------------------------------------------------------------------------------------

UNIT_DEFAULTS: dict[str, Any] = {"restart_exit": 0, "healthy": True}
"""Knobs per unit in ``systemctl.json`` {"units": {NAME: {...}}}: exit code of start/restart, and whether the unit
is active afterwards (False: restart "succeeds" but the service dies at once, as a crash-looping one does)."""


def unit_name(name: str) -> str:
    """systemctl's own completion of a bare name: `edge` -> `edge.service`."""
    return name if "." in name else f"{name}.service"


def systemctl(argv: list[str]) -> int:
    """Stand-in systemctl: start/restart/stop/is-active/status/daemon-reload/enable/disable/is-enabled/reset-failed."""
    words = [a for a in argv[1:] if not a.startswith("-")]
    quiet = "--quiet" in argv or "-q" in argv
    if not words:
        print("stand-in systemctl: a verb is required", file=sys.stderr)
        return 1
    verb, units = words[0], [unit_name(u) for u in words[1:]]
    if verb in ("daemon-reload", "enable", "disable"):
        return 0
    if verb == "is-enabled":
        print("enabled")
        return 0
    known = read_knobs("systemctl.json").get("units", {})
    states = read_knobs("systemctl-state.json")
    rc = 0
    for unit in units:
        rc = max(rc, _unit_verb(verb, unit, known, states, quiet))
    write_json_atomic(control_dir() / "systemctl-state.json", states)
    return rc


def _state_line(state: str, quiet: bool) -> None:
    if not quiet:
        print(state)


def _unit_verb(verb: str, unit: str, known: dict[str, Any], states: dict[str, str], quiet: bool) -> int:
    if unit not in known:
        if verb == "is-active":
            _state_line("inactive", quiet)
            return 3
        print(f"Failed to {verb} {unit}: Unit {unit} not found.", file=sys.stderr)
        return 5 if verb != "status" else 4
    knobs = {**UNIT_DEFAULTS, **known[unit]}
    initial = "active" if knobs["healthy"] else "failed"
    if verb in ("start", "restart", "try-restart", "reload-or-restart"):
        if int(knobs["restart_exit"]):
            states[unit] = "failed"
            print(f"Job for {unit} failed because the control process exited with error code.", file=sys.stderr)
            print(f'See "systemctl status {unit}" and "journalctl -xeu {unit}" for details.', file=sys.stderr)
            return int(knobs["restart_exit"])
        states[unit] = initial
        return 0
    if verb == "stop":
        states[unit] = "inactive"
        return 0
    if verb == "reset-failed":
        states[unit] = "inactive" if states.get(unit, initial) == "failed" else states.get(unit, initial)
        return 0
    state = states.get(unit, initial)
    if verb == "is-active":
        _state_line(state, quiet)
        return 0 if state == "active" else 3
    if verb == "status":
        print(f"● {unit} - stand-in unit\n     Active: {state}")
        return 0 if state == "active" else 3
    print(f"Unknown command verb {verb}.", file=sys.stderr)
    return 1


# --- dpkg-query ----------------------------------------------------------------------------------------------------


def dpkg_format(fmt: str, package: str, version: str) -> str:
    """Expand the `${Field}` and backslash escapes of a dpkg-query --showformat for one package."""
    fields = {
        "Package": package,
        "binary:Package": package,
        "Version": version,
        "Status": "install ok installed",
        "db:Status-Abbrev": "ii ",
    }
    for key, value in fields.items():
        fmt = fmt.replace("${" + key + "}", value)
    return fmt.replace("\\n", "\n").replace("\\t", "\t").replace("\\\\", "\\")


def dpkg_query(argv: list[str]) -> int:
    """Stand-in dpkg-query: only `-W`/`--show`, with `-f=FMT`/`-f FMT`/`--showformat=FMT`."""
    fmt, names, show = "${Package}\t${Version}\n", [], False
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-W", "--show"):
            show = True
        elif arg in ("-f", "--showformat"):
            fmt = next(args, "")
        elif arg.startswith(("-f=", "--showformat=")):
            fmt = arg.partition("=")[2]
        elif arg.startswith("-f"):
            fmt = arg[2:]
        else:
            names.append(arg)
    if not show:
        print("dpkg-query: error: this stand-in supports only -W/--show", file=sys.stderr)
        return 2
    installed = {k: v for k, v in read_knobs("dpkg.json").items() if v is not None}
    rc = 0
    for name in names or sorted(installed):
        if name in installed:
            sys.stdout.write(dpkg_format(fmt, name, installed[name]))
        else:
            print(f"dpkg-query: no packages found matching {name}", file=sys.stderr)
            rc = 1
    return rc


TOOLS = {"trtexec": trtexec, "systemctl": systemctl, "dpkg-query": dpkg_query}


def main() -> int:
    """Log the call, then act as the tool this file was invoked as."""
    tool = Path(sys.argv[0]).name
    log_call(tool, sys.argv)
    return TOOLS[tool](sys.argv)


if __name__ == "__main__":
    sys.exit(main())
