"""The cluster job itself: rounds of torchrun agents on the devices, checkpoints copied back, devices leaving and
joining. See :mod:`pipeline.train.cluster` for the design; this module is its running part.

Every agent runs inside a small shell wrapper on its device. The wrapper marks everything it starts with a token in
the environment (torchrun starts its ranks in sessions of their own, so a process group does not reach them:
docs/torch-distributed.md#workers-outlive-their-agent) and kills every marked process when the controller closes
the session's stdin, when the SSH connection drops (the controller was killed, the link died), when the remote
`timeout` fires, and when the agent exits. Nothing outlives the controller's interest in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from pipeline import layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import read_json, write_json
from pipeline.fleet import upload
from pipeline.fleet.inventory import Inventory, SshTarget, load_inventory
from pipeline.fleet.ssh import FAILURES, Device
from pipeline.safe_dcp import read_metadata
from pipeline.train.cluster import (
    NodeCheck,
    bounds,
    check_all,
    check_one,
    code_bundle,
    nodedata,
    python_path,
    refuse_unready,
)
from pipeline.train.launch.launcher import free_port
from pipeline.train.rank import checkpoint
from pipeline.train.rank.runtime import DATA_LOCAL_ENV, DATA_PATH_ENV

POLL_S = 2.0
"""Seconds between the controller's looks at the devices: a new checkpoint to copy, the last step, a device back."""
REJOIN_EVERY_S = 10.0
"""Seconds between attempts to reach a device that left."""
STOP_WAIT_S = 20.0
"""How long the controller waits for a stopped device to confirm that its processes are gone."""
_STEP = re.compile(r"step-(\d+)")


def agent_script(run_dir: str, python: str, env: dict[str, str], torchrun: list[str], token: str, addr: str) -> str:
    """The shell wrapper that runs one device's torchrun agent (see the module docstring)."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    args = " ".join(torchrun)
    me = shlex.quote(addr) if addr else "$3"
    return f"""tok={token}
marked() {{ for p in /proc/[0-9]*; do
  {{ tr '\\0' '\\n' < "$p/environ"; }} 2>/dev/null | grep -qx "PIPELINE_JOB=$tok" && echo "${{p#/proc/}}"; done; }}
stop() {{ kill -s TERM $(marked) 2>/dev/null; n=0
  while [ -n "$(marked)" ] && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
  kill -s KILL $(marked) 2>/dev/null; }}
trap 'stop; exit 143' TERM INT HUP
exec 3<&0
cd {shlex.quote(run_dir)} || exit 2
set -- $SSH_CONNECTION
ctl=$1 me={me}
env {exports} PIPELINE_JOB=$tok {python} -m torch.distributed.run {args} --rdzv-endpoint "$ctl:$PORT" \\
  --local-addr "$me" -m pipeline.train.rank.worker --run-dir {shlex.quote(run_dir)} </dev/null 3<&- &
agent=$!
( while read -r _; do :; done; stop ) <&3 >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait $agent; rc=$?
stop
kill $watcher 2>/dev/null
exit $rc
"""


class Printer:
    """Every device's output on the controller, each line led by the device's name; rank 0's bar redraws in place.

    With `output` (a Prefect logger), complete lines go there instead and bar redraws count as lines.
    """

    def __init__(self, output: Callable[[str], None] | None) -> None:
        self.output = output
        self.in_bar = False

    def emit(self, name: str, text: str, end: str) -> None:
        """One piece of a device's output, ended by "\\n" or (a progress bar redraw) "\\r"."""
        if not text.strip():
            return
        if self.output is not None:
            self.output(f"[{name}] {text}")
            return
        if end == "\r":
            sys.stderr.write(f"\r[{name}] {text}")
            self.in_bar = True
        else:
            sys.stderr.write(("\n" if self.in_bar else "") + f"[{name}] {text}\n")
            self.in_bar = False
        sys.stderr.flush()

    async def pump(self, name: str, stream: asyncssh.SSHReader[str]) -> None:
        """Forward one stream of a device until it ends (or its connection does)."""
        pending = ""
        with contextlib.suppress(*FAILURES):
            while chunk := await stream.read(4096):
                pieces = re.split(r"([\r\n])", pending + chunk)
                pending = pieces.pop()
                for text, end in zip(pieces[::2], pieces[1::2], strict=True):
                    self.emit(name, text, end)
        self.emit(name, pending, "\n")


@dataclass
class Event:
    """A device that left or joined: when, the last step trained before, and the step training went on from."""

    event: str
    node: str
    time: float
    at_step: int
    resumed_step: int

    @property
    def steps_lost(self) -> int:
        """Steps trained after the checkpoint training went on from: done again."""
        return max(self.at_step - self.resumed_step, 0)

    def record(self) -> dict[str, Any]:
        """As written to summary.json and metrics.jsonl."""
        return {**asdict(self), "steps_lost": self.steps_lost}


@dataclass
class Node:
    """A device taking part: its check, its open connection, its run directory, its running agent."""

    check: NodeCheck
    dev: Device
    run_dir: str
    proc: asyncssh.SSHClientProcess[str] | None = None

    @property
    def name(self) -> str:
        """The inventory name."""
        return self.check.target.name


@dataclass
class RoundEnd:
    """How a round ended: finished, or with the devices that left, or to take in devices that came back."""

    finished: bool = False
    lost: list[Node] = field(default_factory=list)
    joining: list[NodeCheck] = field(default_factory=list)


def _step_of(name: str) -> int:
    match = _STEP.fullmatch(name.strip())
    return int(match[1]) if match else -1


class Job:
    """One cluster training job, driven from the controller's run directory."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        nodes: list[NodeCheck],
        code: upload.Bundle,
        workdir: Path,
        printer: Printer,
        dataset: upload.Bundle | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.code, self.workdir = cfg, run_dir, code, workdir
        self.dataset = dataset
        """The controller's image folder, sent to each device before it trains (`data.sync`); None: not sent."""
        self.sent = {"code": sum(n.bytes_sent for n in nodes), "data": 0, "checkpoints": 0}
        """Bytes sent to the devices, by what they were: what it cost to start (and restart) the job."""
        self.minimum, self.maximum = bounds(cfg.train.devices, len(nodes))
        self.ready, self.away = nodes[: self.maximum], list(nodes[self.maximum :])
        self.printer = printer
        # The run's directory on every device: named after the controller's, unique per controller path.
        self.key = f"{run_dir.name}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
        self.token = secrets.token_hex(8)
        self.events: list[Event] = []
        self.last_step = 0
        self.rounds = 0
        self.port = 0
        self.tqdm_quiet = printer.output is not None

    # -- paths and state on the controller -----------------------------------------------------------------------

    @property
    def ckpt_root(self) -> Path:
        """The controller's train/checkpoints."""
        return self.run_dir / layout.CHECKPOINTS

    def resumed_step(self) -> int:
        """Step of the controller's latest complete checkpoint (0 without one)."""
        found = checkpoint.latest(self.ckpt_root)
        return checkpoint.read_meta(found)["step"] if found else 0

    # -- the job ---------------------------------------------------------------------------------------------------

    async def run(self, port: int) -> dict[str, Any]:
        """Train to the end in rounds; returns what summary.json adds about the cluster."""
        self.port = port
        members = [await self._connect(check) for check in self.ready]
        try:
            while True:
                self.rounds += 1
                end = await self._round(members)
                if end.finished:
                    break
                members = await self._regroup(members, end)
        finally:
            await asyncio.gather(*(self._stop(node) for node in members))
            for node in members:
                await node.dev.__aexit__(None, None, None)
        return {
            "nodes": [n.name for n in members],
            "rounds": self.rounds,
            "events": [e.record() for e in self.events],
            "bytes_sent": dict(self.sent),
        }

    async def _connect(self, check: NodeCheck) -> Node:
        target = check.target
        dev = await Device(target, command_timeout_s=300).__aenter__()
        return Node(check, dev, f"{target.root}/train/runs/{self.key}")

    async def _regroup(self, members: list[Node], end: RoundEnd) -> list[Node]:
        """The next round's devices: those left, plus those that came back; refuses to go below the minimum."""
        now, resumed = time.time(), self.resumed_step()
        for node in end.lost:
            self.events.append(Event("left", node.name, now, self.last_step, resumed))
            self.away.append(node.check)
            await node.dev.__aexit__(None, None, None)
        left = [n for n in members if n not in end.lost]
        for check in end.joining:
            self.events.append(Event("joined", check.target.name, now, self.last_step, resumed))
            self.away = [c for c in self.away if c.target.name != check.target.name]
            left.append(await self._connect(check))
        if len(left) < self.minimum:
            gone = ", ".join(n.name for n in end.lost)
            raise PipelineError(
                f"train: {gone} left; {len(left)} devices remain, below train.devices' minimum {self.minimum}"
            )
        names = ", ".join(n.name for n in left)
        self.printer.emit("controller", f"round {self.rounds + 1}: {names}, from step {resumed}", "\n")
        return left

    async def _round(self, members: list[Node]) -> RoundEnd:
        """Prepare every device, start its agent, and watch until the round ends one way or another."""
        await asyncio.gather(*(self._prepare(node) for node in members))
        for node in members:
            node.proc = await node.dev.start(self._script(node, len(members)), self.cfg.train.timeout_s)
        pumps = [
            asyncio.create_task(self.printer.pump(n.name, stream))
            for n in members
            for stream in (n.proc.stdout, n.proc.stderr)  # type: ignore[union-attr]
        ]
        waits = {asyncio.create_task(self._exit_status(n)): n for n in members}
        watcher = asyncio.create_task(self._watch(members))
        try:
            end = await self._first_end(members, waits, watcher)
        finally:
            watcher.cancel()
            await asyncio.gather(*(self._stop(node) for node in members))
            for task in (*waits, *pumps):
                task.cancel()
        await self._collect_newest(members)
        return end

    async def _first_end(
        self, members: list[Node], waits: dict[asyncio.Task[int | None], Node], watcher: asyncio.Task[RoundEnd]
    ) -> RoundEnd:
        done, _ = await asyncio.wait([*waits, watcher], return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            return watcher.result()
        statuses = {waits[t].name: t.result() for t in done}
        if all(code == 0 for code in statuses.values()):
            # One agent finished: the others finish with it (the workers' last collective is a barrier).
            rest = await asyncio.gather(*(t for t in waits if t not in done))
            statuses |= {waits[t].name: code for t, code in zip([t for t in waits if t not in done], rest, strict=True)}
            if all(code == 0 for code in statuses.values()):
                await self._finish(members)
                return RoundEnd(finished=True)
        await asyncio.gather(*(self._stop(node) for node in members))
        lost = [n for n in members if not await self._alive(n)]
        if not lost:
            codes = ", ".join(f"{name} {code}" for name, code in statuses.items())
            raise PipelineError(f"train: the agents failed ({codes}) with every device still reachable; see above")
        return RoundEnd(lost=lost)

    async def _exit_status(self, node: Node) -> int | None:
        """The agent's exit status; None when the connection was lost (the device is gone or unreachable)."""
        assert node.proc is not None
        try:
            done = await node.proc.wait()
        except FAILURES:
            return None
        return done.exit_status

    async def _alive(self, node: Node) -> bool:
        try:
            return (await asyncio.wait_for(node.dev.run("true", timeout_s=10), timeout=15)).ok
        except FAILURES:
            return False

    async def _stop(self, node: Node) -> None:
        """Close the agent's stdin: the wrapper stops every process it marked; wait (bounded) until it has."""
        proc, node.proc = node.proc, None
        if proc is None:
            return
        with contextlib.suppress(*FAILURES, asyncssh.Error, BrokenPipeError):
            proc.stdin.write_eof()
            await asyncio.wait_for(proc.wait(), timeout=STOP_WAIT_S)
        proc.close()

    def _script(self, node: Node, nnodes: int) -> str:
        target = node.check.target
        env = {
            **self.cfg.train.env,
            "PYTHONPATH": python_path(target, self.code.id),
            # docs/torch-distributed.md#stale-rendezvous-store-after-restarts
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": str(self.cfg.train.threads_per_rank),
            "PORT": str(self.port),
        }
        if nodedata.node_local(self.cfg):
            env[DATA_LOCAL_ENV] = "1"
        if self.dataset is not None:
            env[DATA_PATH_ENV] = nodedata.tree_dir(target, self.dataset.id)
        if target.ifname:
            env |= {"GLOO_SOCKET_IFNAME": target.ifname, "NCCL_SOCKET_IFNAME": target.ifname}
        if self.tqdm_quiet:
            env["TQDM_MININTERVAL"] = "30"  # a log line per bar redraw: keep redraws rare when output is logged
        torchrun = [
            *("--nproc-per-node", str(target.nproc_per_node), "--nnodes", f"{nnodes}:{nnodes}"),
            *("--rdzv-backend", "c10d", "--rdzv-id", f"{self.key}-{self.rounds}"),
            # No agent hosts the store (docs/torch-distributed.md#choosing-the-rendezvous-host).
            *("--rdzv-conf", "is_host=0,join_timeout=120", "--max-restarts", "0"),
        ]
        script = agent_script(node.run_dir, target.python, env, torchrun, self.token, target.addr)
        return script.replace('"$ctl:$PORT"', f'"$ctl:{self.port}"')

    # -- files between the controller and the devices -------------------------------------------------------------

    async def _prepare(self, node: Node) -> None:
        """The device's run directory as the controller's: config, metrics so far, the latest complete checkpoint."""
        run, dev = node.run_dir, node.dev
        ckpts = f"{run}/train/checkpoints"
        await _must(dev, f"mkdir -p {shlex.quote(ckpts)} && rm -f {shlex.quote(run)}/{layout.SUMMARY}")
        if self.dataset is not None:  # every round: a device that comes back may have lost it (or never had it)
            sent = await nodedata.send(dev, self.dataset, self.workdir)
            self.sent["data"] += sent  # added after the await: devices are prepared concurrently
        await dev.put(self.run_dir / layout.CONFIG_SNAPSHOT, f"{run}/{layout.CONFIG_SNAPSHOT}")
        metrics = self.run_dir / layout.METRICS
        if metrics.exists():
            await dev.put(metrics, f"{run}/{layout.METRICS}")
        found = checkpoint.latest(self.ckpt_root)
        keep = found.name if found else ""
        if found is not None:
            files = {p.name: p for p in sorted(found.iterdir()) if p.is_file()}
            cost = await upload.send(dev, ckpts, upload.bundle(found.name, files), self.workdir)
            self.sent["checkpoints"] += cost.bytes
        # Only the checkpoint training goes on from stays: older ones and those of an abandoned round go.
        await _must(
            dev,
            f'cd {shlex.quote(ckpts)} && for d in step-* .step-*; do [ "$d" = \'{keep}\' ] || rm -rf "$d"; done; '
            + (f"ln -sfn {keep} latest" if keep else "rm -f latest"),
        )

    async def _state(self, node: Node) -> tuple[int, int]:
        """(the step the device's `latest` points to, the last step in its metrics); -1 where there is none."""
        run = shlex.quote(node.run_dir)
        out = await node.dev.run(
            f"readlink {run}/{layout.LATEST}; echo; tail -n 3 {run}/{layout.METRICS} 2>/dev/null; true", timeout_s=20
        )
        lines = out.stdout.splitlines()
        steps = [json.loads(x).get("step", -1) for x in lines[2:] if x.startswith("{") and x.endswith("}")]
        return _step_of(lines[0] if lines else ""), max(steps, default=-1)

    async def _collect(self, members: list[Node], step: int) -> bool:
        """Copy checkpoint `step` from every device into the controller's run directory; True once it is whole."""
        name = f"step-{step}"
        final = self.ckpt_root / name
        if (final / checkpoint.TRAINER_JSON).is_file():
            return True
        part = self.ckpt_root / f".{name}.part"
        part.mkdir(parents=True, exist_ok=True)
        for node in members:
            where = f"{node.run_dir}/{layout.CHECKPOINTS}/{name}"
            out = await node.dev.run(f"cd {shlex.quote(where)} 2>/dev/null && ls -A; true", timeout_s=20)
            for file in out.stdout.split():
                if file != upload.SUMS and not file.endswith(".tmp") and not (part / file).exists():
                    await node.dev.get(f"{where}/{file}", part / file)
        if not (part / checkpoint.TRAINER_JSON).is_file() or not _whole(part):
            return False
        part.rename(final)
        checkpoint.point_latest(self.ckpt_root, name)
        checkpoint.prune(self.ckpt_root, self.cfg.train.keep_checkpoints)
        return True

    async def _collect_newest(self, members: list[Node]) -> None:
        """Copy the newest checkpoint the reachable devices committed, if it is newer than the controller's."""
        best = -1
        for node in members:
            with contextlib.suppress(*FAILURES):
                step, last = await self._state(node)
                best, self.last_step = max(best, step), max(self.last_step, last)
        if best > self.resumed_step() or (best >= 0 and checkpoint.latest(self.ckpt_root) is None):
            with contextlib.suppress(*FAILURES):
                await self._collect(members, best)

    async def _watch(self, members: list[Node]) -> RoundEnd:
        """While the round runs: copy each new checkpoint; end the round when a device that left is back and a
        checkpoint newer than its return is here."""
        back: list[NodeCheck] = []
        back_at = 0
        tried = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            await self._collect_newest(members)
            if back and self.resumed_step() > back_at:
                return RoundEnd(joining=back)
            if self.away and not back and time.monotonic() - tried > REJOIN_EVERY_S and len(members) < self.maximum:
                tried = time.monotonic()
                checks = await asyncio.gather(*(check_one(c.target, self.code, self.workdir) for c in self.away))
                self.sent["code"] += sum(c.bytes_sent for c in checks)
                back = [c for c in checks if c.status == "ready"][: self.maximum - len(members)]
                back_at = self.resumed_step()

    async def _finish(self, members: list[Node]) -> None:
        """After the last round: the final checkpoint, and rank 0's metrics, dataset and summary."""
        await self._collect_newest(members)
        for node in members:
            run = node.run_dir
            has = await node.dev.run(f"test -f {shlex.quote(run)}/{layout.SUMMARY}")
            if not has.ok:
                continue
            for rel in (layout.METRICS, layout.DATASET, layout.SUMMARY):
                await node.dev.get(f"{run}/{rel}", self.run_dir / rel)
            return
        raise PipelineError("train: the agents finished but no device holds summary.json")


def _whole(step_dir: Path) -> bool:
    """True when every file the checkpoint's metadata names is here."""
    try:
        metadata = read_metadata(step_dir)
    except (PipelineError, OSError):
        return False
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return all((step_dir / name).is_file() for name in names)


async def _must(dev: Device, command: str) -> None:
    out = await dev.run(command)
    if not out.ok:
        raise PipelineError(f"{dev.target.name}: `{command[:60]}...`: {out.tail()}")


def finish_summary(run_dir: Path, cluster: dict[str, Any], seconds: float) -> None:
    """Add the cluster's record to summary.json and its events to metrics.jsonl."""
    summary = read_json(run_dir / layout.SUMMARY)
    write_json(run_dir / layout.SUMMARY, {**summary, **cluster, "seconds": round(seconds, 3)})
    with (run_dir / layout.METRICS).open("a") as fh:
        for event in cluster["events"]:
            fh.write(json.dumps(event) + "\n")


async def _train(cfg: Config, run_dir: Path, inventory: Inventory, workdir: Path, output: Printer) -> None:
    # A folder that cannot be sent is one line before any device is contacted.
    dataset = nodedata.dataset_bundle(cfg.data, workdir) if nodedata.sent(cfg) else None
    code = code_bundle(workdir)
    checks = await check_all(inventory, code, workdir)
    refuse_unready(checks, cfg.train.strategy)  # one line, exit 2, before anything starts anywhere
    data_record: dict[str, Any] = {"mode": "sent", "id": dataset.id} if dataset is not None else {}
    if nodedata.node_local(cfg):
        data_record = nodedata.record(await _node_data([c.target for c in checks], cfg, code.id))
    job = Job(cfg, run_dir, checks, code, workdir, output, dataset)
    from torch.distributed import TCPStore  # seconds to import: only once the devices are known to be ready

    port = free_port("0.0.0.0")
    # The rendezvous store, hosted here for the whole job: every agent is a client (is_host=0).
    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    started = time.monotonic()
    try:
        async with asyncio.timeout(cfg.train.timeout_s):
            cluster = await job.run(port)
    except TimeoutError:
        raise PipelineError(
            f"train.timeout_s: training still running after {cfg.train.timeout_s}s; stopped it on every device"
        ) from None
    finally:
        del store
    if data_record:
        cluster["data"] = data_record
    finish_summary(run_dir, cluster, time.monotonic() - started)


async def _node_data(targets: list[SshTarget], cfg: Config, code_id: str) -> dict[str, nodedata.NodeData]:
    """Every device's own dataset (node-local `data.path`), reported by the device with the controller's code."""

    async def one(target: SshTarget) -> nodedata.NodeData:
        async with Device(target, command_timeout_s=nodedata.FINGERPRINT_TIMEOUT_S) as dev:
            return await nodedata.report(dev, cfg.data, python_path(target, code_id))

    found = await asyncio.gather(*(one(t) for t in targets))
    return nodedata.check_classes({t.name: n for t, n in zip(targets, found, strict=True)})


def node_data_fingerprint(cfg: Config) -> str:
    """The run's data fingerprint when each device reads its own `data.path`: every device checked (and given the
    code, which reads the folder there), then one digest over every device's folder."""
    assert cfg.train.inventory is not None
    inventory = load_inventory(cfg.train.inventory)
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:

        async def collect() -> dict[str, nodedata.NodeData]:
            code = code_bundle(Path(tmp))
            checks = await check_all(inventory, code, Path(tmp))
            refuse_unready(checks)
            return await _node_data([c.target for c in checks], cfg, code.id)

        return nodedata.combined(asyncio.run(collect()))


def run_on_devices(cfg: Config, run_dir: Path, output: Callable[[str], None] | None = None) -> None:
    """Train on the devices of `train.inventory`; the run directory ends as a local run's would.

    Ctrl-C, SIGTERM (a cancelled flow run) and `train.timeout_s` stop every rank on every device before this
    returns; a controller killed outright closes its SSH sessions, and each device's wrapper then does the same.
    """
    assert cfg.train.inventory is not None
    inventory = load_inventory(cfg.train.inventory)
    bounds(cfg.train.devices, len(inventory.targets))
    run_dir = Path(run_dir).resolve()
    checkpoint.resumable(run_dir / layout.CHECKPOINTS, cfg)
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
        asyncio.run(_main(_train(cfg, run_dir, inventory, Path(tmp), Printer(output))))


async def _main(job: Awaitable[None]) -> None:
    """Run `job`, cancelled by SIGTERM as by Ctrl-C, so that its clean-up runs (main thread only: a Prefect task's
    thread gets the SSH sessions' own clean-up when its process dies)."""
    task = asyncio.ensure_future(job)
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    await task
