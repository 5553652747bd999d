"""One device of federated training: a Flower client that trains on the device's own images, only while the device
is idle, and sends back only how far it moved the global model.

Started by the controller over SSH (``python -m pipeline.train.rank.federated --run-dir DIR --server HOST:PORT
--authority PEM``), it connects to the Flower server through that SSH connection (a port on the device's loopback
forwarded to the controller's), over TLS to a server the run's authority certified, and answers the server's
requests until the server ends the run:

- properties: whether the device is idle now (its window, `PIPELINE_IDLE_WINDOW`, on its own clock; its check
  command, `PIPELINE_IDLE_CHECK`, exit 0), its class names and image count, and its images' channel means and
  standard deviations (numbers, never images) from which the server makes every device's normalisation one;
- fit: train `local_epochs` on its own images from the global model with the run's model, augmentation and
  precision (AdamW, `fedprox`'s proximal term), recompute BatchNorm statistics on its images, and send the change
  (pipeline.train.rank.fedwire); a device that stops being idle mid-round says so and sends nothing;
- evaluate: the global model's accuracy on its own validation images.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import models
from pipeline import data
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.library_warnings import route_library_warnings
from pipeline.manifest import RunDir
from pipeline.train.rank import batchnorm, fedwire, runtime, stepping
from pipeline.train.rank.runtime import Runtime

# Flower reports usage to flower.ai unless FLWR_TELEMETRY_ENABLED is 0, read once when it is first imported: off here
# unless the user turned it on (docs/how-to/federated.md#security).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
from flwr.client import Client, start_client
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

IDLE_WINDOW_ENV = "PIPELINE_IDLE_WINDOW"
IDLE_CHECK_ENV = "PIPELINE_IDLE_CHECK"
NODE_ENV = "PIPELINE_NODE_NAME"
TOKEN_ENV = "PIPELINE_FEDERATED_TOKEN"
"""The device's admission token for this run, which its answers carry (pipeline.train.cluster.flower.admitted)."""
IDLE_EVERY_S = 10.0
"""Seconds between idleness checks while a round trains: a device that gets busy stops within this."""
CHECK_TIMEOUT_S = 30
OK = Status(code=Code.OK, message="")


def in_window(window: str, now: time.struct_time) -> bool:
    """True when `now` (the device's local time) is inside "HH:MM-HH:MM" (which may cross midnight); "" is always."""
    if not window:
        return True
    start, end = (int(t[:2]) * 60 + int(t[3:]) for t in window.split("-"))
    minute = now.tm_hour * 60 + now.tm_min
    return start <= minute < end if start <= end else (minute >= start or minute < end)


def idle_now() -> str:
    """ "" when this device may train now, else why not (outside its window, its check command said busy)."""
    window = os.environ.get(IDLE_WINDOW_ENV, "")
    if not in_window(window, time.localtime()):
        return f"outside its idle window {window}"
    check = os.environ.get(IDLE_CHECK_ENV, "")
    if not check:
        return ""
    try:
        done = subprocess.run(check, shell=True, capture_output=True, timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"its idle check ran over {CHECK_TIMEOUT_S}s"
    return "" if done.returncode == 0 else f"its idle check exited {done.returncode}"


class DeviceClient(Client):
    """The Flower client of this device: its images, its model, its change encoder."""

    def __init__(self, cfg: Config, name: str, token: str, busy: Callable[[], str] = idle_now) -> None:
        self.cfg, self.name, self.token, self.busy = cfg, name, token, busy
        """This device's inventory name, its admission token, and what says why it may not train now ("" when it
        may)."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rt = Runtime(0, 1, "none", device, runtime.resolve_precision(cfg.train, device))
        self.channels = models.spec_for(cfg.model.name).channels
        self.splits = self._load(None)
        self.own_stats = (self.splits.info.mean, self.splits.info.std)
        self.model: torch.nn.Module | None = None
        self.encoder = fedwire.DeltaEncoder(fedwire.KINDS[cfg.train.federated.delta])
        self.steps = 0

    def _load(self, stats: data.Stats | None) -> data.Splits:
        return data.load(runtime.data_config(self.cfg.data), self.cfg.run.seed, channels=self.channels, stats=stats)

    def _prepare(self, config: dict[str, Any], parameters: Parameters) -> list[Any]:
        """The global model loaded, on images normalised with the server's statistics; returns its arrays."""
        stats = (json.loads(str(config["mean"])), json.loads(str(config["std"])))
        if stats != (self.splits.info.mean, self.splits.info.std):
            self.splits = self._load(stats)
        if self.model is None:
            torch.manual_seed(self.cfg.run.seed)
            info = self.splits.info
            self.model = models.build_model(self.cfg.model.name, len(info.classes), info.channels)
            self.model.to(self.rt.device)
        arrays = parameters_to_ndarrays(parameters)
        fedwire.load_arrays(self.model, arrays)
        return arrays

    def get_properties(self, ins: GetPropertiesIns) -> GetPropertiesRes:
        """Idleness now, and what the server needs to know of the device's images (never the images)."""
        info = self.splits.info
        props = {"node": self.name, "token": self.token, "busy": self.busy(), "images": len(self.splits.train)}
        props |= {"classes": json.dumps(info.classes), "mean": json.dumps(self.own_stats[0])}
        props |= {"std": json.dumps(self.own_stats[1]), "channels": info.channels}
        return GetPropertiesRes(status=OK, properties=props)

    def fit(self, ins: FitIns) -> FitRes:
        """Train this round from the global model; the change, or nothing and why when the device got busy."""
        busy = self.busy()
        if busy:
            return _dropped(busy)
        start = time.monotonic()
        before = self._prepare(ins.config, ins.parameters)
        assert self.model is not None
        loss, busy = self._train(ins.config, [torch.from_numpy(a.copy()) for a in before])
        if busy:
            return _dropped(f"busy mid-round: {busy}")
        after = fedwire.state_arrays(self.model)
        sent = ndarrays_to_parameters(self.encoder.encode(before, after))
        sent.tensor_type = self.encoder.kind
        metrics = {"loss": loss, "seconds": time.monotonic() - start, "steps": self.steps}
        return FitRes(status=OK, parameters=sent, num_examples=len(self.splits.train), metrics=metrics)

    def _train(self, config: dict[str, Any], anchor: list[torch.Tensor]) -> tuple[float, str]:
        """`local_epochs` of AdamW on this device's images, then BatchNorm statistics recomputed on them; returns the
        mean loss, and why it stopped early ("" when it did not)."""
        assert self.model is not None
        cfg, net, device = self.cfg, self.model, self.rt.device
        fed = cfg.train.federated
        mu = float(config.get("proximal_mu", 0.0))
        by_name = dict(zip(net.state_dict(), anchor, strict=True))
        weights = [p for _, p in net.named_parameters()]
        pulls = [by_name[name].to(device) for name, _ in net.named_parameters()]
        gen = torch.Generator().manual_seed(cfg.run.seed * 100_003 + int(config["round"]))
        batch = _batch(cfg, len(self.splits.train))
        loader = DataLoader(self.splits.train, batch_size=batch, shuffle=True, generator=gen)
        steps = max(1, math.ceil(fed.local_epochs * len(loader)))
        optim = torch.optim.AdamW(weights, lr=fed.lr, weight_decay=cfg.train.weight_decay)
        net.train()
        total, checked, self.steps = 0.0, time.monotonic(), 0
        while self.steps < steps:
            for x, y in loader:
                x = stepping.augment(x, cfg.train.augment_shift, cfg.run.seed, int(config["round"]), self.steps)
                with self.rt.autocast():
                    loss = F.cross_entropy(net(x.to(device)), y.to(device))
                if mu > 0:  # FedProx: stay near the global model the round started from
                    loss = loss + mu / 2 * sum(((w - a) ** 2).sum() for w, a in zip(weights, pulls, strict=True))
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                total, self.steps = total + loss.item(), self.steps + 1
                if time.monotonic() - checked > IDLE_EVERY_S:
                    checked = time.monotonic()
                    if busy := self.busy():
                        return total / self.steps, busy
                if self.steps >= steps:
                    break
        plain = DataLoader(self.splits.train_eval, batch_size=batch, shuffle=True, generator=gen)
        batchnorm.recalibrate(net, plain, cfg.train.bn_recalibration_batches, device, self.rt.autocast)
        return total / self.steps, ""

    @torch.no_grad()
    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        """The global model's loss and accuracy on this device's validation images."""
        self._prepare(ins.config, ins.parameters)
        assert self.model is not None
        net = self.model.eval()
        correct, count, loss_sum = 0, 0, 0.0
        for x, y in DataLoader(self.splits.val, batch_size=256):
            with self.rt.autocast():
                logits = net(x.to(self.rt.device)).float()
            correct += int((logits.argmax(dim=1) == y).sum())
            count += len(y)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        net.train()
        loss = loss_sum / max(count, 1)
        return EvaluateRes(status=OK, loss=loss, num_examples=count, metrics={"accuracy": correct / max(count, 1)})


def _batch(cfg: Config, images: int) -> int:
    """A device's batch: `train.batch_size`, or with `auto` 32, at most its image count."""
    wanted = 32 if cfg.train.batch_size == "auto" else cfg.train.batch_size
    return max(1, min(wanted, images))


def _dropped(why: str) -> FitRes:
    """No change this round, and why: the server leaves this device out of the round's average."""
    empty = Parameters(tensors=[], tensor_type="")
    return FitRes(status=OK, parameters=empty, num_examples=0, metrics={"dropped": why})


def main(argv: list[str] | None = None) -> int:
    """Entry point on the device; a user-fixable problem prints one `error:` line and exits with code 2."""
    route_library_warnings()
    logging.getLogger("flwr").setLevel(logging.WARNING)  # a line per message otherwise
    parser = argparse.ArgumentParser(prog="python -m pipeline.train.rank.federated", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding config.json")
    parser.add_argument("--server", required=True, help="the Flower server, HOST:PORT")
    parser.add_argument("--authority", type=Path, required=True, help="the run's TLS authority certificate (PEM)")
    args = parser.parse_args(argv)
    try:
        cfg = RunDir(args.run_dir).load_config()
        torch.set_num_threads(cfg.train.threads_per_rank)
        client = DeviceClient(cfg, os.environ.get(NODE_ENV, ""), os.environ.get(TOKEN_ENV, ""))
        authority = _read_authority(args.authority)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    images, classes = len(client.splits.train), len(client.splits.info.classes)
    print(f"{images} training images of {classes} classes; waiting for rounds", file=sys.stderr)
    # TLS: only a server certified by the run's authority gets an answer (pipeline/train/cluster/tls.py).
    start_client(
        server_address=args.server, client=client, root_certificates=authority, insecure=False, transport="grpc-bidi"
    )
    return 0


def _read_authority(path: Path) -> bytes:
    try:
        pem = path.read_bytes()
    except OSError as err:
        raise PipelineError(f"--authority: cannot read {path}: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise PipelineError(f"--authority: {path} holds no PEM certificate")
    return pem


if __name__ == "__main__":
    sys.exit(main())
