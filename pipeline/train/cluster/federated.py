"""Federated training over SSH (`train.mode = "federated"`): the controller runs Flower's server, every device of
the inventory runs a Flower client on its own images (pipeline.train.rank.federated), and the run directory ends
as any training run's does: checkpoints the consolidate stage reads, metrics.jsonl (a line per round: who took part,
who was busy or dropped, bytes each way, validation accuracy), dataset.json and summary.json.

The devices come and go. Each is started over its SSH connection, which also carries its Flower traffic (a port on
its loopback forwarded to the server on the controller's, over TLS with a certificate of the run's own:
pipeline.train.cluster.tls), and started again, once reachable, whenever it stops
before the run ends: a camera that rebooted or lost its link takes part again when it is next idle. A round needs
`min_devices` idle devices, not all of them; one that gets busy, leaves or misses the deadline mid-round is left out
of that round only. Each round's model is checkpointed before the next starts, so a controller that is stopped
resumes from the last aggregated round.

No image leaves a device: the controller learns each device's class names, image count and channel statistics,
and receives model changes, nothing else (docs/how-to/federated.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.fleet.inventory import Inventory, load_inventory
from pipeline.fleet.ssh import FAILURES
from pipeline.fleet.upload import Bundle
from pipeline.train.cluster import NodeCheck, check_all, check_one, code_bundle, python_path, run_key, tls
from pipeline.train.cluster.agent import Printer, agent_script, env_file
from pipeline.train.cluster.flower import token_for
from pipeline.train.cluster.node import Node
from pipeline.train.cluster.rounds import main_task, node_data
from pipeline.train.rank.federated import IDLE_CHECK_ENV, IDLE_WINDOW_ENV, NODE_ENV, TOKEN_ENV

AUTHORITY = "flower-authority.pem"
"""The run's TLS authority certificate (pipeline.train.cluster.tls), beside config.json in each device's run dir."""
CENSUS_GRACE_S = 60.0
"""Seconds the first round waits for every device found ready to connect, once `min_devices` have."""
RAN_A_WHILE_S = 30.0
"""A client that stopped after running this long is started again at once rather than after REJOIN_EVERY_S."""
REJOIN_EVERY_S = 10.0
"""Seconds between attempts to start a device's client again after it stopped or could not be reached."""


def run_federated(cfg: Config, run_dir: Path, output: Callable[[str], None] | None = None) -> None:
    """Train with Flower on the devices of `train.inventory`; the run directory ends as a local run's would."""
    assert cfg.train.inventory is not None
    inventory = load_inventory(cfg.train.inventory)
    run_dir = Path(run_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="federated-") as tmp:
        asyncio.run(main_task(_train(cfg, run_dir, inventory, Path(tmp), Printer(output))))


async def _train(cfg: Config, run_dir: Path, inventory: Inventory, workdir: Path, printer: Printer) -> None:
    code = code_bundle(workdir)
    checks = await check_all(inventory, code, workdir)
    for check in checks:
        if check.status == "ready" and check.facts.get("federated_missing"):
            need = " ".join(check.facts["federated_missing"])
            check.status, check.reason = "refused", f"missing {need}: `{check.target.python} -m pip install {need}`"
        if check.status != "ready":
            printer.emit("controller", f"{check.target.name}: {check.status}: {check.reason}; left out", "\n")
    ready = [c for c in checks if c.status == "ready"]
    fed = cfg.train.federated
    if len(ready) < fed.min_devices:
        raise PipelineError(
            f"train.federated.min_devices is {fed.min_devices}, but {len(ready)} of the inventory's "
            f"{len(checks)} devices are ready"
        )
    found = await node_data([c.target for c in ready], cfg, code.id)  # one line when their class names differ
    classes = next(iter(found.values())).classes
    secret = secrets.token_bytes(32)  # the devices' admission tokens derive from it (flower.token_for)
    certificates = tls.issue(cfg.train.timeout_s)
    fleet = Fleet(cfg, run_dir, code, workdir, classes, printer, secret)
    authority = workdir / AUTHORITY
    authority.write_bytes(certificates.authority)
    server = Server(cfg, run_dir, classes, len(ready), printer.emit, secret, certificates)
    started = time.monotonic()
    # Devices unreachable now (a camera switched off) are tried again all along, and take part once they answer.
    joining = ready + [c for c in checks if c.status == "unreachable"]
    keepers = [asyncio.create_task(fleet.keep_running(check, server.port)) for check in joining]
    try:
        async with asyncio.timeout(cfg.train.timeout_s):
            summary = await asyncio.to_thread(server.run)
    except TimeoutError:
        limit = cfg.train.timeout_s
        raise PipelineError(f"train.timeout_s: still training after {limit}s; stopped every device") from None
    finally:
        server.close()
        fleet.done = True
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
    summary |= {"seconds": round(time.monotonic() - started, 3), "bytes_sent": {"code": fleet.code_bytes(checks)}}
    write_json(run_dir / layout.SUMMARY, summary)


class Fleet:
    """The devices' Flower clients, each kept running (started again when it stops) until the run is done."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        code: Bundle,
        workdir: Path,
        classes: list[str],
        printer: Printer,
        secret: bytes,
    ) -> None:
        self.cfg, self.code, self.workdir, self.classes, self.printer = cfg, code, workdir, classes, printer
        self.secret = secret
        self.config_file = run_dir / layout.CONFIG_SNAPSHOT
        self.key = run_key(run_dir)
        self.token = secrets.token_hex(8)
        self.done = False

    @staticmethod
    def code_bytes(checks: list[NodeCheck]) -> int:
        """Bytes of code shipped to the devices."""
        return sum(c.bytes_sent for c in checks)

    async def keep_running(self, check: NodeCheck, port: int) -> None:
        """Run the device's client until the run is done, starting it again after it stops; a device that was not
        reachable at the start is checked (and given the code) first, and refused if its class names differ."""
        name, said = check.target.name, ""
        while check.status != "ready" and not self.done:
            await asyncio.sleep(REJOIN_EVERY_S)
            check = await check_one(check.target, self.code, self.workdir)
            if check.status == "refused":
                self.printer.emit("controller", f"{name}: refused: {check.reason}; left out", "\n")
                return
            if check.status == "ready" and not await self._same_classes(check):
                return
        while not self.done:
            started = time.monotonic()
            try:
                await self._run_once(check, port)
                said = ""
            except (*FAILURES, PipelineError) as err:
                why = str(err).splitlines()[0] if str(err) else type(err).__name__
                if why != said:
                    self.printer.emit("controller", f"{name}: {why}; trying again every {REJOIN_EVERY_S:.0f}s", "\n")
                    said = why
            # A client that ran a while and stopped (killed, the device rebooted) is started again at once; one
            # that cannot start, or stops as soon as it starts, is tried again every REJOIN_EVERY_S.
            ran = time.monotonic() - started
            if not self.done:
                await asyncio.sleep(1.0 if ran > RAN_A_WHILE_S else REJOIN_EVERY_S)

    async def _same_classes(self, check: NodeCheck) -> bool:
        """True when the device's folder has the run's class names; else says so (the device is left out)."""
        found = (await node_data([check.target], self.cfg, self.code.id))[check.target.name]
        if found.classes != self.classes:
            self.printer.emit(
                "controller", f"{check.target.name}: its class folders differ from the run's; left out", "\n"
            )
        return found.classes == self.classes

    async def _run_once(self, check: NodeCheck, port: int) -> None:
        """Connect, start the client with the config, forward its output, wait until it stops."""
        node = await Node.connect(check, self.key, port, self.cfg.train.link_timeout_s)
        try:
            await node.dev.run(f"mkdir -p {shlex.quote(node.run_dir)}", timeout_s=30)
            await node.dev.put(self.config_file, f"{node.run_dir}/{layout.CONFIG_SNAPSHOT}")
            await node.dev.put(self.workdir / AUTHORITY, f"{node.run_dir}/{AUTHORITY}")
            target = check.target
            command = (
                f"{target.python} -m pipeline.train.rank.federated --run-dir {shlex.quote(node.run_dir)} "
                f"--server {tls.HOST}:{node.store_port} --authority {shlex.quote(f'{node.run_dir}/{AUTHORITY}')}"
            )
            script = agent_script(node.run_dir, command, self.token, target.addr)
            proc = await node.start(script, env_file(self._env(node)), self.cfg.train.timeout_s)
            pumps = [asyncio.create_task(self.printer.pump(node.name, s)) for s in (proc.stdout, proc.stderr)]
            status = await node.exit_status()
            await asyncio.gather(*pumps, return_exceptions=True)
            if status not in (0, None) and not self.done:
                self.printer.emit("controller", f"{node.name}: its client exited with {status}", "\n")
        finally:
            await node.stop()
            await node.close()

    def _env(self, node: Node) -> dict[str, str]:
        target = node.check.target
        return {
            **self.cfg.train.env,
            **self.cfg.train.passed_env(),
            "PYTHONPATH": python_path(target, self.code.id),
            "OMP_NUM_THREADS": str(self.cfg.train.threads_per_rank),
            "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),  # see rank/federated.py
            NODE_ENV: target.name,
            TOKEN_ENV: token_for(self.secret, target.name),
            IDLE_WINDOW_ENV: target.idle,
            IDLE_CHECK_ENV: target.idle_check,
        }


class Server:
    """Flower's server on the controller's loopback, and the rounds, each checkpointed as it ends."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        classes: list[str],
        expected: int,
        emit: Callable[[str, str, str], None],
        secret: bytes,
        certificates: tls.Certificates,
    ) -> None:
        from pipeline.train.cluster import flower

        self.cfg, self.run_dir, self.classes, self.flower = cfg, run_dir, classes, flower
        self.expected = expected
        """Devices found ready: the first round waits (a while) for all of them to connect."""
        self.say = lambda text: emit("controller", text, "\n")
        self.manager = flower.IdleClientManager(cfg.train.federated, cfg.run.seed, self.say, secret)
        self.port = flower.free_port()
        self.grpc = flower.listen(self.manager, self.port, certificates)

    def run(self) -> dict[str, Any]:
        """Every round from the last checkpointed one on; returns the summary's fields."""
        from pipeline.train.cluster import fedstate

        fed, flower = self.cfg.train.federated, self.flower
        state = fedstate.State.resume(self.cfg, self.run_dir, len(self.classes))
        if state.model is None:
            state.begin(*self._census())
        assert state.stats is not None
        initial = state.arrays()
        config = {"mean": json.dumps(state.stats[0]), "std": json.dumps(state.stats[1])}
        inner = flower.strategy(fed, initial, lambda number: {"round": number, **config})
        rounds = flower.Rounds(fed, self.manager, inner, initial)
        sent = {"model_down": 0, "changes_up": 0}
        (self.run_dir / layout.METRICS).parent.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / layout.METRICS).open("a") as log:
            for number in range(state.round + 1, fed.rounds + 1):
                if self.manager.stopping.is_set():
                    break
                model, record = rounds.run_one(number)
                if model is not None:
                    state.save(number, model, record.get("val_accuracy"))
                sent["model_down"] += record["bytes_down"]
                sent["changes_up"] += record["bytes_up"]
                log.write(json.dumps(record) + "\n")
                log.flush()
                self.say(_line(record))
        rounds.end()
        return state.summary(self.classes) | {"bytes": sent}

    def _census(self) -> tuple[tuple[list[float], list[float]], int]:
        """Normalisation statistics of the connected devices' images together, and their channel count: once every
        device found ready has connected, or `min_devices` have and CENSUS_GRACE_S has passed."""
        least, expected = self.cfg.train.federated.min_devices, self.expected
        started = time.monotonic()
        deadline = started + self.cfg.train.federated.wait_idle_s + CENSUS_GRACE_S
        while True:
            answers = self.manager.ask()
            waited = time.monotonic() - started
            if len(answers) >= expected or (len(answers) >= least and waited > CENSUS_GRACE_S):
                break
            if time.monotonic() > deadline or self.manager.stopping.is_set():
                raise PipelineError(f"train: fewer than {least} devices connected to the federated server")
            time.sleep(1.0)
        return self.flower.pooled_stats(list(answers.values())), next(iter(answers.values())).channels

    def close(self) -> None:
        """Stop the rounds (after the one in flight) and stop listening."""
        self.manager.stopping.set()
        with contextlib.suppress(Exception):
            self.grpc.stop(grace=1)


def _line(record: dict[str, Any]) -> str:
    acc = record.get("val_accuracy")
    took = ", ".join(record["took_part"]) or "nobody"
    score = f"val_accuracy {acc:.4f}" if acc is not None else "no new model"
    return f"round {record['round']}: {took}; {score}; {record['bytes_up'] / 1e6:.2f} MB up ({record['seconds']:.1f}s)"
