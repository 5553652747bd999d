"""Where the train stage puts its files, relative to the run directory (shared by the launcher side and the ranks)."""

from __future__ import annotations

TRAIN_DIR = "train"
METRICS = f"{TRAIN_DIR}/metrics.jsonl"
DATASET = f"{TRAIN_DIR}/dataset.json"
SUMMARY = f"{TRAIN_DIR}/summary.json"
CHECKPOINTS = f"{TRAIN_DIR}/checkpoints"
LATEST = f"{CHECKPOINTS}/latest"
