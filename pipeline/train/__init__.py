"""The train stage: data-parallel training under torchrun, with epoch checkpoints and a metrics log.

The stage itself runs in this process and only launches torchrun (:func:`pipeline.train.launch.launcher.launch`) or,
with `train.inventory`, the SSH job on the devices (:func:`pipeline.train.cluster.rounds.run_on_devices`); the ranks run
:mod:`pipeline.train.rank.worker`. Everything they produce lands under ``train/`` in the run directory.

A rank imports this package too (it is the parent of :mod:`pipeline.train.rank`): so this module imports nothing of
the controller's rooms at module level, only inside the functions the controller calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline import data, layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import read_json, sha256_file
from pipeline.manifest import RunDir, Stage, StageResult, cached_result, run_stage

if TYPE_CHECKING:  # for the annotation only: run() imports launch/ itself, lazily
    from pipeline.train.launch.topology import Topology

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
    topology: Topology | None = None,
    output: Callable[[str], None] | None = None,
) -> StageResult:
    """Train (or resume training) into `run`'s train/ directory; cached when data, model and config are unchanged.

    `topology` places this node in a multi-node torchrun job (None: this host alone); every node must see `run` on a
    shared filesystem, since each rank writes its checkpoint shard there and c10d may place global rank 0, which
    writes the metrics and the summary, on any node. Only the node with `node_rank` 0 records the stage in the
    manifest: the others return "done" with no outputs, or node 0's result when it is cached, since then node 0
    starts nothing for them to join.
    """
    # launch/ is the controller's room: imported here, not at module level, since a rank imports this package.
    from pipeline.train.launch.topology import SINGLE_NODE

    here = topology or SINGLE_NODE

    def train_here() -> None:
        from pipeline.train.launch.launcher import launch

        launch(cfg, run.path, here, output)

    if here.node_rank != 0:
        # Node 0 will find the same manifest on the shared filesystem and launch nothing: joining the rendezvous
        # would only wait there until it timed out.
        if cached := cached_result(run, cfg, STAGE, log):
            return cached
        train_here()
        where = f"node {here.node_rank} of {here.nnodes}"
        log(f"[train] done: {where}; node 0 records the run")
        return StageResult("train", "done", reason=f"{where}: node 0 records the run")

    def body() -> StageResult:
        if cfg.train.mode == "federated":
            from pipeline.train.cluster import federated  # Flower: only for federated training

            cfg.train.passed_env()
            run.save_config(cfg)  # what every device is sent
            federated.run_federated(cfg, run.path, output)
        elif cfg.train.inventory is not None:
            from pipeline.train.cluster import rounds  # asyncssh and the fleet: only for cluster training
            from pipeline.train.compression import registry

            registry.check(cfg.train)  # before any device is asked: the launcher's preflight does it for torchrun
            cfg.train.passed_env()
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
