"""Every file one stage hands another, relative to the run directory, and every name in a device's deploy root:
declared once, here.

The run directory is the only channel between stages (DESIGN: "every arrow is a file on disk plus a line in the
manifest"), so its names are the stages' contract. A device's deploy root is a second one, between the controller
(deploy, its probe, the health check) and the device-side activate.sh; a release keeps some run-directory names
(`PLAN`, `ONNX_NAME`, `SAMPLE_NAME`, `MODEL_JSON_NAME`).
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
ONNX_NAME = "model.onnx"
SAMPLE_NAME = "sample.npz"
ONNX = f"{ONNX_DIR}/{ONNX_NAME}"
SAMPLE = f"{ONNX_DIR}/{SAMPLE_NAME}"
PARITY = f"{ONNX_DIR}/parity.json"

# build: one directory per device class, and the table of classes.
ENGINES = "engines"
CLASSES = f"{ENGINES}/classes.json"
PLAN = "model.plan"
BUILD_INFO = "build.json"
# The build stage's manifest outputs that deploy reads: the first (or only) engine and its build.json, and per device
# class `<key>:<class>` (`engine_keys`, `class_of_engine_key`).
ENGINE_KEY = "engine"
BUILD_INFO_KEY = "build_info"

# deploy: the release plan and the per-target outcome.
DEPLOY_DIR = "deploy"
DEPLOY_PLAN = f"{DEPLOY_DIR}/plan.json"
DEPLOY_RESULTS = f"{DEPLOY_DIR}/results.json"

# A device's deploy root (a local target's too), relative to it: what deploy uploads and its probe reads there, and
# what the device-side activate.sh works on. activate.sh spells none of these: the controller hands them over in its
# environment (pipeline.deploy.remote.ACTIVATE_NAMES), so a rename here reaches both sides.
RELEASES = "releases"
"""One directory per release, `releases/<id>/`, named by its content (pipeline.deploy.release)."""
CURRENT = "current"
"""Symlink to `releases/<id>` of the live release."""
PREVIOUS = "previous"
"""Symlink to the release that was live before `current`: what a rollback switches back to."""
DEVICE_CACHE = "engine-cache"
"""The device's engine cache: `<key>/{model.plan,build.json}`, the newest few kept (pipeline.deploy.device_build)."""

# A release, `releases/<id>/`: the run's files under the names a device knows (model.plan, model.onnx, sample.npz and
# model.json keep their run-directory names), with its SHA256SUMS (pipeline.fleet.upload.SUMS).
ACTIVATE = "activate.sh"
LABELS = "labels.txt"
ENGINE_INFO = "engine.json"
"""The engine's build.json, renamed: a release holds one engine, whichever class it was built for."""


def onnx_name(variant: str) -> str:
    """File name of an ONNX precision variant: fp32 is `model.onnx`, the others `model.<variant>.onnx`."""
    return ONNX_NAME if variant == "fp32" else f"model.{variant}.onnx"


def onnx_path(variant: str) -> str:
    """Run-dir path of an ONNX precision variant."""
    return f"{ONNX_DIR}/{onnx_name(variant)}"


def engine_dir(klass: str) -> str:
    """Run-dir path of a device class's engine directory (`model.plan`, `build.json`, `timing.cache`)."""
    return f"{ENGINES}/{klass}"


def engine_keys(klass: str) -> tuple[str, str]:
    """The build stage's manifest output keys for device class `klass`'s engine and its build.json:
    (`engine:<class>`, `build_info:<class>`)."""
    return f"{ENGINE_KEY}:{klass}", f"{BUILD_INFO_KEY}:{klass}"


def class_of_engine_key(key: str) -> str | None:
    """The device class an `engine:<class>` output key names; None for any other key (`build_info:<class>` too: each
    class is named once, by its engine's key)."""
    prefix = f"{ENGINE_KEY}:"
    return key[len(prefix) :] if key.startswith(prefix) else None
