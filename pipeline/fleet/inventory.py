"""The fleet inventory: a TOML file of SSH targets ([defaults], [policy], [[targets]]), validated into models.

Every key a target takes may also be set in [defaults]; a target's own value wins. Paths (`key`, `known_hosts`)
may start with `~`. Errors name the inventory file, the target and the key, on one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.config import read_toml
from pipeline.errors import PipelineError
from pipeline.fleet.names import safe_name

UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]{1,255}")
"""The characters systemd accepts in a unit name, at most 255 of them (docs/ssh-and-devices.md#systemd-unit-names);
a leading '-' is refused apart, since systemctl would read it as an option."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class SshTarget(_Strict):
    """One device, after [defaults] were merged in."""

    name: str
    """Unique name, shown in tables; also names the target in results.json."""
    host: str
    """Address or DNS name to connect to."""
    user: str = "root"
    """Login user; it needs write access to `root` and, with `service`, the right to restart it."""
    port: int = Field(22, ge=1, le=65535)
    """SSH port."""
    key: Path = Path("~/.ssh/id_ed25519")
    """Private key file for public-key login."""
    known_hosts: Path = Path("~/.ssh/known_hosts")
    """Host keys the device must match (OpenSSH's format, e.g. from `ssh-keyscan`, checked by hand); a device not
    listed there is refused unless `trust_on_first_use`."""
    trust_on_first_use: bool = False
    """Accept (and record in `known_hosts`) the key of a device not listed there yet. A listed device whose key
    changed is still refused."""
    root: str = "/opt/edge"
    """Deploy root on the device: `releases/`, `current`, `previous`."""
    service: str = ""
    """systemd unit restarted after the switch (and after a switch back); "" = none."""
    health_command: str = ""
    """Shell command run on the device with RELEASE_DIR set: as preflight when the release has no engine, and
    after the switch. "" = load the engine (trtexec) or run the model (python3 + onnxruntime) or check the files."""
    tags: list[str] = Field(default_factory=list)
    """Free-form labels (not used by the rollout)."""
    python: str = "/usr/bin/python3"
    """Training: the interpreter that runs the ranks (Python >= 3.10 with torch >= 2.5; JetPack 6 ships 3.10)."""
    nproc_per_node: int = Field(1, ge=1, le=1024)
    """Training: ranks started on this device (one per GPU; a Jetson has one)."""
    ifname: str = ""
    """Training: network interface for the collectives (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`); "" = let
    gloo and NCCL pick one from the hostname."""
    addr: str = ""
    """Training: the address the other devices reach this one at; "" = the address the controller reached it at."""
    code: str = "ship"
    """Training: `ship` uploads the controller's code (verified, deduplicated); a directory on the device holding
    the `pipeline` and `models` packages runs that copy instead, refused unless it is the controller's version."""
    idle: str = Field("", pattern=r"^(([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9])?$")
    """Federated training: the daily window the device may train in, "HH:MM-HH:MM" on the device's own clock and
    timezone (it may cross midnight: "22:00-05:30"); "" = any time."""
    idle_check: str = ""
    """Federated training: a shell command run on the device before and during its work in a round; exit 0 means
    idle (e.g. the inference service's GPU use under a threshold). "" = no check beyond `idle`."""

    @field_validator("name")
    @classmethod
    def _safe(cls, name: str) -> str:
        try:
            return safe_name(name, "name")
        except PipelineError as err:
            raise ValueError(str(err)) from None

    @field_validator("service")
    @classmethod
    def _unit_name(cls, service: str) -> str:
        if service and (service.startswith("-") or not UNIT_NAME.fullmatch(service)):
            raise ValueError(f"{service!r} is not a systemd unit name (see docs/ssh-and-devices.md#systemd-unit-names)")
        return service

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        if not root.startswith("/") or ".." in root.split("/") or any(c in root for c in "'\"\\$`\n"):
            raise ValueError(f"{root!r} must be an absolute path without '..' or quotes")
        return root.rstrip("/") or "/"

    @field_validator("ifname", "addr")
    @classmethod
    def _plain(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._:-]*", value):
            raise ValueError(f"{value!r} may hold only letters, digits, '.', '_', ':' and '-'")
        return value

    @field_validator("python", "code")
    @classmethod
    def _no_quotes(cls, value: str) -> str:
        if not value or any(c in value for c in "'\"\\$`\n "):
            raise ValueError(f"{value!r} must be non-empty, without quotes, spaces or '$'")
        return value

    @field_validator("key", "known_hosts")
    @classmethod
    def _expand(cls, path: Path) -> Path:
        return path.expanduser()


class Policy(_Strict):
    """How a rollout proceeds through the fleet."""

    canary: int | list[str] = 1
    """Targets that go first, alone: a count (the first N in the inventory) or a list of names."""
    wave_size: int = Field(4, ge=1)
    """Targets per wave after the canary."""
    max_parallel: int = Field(8, ge=1)
    """Cap on concurrent SSH connections."""
    max_failure_pct: float = Field(25, ge=0, le=100)
    """Stop (remaining targets SKIPPED) once more than this share of all targets has failed."""
    keep_releases: int = Field(3, ge=2)
    """Releases kept per device; `current` and `previous` are never pruned."""
    timeout_s: int = Field(300, ge=5)
    """Limit, in seconds, for one target's whole deploy, plus 3 x `build.timeout_s` when the device may build its
    engine at install time; every remote command also runs under the device's `timeout -k 5`."""

    @field_validator("canary")
    @classmethod
    def _non_negative(cls, canary: int | list[str]) -> int | list[str]:
        if isinstance(canary, int) and canary < 0:
            raise ValueError("must be >= 0")
        return canary


class Inventory(_Strict):
    """A validated inventory."""

    path: Path
    policy: Policy
    targets: list[SshTarget]

    @model_validator(mode="after")
    def _canaries_exist(self) -> Inventory:
        if isinstance(self.policy.canary, list):
            names = {t.name for t in self.targets}
            unknown = [n for n in self.policy.canary if n not in names]
            if unknown:
                raise ValueError(f"policy.canary: no target named {unknown[0]!r}")
        return self

    def select(self, name: str | None) -> list[SshTarget]:
        """All targets, or the one called `name` (PipelineError naming the known ones otherwise)."""
        if name is None:
            return list(self.targets)
        chosen = [t for t in self.targets if t.name == name]
        if not chosen:
            known = ", ".join(t.name for t in self.targets) or "none"
            raise PipelineError(f"{self.path}: no target named {name!r} (known: {known})")
        return chosen


TARGET_KEYS = frozenset(SshTarget.model_fields)
DEFAULT_KEYS = TARGET_KEYS - {"name", "host"}


def load_inventory(path: Path) -> Inventory:
    """Read and validate the inventory at `path`; any problem is a one-line PipelineError naming target and key."""
    data = read_toml(path, "inventory")
    unknown = sorted(set(data) - {"defaults", "policy", "targets"})
    if unknown:
        raise PipelineError(f"{path}: unknown table [{unknown[0]}] (expected [defaults], [policy], [[targets]])")
    defaults = _table(data, "defaults", path)
    for key in defaults:
        if key not in DEFAULT_KEYS:
            raise PipelineError(f"{path}: defaults.{key}: unknown key")
    entries = data.get("targets", [])
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise PipelineError(f"{path}: needs at least one [[targets]] table")
    targets = [_target(path, index, defaults, entry) for index, entry in enumerate(entries)]
    _check_unique(path, targets)
    try:
        policy = Policy.model_validate(_table(data, "policy", path))
        inventory = Inventory(path=path, policy=policy, targets=targets)
    except ValidationError as err:
        raise _error(path, "policy", err) from None
    for target in targets:
        _check_files(path, target)
    return inventory


def _table(data: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise PipelineError(f"{path}: {name} must be a table")
    return table


def _target(path: Path, index: int, defaults: dict[str, Any], entry: dict[str, Any]) -> SshTarget:
    label = f"targets[{index}]" + (f" ({entry['name']})" if isinstance(entry.get("name"), str) else "")
    try:
        return SshTarget.model_validate({**defaults, **entry})
    except ValidationError as err:
        raise _error(path, label, err) from None


def _error(path: Path, where: str, err: ValidationError) -> PipelineError:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    if first["type"] == "missing":
        msg = "missing (set it here or in [defaults])"
    return PipelineError(f"{path}: {where}" + (f": {key}" if key else "") + f": {msg}")


def _check_unique(path: Path, targets: list[SshTarget]) -> None:
    seen: set[str] = set()
    for target in targets:
        if target.name in seen:
            raise PipelineError(f"{path}: targets: duplicate name {target.name!r}")
        seen.add(target.name)


def _check_files(path: Path, target: SshTarget) -> None:
    if not target.key.is_file():
        raise PipelineError(f"{path}: {target.name}: key: {target.key} not found")
    if not target.known_hosts.is_file() and not target.trust_on_first_use:
        raise PipelineError(
            f"{path}: {target.name}: known_hosts: {target.known_hosts} not found "
            "(list the device's host key there, or set trust_on_first_use = true)"
        )
