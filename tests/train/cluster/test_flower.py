"""Flower's server and clients in one process, on the loopback (no SSH): the project's idle-aware sampling, its
delta strategy and the device client, over Flower's real gRPC transport. tests/train/cluster/test_federated.py runs
the same over SSH against stand-in devices."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from flwr.client import start_client
from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes

from pipeline.config import Config, load_config
from pipeline.train.cluster import fedstate, flower, tls
from pipeline.train.rank.federated import DeviceClient, in_window
from tests.digit_folders import write_digit_folders


def device_config(folder: Path, **federated: object) -> Config:
    cfg = load_config()
    return cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"source": "imagefolder", "path": folder, "image_size": 8}),
            "model": cfg.model.model_copy(update={"name": "small_cnn"}),
            "train": cfg.train.model_copy(
                update={"federated": cfg.train.federated.model_copy(update={"min_devices": 2, **federated})}
            ),
        }
    )


class Impostor(DeviceClient):
    """A client that calls itself cam-1 without cam-1's token (a local process that found the server's port): it
    counts what it is asked to do."""

    asked: ClassVar[list[str]] = []

    def fit(self, ins: FitIns) -> FitRes:
        self.asked.append("fit")
        return super().fit(ins)

    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        self.asked.append("evaluate")
        return super().evaluate(ins)


def test_idle_devices_train_rounds_and_a_busy_one_sits_out(tmp_path: Path) -> None:
    folders = [tmp_path / f"cam-{i}" for i in range(3)]
    write_digit_folders(folders, alpha=0.5)
    cfgs = [device_config(f, lr=0.003, local_epochs=2, wait_idle_s=2) for f in folders]
    busy = {"cam-2": "its idle check exited 1"}
    secret = b"the run's secret"
    clients = [
        DeviceClient(c, f.name, flower.token_for(secret, f.name), lambda n=f.name: busy.get(n, ""))
        for c, f in zip(cfgs, folders, strict=True)
    ]
    clients.append(Impostor(cfgs[0], "cam-1", flower.token_for(b"another run's secret", "cam-1"), lambda: ""))

    said: list[str] = []
    manager = flower.IdleClientManager(cfgs[0].train.federated, 0, said.append, secret)
    port = flower.free_port()
    certificates = tls.issue(600)
    server = flower.listen(manager, port, certificates)
    address = {"server_address": f"127.0.0.1:{port}", "transport": "grpc-bidi"}
    trusting = {"root_certificates": certificates.authority, "insecure": False}
    threads = [
        threading.Thread(target=start_client, kwargs={**address, **trusting, "client": c}, daemon=True) for c in clients
    ]
    # Two clients of cam-0 that reach the port but not the server: one trusts another run's authority (it hangs up
    # on this server), one speaks plain text (the server hangs up on it).
    refused = [DeviceClient(cfgs[0], "cam-0", flower.token_for(secret, "cam-0"), lambda: "") for _ in range(2)]
    elsewhere = {"root_certificates": tls.issue(600).authority, "insecure": False, "max_retries": 2}
    failures: list[str] = []
    for client, kwargs in zip(refused, (elsewhere, {"insecure": True, "max_retries": 2}), strict=True):
        threads.append(threading.Thread(target=_refused, args=(client, {**address, **kwargs}, failures), daemon=True))
    for t in threads:
        t.start()
    try:
        assert manager.wait_for(4, timeout=60)
        connected = len(manager.all())
        answers = list(manager.ask().values())
        assert sorted(a.node for a in answers) == ["cam-0", "cam-1", "cam-2"]  # the impostor is not admitted
        stats = flower.pooled_stats(answers)
        state = fedstate.State(cfgs[0], tmp_path / "run", 10)
        state.begin(stats, answers[0].channels)
        config = {"mean": json.dumps(stats[0]), "std": json.dumps(stats[1])}
        inner = flower.strategy(cfgs[0].train.federated, state.arrays(), lambda n: {"round": n, **config})
        rounds = flower.Rounds(cfgs[0].train.federated, manager, inner, state.arrays())
        records = []
        for number in (1, 2, 3):
            if number == 3:
                busy.clear()
            model, record = rounds.run_one(number)
            assert model is not None
            records.append(record)
        busy.update({f.name: "outside its idle window 00:30-05:30" for f in folders})
        model, skipped = rounds.run_one(4)  # nobody idle within wait_idle_s: the round is skipped, nothing changes
        rounds.end()
    finally:
        server.stop(grace=1)
    for t in threads:
        t.join(timeout=30)
    assert [sorted(r["took_part"]) for r in records] == [["cam-0", "cam-1"]] * 2 + [["cam-0", "cam-1", "cam-2"]]
    assert records[0]["not_idle"] == {"cam-2": "its idle check exited 1"} and records[2]["not_idle"] == {}
    assert model is None and skipped["took_part"] == [] and sorted(skipped["not_idle"]) == ["cam-0", "cam-1", "cam-2"]
    assert "val_accuracy" not in skipped and skipped["bytes_down"] == 0
    assert any("0 of 3 connected devices idle; waiting for 2" in line for line in said)
    assert said.count("a client calling itself 'cam-1' has not its device's token; not admitted") == 1
    assert Impostor.asked == []  # never sampled to train, never asked to score a model
    # Each device's change is int8 (a quarter of the fp32 model it received, plus headers and scales).
    per_device_down, per_device_up = records[0]["bytes_down"] / 2, records[0]["bytes_up"] / 2
    assert per_device_up < per_device_down / 3
    # Learning: above twice chance (10 classes) after one round (one fresh clone saw 0.294: it moves from run to
    # run), more after three.
    assert records[2]["val_accuracy"] > records[0]["val_accuracy"] > 0.2
    # The two clients that could not check the server's certificate, or offered none, never joined the pool.
    assert connected == 4 and len(failures) == 2 and all("UNAVAILABLE" in f for f in failures)


def _refused(client: DeviceClient, kwargs: dict[str, object], failures: list[str]) -> None:
    """Run a client expected to fail its TLS handshake; record how it ended."""
    try:
        start_client(client=client, **kwargs)  # type: ignore[arg-type]
    except Exception as err:  # grpc's own error type, raised when its retries are spent
        failures.append(str(err))


def test_pooled_statistics_are_those_of_all_images_together() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.normal(m, s, size=n) for m, s, n in ((0.2, 0.1, 300), (0.7, 0.3, 100))]
    answers = [
        flower.Answer(f"d{i}", "token", "", len(p), ["a"], [float(p.mean())], [float(p.std())], 1)
        for i, p in enumerate(parts)
    ]
    mean, std = flower.pooled_stats(answers)
    together = np.concatenate(parts)
    assert mean[0] == pytest.approx(together.mean()) and std[0] == pytest.approx(together.std())


@pytest.mark.parametrize(
    "window, hour, minute, inside",
    [("", 12, 0, True), ("00:30-05:30", 3, 0, True), ("00:30-05:30", 6, 0, False), ("22:00-05:30", 23, 59, True),
     ("22:00-05:30", 5, 29, True), ("22:00-05:30", 5, 30, False), ("22:00-05:30", 21, 59, False)],
)  # fmt: skip
def test_idle_windows_may_cross_midnight(window: str, hour: int, minute: int, inside: bool) -> None:
    import time

    now = time.struct_time((2026, 12, 7, hour, minute, 0, 0, 341, 0))
    assert in_window(window, now) is inside
