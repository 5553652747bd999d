"""Typed pipeline configuration: one TOML table per stage, overridable with ``--set section.key=value``.

Every field carries a docstring (pydantic reads them as descriptions), so ``pipeline config --help``-style
introspection and the README stay in step with the code.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import PipelineError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "quickstart.toml"


class Section(BaseModel):
    """Base for config tables: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(Section):
    name: str = "quickstart"
    """Human-readable name of the job; recorded in the manifest."""
    seed: int = 0
    """Seed for data splits, initial weights and sampling; the same seed gives the same run."""
    runs_root: Path = Path("artifacts/runs")
    """Where `pipeline run` creates `<run-id>/` directories when `--run-dir` is not given."""


class DataConfig(Section):
    source: Literal["digits", "imagefolder", "synthetic"] = "digits"
    """`digits`: scikit-learn's bundled 8x8 handwritten digits; `imagefolder`: `data.path/<class>/*.png|jpg`;
    `synthetic`: random class-dependent patterns (benchmarks)."""
    path: Path | None = None
    """Root of an ImageFolder tree (one sub-directory per class). Required when `source = "imagefolder"`."""
    image_size: int = Field(16, ge=8, le=1024)
    """Square side, in pixels, that images are resized to."""
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of the images held out for validation (stratified, seeded by `run.seed`)."""
    synthetic_samples: int = Field(2000, ge=20)
    """Number of images generated when `source = "synthetic"`."""
    synthetic_classes: int = Field(10, ge=2)
    """Number of classes generated when `source = "synthetic"`."""

    @model_validator(mode="after")
    def _path_for_imagefolder(self) -> DataConfig:
        if self.source == "imagefolder" and self.path is None:
            raise ValueError("data.path is required when data.source = 'imagefolder'")
        return self


class ModelConfig(Section):
    name: str = "small_cnn"
    """Architecture from `models/`: small_cnn, resnet18, mobilenet_v3_small."""
    weights: Path | None = None
    """Optional safetensors file with initial weights (nothing is downloaded at run time)."""


class TrainConfig(Section):
    epochs: int = Field(8, ge=1)
    """Passes over the training split."""
    batch_size: int = Field(64, ge=1)
    """Global batch size: split evenly across all ranks."""
    lr: float = Field(1e-2, gt=0.0)
    """Peak learning rate of AdamW (cosine-decayed to zero)."""
    weight_decay: float = Field(1e-4, ge=0.0)
    """AdamW weight decay."""
    strategy: Literal["ddp"] = "ddp"
    """Data-parallel strategy. FSDP and `auto` come with the training issue."""
    precision: Literal["auto", "fp32", "bf16-mixed"] = "auto"
    """`auto` is bf16 autocast on GPUs that support it and fp32 on CPU, where bf16 buys no speed."""
    compression: Literal["none", "fp16", "bf16"] = "none"
    """Gradient compression on the DDP all-reduce: `fp16`/`bf16` halve the bytes on the wire."""
    nproc_per_node: int = Field(2, ge=1)
    """Ranks started on this node: one per GPU with nccl, or this many CPU ranks with gloo."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; `auto` is nccl when CUDA is present, gloo otherwise."""
    threads_per_rank: int = Field(1, ge=1)
    """torch intra-op threads per CPU rank; keeps 2 ranks from fighting over 2 cores."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest epoch checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    timeout_s: int = Field(3600, ge=10)
    """Wall-clock limit for the whole torchrun job; the process group is killed past it."""


class ExportConfig(Section):
    opset: int = Field(18, ge=13, le=23)
    """ONNX opset requested. The exporter raises anything below 18 to 18; the stage records what the file declares."""
    max_batch: int = Field(32, ge=1)
    """Largest batch of the dynamic batch axis (min is 1); also the `max` TensorRT profile shape."""
    opt_batch: int = Field(8, ge=1)
    """Batch the TensorRT profile is tuned for."""
    parity_samples: int = Field(256, ge=1)
    """Validation images compared between ONNX Runtime and PyTorch."""
    atol: float = Field(1e-4, gt=0.0)
    """Largest allowed absolute difference between ONNX Runtime and PyTorch logits."""

    @model_validator(mode="after")
    def _opt_within_max(self) -> ExportConfig:
        if self.opt_batch > self.max_batch:
            raise ValueError("export.opt_batch must not exceed export.max_batch")
        return self


class BuildConfig(Section):
    builder: Literal["auto", "python", "trtexec"] = "auto"
    """`auto`: the TensorRT Python API when it imports and a GPU is present, else `trtexec` on PATH, else skip."""
    precision: Literal["fp32", "fp16"] = "fp16"
    """Engine precision (builder flag on TensorRT < 11)."""
    workspace_mb: int = Field(1024, ge=16)
    """Builder workspace memory-pool limit."""
    trtexec: str = "trtexec"
    """trtexec executable: a name looked up on PATH or an absolute path."""
    timeout_s: int = Field(1800, ge=10)
    """Limit for one engine build."""


class LocalTarget(Section):
    name: str
    """Target name, unique in the list; shown in the deploy table."""
    root: Path
    """Directory standing in for the device's deploy root (`releases/`, `current`, `previous`)."""


class DeployConfig(Section):
    targets: list[LocalTarget] = Field(
        default_factory=lambda: [LocalTarget(name="local", root=Path("artifacts/devices/local"))]
    )
    """Local targets: directories that stand in for devices. SSH fleets come with the deploy issue."""
    keep_releases: int = Field(3, ge=2)
    """Releases kept on a target; `current` and `previous` are never pruned."""
    health_atol: float = Field(1e-3, gt=0.0)
    """Largest allowed |logits - stored logits| on `sample.npz` for the ONNX model and fp32 engines."""
    health_atol_fp16: float = Field(1e-2, gt=0.0)
    """The same bound for fp16 engines, whose rounding is larger (NVIDIA's guides use 1e-2)."""

    @model_validator(mode="after")
    def _unique_names(self) -> DeployConfig:
        names = [t.name for t in self.targets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate target name(s): {', '.join(dupes)}")
        return self


class RetrainConfig(Section):
    only_on_new_data: bool = False
    """End the run early, saying so, when data and training config are unchanged since the last trained run
    (the nightly schedule sets this)."""
    promotion_tolerance: float = Field(0.01, ge=0.0, le=1.0)
    """Deploy a new model only when its validation accuracy is at least the deployed model's minus this."""


class Config(Section):
    """The whole pipeline configuration."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and output location."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where images come from and how they are shaped."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which architecture to train."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Distributed training."""
    export: ExportConfig = Field(default_factory=ExportConfig)
    """ONNX export and parity gate."""
    build: BuildConfig = Field(default_factory=BuildConfig)
    """TensorRT engine build."""
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    """Release to targets."""
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)
    """Scheduled retraining: skip when nothing is new, promote only a model at least as good as the deployed one."""

    def digest(self, *sections: str) -> str:
        """sha256 of the named sections (all when none): the config part of a stage's cache key."""
        data = self.model_dump(mode="json")
        picked = {s: data[s] for s in (sections or data.keys())}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()


def _parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` → (["section", "key"], value); the value is read as TOML, else kept as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise PipelineError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `section.key=value` in the raw config mapping (before validation, so types are checked once)."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise PipelineError(f"--set {item!r}: {part!r} is not a table")
        node[path[-1]] = value
    return data


def _first_error(err: ValidationError, origin: str) -> PipelineError:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return PipelineError(f"{origin}: {where}: {msg}{more}")


def validate(data: dict[str, Any], origin: str) -> Config:
    """Validate a raw mapping; errors name the dotted key and the origin (a file or `--set`)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise _first_error(err, origin) from None


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file into a mapping, turning a missing or malformed file into a one-line error."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise PipelineError(f"{path}: invalid TOML: {err}") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise PipelineError(f"{path}: cannot read config: {err}") from None


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load the TOML config at `path` (the embedded quickstart when None) and apply `--set` overrides."""
    path = path or DEFAULT_CONFIG
    data = apply_overrides(read_toml(path), overrides or [])
    return validate(data, str(path))
