"""The train stage: data-parallel training under torchrun, with epoch checkpoints and a metrics log.

The stage itself runs in this process and only launches torchrun (:func:`pipeline.train.launch.launcher.launch`) or,
with `train.inventory`, the SSH job on the devices (:func:`pipeline.train.cluster.rounds.run_on_devices`); the ranks run
:mod:`pipeline.train.rank.worker`. Everything they produce lands under ``train/`` in the run directory.

A rank imports this package too (it is the parent of :mod:`pipeline.train.rank`): so this module imports nothing of
the controller's rooms at module level, only inside the functions the controller calls.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline import data, layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import read_json, sha256_file
from pipeline.manifest import RunDir, Stage, StageResult, cached_result, run_stage

SUMMARY_METRICS = (
    "val_accuracy",
    "epochs",
    "steps",
    "samples_per_s",
    "seconds",
    "eval_mode_accuracy",
    "train_mode_accuracy",
    "bn_recalibration_images",
    "warnings",
)

__all__ = ["STAGE", "run"]


def fingerprints(cfg: Config) -> dict[str, str]:
    """What the stage reads from outside the run dir: the dataset (every device's own, when cluster training reads
    `data.path` on each device) and, when set, the initial weights file."""
    external = {"data": data.fingerprint(cfg.data)}
    if cfg.train.inventory is not None and cfg.data.source == "imagefolder" and not cfg.data.sync:
        # Each device trains on its own folder: the run's data is all of them (asks every device, over SSH).
        from pipeline.train.cluster import rounds

        external["data"] = rounds.node_data_fingerprint(cfg)
    if cfg.model.weights is not None:
        try:
            external["weights"] = sha256_file(cfg.model.weights)
        except OSError as err:
            raise PipelineError(f"model.weights: {cfg.model.weights}: {err.strerror}") from None
    return external


def run(
    cfg: Config,
    run: RunDir,
    log: Callable[[str], None] = print,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    nproc_per_node: int | None = None,
    output: Callable[[str], None] | None = None,
    local_addr: str | None = None,
) -> StageResult:
    """Train (or resume training) into `run`'s train/ directory; cached when data, model and config are unchanged.

    The keyword arguments place this node in a multi-node job (see :func:`launcher.launch`); every node must see
    `run` on a shared filesystem, since each rank writes its checkpoint shard there and c10d may place global rank 0,
    which writes the metrics and the summary, on any node. Only the node started with `node_rank` 0 records the
    stage in the manifest: the others return "done" with no outputs, or node 0's result when it is cached, since
    then node 0 starts nothing for them to join.
    """

    def train_here() -> None:
        from pipeline.train.launch.launcher import launch  # the controller's: a rank never imports it

        launch(cfg, run.path, nnodes, node_rank, rdzv_endpoint, nproc_per_node, output, local_addr)

    if node_rank != 0:
        # Node 0 will find the same manifest on the shared filesystem and launch nothing: joining the rendezvous
        # would only wait there until it timed out.
        if cached := cached_result(run, cfg, STAGE, log):
            return cached
        train_here()
        log(f"[train] done: node {node_rank} of {nnodes}; node 0 records the run")
        return StageResult("train", "done", reason=f"node {node_rank} of {nnodes}: node 0 records the run")

    def body() -> StageResult:
        if cfg.train.inventory is not None:
            from pipeline.train.cluster import rounds  # asyncssh and the fleet: only for cluster training
            from pipeline.train.compression import registry

            registry.check(cfg.train)  # before any device is asked: the launcher's preflight does it for torchrun
            run.save_config(cfg)  # what every device is sent
            rounds.run_on_devices(cfg, run.path, output)
        else:
            train_here()
        summary = read_json(run.path / layout.SUMMARY)
        return StageResult("train", "done", dict(STAGE.outputs), {k: summary[k] for k in SUMMARY_METRICS})

    return run_stage(run, cfg, STAGE, body, log)


STAGE = Stage(
    name="train",
    sections=("run", "data", "model", "train"),
    inputs=(),
    outputs={
        "metrics": layout.METRICS,
        "checkpoint": layout.LATEST,
        "dataset": layout.DATASET,
        "summary": layout.SUMMARY,
    },
    run=run,
    fingerprint=fingerprints,
)
