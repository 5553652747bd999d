"""The Flower server of federated training, on the controller: which devices take part in a round (the idle ones),
how their changes become the new global model, and the rounds themselves, one at a time, so that each aggregated
model is checkpointed before the next round starts.

Flower's own pieces do the work: its gRPC server and client proxies, its `Server.fit_round` and `evaluate_round`,
its `FedAvg` and `FedProx` strategies. Two thin layers adapt them: :class:`IdleClientManager` samples only among the
devices that say they are idle, and :class:`DeltaStrategy` turns each device's change (pipeline.train.rank.fedwire)
back into a model before the strategy averages, leaving out the devices that got busy and any change that does not
fit the model. The server listens on the controller's loopback only, over TLS with a certificate of the run's own
(pipeline.train.cluster.tls); the devices reach it through their SSH connections (pipeline.train.cluster.federated),
so only the inventory's devices, logged in with verified host keys, and local processes can connect at all; of
those, only a client that answers with its device's token for this run (:func:`admitted`) is sampled or scores a
model (docs/how-to/federated.md#security).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import FederatedConfig
from pipeline.train.cluster import tls
from pipeline.train.rank import fedwire

# Flower's usage reports to flower.ai: off unless the user turned them on, as on the devices (rank/federated.py).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import Server, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg, FedProx, Strategy
from flwr.server.superlink.fleet.grpc_bidi.grpc_server import start_grpc_server

ASK_TIMEOUT_S = 30.0
"""Seconds a device has to answer the server's question whether it is idle."""
POLL_S = 2.0


def free_port() -> int:
    """A port free on the controller's loopback now (Flower's gRPC server takes an address, not port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listen(manager: IdleClientManager, port: int, certificates: tls.Certificates) -> Any:
    """Flower's gRPC server for the devices, on the controller's loopback only, speaking TLS with the run's
    certificate (:mod:`pipeline.train.cluster.tls`)."""
    pems = (certificates.authority, certificates.server, certificates.server_key)
    return start_grpc_server(client_manager=manager, server_address=f"{tls.HOST}:{port}", certificates=pems)


def admitted(secret: bytes, node: str, token: str) -> bool:
    """Whether `token` is device `node`'s for the run whose secret is `secret` (:func:`token_for`)."""
    return hmac.compare_digest(token, token_for(secret, node))


def token_for(secret: bytes, node: str) -> str:
    """Device `node`'s admission token: an HMAC of its name under the run's secret, which never leaves the
    controller. Each device gets its own in its agent's environment file (read once, then deleted)."""
    return hmac.new(secret, node.encode(), hashlib.sha256).hexdigest()


@dataclass
class Answer:
    """One device's answer to "are you idle, and what are your images?"."""

    node: str
    token: str
    busy: str
    images: int
    classes: list[str]
    mean: list[float]
    std: list[float]
    channels: int


class IdleClientManager(SimpleClientManager):
    """Flower's client pool, sampling each round among the devices that are idle now: it asks every connected device,
    waits (up to `wait_idle_s`) until `min_devices` say yes, and samples among them; an empty sample skips the round.
    """

    def __init__(self, fed: FederatedConfig, seed: int, say: Callable[[str], None], secret: bytes) -> None:
        super().__init__()
        self.fed, self.rng, self.say, self.secret = fed, random.Random(seed), say, secret
        self.names: dict[str, str] = {}
        """Client id (its connection) → device name, for the clients admitted (:func:`admitted`)."""
        self.refused: set[str] = set()
        """Client ids whose answer carried no valid token (said once each)."""
        self.busy: dict[str, str] = {}
        """Device name → why it was not sampled in the last round."""
        self.stopping = threading.Event()
        """Set when the run is being stopped: no round waits for devices any more."""

    def ask(self) -> dict[str, Answer]:
        """Every admitted connected device's answer, by client id; one that does not answer is left out, and one
        whose token is not its device's is named once and never sampled."""
        clients = dict(self.clients)
        with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
            found = dict(zip(clients, pool.map(_ask, clients.values()), strict=True))
        answers = {cid: a for cid, a in found.items() if a is not None}
        for cid, answer in list(answers.items()):
            if not admitted(self.secret, answer.node, answer.token):
                del answers[cid]
                if cid not in self.refused:
                    self.refused.add(cid)
                    self.say(f"a client calling itself {answer.node[:40]!r} has not its device's token; not admitted")
        self.names |= {cid: a.node for cid, a in answers.items()}
        return answers

    def sample(self, num_clients: int, min_num_clients: int | None = None, criterion: Any = None) -> list[ClientProxy]:
        """Up to `num_clients` idle devices, at least `min_devices`; none when too few are idle within the wait."""
        least = max(min_num_clients or 1, self.fed.min_devices)
        deadline = time.monotonic() + self.fed.wait_idle_s
        said = False
        while True:
            answers = self.ask()
            idle = sorted(cid for cid, a in answers.items() if not a.busy)
            self.busy = {a.node: a.busy for a in answers.values() if a.busy}
            if len(idle) >= least:
                return [self.clients[cid] for cid in self.rng.sample(idle, min(num_clients, len(idle)))]
            if time.monotonic() >= deadline or self.stopping.is_set():
                return []
            if not said:
                self.say(f"{len(idle)} of {len(answers)} connected devices idle; waiting for {least}")
                said = True
            time.sleep(POLL_S)


def _ask(client: ClientProxy) -> Answer | None:
    try:
        props = client.get_properties(GetPropertiesIns(config={}), timeout=ASK_TIMEOUT_S, group_id=None).properties
        return Answer(
            str(props["node"]),
            str(props.get("token", "")),
            str(props["busy"]),
            int(props["images"]),
            [str(c) for c in json.loads(str(props["classes"]))],
            [float(v) for v in json.loads(str(props["mean"]))],
            [float(v) for v in json.loads(str(props["std"]))],
            int(props["channels"]),
        )
    except Exception:  # a device that left mid-question, or answers nonsense: not in this round
        return None


def pooled_stats(answers: list[Answer]) -> tuple[list[float], list[float]]:
    """Every device's channel mean and std as if their training images were one set (weighted by image count)."""
    counts = np.array([a.images for a in answers], dtype=np.float64)[:, None]
    means = np.array([a.mean for a in answers])
    squares = np.array([a.std for a in answers]) ** 2 + means**2
    mean = (counts * means).sum(0) / counts.sum()
    std = np.sqrt(np.maximum((counts * squares).sum(0) / counts.sum() - mean**2, 1e-12))
    return mean.tolist(), std.tolist()


@dataclass
class RoundLog:
    """What one round did, for metrics.jsonl."""

    took_part: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    failures: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


class DeltaStrategy(Strategy):
    """A Flower strategy (`inner`: FedAvg or FedProx) fed devices' models rebuilt from the changes they sent."""

    def __init__(self, inner: FedAvg, manager: IdleClientManager) -> None:
        self.inner, self.manager = inner, manager
        self.current: list[np.ndarray] = []
        self.log = RoundLog()

    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        """The initial global model (the controller's, seeded), as the inner strategy holds it."""
        return self.inner.initialize_parameters(client_manager)

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple[Any, FitIns]]:
        """The inner strategy's instructions to the sampled idle devices; the global model remembered to rebuild
        their models from their changes, and the bytes it costs counted."""
        self.current = parameters_to_ndarrays(parameters)
        self.log = RoundLog()
        chosen = self.inner.configure_fit(server_round, parameters, client_manager)
        self.log.bytes_down = len(chosen) * _size(parameters)
        return chosen

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[Any]
    ) -> tuple[Parameters | None, dict[str, Any]]:
        """Average the models of the devices that trained; the others are this round's dropped or failed."""
        names, kept = self.manager.names, []
        self.log.failures = len(failures)
        for client, res in results:
            name = names.get(client.cid, client.cid)
            self.log.bytes_up += _size(res.parameters)
            if "dropped" in res.metrics:
                self.log.dropped[name] = str(res.metrics["dropped"])
                continue
            try:
                model = fedwire.decode(self.current, parameters_to_ndarrays(res.parameters), res.parameters.tensor_type)
            except ValueError as err:
                self.log.dropped[name] = f"sent a change that does not fit the model: {err}"
                continue
            res.parameters = ndarrays_to_parameters(model)
            kept.append((client, res))
            self.log.took_part.append(name)
        if not kept:
            return None, {}
        return self.inner.aggregate_fit(server_round, kept, failures)

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[Any]:
        """Every admitted connected device scores the new global model on its own validation images (busy or not: a
        few forward passes, no training)."""
        ins = EvaluateIns(parameters, self.inner.on_evaluate_config_fn(server_round))  # type: ignore[misc]
        return [(client, ins) for cid, client in client_manager.all().items() if cid in self.manager.names]

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: list[Any]
    ) -> tuple[float | None, dict[str, Any]]:
        """Validation loss and accuracy over every device's validation images together."""
        count = sum(r.num_examples for _, r in results)
        if not count:
            return None, {}
        loss = sum(r.loss * r.num_examples for _, r in results) / count
        correct = sum(float(r.metrics["accuracy"]) * r.num_examples for _, r in results)
        return loss, {"accuracy": correct / count, "images": count}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        """No evaluation on the controller: it holds no images."""
        return None


def _size(parameters: Parameters) -> int:
    return sum(len(t) for t in parameters.tensors)


def strategy(fed: FederatedConfig, initial: list[np.ndarray], config: Callable[[int], dict[str, Any]]) -> FedAvg:
    """Flower's strategy for `train.federated.strategy`, starting from the `initial` model."""
    common: dict[str, Any] = {
        "fraction_fit": fed.fraction,
        "min_fit_clients": fed.min_devices,
        "min_available_clients": fed.min_devices,
        "initial_parameters": ndarrays_to_parameters(initial),
        "on_fit_config_fn": config,
        "on_evaluate_config_fn": config,
        "accept_failures": True,
    }
    if fed.strategy == "fedprox":
        return FedProx(proximal_mu=fed.proximal_mu, **common)
    return FedAvg(**common)


class Rounds:
    """Flower's server running one round at a time (so each new model is saved before the next round starts)."""

    def __init__(
        self, fed: FederatedConfig, manager: IdleClientManager, inner: FedAvg, start: list[np.ndarray]
    ) -> None:
        self.fed, self.manager = fed, manager
        self.strategy = DeltaStrategy(inner, manager)
        self.server = Server(client_manager=manager, strategy=self.strategy)
        self.server.parameters = ndarrays_to_parameters(start)
        self.stop = threading.Event()

    def run_one(self, number: int) -> tuple[list[np.ndarray] | None, dict[str, Any]]:
        """Round `number`: the new global model (None when no device's change came) and the round's record."""
        started = time.monotonic()
        fitted = self.server.fit_round(number, timeout=self.fed.round_timeout_s)
        log = self.strategy.log if fitted is not None else RoundLog()
        record: dict[str, Any] = {"round": number, "took_part": log.took_part, "dropped": log.dropped}
        record |= {"not_idle": dict(self.manager.busy), "failures": log.failures}
        record |= {"bytes_down": log.bytes_down, "bytes_up": log.bytes_up}
        model = None
        if fitted is not None and fitted[0] is not None:
            self.server.parameters = fitted[0]
            model = parameters_to_ndarrays(fitted[0])
            scored = self.server.evaluate_round(number, timeout=self.fed.round_timeout_s)
            if scored is not None and scored[0] is not None:
                record |= {"val_loss": scored[0], "val_accuracy": scored[1]["accuracy"]}
        record["seconds"] = round(time.monotonic() - started, 3)
        return model, record

    def end(self) -> None:
        """Tell every connected device the run is over (each client process then exits)."""
        self.server.disconnect_all_clients(timeout=ASK_TIMEOUT_S)
