"""Every file one stage hands another, relative to the run directory: declared once, here.

The run directory is the only channel between stages (DESIGN: "every arrow is a file on disk plus a line in the
manifest"), so its names are the stages' contract. A release on a device reuses some of them (`PLAN`).
"""

from __future__ import annotations

# the run: its lineage manifest, the config it ran with, and the report of it.
MANIFEST = "manifest.json"
CONFIG_SNAPSHOT = "config.json"
REPORT = "report.md"
CURVES = "report/curves.png"

# train: the ranks write these (rank 0 alone writes metrics and summary; every rank its checkpoint shard).
TRAIN_DIR = "train"
METRICS = f"{TRAIN_DIR}/metrics.jsonl"
DATASET = f"{TRAIN_DIR}/dataset.json"
SUMMARY = f"{TRAIN_DIR}/summary.json"
CHECKPOINTS = f"{TRAIN_DIR}/checkpoints"
LATEST = f"{CHECKPOINTS}/latest"

# consolidate: one weights file and what every later stage (and the device) knows about the model.
MODEL_DIR = "model"
WEIGHTS_NAME = "model.safetensors"
MODEL_JSON_NAME = "model.json"
WEIGHTS = f"{MODEL_DIR}/{WEIGHTS_NAME}"
MODEL_JSON = f"{MODEL_DIR}/{MODEL_JSON_NAME}"

# export: the fp32 model, its precision variants, the stored sample (input + logits) and the gates' evidence.
ONNX_DIR = "onnx"
ONNX = f"{ONNX_DIR}/model.onnx"
SAMPLE = f"{ONNX_DIR}/sample.npz"
PARITY = f"{ONNX_DIR}/parity.json"

# build: one directory per device class, and the table of classes.
ENGINES = "engines"
CLASSES = f"{ENGINES}/classes.json"
PLAN = "model.plan"
BUILD_INFO = "build.json"

# deploy: the release plan and the per-target outcome.
DEPLOY_DIR = "deploy"
DEPLOY_PLAN = f"{DEPLOY_DIR}/plan.json"
DEPLOY_RESULTS = f"{DEPLOY_DIR}/results.json"


def onnx_name(variant: str) -> str:
    """File name of an ONNX precision variant: fp32 is `model.onnx`, the others `model.<variant>.onnx`."""
    return "model.onnx" if variant == "fp32" else f"model.{variant}.onnx"


def onnx_path(variant: str) -> str:
    """Run-dir path of an ONNX precision variant."""
    return f"{ONNX_DIR}/{onnx_name(variant)}"


def engine_dir(klass: str) -> str:
    """Run-dir path of a device class's engine directory (`model.plan`, `build.json`, `timing.cache`)."""
    return f"{ENGINES}/{klass}"
