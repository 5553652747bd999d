"""Typed pipeline configuration: one TOML table per stage, overridable with ``--set section.key=value``.

Every field carries a docstring (pydantic reads them as descriptions), and the documentation's config reference
(docs/reference/config.md) is generated from them: this file is the one place a key is described.

Over the project's ~450 lines a module on purpose: it is the config reference, one section class per TOML table, read
top to bottom like the file a user writes; the loading and error-wording code at its end is a few dozen lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import PipelineError
from pipeline.files import TOO_DEEP

if sys.version_info >= (3, 11):  # noqa: UP036 -- the package needs 3.11; the device side runs on 3.10
    import tomllib
else:
    import tomli as tomllib

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""An environment variable's name: it goes into shell scripts on devices, so nothing else is one."""
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|AUTH", re.IGNORECASE)
"""Names whose value `train.env` would write into the run's files: such variables belong in `train.pass_env`."""
"""A TOML key that needs no quotes."""
DEFAULT_CONFIG = Path(__file__).with_name("defaults") / "quickstart.toml"
"""The embedded quickstart, shipped inside the package (configs/quickstart.toml in the repo links to it)."""


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
    """`digits`: scikit-learn's bundled 8x8 handwritten digits; `imagefolder`: `data.path/<class>/<image>`, JPEG, PNG,
    BMP or WebP in any colour mode (grayscale becomes RGB, transparent parts are laid on white); `synthetic`: random
    class-dependent patterns (benchmarks)."""
    path: Path | None = None
    """Root of an ImageFolder tree (one sub-directory per class). Required when `source = "imagefolder"`."""
    image_size: int = Field(16, ge=8, le=1024)
    """Square side, in pixels, that images are resized to."""
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of the images held out for validation (stratified, seeded by `run.seed`)."""
    synthetic_samples: int = Field(2000, ge=20, le=10_000_000)
    """Number of images generated when `source = "synthetic"`."""
    synthetic_classes: int = Field(10, ge=2, le=100_000)
    """Number of classes generated when `source = "synthetic"`."""
    normalize: Literal["auto", "imagenet", "dataset"] = "auto"
    """Per-channel mean and std images are normalised with (recorded in model.json, so export and the device use
    the same): `imagenet`, what published weights were trained with; `dataset`, computed over the training split;
    `auto`: with `model.weights`, the statistics that file was trained with when a run of this pipeline wrote it
    (its safetensors metadata or the model.json beside it), else ImageNet's (torchvision's published weights);
    without, the training split's."""
    augment: bool = True
    """ImageFolder training images get a random resized crop (`crop_scale`) and a horizontal flip (`hflip`);
    validation images never do. The tensor sources (digits, synthetic) use `train.augment_shift` instead."""
    crop_scale: float = Field(0.35, gt=0.0, le=1.0)
    """Smallest share of an image's area a random resized crop keeps (torchvision's `scale=(crop_scale, 1)`)."""
    hflip: bool = True
    """Flip training images left-right at random (`data.augment`); turn off for text or asymmetric signs."""
    sync: bool = False
    """Cluster training (`train.inventory`) with `source = "imagefolder"`: `true` sends `data.path` from this machine
    to every device before the job starts (verified, deduplicated, resumable: an unchanged folder sends nothing);
    `false` has each device read `data.path` on its own disk (cameras keep their own images), and the run's data
    fingerprint then covers every device's folder."""
    on_bad_image: Literal["error", "skip"] = "error"
    """An ImageFolder file that cannot be decoded: `error` stops before training with one line naming it; `skip`
    leaves it out, and the log and train/summary.json count the skipped files."""
    reference: Path | None = None
    """A labelled ImageFolder tree on this machine (the training classes) that the stages after training score
    models on: export's parity and accuracy gates and int8 calibration, the promotion gate. Unset: the training
    data. Needed where the training images never reach this machine (`train.mode = "federated"`)."""

    @model_validator(mode="after")
    def _path_for_imagefolder(self) -> DataConfig:
        if self.source == "imagefolder" and self.path is None:
            raise ValueError("data.path is required when data.source = 'imagefolder'")
        return self

    def for_scoring(self) -> DataConfig:
        """The images models are scored on after training: `reference`'s folder, else the training data."""
        if self.reference is None:
            return self
        return self.model_copy(update={"source": "imagefolder", "path": self.reference, "sync": False})


class ModelConfig(Section):
    name: str = "small_cnn"
    """Architecture from `models/`: `small_cnn` (any channels, tiny), `resnet18` and `mobilenet_v3_small`
    (torchvision's architectures)."""
    weights: Path | None = None
    """Initial weights: torchvision's published `.pth` files (read with `weights_only=True`) or a safetensors file,
    such as an earlier run's `model/model.safetensors`; a file holding anything but tensors is refused. When the
    class count differs, the classifier head (`fc` in resnet18, `classifier.3` in mobilenet_v3_small) is replaced and
    the log names the dropped tensors; any other tensor that does not fit is one line naming the first. Nothing is
    downloaded at run time."""
    freeze: Literal["none", "backbone"] | Annotated[int, Field(ge=0)] = "none"
    """What does not train during the first `freeze_epochs` epochs: `none`; `backbone`, everything but the
    classifier head; or a number N, the first N blocks (the units FSDP shards: a stem, a residual block, ...)."""
    freeze_epochs: int = Field(1, ge=1)
    """Epochs, from the first, during which `freeze` holds; then every parameter trains. Set it to `train.epochs`
    to train only the unfrozen part throughout."""


class FederatedConfig(Section):
    """`train.mode = "federated"`: rounds of Flower's federated averaging over the inventory's devices
    (docs/how-to/federated.md)."""

    rounds: int = Field(20, ge=1, le=100_000)
    """Aggregation rounds: in each, the sampled idle devices train from the global model on their own images and
    send back how far they moved it."""
    local_epochs: float = Field(5.0, gt=0.0, le=1000.0)
    """Passes over its own training images a device makes in one round. 5 with `lr` 3e-3 reached the highest accuracy
    in 20 rounds of those tried on 10 devices with skewed digits (docs/how-to/federated.md#the-defaults)."""
    strategy: Literal["fedavg", "fedprox"] = "fedprox"
    """How the devices' models are combined: `fedavg` (weighted by each device's image count) or `fedprox` (the same
    average, with each device's training held near the global model by `proximal_mu`: made for devices whose
    images differ, as cameras' scenes do)."""
    proximal_mu: float = Field(0.01, ge=0.0)
    """`fedprox`: weight of the proximal term mu/2 * ||w - w_global||^2 in each device's loss."""
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of the connected devices sampled for a round (among the idle ones), at least `min_devices`."""
    min_devices: int = Field(2, ge=1)
    """Fewest idle devices a round starts with; with fewer, the server waits up to `wait_idle_s`, then skips the
    round."""
    wait_idle_s: int = Field(3600, ge=0)
    """Seconds a round waits for `min_devices` idle devices before it is skipped (counted as a round)."""
    round_timeout_s: int = Field(1800, ge=10)
    """Deadline of a device's work in a round: one that has not answered by then is dropped from that round only."""
    delta: Literal["int8", "fp32"] = "int8"
    """What a device sends back: its model change in 8 bits (one scale per tensor, with error feedback: what rounding
    left out is added to its next round's change) or in 32-bit floats."""
    lr: float = Field(3e-3, gt=0.0)
    """AdamW learning rate of each device's local training (its optimizer starts afresh every round)."""


class TrainConfig(Section):
    epochs: Annotated[int, Field(ge=1, le=100_000)] | Literal["auto"] = "auto"
    """Passes over the training split. `auto`: 8, or more when that would make fewer than 120 optimizer steps (a
    folder of a hundred photos gets 30); the log gives the number and why, and train/summary.json records it. A
    number is used as it is, but for `compression = "auto"` choosing `diloco`: it counts the plain run's epochs, and
    DiLoCo trains twice as many, as with `auto` (docs/how-to/compression.md)."""
    batch_size: Annotated[int, Field(ge=1, le=1 << 20)] | Literal["auto"] = "auto"
    """Global batch size: split evenly across all ranks. `auto`: 64, halved while an epoch would have fewer than 4
    optimizer steps, down to 16 images a rank (a hundred photos on 2 ranks: 32)."""
    lr: Annotated[float, Field(gt=0.0)] | Literal["auto"] = "auto"
    """Peak learning rate of AdamW: reached linearly over `warmup_epochs`, then cosine-decayed to zero. `auto`: 1e-2
    from scratch, 1e-3 from `model.weights` (a full-size step early on overwrites what the weights know)."""
    warmup_epochs: float = Field(1.0, ge=0.0)
    """Epochs of linear learning-rate warm-up from near zero to `lr` (0: none). Fresh BatchNorm statistics and a new
    classifier head make the first steps' gradients large; a full-size step then wrecks pretrained weights."""
    bn_recalibration_batches: int = Field(32, ge=0)
    """Before each epoch's validation (and so before every checkpoint), recompute BatchNorm running statistics as
    a cumulative average over this many batches of each rank's training images, unaugmented, averaged over all
    ranks (as `torch.optim.swa_utils.update_bn` does). Running statistics updated with a small momentum (0.01 in
    torchvision's MobileNetV3) lag the weights by hundreds of steps; eval-mode accuracy then says nothing about
    the weights (docs/measurements.md#batchnorm-recalibration). The check that follows compares eval mode with batch
    statistics on the same training images; a gap over 0.2 is a warning in the log and the report. 0: off."""
    weight_decay: float = Field(1e-4, ge=0.0)
    """AdamW weight decay."""
    strategy: Literal["ddp", "fsdp", "auto"] = "ddp"
    """`ddp`: a full replica per rank; `fsdp`: FSDP2, parameters, gradients and AdamW state sharded across ranks
    (`fully_shard` per block: a residual block, a conv-norm-activation group, the head; then the root); `auto`: FSDP
    when the DDP estimate per rank (parameters + gradients + optimizer state + activations) exceeds
    `train.memory_budget_mb`, else DDP. Rank 0 logs the choice and why (`strategy: fsdp (DDP needs ~... > ...
    budget; ...)`), and train/summary.json records it."""
    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"] = "auto"
    """`auto` is bf16 autocast on GPUs that support it and fp32 on CPU, where bf16 buys no speed. Under FSDP,
    `bf16-mixed` is also a `MixedPrecisionPolicy` (bf16 parameters, fp32 norm layers and gradient reduction).
    `fp16-mixed` scales the loss (GradScaler; under FSDP ShardedGradScaler, which agrees on overflows across
    shards); fp16 autocast is very slow on CPU."""
    compression: str = "none"
    """Gradient compression method, by name: the table in docs/compression.md lists them, what each sends and which
    FSDP can use (it is generated from the methods' registry, `pipeline/train/compression/registry.py`, which the
    train stage checks this name and its settings against before any rank starts). `none` is plain all-reduce;
    `auto` measures the link and the methods and runs the fastest: `diloco` for the whole run when a probe before
    the first step predicts it soonest to the plain run's accuracy, else the gradient methods, switched per step."""
    compression_warmup_epochs: float = Field(1.0, ge=0.0)
    """Epochs of plain all-reduce before `powersgd`, `topk`, `sign`, `localsgd` or `auto` start: compressing the
    large gradients of the first steps costs accuracy (docs/measurements.md#compression-warm-up). Counted from the
    run's first step: a resumed run goes on compressing (PowerSGD after 2 plain steps, to rebuild its buckets).
    `diloco` has none: its warm-up cost more bytes than it saved epochs
    (docs/measurements.md#diloco-epochs-and-defaults)."""
    compression_warmup_steps: int | None = Field(None, ge=0)
    """Warm-up in optimizer steps instead of `compression_warmup_epochs` (`powersgd` and `auto` need >= 2); unset:
    epochs."""
    powersgd_rank: int = Field(8, ge=1)
    """Rank of PowerSGD's low-rank approximation: bytes grow linearly with it, and below 8 the quickstart and
    resnet18 lost more than a point against `none` (docs/measurements.md#powersgd-rank). `powersgd` is refused, with
    one line, on a model where no weight matrix is large enough for this rank to shrink it."""
    topk_fraction: float | None = Field(None, gt=0.0, le=1.0)
    """Share of each bucket's gradient entries `topk` sends (values as fp32, indices as int32); unset: scaled to the
    model, 1% but at least 2048 entries and at most 10% (small_cnn: 10%, resnet18 and resnet50: 1%;
    docs/measurements.md#top-k-how-many-entries)."""
    localsgd_period: int = Field(8, ge=1)
    """`localsgd` and `diloco`: steps between model averagings (`diloco`: outer steps) after warm-up, as near as the
    epoch allows: an epoch of S steps gets round(S / period) of them (at least one), spread evenly, the last at its
    end, where one model must be validated and saved (docs/measurements.md#averagings-lined-up-with-the-epochs)."""
    localsgd_int8: bool = False
    """`localsgd`: average each tensor's change since the last averaging in 8 bits (one fp32 scale per tensor) with
    error feedback, instead of the fp32 parameters: a quarter of the bytes on each averaging step (the first, with no
    shared anchor yet, is fp32). Every rank sums the same gathered payloads, so the models stay bit-identical."""
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    """`diloco`: learning rate of the outer step, on the ranks' averaged change since the last one (DiLoCo's 0.7;
    1.0 with `outer_momentum = 0` is plain model averaging, as `localsgd`)."""
    outer_momentum: float = Field(0.5, ge=0.0, lt=1.0)
    """`diloco`: Nesterov momentum of the outer step, carried from one outer step to the next. DiLoCo's 0.9 was
    tuned for hundreds of inner steps; at 8 it lost 2 points on the quickstart
    (docs/measurements.md#diloco-outer-step)."""
    outer_int8: bool = True
    """`diloco`: send the outer step's change in 8 bits (one fp32 scale per tensor) with error feedback, as
    `localsgd_int8` does: a quarter of the bytes, and on the cluster benchmark's job the same accuracy
    (docs/measurements.md#diloco-epochs-and-defaults). The first outer step, with no shared anchor yet, is fp32."""
    stream_fragments: int = Field(1, ge=1)
    """`streaming`: fragments of the model, each with an outer step of its own every `localsgd_period` steps, their
    turns spread over the period. More fragments lower the peak bandwidth, each adds a collective's round trips per
    period (docs/measurements.md#streaming-diloco)."""
    stream_delay_steps: int = Field(4, ge=0)
    """`streaming`: inner steps a fragment's outer step travels in the background before it is applied; at most
    `localsgd_period`. Long enough to hide the collective (on the cluster benchmark's link an 8-bit all-gather takes
    some 0.37 s) and short enough that the change applied is recent (docs/measurements.md#streaming-diloco)."""
    compression_auto_every_steps: int = Field(20, ge=1)
    """`auto`: steps between measurements. Each times the steps since the last; the link itself (an all-reduce of
    4 bytes and of 512 KiB) is timed only when the running method's own communication time has moved by half, or at
    every 5th measurement. A switch needs the median of the last 3 link samples to favour another method by 20% at
    2 measurements in a row."""
    balance: bool = True
    """Keep a slow or throttled device from setting every step's pace, from the steps each rank measured over the
    last epoch (forward passes and optimizer step). Under DDP with a gradient method, each rank's share of the global
    batch is sized to them, its loss weighted by its share so that the averaged gradient is still the whole batch's.
    Under `localsgd` and `diloco`, whose ranks meet only at averagings, a rank slower than the median trains that
    share of the steps, its change weighed by the steps it trained. Either stays even while the ranks' steps are
    within 1.5x of each other or the gain is under a tenth of a step (pipeline/train/rank/shares.py). Not under FSDP,
    whose ranks gather every layer in step."""
    memory_budget_mb: int | None = Field(None, ge=1)
    """Memory one rank may use, for `strategy = "auto"`; unset: free CUDA memory, or 80% of the host's available
    memory split between the node's ranks. The smallest over all ranks counts."""
    grad_clip_norm: float | None = Field(None, gt=0.0)
    """Clip the global gradient norm (across all ranks and shards) to this value; unset: no clipping."""
    accumulation: int = Field(1, ge=1, le=4096)
    """Micro-steps per optimizer step: each rank's share of the batch is split in this many micro-batches, and
    gradients are synchronised only after the last (`no_sync`). The global batch does not change."""
    checkpoint_every_steps: int | None = Field(None, ge=1)
    """Also checkpoint every this many optimizer steps (mid-epoch): a resume continues at the same batch of the same
    epoch order, with each rank's RNG state, the optimizer and the gradient scaler restored. Under `localsgd` and
    `diloco` the save waits for the next averaging, when the ranks' models are one (up to `localsgd_period` steps
    more). Unset: at each epoch's end; in a cluster job (`inventory`) under `localsgd` or `diloco` where each device
    saves a checkpoint of its own (DDP, torch newer than 2.5 on every device), also after every averaging, each a
    write to the device's own disk: a device lost for good costs the others at most the outer step in flight."""
    max_restarts: int = Field(0, ge=0, le=1000)
    """torchrun `--max-restarts`: when a rank dies, restart the whole group this many times; each restart resumes
    from `latest` (set `checkpoint_every_steps` to lose less than an epoch). The launcher sets
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, without which restarted gloo ranks dial a stale address
    (docs/torch-distributed.md#stale-rendezvous-store-after-restarts)."""
    pg_timeout_s: int = Field(1800, ge=1, le=30 * 86400)
    """Seconds a collective may wait for a peer before the process group gives up (`init_process_group(timeout)`);
    raise it on links that black out for a while."""
    link_timeout_s: int = Field(120, ge=15, le=30 * 86400)
    """With `inventory`: seconds a device may be silent (a WiFi blackout) before the SSH job counts it as gone. One
    back within it trains on in the same round, its ranks' collectives having waited for it; one silent for longer
    leaves, and the job goes on without it (`devices`). At most `pg_timeout_s`: the collectives must outlast it."""
    env: dict[EnvName, str] = Field(default_factory=dict)
    """Environment for the ranks, under the libraries' own variable names, e.g. `NCCL_SOCKET_IFNAME`,
    `GLOO_SOCKET_IFNAME`, `TORCH_NCCL_ASYNC_ERROR_HANDLING`, `NCCL_IB_DISABLE`; applied on top of the caller's. The
    values are part of the config, written into the run's config.json: a name that looks like a secret (a token, a
    key, a password) is refused here; name it in `pass_env` instead."""
    pass_env: list[EnvName] = Field(default_factory=list)
    """Variables of this controller's environment passed to the ranks, here and on every device, e.g. an API token:
    only their names are part of the config; their values never reach config.json, the manifest, a log or a command
    line (docs/security.md#secrets). Each must be set when training starts."""
    thermal_limit_c: float | None = None
    """Device temperature (°C) above which each rank halves its micro-batch and doubles accumulation (again at each
    hot reading; the global batch stays the same), and steps back once 5 °C cooler; unset: off. A CUDA out-of-memory
    error halves it too and retries the step (safe when it strikes before the step's synchronising backward pass,
    where it almost always does: that is where activations peak). Under FSDP, whose every micro-batch meets all the
    ranks, they split alike, as the hottest says, and an out-of-memory error stops the run with the accumulation to
    set. Step lines in train/metrics.jsonl record `accumulation`, `micro_batch`, `batch`, `temperature_c` and
    `batch_event`."""
    thermal_path: Path | None = None
    """File to read the temperature from (millidegrees or degrees, like a Jetson thermal zone); unset: the hottest
    `/sys/class/thermal/thermal_zone*/temp`, else `nvidia-smi`."""
    thermal_every_steps: int = Field(10, ge=1)
    """Steps between temperature readings."""
    augment_shift: int = Field(0, ge=0)
    """Random translation of training batches by up to this many pixels (0: off); each rank draws its own shifts
    from a seed derived from `run.seed`, its rank and the step, so a resumed run draws the same ones."""
    nproc_per_node: int = Field(2, ge=1, le=1024)
    """Ranks started on this node: each takes a GPU of its own where there are GPUs (whichever the backend), else
    this many CPU ranks."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; `auto` is nccl when CUDA is present and torch was built with NCCL, gloo otherwise
    (NVIDIA's torch for JetPack has no NCCL: its ranks train on the GPU and exchange through gloo). In cluster
    training every device's ranks use one: gloo as soon as any device lacks NCCL; nccl set where a device lacks
    it is refused before anything starts, naming the device."""
    threads_per_rank: int = Field(1, ge=1, le=1024)
    """torch intra-op threads per CPU rank; keeps 2 ranks from fighting over 2 cores."""
    checkpoint_async: bool | None = None
    """Write checkpoints in the background (DCP `async_save` on a gloo group of its own: on the default group it
    deadlocks against training's collectives, docs/torch-distributed.md#async-checkpoints-need-their-own-group) while
    training goes on;
    `latest` moves only once a write has completed. Unset: in the background when training on CUDA (the copy to
    host memory frees the GPU, and the write runs on host cores training leaves idle), in the foreground on CPU
    (the ranks already use every core: a writer thread slows the steps by more than the save it hides;
    docs/measurements.md#background-checkpoints-on-cpu). A
    background save holds a CPU copy of each rank's model and optimizer state: turn it off where memory is short."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """Newest epoch checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    timeout_s: int = Field(3600, ge=10, le=30 * 86400)
    """Wall-clock limit for the whole torchrun job; the process group is killed past it."""
    inventory: Path | None = None
    """Fleet inventory TOML of the devices to train on over SSH (one torchrun agent per target, with the target's
    `python`, `nproc_per_node`, `ifname` and `addr`); unset: train on this machine."""
    mode: Literal["sync", "federated"] = "sync"
    """With `inventory`: `sync` trains one synchronous job across the devices (every step averaged over all of
    them); `federated` runs Flower's federated averaging, each device training on its own images in its idle
    windows (`idle`, `idle_check` in the inventory) and sending only its model change (`train.federated`)."""
    federated: FederatedConfig = Field(default_factory=FederatedConfig)
    """Federated training settings (`mode = "federated"`)."""
    devices: str | None = Field(None, pattern=r"^[1-9][0-9]*(:[1-9][0-9]*)?$")
    """With `inventory`: how many of the inventory's devices the SSH job needs, "N" or "MIN:MAX"; training goes on
    while at least MIN remain, and a device that comes back rejoins up to MAX. Unset: every device of the
    inventory, none may leave. Not the CLI's `pipeline train --nnodes`, which is torchrun's fixed node count for
    one job across hosts on a shared filesystem (no inventory)."""

    @model_validator(mode="after")
    def _no_secret_in_env(self) -> TrainConfig:
        for name in self.env:
            if SECRET_NAME.search(name):
                raise ValueError(
                    f"train.env.{name}: looks like a secret, and train.env is written into the run's config.json: "
                    f"export it here and list {name} in train.pass_env instead"
                )
        return self

    @model_validator(mode="after")
    def _federated_needs_devices(self) -> TrainConfig:
        if self.mode == "federated" and self.inventory is None:
            raise ValueError('train.mode = "federated" needs train.inventory: the devices that train')
        return self

    @model_validator(mode="after")
    def _stream_lands_before_its_next_turn(self) -> TrainConfig:
        if self.stream_delay_steps > self.localsgd_period:
            raise ValueError(
                f"train.stream_delay_steps ({self.stream_delay_steps}) is above train.localsgd_period "
                f"({self.localsgd_period}): a fragment's outer step must land before its next turn"
            )
        return self

    @model_validator(mode="after")
    def _collectives_outlast_the_link(self) -> TrainConfig:
        if self.inventory is not None and self.pg_timeout_s < self.link_timeout_s:
            raise ValueError(
                f"train.pg_timeout_s ({self.pg_timeout_s}) is below train.link_timeout_s ({self.link_timeout_s}): "
                "the ranks would give up on a silent device the job still waits for; raise pg_timeout_s or lower "
                "link_timeout_s"
            )
        return self

    def passed_env(self) -> dict[str, str]:
        """The `pass_env` variables with their values from this process's environment; one line naming the first
        one that is not set."""
        missing = [name for name in self.pass_env if name not in os.environ]
        if missing:
            raise PipelineError(f"train.pass_env: {missing[0]} is not set in this environment")
        return {name: os.environ[name] for name in self.pass_env}


class ExportConfig(Section):
    opset: int = Field(18, ge=13, le=23)
    """Highest ONNX opset wanted; the file gets the lower of this and what `export.min_tensorrt` parses (the dynamo
    exporter writes >= 18 and the stage converts down). parity.json records the opset and why."""
    max_batch: int = Field(32, ge=1, le=65_536)
    """Largest batch of the dynamic batch axis (min is 1); also the `max` TensorRT profile shape."""
    opt_batch: int = Field(8, ge=1, le=65_536)
    """Batch the TensorRT profile is tuned for."""
    parity_samples: int = Field(256, ge=1, le=1_000_000)
    """Validation images compared between ONNX Runtime and PyTorch: the parity gate needs every logit within `atol`
    and the same top-1 class on all of them."""
    atol: float = Field(1e-4, gt=0.0)
    """Largest allowed absolute difference between ONNX Runtime and PyTorch logits."""
    min_tensorrt: str = Field("8.5", pattern=r"^\d+\.\d+$")
    """Oldest TensorRT among the targets ("major.minor"); the file's opset is lowered to what it parses (8.5 and
    8.6: 17, 10.x: 20, 11.x: 24). JetPack 5.1 ships 8.5, JetPack 6.0 8.6, JetPack 6.1/6.2 10.3."""
    exporter: Literal["dynamo", "legacy"] = "dynamo"
    """`dynamo`: torch.export-based exporter (writes opset >= 18, converted down when needed). `legacy`: the
    deprecated TorchScript exporter, writing the target opset directly; only a fallback for models whose opset
    conversion fails."""
    simplify: bool = False
    """Run onnxscript's graph optimizer (constant folding, dead code removal) on the fp32 graph; parity is checked
    on the simplified file."""
    variants: list[Literal["fp32", "fp16", "int8"]] = Field(default_factory=lambda: ["fp32"])
    """Files to write: `fp32` onnx/model.onnx (always), `fp16` onnx/model.fp16.onnx (FP16 graph, fp32 inputs and
    outputs: what TensorRT 11's strongly typed builds take), `int8` onnx/model.int8.onnx (explicit Q/DQ: symmetric
    int8 activations, per-channel symmetric int8 weights, fp32 biases). All are written in a staging directory and
    moved into onnx/ together only when every gate passes."""
    calibration_samples: int = Field(256, ge=1, le=1_000_000)
    """Training images (the first ones) that calibrate the int8 activation ranges."""
    max_accuracy_drop: float = Field(0.01, ge=0.0, le=1.0)
    """Largest allowed validation-accuracy drop of the fp16 and int8 files below the fp32 file (0.01 = 1 point),
    measured with ONNX Runtime on the whole validation split."""

    @model_validator(mode="after")
    def _opt_within_max(self) -> ExportConfig:
        if self.opt_batch > self.max_batch:
            raise ValueError("export.opt_batch must not exceed export.max_batch")
        return self


class BuildClass(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Device class, e.g. `orin-sm87-trt10.3.0` (what the deploy probe calls the device); names `engines/<name>/`."""
    tensorrt: str = Field(pattern=r"^\d+\.\d+(\.\d+)?$")
    """TensorRT version of the class ("10.3" or "10.3.0"); a builder reporting another version does not build it."""
    sm: str = Field("", pattern=r"^(sm\d+)?$")
    """GPU compute capability ("sm87" = Orin); "" = not checked."""
    l4t: str = ""
    """L4T release of the class (informational, recorded in build.json)."""
    builder: Literal["python", "trtexec", "device"] = "trtexec"
    """`python`: the TensorRT Python API here; `trtexec`: `trtexec` here; `device`: `device_trtexec` on the
    inventory target `target` over SSH, or, without `target`, the device builds at install time (not built here)."""
    trtexec: str = "trtexec"
    """trtexec here (builder `trtexec`): a name on PATH or an absolute path."""
    target: str = ""
    """Inventory target (deploy.inventory) that builds this class (builder `device`)."""
    device_trtexec: str = "/usr/src/tensorrt/bin/trtexec"
    """trtexec on the device (builder `device`)."""
    workspace_mb: int | None = Field(None, ge=16)
    """Workspace limit for this class; None = build.workspace_mb (small Jetsons need less)."""
    opt_level: int | None = Field(None, ge=0, le=5)
    """Builder optimisation level (TensorRT >= 8.6); None = build.opt_level."""
    dla_core: int | None = Field(None, ge=0)
    """DLA core (Orin/Xavier) with GPU fallback; None = GPU only."""


class BuildConfig(Section):
    builder: Literal["auto", "python", "trtexec"] = "auto"
    """`auto`: the TensorRT Python API when it imports and a GPU is present, else `trtexec` on PATH, else skip.
    Used when `classes` is empty (one engine for this host)."""
    classes: list[BuildClass] = Field(default_factory=list)
    """Device classes to build for, one engine each (`[[build.classes]]`); empty = this host's class only."""
    from_inventory: bool = False
    """Also probe the devices of deploy.inventory and build one engine per device class found there, on the first
    device of that class (builder `device`); classes declared in `classes` with the same name win."""
    cache_dir: Path = Path("artifacts/engine-cache")
    """Engines and timing caches kept across runs, per class; an engine whose key (ONNX sha256, TensorRT version,
    class, precision, shapes, builder options) matches is copied in without building. Every build of a class starts
    from, and extends, `<cache_dir>/<class>/timing.cache`."""
    opt_level: int | None = Field(None, ge=0, le=5)
    """`--builderOptimizationLevel` (TensorRT >= 8.6; ignored, and noted in build.json, before); None = default."""
    verify: bool = True
    """Check every engine built for a class, where it was built: plan version (TensorRT 9.1 and later), a load, and
    the outputs on onnx/sample.npz against ONNX Runtime's (fp32 1e-3, fp16 1e-2, int8 the same top-1); trtexec's
    latency summary goes into build.json. A failed check publishes and caches nothing; its log is kept as
    engines/<class>/build-failed.log."""
    precision: Literal["fp32", "fp16", "int8"] = "fp16"
    """Engine precision: builder flags on the fp32 (or, for int8, Q/DQ) ONNX before TensorRT 11; from 11 the
    matching ONNX variant (onnx/model.fp16.onnx, onnx/model.int8.onnx) is built as it is."""
    workspace_mb: int = Field(1024, ge=16, le=1 << 20)
    """Builder workspace memory-pool limit, in MiB (passed as a plain number: TensorRT 10.0.x would count an `M`
    suffix twice)."""
    trtexec: str = "trtexec"
    """trtexec executable: a name looked up on PATH or an absolute path."""
    timeout_s: int = Field(1800, ge=10, le=30 * 86400)
    """Limit for one engine build."""

    @model_validator(mode="after")
    def _unique_classes(self) -> BuildConfig:
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate build class name(s): {', '.join(dupes)}")
        return self


class LocalTarget(Section):
    name: str
    """Target name, unique in the list; shown in the deploy table."""
    root: Path
    """Directory standing in for the device's deploy root (`releases/`, `current`, `previous`)."""


class DeployConfig(Section):
    targets: list[LocalTarget] = Field(
        default_factory=lambda: [LocalTarget(name="local", root=Path("artifacts/devices/local"))]
    )
    """Local targets: directories that stand in for devices; used when `inventory` is not set."""
    inventory: Path | None = None
    """Fleet inventory TOML ([defaults], [policy], [[targets]]): when set, deploy goes to these devices over SSH
    (canary, then waves) instead of `targets`; its [policy] sets keep_releases for them."""
    keep_releases: int = Field(3, ge=2, le=1000)
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
    """End the run early, saying so, when data and training config are unchanged since an earlier trained run under
    `run.runs_root` (the data fingerprint: an ImageFolder's file names, sizes and mtimes, or the built-in data's
    config). The nightly schedules set this."""
    promotion_tolerance: float = Field(0.01, ge=0.0, le=1.0)
    """Deploy a new model only when its validation accuracy is at least the deployed model's minus this. The
    deployed model is the newest run under `run.runs_root` whose deploy succeeded; both are scored by their exported
    ONNX models on the new run's held-out images."""
    min_accuracy: float | None = Field(None, ge=0.0, le=1.0)
    """Validation accuracy below which the run stops before build and deploy: a model at chance is not shipped.
    Unset: twice chance (1/classes) or a fifth of the way from chance to 1, whichever is lower (5 classes: 0.36,
    2 classes: 0.6, 100 classes: 0.02)."""


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

    @model_validator(mode="after")
    def _federated_reads_each_devices_own_images(self) -> Config:
        if self.train.mode == "federated" and (self.data.source != "imagefolder" or self.data.sync):
            raise ValueError(
                'train.mode = "federated" trains each device on its own images: it needs data.source = '
                '"imagefolder" (data.path on each device) and data.sync = false'
            )
        return self

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
    except RecursionError:
        # Not kept as a string: a string-valued key would take the brackets as its value without a word.
        raise PipelineError(f"--set {key.strip()}: {TOO_DEEP}") from None
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


RENAMED = {
    ("train", "nnodes"): (
        "devices",
        'how many inventory devices the SSH job needs, "N" or "MIN:MAX"; the CLI\'s --nnodes is torchrun\'s node count',
    ),
}
"""(section, old key) -> (new key, what it is): a TOML file or `--set` with the old key is refused naming the new
one, in place of "unknown key"; a config snapshot the pipeline wrote before the rename is read under the new name."""


def _renamed(where: str) -> str | None:
    """The refusal for a dotted key that was renamed, or None."""
    section, _, key = where.partition(".")
    if (section, key) in RENAMED:
        new, what = RENAMED[section, key]
        return f"renamed to {section}.{new} ({what})"
    return None


def upgrade_snapshot(data: dict[str, Any]) -> dict[str, Any]:
    """A config snapshot the pipeline wrote itself, with renamed keys under their new names, so that an older run
    directory still opens."""
    for (section, old), (new, _) in RENAMED.items():
        table = data.get(section)
        if isinstance(table, dict) and old in table and new not in table:
            table[new] = table.pop(old)
    return data


UNION_TAG = re.compile(r"^(literal\[.*\]|constrained-\w+|int|float|str|bool)$")
"""How pydantic names the member of a union (`int | Literal["auto"]`) an error is about, after the field's key."""


def _first_error(err: ValidationError, origin: str) -> PipelineError:
    """One line for the first field in error. A union field fails once per member (`int`, `'auto'`): that is one
    error, said as the first member's message plus what the literal members would accept."""
    by_field: dict[str, list[Any]] = {}
    for error in err.errors():
        loc = [str(p) for p in error["loc"] if not (isinstance(p, str) and UNION_TAG.match(p))]
        by_field.setdefault(".".join(loc) or "(top level)", []).append(error)
    where, errors = next(iter(by_field.items()))
    first = errors[0]
    msg = (_renamed(where) or "unknown key") if first["type"] == "extra_forbidden" else first["msg"]
    others = [e["ctx"]["expected"] for e in errors[1:] if e["type"] == "literal_error"]
    msg += f" (or {', '.join(others)})" if others and first["type"] != "literal_error" else ""
    more = f" (and {len(by_field) - 1} more)" if len(by_field) > 1 else ""
    return PipelineError(f"{origin}: {where}: {msg}{more}")


def validate(data: dict[str, Any], origin: str) -> Config:
    """Validate a raw mapping; errors name the dotted key and the origin (a file or `--set`)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise _first_error(err, origin) from None


def read_toml(path: Path, what: str = "config") -> dict[str, Any]:
    """Parse a TOML file (`what`: config, inventory) into a mapping; a missing or malformed file is one line."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{path}: {what} file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise PipelineError(f"{path}: invalid TOML: {err}") from None
    except RecursionError:
        raise PipelineError(f"{path}: invalid TOML: {TOO_DEEP}") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise PipelineError(f"{path}: cannot read {what}: {err}") from None


def toml_value(value: Any) -> str:
    """The TOML text of a value, as a config file or `--set key=value` reads it: strings, ints, floats, bools,
    paths, lists and inline tables of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        # A JSON string is a valid TOML basic string: same quotes, and escapes TOML also knows.
        return json.dumps(str(value))
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def toml_key(key: str) -> str:
    """A key, quoted only when it is not a bare key."""
    return key if BARE_KEY.fullmatch(key) else json.dumps(key)


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load the TOML config at `path` (the embedded quickstart when None) and apply `--set` overrides."""
    path = path or DEFAULT_CONFIG
    data = apply_overrides(read_toml(path), overrides or [])
    return validate(data, str(path))
