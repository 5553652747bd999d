"""How the model is spread over the ranks: DDP with a compression hook, or FSDP2 sharded per block; `auto` picks.

`auto` estimates what one rank holds under DDP (parameters + gradients + optimizer state + activations) and under
FSDP (a 1/world share of the first three, plus the largest block gathered whole, plus activations) and takes DDP
when it fits the memory budget (`train.memory_budget_mb`, else the device's), FSDP otherwise.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import TrainConfig
from pipeline.errors import PipelineError
from pipeline.train.compression import collectives, registry
from pipeline.train.compression.method import CommCounter, Compression, Epoch
from pipeline.train.rank.fsdp2 import NEEDS_CUDA, FSDPModule, MixedPrecisionPolicy, fully_shard
from pipeline.train.rank.runtime import Runtime

ADAM_STATES = 2
"""Optimizer tensors per parameter (AdamW: exp_avg, exp_avg_sq)."""
HOST_MEMORY_SHARE = 0.8
"""Share of available host memory the ranks of a node may plan to use, split evenly between them."""


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds under each strategy."""

    ddp: int
    fsdp: int
    budget: int


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one: the root's children that hold parameters, descending one level into a
    container (Sequential, ModuleList) whose children are themselves composite (resnet's layer1, mobilenet's
    features), so a block is a residual block or a conv-norm-activation group, never a lone layer."""
    found: list[nn.Module] = []
    for child in model.children():
        if not any(True for _ in child.parameters()):
            continue
        nested = isinstance(child, nn.Sequential | nn.ModuleList) and any(
            any(True for _ in c.children()) for c in child.children()
        )
        if nested:
            found.extend(c for c in child.children() if any(True for _ in c.parameters()))
        else:
            found.append(child)
    return found


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@torch.no_grad()
def activation_bytes(model: nn.Module, sample: torch.Tensor, batch: int) -> int:
    """Bytes of the leaf modules' outputs for `batch` samples: what autograd keeps for the backward pass."""
    total = 0

    def count(_m: nn.Module, _i: object, out: object) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel() * out.element_size()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        model.eval()(sample[:1])
    finally:
        for handle in handles:
            handle.remove()
        model.train()
    return total * batch


def device_budget(rt: Runtime) -> int:
    """Free CUDA memory on this rank's GPU, or a share of available host memory per local rank."""
    if rt.device.type == "cuda":
        return int(torch.cuda.mem_get_info(rt.device)[0])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * HOST_MEMORY_SHARE / local)


def estimate(model: nn.Module, sample: torch.Tensor, batch: int, cfg: TrainConfig, rt: Runtime) -> Estimate:
    """Per-rank bytes under DDP and FSDP, and the budget: the smallest any rank has, so all ranks choose alike."""
    params = _nbytes(list(model.parameters()))
    state = params * (2 + ADAM_STATES)  # parameters, gradients, optimizer state
    act = activation_bytes(model, sample, batch)
    largest = max((_nbytes(list(b.parameters())) for b in blocks(model)), default=params)
    own = cfg.memory_budget_mb * 2**20 if cfg.memory_budget_mb is not None else device_budget(rt)
    budget = torch.tensor([own], dtype=torch.float64, device=rt.device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    fsdp = math.ceil(state / rt.world_size) + 2 * largest + act  # the gathered block, and its gradient
    return Estimate(ddp=state + act, fsdp=fsdp, budget=int(budget.item()))


def choose(model: nn.Module, sample: torch.Tensor, batch: int, cfg: TrainConfig, rt: Runtime) -> tuple[str, str]:
    """The strategy to use, and why (`auto` decides from :func:`estimate`; an explicit choice is kept)."""
    if cfg.strategy == "fsdp" and NEEDS_CUDA and rt.device.type != "cuda":
        raise PipelineError(f"train.strategy=fsdp: torch {torch.__version__}'s FSDP2 needs CUDA; use ddp here")
    # gloo gathers and scatters no CUDA tensors, and FSDP's every collective does (docs/torch-distributed.md
    # #no-nccl-on-jetson): on a GPU without NCCL only DDP trains.
    no_fsdp = rt.backend == "gloo" and rt.device.type == "cuda"
    if cfg.strategy == "fsdp" and no_fsdp:
        raise PipelineError("train.strategy=fsdp: on a GPU it needs the nccl backend; these ranks run gloo: use ddp")
    if cfg.strategy != "auto":
        return cfg.strategy, "set in train.strategy"
    est = estimate(model, sample, batch, cfg, rt)
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in vars(est).items()}
    if est.ddp <= est.budget:
        return "ddp", f"DDP needs ~{mib['ddp']} per rank, within the {mib['budget']} budget"
    if NEEDS_CUDA and rt.device.type != "cuda":
        return "ddp", f"DDP needs ~{mib['ddp']} > {mib['budget']}, but torch {torch.__version__}'s FSDP2 needs CUDA"
    if no_fsdp:
        return "ddp", f"DDP needs ~{mib['ddp']} > {mib['budget']}, but FSDP on a GPU needs nccl, and this is gloo"
    if not registry.method(cfg).fsdp:
        return "ddp", f"DDP needs ~{mib['ddp']} > {mib['budget']}, but compression {cfg.compression} needs DDP"
    return "fsdp", f"DDP needs ~{mib['ddp']} > {mib['budget']} budget; FSDP needs ~{mib['fsdp']} per rank"


def fsdp_policy(cfg: TrainConfig, precision: str) -> MixedPrecisionPolicy:
    """bf16 compute for `bf16-mixed`; the reduce-scatter in fp16/bf16 when compression asks for it."""
    param = torch.bfloat16 if precision == "bf16-mixed" else None
    reduce = registry.method(cfg).reduce_dtype
    if reduce is None and param is not None:
        reduce = torch.float32  # gradients are averaged in fp32 unless compression says otherwise
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def fsdp_comm_bytes(model: nn.Module, world: int, reduce: torch.dtype | None) -> int:
    """Gradient payload of one FSDP step: every parameter, dim 0 padded to a multiple of `world`, in reduce dtype."""
    total = 0
    for p in model.parameters():
        rows = math.ceil(p.shape[0] / world) * world if p.dim() else 1
        total += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) * (reduce or p.dtype).itemsize
    return total


class _FixedPayload(Compression):
    """FSDP's reduce-scatter payload is the same every step; it is counted per optimizer step. Its time is not
    measured: the collectives run inside FSDP, overlapped with compute."""

    timed = False

    def __init__(self, nbytes: int, name: str) -> None:
        super().__init__(CommCounter(), name)
        self.nbytes = nbytes

    def after_step(self, model: nn.Module) -> None:
        """Count this step's reduce-scatter payload."""
        self.counter.add(self.nbytes)


def wrap(
    model: nn.Module, cfg: TrainConfig, rt: Runtime, name: str = "ddp", warmup: int = 0, epoch: Epoch | None = None
) -> tuple[nn.Module, Compression]:
    """Move `model` to this rank's device and wrap it as `name` (ddp or fsdp); return it and its compression, which
    under DDP runs plain all-reduce for `warmup` more steps (registry.warmup_steps) and lines up the averagings of
    the methods that average models with `epoch`'s steps (registry.knobs)."""
    model = model.to(rt.device)
    if name == "fsdp":
        policy = fsdp_policy(cfg, rt.precision)
        payload = fsdp_comm_bytes(model, rt.world_size, policy.reduce_dtype)
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
        if policy.param_dtype is not None:
            # Norm layers keep fp32 parameters (their running statistics are fp32): units of their own.
            full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=policy.reduce_dtype)
            for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
                fully_shard(norm, mesh=mesh, mp_policy=full)
        for block in blocks(model):
            if not isinstance(block, FSDPModule):  # a lone norm layer (resnet's stem bn1) is a unit already
                fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, _FixedPayload(payload, cfg.compression)
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    # One bucket for the blocking methods; DDP's default 25 MiB buckets let plain all-reduces overlap the backward.
    blocking = registry.method(cfg).blocking
    one_bucket = math.ceil(_nbytes(list(model.parameters())) / 2**20) + 1 if blocking else None
    # No buffer broadcast before each forward: rank 0's running statistics come out the same without it (it keeps
    # its own), and sync_buffers copies them to every rank before evaluation and checkpoints. It was a collective
    # every step (docs/measurements.md#collectives-on-a-weak-link).
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=one_bucket, broadcast_buffers=False)
    return ddp, registry.install(ddp, cfg, warmup, epoch)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DDP wrapper (FSDP2 shards the module in place: it is its own)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    """True under FSDP, whose forward runs collectives: every rank must run the same number of them."""
    return isinstance(model, FSDPModule)


def sync_buffers(model: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank.

    DDP broadcasts them at the start of each forward, but every rank then updates its own copy with its own
    batch (FSDP never syncs them); syncing before evaluation and checkpoints makes all ranks evaluate and save
    the same model. One broadcast for all of them (see pipeline.train.compression.collectives).
    """
    collectives.broadcast_flat(list(unwrap(model).buffers()), src=0)
